"""
nanoGPT-style configuration: an entry point defines its defaults as commented module
globals; the command line names config files (plain Python, executed in order) and
`--key=value` overrides (parsed with ast.literal_eval, else taken as a string):

    python train.py config/xsa_0p7b.py --learning_rate=3e-4 --compile=False

Unlike nanoGPT, a mistyped key fails with the closest valid names, a value of the wrong
type fails naming the key and both types, and `--help` lists every key with its default
and comment. All checks happen before anything is written.
"""

import ast
import difflib
import io
import os
import sys
import tokenize
import types

TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


class ConfigError(ValueError):
    """A config file or override that does not fit the entry point's keys."""


def key_comments(source_path, keys):
    """The trailing `# comment` of each top-level `key = value` line in source_path."""
    with open(source_path, encoding="utf-8") as f:
        source = f.read()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in keys:
                found[name] = comments.get(node.end_lineno, comments.get(node.lineno, ""))
    return found


def read_defaults(source_path=TRAIN_PY):
    """An entry point's config defaults (top-level lowercase `key = <literal>` lines) and key groups
    (`NAME_KEYS = (...)`), read from its source rather than imported: bench.py, eval/, the sweep
    scripts and checkpoint.py get train.py's keys without running an entry point (or importing torch).
    Returns (defaults, groups), e.g. groups["ARCHITECTURE_KEYS"]."""
    with open(source_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source_path)
    defaults, groups = {}, {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError):
            continue  # not a literal: not a config key
        if name.endswith("_KEYS") and isinstance(value, tuple):
            groups[name] = value
        elif not name.startswith("_") and name.islower() and isinstance(value, (int, float, bool, str, type(None))):
            defaults[name] = value
    return defaults, groups


def check_type(key, value, default):
    """Return value, converted where harmless (int for float); raise ConfigError if it does not fit."""
    if default is None:  # keys that default to None take any value
        return value
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{key} expects {expected.__name__} (default {default!r}), "
                          f"got {type(value).__name__} {value!r}")
    return value


def unknown_key_error(key, keys, where):
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see --help for the valid keys"
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def format_help(defaults, comments, prog):
    lines = [f"usage: {prog} [config/file.py ...] [--key=value ...]", "", "config keys (default, meaning):"]
    width = max(len(k) for k in defaults)
    for key, value in defaults.items():
        lines.append(f"  {key:<{width}}  {value!r:<24} {comments.get(key, '')}")
    return "\n".join(lines)


def parse_config(defaults, argv, comments=None, prog="train.py"):
    """Resolve config files and overrides against defaults.
    Returns (config dict in the order of defaults, list of config files used)."""
    config = dict(defaults)
    config_files = []
    for arg in argv:
        if arg in ("-h", "--help"):
            print(format_help(defaults, comments or {}, prog))
            sys.exit(0)
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} does not exist")
            namespace = {}
            try:
                with open(arg, encoding="utf-8") as f:
                    code = compile(f.read(), arg, "exec")
                exec(code, namespace)
            except Exception as e:
                raise ConfigError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from e
            for key, value in namespace.items():
                if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
                    continue
                if key not in defaults:
                    raise unknown_key_error(key, list(defaults), arg)
                config[key] = check_type(key, value, defaults[key])
            config_files.append(arg)
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"override {arg!r} must be written --key=value")
            if key not in defaults:
                raise unknown_key_error(key, list(defaults), "the command line")
            try:
                value = ast.literal_eval(raw)
            except (SyntaxError, ValueError):
                value = raw  # a bare string, e.g. --attn_type=xsa
            config[key] = check_type(key, value, defaults[key])
    return config, config_files


def load_config(defaults, argv=None, source_path=(), prog=None):
    """parse_config for an entry point whose keys are defined, with their comments, in source_path
    (a file or a tuple of files): on a bad config, print one line and exit with status 2."""
    argv = sys.argv[1:] if argv is None else argv
    comments = {}
    for path in (source_path,) if isinstance(source_path, str) else source_path:
        comments.update(key_comments(path, defaults))
    try:
        return parse_config(defaults, argv, comments, prog or os.path.basename(sys.argv[0]))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
