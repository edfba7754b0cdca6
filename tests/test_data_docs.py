"""docs/data.md as written: every command it gives is installed, and takes the flags it is given."""

import os
import re
import shlex
import shutil
import sys

from running import REPO, run_script


def documented_commands(path):
    """The commands in a markdown file's bash blocks, as token lists (comments dropped)."""
    with open(path) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):  # VAR=value before the command
            tokens.pop(0)
        if tokens:
            commands.append(tokens)
    return commands


def test_every_command_in_data_md_is_installed_and_takes_its_flags():
    """What docs/data.md tells a user to type exists once requirements.txt is installed: each program on
    PATH, each flag in the --help of its script or subcommand (e.g. the Hub's CLI, renamed in the past)."""
    commands = documented_commands(os.path.join(REPO, "docs", "data.md"))
    programs = {tokens[0] for tokens in commands}
    assert {"python", "hf"} <= programs  # the tokenizer and the FineWeb download are both documented
    flags = {}  # (program, script or subcommand) -> flags used with it
    for program, target, *args in commands:
        assert shutil.which(program), f"docs/data.md runs `{program}`, which is not on PATH"
        if target == "-m":  # python -m data.fineweb.prepare: the module is the target
            target = f"-m {args.pop(0)}"
        flags.setdefault((program, target), set()).update(a.split("=")[0] for a in args if a.startswith("--"))
    for (program, target), used in flags.items():
        cmd = [sys.executable, *target.split()] if program == "python" else [shutil.which(program), target]
        result = run_script([*cmd, "--help"])
        assert result.returncode == 0, result.stderr
        unknown = {flag for flag in used if not re.search(rf"{re.escape(flag)}\b", result.stdout)}
        assert not unknown, f"docs/data.md gives `{program} {target}` flags its --help does not list: {unknown}"
