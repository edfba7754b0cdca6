"""The house's layout as docs/design.md states it ("Rooms and doors"), checked from the code: which module may
import which (parsed with ast), no file that edits the import path, the root's Python files, and every folder
entry point run as a file (a one-line hint and exit 2) and as a documented `python -m` command (its --help)."""

import ast
import glob
import os
import re
import sys

import pytest

from running import REPO, run_script

# the entry points that run from the repo root as modules: their folders are packages
ENTRY_FOLDERS = ("eval", "scripts", "data/fineweb")
ROOT_MODULES = ("train", "model", "configurator")  # and nothing else at the root
STDLIB = sys.stdlib_module_names


def repo_files(pattern):
    return sorted(glob.glob(os.path.join(REPO, pattern), recursive=True))


def relative(path):
    return os.path.relpath(path, REPO)


def imported_modules(path):
    """Every module a Python file imports, anywhere in it (functions included), as dotted names; a relative
    import is resolved against the file's package."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = os.path.dirname(relative(path)).replace(os.sep, ".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from eval import common`
    return names


def repo_top_level_names():
    """The names under which the repo's own modules import: the root's modules and its folders."""
    names = {os.path.basename(p)[:-3] for p in repo_files("*.py")}
    names.update(os.path.basename(p.rstrip("/")) for p in repo_files("*/")
                 if os.path.exists(os.path.join(p, "__init__.py")))
    return names


def entry_points():
    """The Python files in eval/, scripts/ and data/fineweb/ that run as programs, as module names."""
    found = []
    for folder in ENTRY_FOLDERS:
        for path in repo_files(f"{folder}/*.py"):
            with open(path) as f:
                if 'if __name__ == "__main__":' in f.read():
                    found.append(relative(path)[:-3].replace(os.sep, "."))
    return found


def test_model_and_configurator_import_nothing_of_the_repo_and_model_only_torch():
    """model.py is shipped as it is in every Hugging Face export: torch and the standard library only."""
    repo = repo_top_level_names()
    for name in ("model.py", "configurator.py"):
        imported = {m.split(".")[0] for m in imported_modules(os.path.join(REPO, name))}
        assert not imported & repo, f"{name} imports the repo's {sorted(imported & repo)}"
    model_imports = {m.split(".")[0] for m in imported_modules(os.path.join(REPO, "model.py"))}
    assert model_imports - set(STDLIB) == {"torch"}


def test_the_package_never_imports_an_entry_point():
    """pretrain/ is imported by train.py, eval/, scripts/ and data/fineweb/, never the other way round; its
    modeling_xsa.py, shipped in exports, imports the export's own model.py (`.model`), transformers and torch."""
    entry = {"train", "bench", "eval", "scripts", "data"}  # train.py, and the folders of the other entry points
    modules = repo_files("pretrain/*.py")
    names = {os.path.basename(p) for p in modules}
    assert names >= {"__init__.py", "checkpoint_format.py", "checkpointer.py", "exits.py", "guards.py",
                     "train_config.py"}
    for path in modules:
        imported = imported_modules(path)
        wrong = sorted(m for m in imported if m.split(".")[0] in entry)
        assert not wrong, f"{relative(path)} imports the entry point(s) {wrong}"
    shipped = {m.split(".")[0] for m in imported_modules(os.path.join(REPO, "pretrain", "modeling_xsa.py"))}
    assert shipped - set(STDLIB) == {"pretrain", "transformers", "torch"}  # pretrain: its `.model`, resolved here
    assert "pretrain.model" in imported_modules(os.path.join(REPO, "pretrain", "modeling_xsa.py"))


def edits_sys_path(node):
    """Whether an ast node changes sys.path: sys.path.insert/append/extend(...), or an assignment to sys.path."""
    def is_sys_path(n):
        return isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) \
            and n.value.id == "sys"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("insert", "append", "extend") and is_sys_path(node.func.value)
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(is_sys_path(target) for target in targets)
    return False


def test_no_file_edits_the_import_path():
    """Entry points run as modules from the repo root (`python -m eval.compare`): no sys.path edits, in the code,
    the tests or the shell scripts' inline Python."""
    for path in repo_files("**/*.py"):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        assert not any(edits_sys_path(node) for node in ast.walk(tree)), f"{relative(path)} edits sys.path"
    edit = re.compile(r"\bsys\.path\.(insert|append|extend)\(|\bsys\.path\s*[+]?=")
    for path in repo_files("**/*.sh") + repo_files(".ci/*"):
        with open(path) as f:
            assert not edit.search(f.read()), f"{relative(path)} edits sys.path"


def test_the_root_holds_the_few_python_files_a_researcher_edits():
    assert sorted(os.path.basename(p) for p in repo_files("*.py")) == sorted(f"{m}.py" for m in ROOT_MODULES)
    for folder in ("pretrain", "eval", "scripts", "data", "data/fineweb"):
        assert os.path.isfile(os.path.join(REPO, folder, "__init__.py")), f"{folder}/ is not a package"


def test_the_folder_packages_are_the_repos_own():
    """Regular packages: an installed package named data, eval or scripts never shadows them."""
    code = "import data, eval, pretrain, scripts; print(*(m.__file__ for m in (data, eval, pretrain, scripts)))"
    result = run_script([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert all(path.startswith(os.path.join(REPO, "")) for path in result.stdout.split()), result.stdout


@pytest.mark.parametrize("module", entry_points())
def test_an_entry_point_run_as_a_file_says_to_run_it_as_a_module(module):
    """`python eval/compare.py`: one line with the -m form, exit 2, before any import of the repo."""
    result = run_script([sys.executable, module.replace(".", "/") + ".py", "--help"])
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert f"python -m {module}" in result.stderr


def test_every_entry_point_is_found():
    assert {"eval.compare", "eval.downstream", "eval.similarity", "eval.position_loss", "eval.sample",
            "scripts.export_hf", "scripts.memory_plan", "scripts.bench", "data.fineweb.prepare",
            "data.fineweb.download", "data.fineweb.bench_tokenize"} <= set(entry_points())


def documented_modules():
    """Every `python -m <module>` of the repo's entry points that the README, docs/, the docstrings and the shell
    scripts give."""
    pattern = re.compile(r"python3? -m ((?:eval|scripts|data\.fineweb)\.[a-z_]+)")
    found = set()
    for path in repo_files("*.md") + repo_files("docs/*.md") + repo_files("**/*.py") + repo_files("**/*.sh"):
        if relative(path).startswith("tests"):
            continue
        with open(path) as f:
            text = f.read()
        if path.endswith(".py"):  # its docstrings, not the hint its guard prints
            kinds = (ast.Module, ast.FunctionDef, ast.ClassDef)
            documented = (node for node in ast.walk(ast.parse(text)) if isinstance(node, kinds))
            text = "\n".join(ast.get_docstring(node) or "" for node in documented)
        found.update(pattern.findall(text))
    return sorted(found)


# `python -m MODULE --help` for each module in turn, in one interpreter (runpy, what -m runs): torch is imported
# once, not once per module; each help text ends with a line naming the module and its exit status
RUN_EACH_AS_MAIN = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = "returned without exiting"
    except SystemExit as e:
        status = e.code
    print(f"\\n=== {module} exit {status}", flush=True)
"""


@pytest.mark.slow
def test_every_documented_python_m_command_runs_from_the_repo_root():
    """Each documented module runs as written, from the repo root: its --help prints a usage and exits 0."""
    modules = documented_modules()
    assert set(modules) == set(entry_points())  # every entry point is documented, and nothing else
    result = run_script([sys.executable, "-c", RUN_EACH_AS_MAIN, *modules])
    assert result.returncode == 0, result.stderr[-3000:]
    helps = re.split(r"^=== (\S+) exit (.*)$", result.stdout, flags=re.M)
    assert helps[-1].strip() == "", helps[-1]  # nothing after the last module's line
    assert [helps[i] for i in range(1, len(helps), 3)] == modules, result.stdout[-3000:]
    flags = documented_flags()
    for text, module, status in zip(helps[0::3], helps[1::3], helps[2::3]):
        assert status == "0", f"python -m {module} --help: exit {status}\n{text[-2000:]}\n{result.stderr[-2000:]}"
        assert "usage" in text.lower(), f"python -m {module} --help printed no usage:\n{text[-2000:]}"
        for path, flag in sorted(flags.get(module, ())):  # each flag the docs give it, in its --help: argparse's
            # "--flag", or a config key's "  key  default  meaning" line (configurator.py)
            listed = re.search(rf"(^|[\s\[,]){re.escape(flag)}($|[\s=\],])", text, re.M) or \
                re.search(rf"^ +{re.escape(flag[2:])} +\S", text, re.M)
            assert listed, f"{path} passes {flag} to python -m {module}, which its --help does not list"


def documented_command_lines():
    """The command lines of README.md's and docs/*.md's shell blocks, a backslash continuation joined to its line,
    comments cut."""
    lines = []
    for path in repo_files("README.md") + repo_files("docs/*.md"):
        with open(path) as f:
            blocks = re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", f.read(), flags=re.M | re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                if line:
                    lines.append((relative(path), line))
    return lines


def documented_flags():
    """{module: {(file, flag)}}: the --flags given to each `python -m <module>` in the docs' shell blocks."""
    flags = {}
    for path, line in documented_command_lines():
        for module, rest in re.findall(r"python3? -m ((?:eval|scripts|data\.fineweb)\.[a-z_]+)([^|;&]*)", line):
            for flag in re.findall(r"(?:^|\s)(--[a-z][a-z0-9_-]*)", rest):
                flags.setdefault(module, set()).add((path, flag))
    return flags


def test_documented_scripts_and_train_keys_exist():
    """Every `bash scripts/...` or `scripts/...sh` the docs run is a file of the repo, and every --key a documented
    `train.py` command passes is one of train.py's keys."""
    from pretrain.train_config import TRAIN_KEYS
    for path, line in documented_command_lines():
        for script in re.findall(r"(?:^|\s|=)((?:\./)?scripts/[A-Za-z0-9_]+\.sh)\b", line):
            assert os.path.isfile(os.path.join(REPO, script)), f"{path}: {line!r} runs {script}, which is not a file"
        if re.search(r"(?:^|\s)train\.py(\s|$)", line):
            keys = re.findall(r"\s--([a-z_0-9]+)(?==|\s|$)", line.split("train.py", 1)[1])
            unknown = [k for k in keys if k not in TRAIN_KEYS and k != "help"]
            assert not unknown, f"{path}: {line!r} passes --{unknown[0]}, which train.py does not have"


def test_code_the_docs_quote_is_the_code():
    """A block after `<!-- verbatim: FILE -->` in README.md or docs/*.md is the repo's code: it appears, line for
    line, in FILE. Code the docs give without the marker is a sketch or a usage example, and says so in words."""
    quoted = 0
    for path in repo_files("README.md") + repo_files("docs/*.md"):
        with open(path) as f:
            text = f.read()
        for source, block in re.findall(r"^<!-- verbatim: (\S+) -->\n```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
            with open(os.path.join(REPO, source)) as f:
                assert block in f.read(), f"{relative(path)} quotes {source}, but this is not in it:\n{block}"
            quoted += 1
    assert quoted >= 2  # the README's XSA in the code
