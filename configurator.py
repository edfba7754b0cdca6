"""
nanoGPT-style configuration, checked against a schema. An entry point's keys are dataclass fields
made with `key()` (pretrain/train_config.py): each carries its default, type, one-line meaning, the checks its
value must pass and, for a None default, the value it derives from the other keys. The command line
names config files (plain Python, executed in order) and `--key=value` overrides (parsed with
ast.literal_eval, else taken as a string; a text key always takes the text):

    python train.py config/xsa_0p7b.py --learning_rate=3e-4 --compile=False

The resolved config is one flat dataclass read by attribute (`c.learning_rate`). Unlike nanoGPT, a
mistyped key fails with the closest valid names, a value of the wrong type or range fails naming the
key, `--help` lists every key with its default and meaning, and a config file finds the files it reads
(`exec(open("config/sa_0p7b.py").read())`) from any working directory. All checks happen before
anything is written.
"""

import ast
import builtins
import dataclasses
import difflib
import inspect
import os
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields


class ConfigError(ValueError):
    """A config file or override that does not fit the entry point's keys."""


def key(default, help, *, check=(), derive=None):
    """A config key as a dataclass field.
    default: its value unless a config file or the command line sets it
    help: its meaning in one line, shown by --help
    check: a function of (name, value), or a tuple of them, returning what is wrong with the value (one
        line) or None; a None value (unset, or "off") is not checked
    derive: for a None default, a function of (config, run name) giving the value it stands for, e.g.
        min_lr = learning_rate / 10; run name: the last config file's name without .py, or "run" """
    checks = check if isinstance(check, tuple) else (check,)
    return field(default=default, metadata={"help": help, "checks": checks, "derive": derive})


# checks a key may name: each returns the error message, or None

def positive(name, value):
    return None if value > 0 else f"{name} must be positive, got {value!r}"


def non_negative(name, value):
    return None if value >= 0 else f"{name} must not be negative, got {value!r}"


def fraction(name, value):
    return None if 0 <= value < 1 else f"{name} must be in [0, 1), got {value!r}"


@dataclass(frozen=True)
class Key:
    name: str
    default: object
    type: object  # the field's annotation: int, float | None, Literal["sa", "xsa"], ...
    help: str
    section: str  # the first line of the declaring dataclass's docstring: what its keys decide
    checks: tuple = ()
    derive: object = None


def keys_of(*sections):
    """{name: Key} of the fields of the dataclasses `sections`, in order. A field without a meaning
    (made without key(), or with metadata={"help": ...}) is a mistake of the schema: TypeError."""
    keys = {}
    for section in sections:
        hints = typing.get_type_hints(section)
        title = (inspect.getdoc(section) or section.__name__).splitlines()[0]
        for f in fields(section):
            if not f.metadata.get("help"):
                raise TypeError(f"{section.__name__}.{f.name} has no meaning: declare it with key(default, help)")
            default = f.default if f.default is not MISSING else f.default_factory()
            keys[f.name] = Key(f.name, default, hints[f.name], f.metadata["help"], title,
                               f.metadata.get("checks", ()), f.metadata.get("derive"))
    return keys


class Config:
    """Base of the resolved configs: a flat dataclass of every key, read by attribute."""
    keys = {}  # {name: Key}, set by config_class

    def to_dict(self):
        """{key: value}, for config.json, checkpoints and wandb."""
        return {name: getattr(self, name) for name in self.keys}

    @classmethod
    def from_dict(cls, values):
        """The config a dict records (a checkpoint's, config.json's): its values of this config's keys,
        the defaults for keys it lacks (it may come from an older version)."""
        return cls(**{name: value for name, value in values.items() if name in cls.keys})


def config_class(name, *sections, base=Config):
    """One flat dataclass with the fields of every section (and base's methods): `c.learning_rate`."""
    keys = keys_of(*sections)
    specs = [(k.name, k.type, field(default=k.default, metadata={"help": k.help})) for k in keys.values()]
    cls = dataclasses.make_dataclass(name, specs, bases=(base,))
    cls.keys = keys
    return cls


# -----------------------------------------------------------------------------
# types: the annotations a key may have

def type_name(annotation):
    """'int', 'int or None', "one of 'ddp', 'fsdp'", 'list of int'."""
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(type_name(option) for option in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"list of {type_name(typing.get_args(annotation)[0])}"
    return "None" if annotation is type(None) else annotation.__name__


def converted(value, annotation):
    """(True, value as the annotation takes it) or (False, None). Exact types: a bool is no int. An int
    is taken for a float, and a tuple for a list (`--xsa_layers=0,2` reads as a tuple)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            ok, result = converted(value, option)
            if ok:
                return True, result
        return False, None
    if origin is typing.Literal:
        return (value in typing.get_args(annotation) and type(value) in {type(a) for a in typing.get_args(annotation)},
                value)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, (list, tuple)) and value and all(converted(v, item)[0] for v in value):
            return True, [converted(v, item)[1] for v in value]
        return False, None
    if annotation is type(None):
        return value is None, None
    if annotation is float and type(value) is int:
        return True, float(value)
    return type(value) is annotation, value


def check_type(key, value):
    """value, converted where harmless, if it fits key.type; else ConfigError naming the key."""
    ok, result = converted(value, key.type)
    if ok:
        return result
    if typing.get_origin(key.type) is typing.Literal:
        raise ConfigError(f"{key.name} must be {type_name(key.type)}; got {value!r}")
    raise ConfigError(f"{key.name} expects {type_name(key.type)} (default {key.default!r}), "
                      f"got {type(value).__name__} {value!r}")


def takes_text_only(annotation):
    """str, str | None, Literal["a", "b"]: a key whose values are text (or None)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return all(option is str or option is type(None) or (typing.get_origin(option) is typing.Literal and all(
        isinstance(a, str) for a in typing.get_args(option))) for option in options)


def parse_value(key, raw):
    """The value of `--key=raw`: a Python literal (3e-4, True, None, [0, 5]), or the text itself where it is
    not one (--attn_type=xsa). A key that takes only text takes the text as written, even where it reads as
    a number (--wandb_run_name=2024, --out_dir=123); None stays None where the key allows it."""
    try:
        value = ast.literal_eval(raw)
    except (SyntaxError, ValueError):
        return raw
    if takes_text_only(key.type) and not isinstance(value, str) and not (value is None and converted(None, key.type)[0]):
        return raw
    return value


# -----------------------------------------------------------------------------
# config files and the command line

def unknown_key_error(key, keys, where):
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see --help for the valid keys"
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def format_help(keys, prog):
    lines = [f"usage: {prog} [config/file.py ...] [--key=value ...]", "", "config keys (default, meaning):"]
    width = max(len(k) for k in keys)
    section = None
    for key in keys.values():
        if key.section != section:
            section = key.section
            lines.append(f"\n  {section}")
        lines.append(f"  {key.name:<{width}}  {key.default!r:<24} {key.help}")
    return "\n".join(lines)


def config_file_open(config_file):
    """`open` for the code of a config file: a relative path is looked for beside the file, then in the
    folders above it (so `exec(open("config/sa_tiny.py").read())` in config/xsa_tiny.py finds the
    repository's config/sa_tiny.py), never in the working directory of whoever runs it."""
    def open_from_config_dir(path, mode="r", *args, **kwargs):
        if isinstance(path, str) and not os.path.isabs(path) and set(mode) <= set("rbt"):
            folder = os.path.dirname(os.path.abspath(config_file))
            while True:
                candidate = os.path.join(folder, path)
                if os.path.exists(candidate) or os.path.dirname(folder) == folder:
                    break
                folder = os.path.dirname(folder)
            if not os.path.exists(candidate):
                raise FileNotFoundError(f"{path!r} is neither beside {config_file} nor in a folder above it")
            path = candidate
        return builtins.open(path, mode, *args, **kwargs)
    return open_from_config_dir


def run_config_file(path):
    """The names a config file sets: its code run with an `open` that finds files relative to it."""
    namespace = {"open": config_file_open(path)}
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
        exec(code, namespace)
    except Exception as e:
        raise ConfigError(f"config file {path!r} failed: {type(e).__name__}: {e}") from e
    return {name: value for name, value in namespace.items()
            if not name.startswith("_") and name != "open"
            and not isinstance(value, (types.ModuleType, types.FunctionType, type))}


def print_help(text):
    """Print --help's text and exit 0; a reader that stops early (`--help | head`) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    sys.exit(0)


def parse_config(keys, argv, prog="train.py"):
    """Resolve config files and overrides against the keys ({name: Key}).
    Returns ({key: value} in the order of keys, the config files used)."""
    config = {name: key.default for name, key in keys.items()}
    config_files = []
    for arg in argv:
        if arg in ("-h", "--help"):
            print_help(format_help(keys, prog))
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} does not exist")
            for name, value in run_config_file(arg).items():
                if name not in keys:
                    raise unknown_key_error(name, list(keys), arg)
                config[name] = check_type(keys[name], value)
            config_files.append(arg)
        else:
            name, sep, raw = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"override {arg!r} must be written --key=value")
            if name not in keys:
                raise unknown_key_error(name, list(keys), "the command line")
            config[name] = check_type(keys[name], parse_value(keys[name], raw))
    return config, config_files


def derive_and_check(config, run_name):
    """Fill in each None key that derives its value (key's derive), then run every key's checks."""
    for name, k in config.keys.items():
        if getattr(config, name) is None and k.derive is not None:
            setattr(config, name, k.derive(config, run_name))
    for name, k in config.keys.items():
        value = getattr(config, name)
        for check in k.checks if value is not None else ():
            problem = check(name, value)
            if problem:
                raise ConfigError(problem)
    return config


def resolve(config_class, argv, prog="train.py"):
    """The config of a command line: the keys' defaults, then the config files and overrides of argv,
    derived values filled in, every check passed. Returns (config, config files); ConfigError."""
    values, config_files = parse_config(config_class.keys, argv, prog)
    run_name = os.path.splitext(os.path.basename(config_files[-1]))[0] if config_files else "run"
    return derive_and_check(config_class(**values), run_name), config_files
