"""
nanoGPT-style configuration, checked against a schema. An entry point's keys are dataclass fields
(train_config.py: each with its default, type and meaning); the command line names config files
(plain Python, executed in order) and `--key=value` overrides (parsed with ast.literal_eval, else
taken as a string):

    python train.py config/xsa_0p7b.py --learning_rate=3e-4 --compile=False

Unlike nanoGPT, a mistyped key fails with the closest valid names, a value of the wrong type fails
naming the key and the types it takes, `--help` lists every key with its default and meaning, and a
config file finds the files it reads (`exec(open("config/sa_0p7b.py").read())`) from any working
directory. All checks happen before anything is written.
"""

import ast
import builtins
import difflib
import inspect
import os
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass, fields


class ConfigError(ValueError):
    """A config file or override that does not fit the entry point's keys."""


@dataclass(frozen=True)
class Key:
    name: str
    default: object
    type: object  # the field's annotation: int, float | None, Literal["sa", "xsa"], ...
    help: str  # its line under "Attributes:" in the docstring of the dataclass declaring it
    section: str  # the first line of that dataclass's docstring: what its keys decide


def field_docs(cls):
    """{field: meaning} from the "Attributes:" section of a dataclass's docstring (`name: meaning`
    lines, continued on more deeply indented lines)."""
    _, _, attributes = (inspect.getdoc(cls) or "").partition("Attributes:")
    lines = [line for line in attributes.splitlines() if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    docs, name = {}, None
    for line in lines:
        entry = re.fullmatch(r"(\w+): (.*)", line.strip())
        if entry and len(line) - len(line.lstrip()) == indent:
            name, docs[entry.group(1)] = entry.group(1), entry.group(2).strip()
        elif name:
            docs[name] += " " + line.strip()
    return docs


def keys_of(*sections):
    """{name: Key} of the fields of the dataclasses `sections`, in order. A field that its dataclass's
    docstring does not describe is a mistake of the schema: TypeError."""
    keys = {}
    for section in sections:
        docs, hints = field_docs(section), typing.get_type_hints(section)
        title = (inspect.getdoc(section) or section.__name__).splitlines()[0]
        for f in fields(section):
            if f.name not in docs:
                raise TypeError(f"{section.__name__}.{f.name} has no line under Attributes: in its docstring")
            default = f.default if f.default is not MISSING else f.default_factory()
            keys[f.name] = Key(f.name, default, hints[f.name], docs[f.name], title)
    return keys


def defaults_of(keys):
    return {name: key.default for name, key in keys.items()}


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


def parse_config(keys, argv, prog="train.py"):
    """Resolve config files and overrides against the keys ({name: Key}).
    Returns (config dict in the order of keys, list of config files used)."""
    config = defaults_of(keys)
    config_files = []
    for arg in argv:
        if arg in ("-h", "--help"):
            print(format_help(keys, prog))
            sys.exit(0)
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
            try:
                value = ast.literal_eval(raw)
            except (SyntaxError, ValueError):
                value = raw  # a bare string, e.g. --attn_type=xsa
            config[name] = check_type(keys[name], value)
    return config, config_files


