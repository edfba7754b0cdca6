"""How the tests run the repo's programs: a script or a command in a process of its own (run_script, with every
wait bounded), a Python program in a process of its own without a new Python's imports (run_python), a Python
entry point in the test's own process (run_in_process, run_eval), the ranks of a process group (run_ranks), and
train.py any of these ways or under torchrun (run_train), each returning a Result. The `python` of the scripts the
tests start, and of run_python and run_ranks, goes through the preloaded server (preloaded.py,
python_shim) where it can."""

import dataclasses
import os
import signal
import sys

import pytest

from preloaded import SOCKET_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Time limits in tests only end hangs, never judge speed: 8 minutes is far beyond any correct run on a busy
# machine. pytest-timeout (pytest.ini) ends any test after 10, dumping every thread's stack; this one, shorter,
# lets a test that waits on processes kill them and say what it waited for.
HANG_GUARD_S = 480
# torchrun kills its ranks 30 s after relaying a signal; a busy machine may need longer to checkpoint
TORCHRUN_GRACE = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(HANG_GUARD_S)}


def usable_cores():
    """The CPUs this process may run on, capped by a container's CPU quota (cgroup v2), which the
    affinity mask does not show: a 2-CPU container on a 64-core host must not start 64 workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 here, or a format we do not know
        pass
    return cores


def cpu_threads():
    """The CPU threads of one test process, as conftest.py set them (OMP_NUM_THREADS)."""
    return max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))


@dataclasses.dataclass
class Result:
    """A finished script: its exit status (also as subprocess's returncode) and what it printed."""
    args: list
    status: int
    stdout: str
    stderr: str

    @property
    def returncode(self):
        return self.status

    @property
    def output(self):
        """stdout, then stderr."""
        return self.stdout + self.stderr


SHIM_DIR = None  # python_shim's directory, made once per test process
PRELOADED_SERVER = None  # this test process's preloaded.py server (a Popen), once started


def python_shim():
    """The directory of a `python` that runs a program in a process forked from the preloaded server
    (preloaded.py), once start_preloaded_server has started it, else as the real interpreter does: the
    tests put it first on their PATH and in $PYTHON, for the scripts they start."""
    global SHIM_DIR
    if SHIM_DIR is None:
        import tempfile
        SHIM_DIR = tempfile.mkdtemp(prefix="python_shim_")
        with open(os.path.join(SHIM_DIR, "python"), "w") as f:  # -S: it needs only the standard library, and
            # site's start-up (site-packages' .pth files) is a fifth of a shim's CPU time, over hundreds of shims
            f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {os.path.join(REPO, 'tests')!r})\n"
                    "import preloaded\npreloaded.shim(sys.argv[1:])\n")
        os.chmod(os.path.join(SHIM_DIR, "python"), 0o755)
    return SHIM_DIR


def preloaded_python(start=False):
    """The shim's `python` (python_shim's directory): through the preloaded server where it can stand in. start:
    the server is started (and waited for) first, for a test that starts the process itself and needs it forked."""
    if start:
        start_preloaded_server(wait=True)
    return os.path.join(python_shim(), "python")


def start_preloaded_server(wait=False):
    """Start this test process's preloaded.py server, unless it runs, or this is a pytest-xdist worker whose
    controller started one for every worker (share_preloaded_server): ready seconds later (its imports), and
    until then the shim runs the real interpreter (wait: until it is ready, or has failed). Its socket is in
    the environment ($PRELOADED_PYTHON_SOCKET) of every process started after."""
    global PRELOADED_SERVER
    import subprocess
    import time
    address = os.environ.get(SOCKET_ENV) or os.path.join(python_shim(), "server.sock")
    if PRELOADED_SERVER is None and SOCKET_ENV not in os.environ:
        PRELOADED_SERVER = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "preloaded.py"), "serve",
                                             address], env={**os.environ, "PYTHONPATH": REPO},
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        os.environ[SOCKET_ENV] = address
    deadline = time.time() + HANG_GUARD_S  # a server that never comes up: the real interpreter, after a while
    while wait and not os.path.exists(address) and time.time() < deadline and \
            (PRELOADED_SERVER is None or PRELOADED_SERVER.poll() is None):
        time.sleep(0.05)


def share_preloaded_server(config):
    """pytest-xdist's controller starts the server that its workers then share (they inherit its socket): one
    server's imports, not one per worker. Not for the fast tier (-m "not slow"), which trains nothing in another
    process: a worker there, as the test process under -n 0, starts its own when a test first needs one."""
    controller = config.getoption("dist", "no") != "no" and "PYTEST_XDIST_WORKER" not in os.environ
    if controller and not fast_tier(config):
        start_preloaded_server()


def fast_tier(config):
    """Whether this pytest run is the fast tier: the tests selected by -m "not slow" exactly."""
    return config.option.markexpr.replace(" ", "") == "notslow"


def stop_preloaded_server():
    """Stop this test process's preloaded server, if it started one, and wait for it to end: the CPU time of
    the processes forked from it then counts among this process's children, as /usr/bin/time reports it."""
    if PRELOADED_SERVER is not None:
        PRELOADED_SERVER.terminate()
        PRELOADED_SERVER.wait()


def run_script(cmd, *, cwd=REPO, env=None, timeout=HANG_GUARD_S, preloaded=False):
    """Run cmd (a program and its arguments, or a program alone) from cwd, the repo root unless told, and
    return its Result; a Python script (.py) runs under the interpreter running pytest. env, when given,
    is the whole environment. It runs in a session of its own: past timeout (a hang), the whole session is
    killed, torchrun's ranks and a script's children with it, and the test fails saying so. preloaded: the
    `python` it runs goes through this process's preloaded server, started (and waited for) first."""
    import subprocess
    if preloaded:
        start_preloaded_server(wait=True)
    if env is not None and SOCKET_ENV in os.environ:  # a whole environment of its own: the server's socket too
        env = {SOCKET_ENV: os.environ[SOCKET_ENV], **env}
    args = [str(cmd)] if isinstance(cmd, (str, os.PathLike)) else [str(a) for a in cmd]
    if args[0].endswith(".py"):
        args.insert(0, sys.executable)
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stdout, stderr = communicate(proc, timeout)
    return Result(args, proc.returncode, stdout, stderr)


def communicate(proc, timeout=HANG_GUARD_S):
    """proc.communicate(), bounded: past timeout, proc's process group (start it with start_new_session=True)
    is killed and the test fails. Returns (stdout, stderr)."""
    import subprocess
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        pytest.fail(f"{proc.args} still ran after {timeout} s: a hang, killed with its process group")


def kill_group(proc):
    """SIGKILL proc's process group, if proc leads one that still lives."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass


def run_in_process(cmd, env=None, cwd=REPO):
    """Run a Python program of the repository in this process, as `python script args` or
    `python -m module args` would run it from cwd (cmd: the script's path, relative to cwd, and its
    arguments; or "-m", the module's name and its arguments), without the seconds a new Python spends
    importing torch; returns its Result: exit status, stdout and stderr (warnings, and the traceback of a
    crash with status 1, included). The working directory, sys.argv, sys.path, sys.modules' entry of the
    module, the environment and the signal handlers are restored after. Not for a program that reads its
    environment at import (the Hub's address), starts worker processes, or whose test needs a process of
    its own to signal or kill."""
    import contextlib
    import io
    import runpy
    import traceback
    import warnings
    args = [str(a) for a in cmd]
    module = args[1] if args[0] == "-m" else None
    out, err = io.StringIO(), io.StringIO()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    saved = dict(environ=dict(os.environ), cwd=os.getcwd(), argv=sys.argv, path=list(sys.path),
                 module=sys.modules.pop(module, None) if module else None)  # `python -m` runs it afresh
    os.environ.update(env or {})
    os.chdir(cwd)
    sys.argv = args[1:] if module else args  # run_module puts the module's file in sys.argv[0]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("always")  # a new process has seen none yet; Python ignores these there too:
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))  # not pytest's
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(args[0], run_name="__main__")
                status = 0
            except SystemExit as e:  # sys.exit(status), sys.exit("message"), argparse's errors, --help
                status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(saved["cwd"])
        os.environ.clear()
        os.environ.update(saved["environ"])
        sys.argv, sys.path[:] = saved["argv"], saved["path"]
        if saved["module"] is not None:
            sys.modules[module] = saved["module"]
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return Result(args, status, out.getvalue(), err.getvalue())


def run_eval(script, *args, out):
    """eval/<script> (in this process, as `python -m eval.<name>` runs it) writing to out: its Result, and the
    JSON report it wrote there
    (<script's name>.json). A failed run fails the test, with what it printed."""
    import json
    result = run_in_process(["-m", "eval." + script.removesuffix(".py"), *args, "--out", out])
    assert result.status == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(os.path.join(out, script.replace(".py", ".json"))) as f:
        return result, json.load(f)


def free_port():
    """A TCP port nothing listens on now, for a process group's rendezvous."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(args, env=None, cwd=REPO, timeout=HANG_GUARD_S):
    """`python args` (a script and its arguments, or "-m", a module and its arguments) from cwd in a process of
    its own, through the preloaded server (python_shim): its environment (env: the whole of it, else this
    process's), exit status and output are its own, without a new Python's seconds of imports. Returns its
    Result. For a program whose process is what the test needs (the environment it reads at import, a cache it
    keeps, its exit); not where what a program imports is the subject."""
    return run_script([preloaded_python(), *args], cwd=cwd, env=env, timeout=timeout, preloaded=True)


def run_ranks(script, args, nproc, env, timeout=HANG_GUARD_S):
    """Run nproc copies of `python script args` as the ranks of one process group, with the variables torchrun
    gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), through the preloaded server
    (python_shim) and without torchrun's launcher: the launcher and each rank's imports would cost a Python and
    torch start of their own. As torchrun does, the first rank to fail ends the others (a rank left alone would
    wait in a collective until the process group's timeout). Returns a Result: a failed rank's status (the
    lowest rank's, of those seen failed at once), else 0; the ranks' output one after another, rank 0's first."""
    import subprocess
    import tempfile
    import time
    cmd = [preloaded_python(start=True), script, *args]
    port = free_port()
    procs, logs = [], []
    for rank in range(nproc):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), SOCKET_ENV: os.environ[SOCKET_ENV]}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err, text=True,
                                      start_new_session=True))
        logs.append((out, err))
    deadline, failed = time.monotonic() + timeout, []
    try:
        while time.monotonic() < deadline:
            statuses = [p.poll() for p in procs]
            failed = [status for status in statuses if status not in (None, 0)]  # in the ranks' order
            if failed or None not in statuses:
                break
            time.sleep(0.01)
    finally:
        hung = not failed and any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                kill_group(p)  # the server then kills the rank it runs
                p.wait()
    if hung:
        pytest.fail(f"{cmd} on {nproc} ranks still ran after {timeout} s: a hang, killed")
    texts = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    return Result(cmd, failed[0] if failed else 0, "".join(o for o, _ in texts), "".join(e for _, e in texts))


def run_train(args, nproc=1, check=True, env=None, script="train.py", torchrun=False):
    """Run train.py (or a stand-in script) from the repo root and return its Result: in this process (one
    process: the training is the same, and a test spends its time training rather than starting Python), or
    as nproc ranks of a process group (run_ranks), or under torchrun itself (torchrun=True: where its
    launcher is what the test is about: its exit status, relayed signals, relaunches; torchrun and its ranks
    forked from the preloaded server, run_python). A run that logs to wandb, which takes over stdout, gets a
    process of its own; a deadlock between processes ends after HANG_GUARD_S."""
    full_env = {**os.environ, **TORCHRUN_GRACE, "OMP_NUM_THREADS": str(max(1, cpu_threads() // nproc)),
                **(env or {})}
    if torchrun:
        result = run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args],
                            env=full_env)
    elif nproc > 1:
        result = run_ranks(script, args, nproc, full_env)
    elif "--wandb_log=True" in args:
        result = run_python([script, *args], env=full_env)
    else:
        result = run_in_process([script, *args], env)
    if check and result.status != 0:
        raise AssertionError(f"train.py failed ({result.status}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
