"""tests/preloaded.py, the `python` of the scripts the tests start: a program forked from the preloaded server
ends as under the real interpreter (exit status, output, traceback, an unhandled Ctrl-C), a program in a copy of
the repository imports the copy's modules, and torchrun's ranks are forked from the server too."""

import os
import sys

import pytest

from running import REPO, preloaded_python, run_python

pytestmark = pytest.mark.slow  # the server imports torch

SCRIPT = "import sys\nprint(__name__, sys.argv)\nsys.exit(int(sys.argv[1]))\n"
PROGRAMS = {
    "status and both streams": (["-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], None),
    "a traceback": (["-c", "def f():\n    raise ValueError('boom')\nf()"], None),
    "sys.exit with a message": (["-c", "import sys; sys.exit('a message')"], None),
    "an unhandled Ctrl-C": (["-c", "raise KeyboardInterrupt"], None),
    "a program on stdin": (["-", "a", "b"], "import sys\nprint(sys.argv, repr(sys.stdin.read()))\n"),
    "a syntax error": (["-c", "print(1)\nsecond line"], None),
    "a module": (["-m", "json.tool", "--sort-keys"], '{"b": 1, "a": [2]}'),
    "a script, unbuffered": (["-u", "script.py", "4"], None),
}


def run(python, args, stdin, cwd):
    import subprocess
    proc = subprocess.run([python, *args], input=stdin, capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": ""})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def shim():
    """The shim's path, once its programs are forked from the server (which has imported torch)."""
    python = preloaded_python(start=True)
    imported = "import sys; print('torch' in sys.modules)"
    assert run(python, ["-c", imported], None, REPO)[1] == "True\n"
    assert run(sys.executable, ["-c", imported], None, REPO)[1] == "False\n"
    return python


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_forked_program_ends_as_under_the_real_interpreter(shim, name, tmp_path):
    args, stdin = PROGRAMS[name]
    (tmp_path / "script.py").write_text(SCRIPT)
    real = run(sys.executable, args, stdin, tmp_path)
    assert run(shim, args, stdin, tmp_path) == real


def test_a_program_in_a_copy_of_the_repository_imports_the_copys_modules(tmp_path):
    (tmp_path / "model.py").write_text("WHERE = 'the copy'\n")
    program = "import model; print(model.WHERE if hasattr(model, 'WHERE') else model.__file__)"
    assert run_python(["-c", program]).stdout == os.path.join(REPO, "model.py") + "\n"  # the server's own
    assert run_python(["-c", program], cwd=str(tmp_path)).stdout == "the copy\n"
    missing = run_python(["-c", "import train"], cwd=str(tmp_path))  # imported by the server, not in the copy
    assert missing.status == 1 and "ModuleNotFoundError: No module named 'train'" in missing.stderr


def test_torchruns_ranks_are_forked_from_the_server(tmp_path):
    """Each rank's command line is the server's, and a rank's failure is torchrun's."""
    rank = tmp_path / "rank.py"
    rank.write_text("import os, sys\nprint(os.environ['RANK'], open('/proc/self/cmdline').read().split(chr(0))[1:3])\n"
                    "sys.exit(int(os.environ['RANK']) == int(sys.argv[1]))\n")
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(rank), "-1"])
    assert proc.status == 0, proc.stderr[-3000:]
    server = [os.path.join(REPO, "tests", "preloaded.py"), "serve"]
    assert sorted(proc.stdout.splitlines()) == [f"{r} {server}" for r in (0, 1)]
    failed = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(rank), "1"])
    assert failed.status == 1 and "ChildFailedError" in failed.stderr
