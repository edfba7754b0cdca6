"""A `python` for the scripts the tests start (sweeps, launchers, gpu_check.sh) that skips the seconds of imports
a new Python spends on torch and train.py's modules: a server that has imported them once forks a process for
each program, which then runs as `python ARGS` would run it, with the caller's arguments, environment, working
directory, standard streams, signals and exit status. The shim (running.python_shim(), first on the tests'
PATH and their $PYTHON) asks the server, or runs the real interpreter where the server cannot stand in for it: no
server yet, or interpreter options other than -u and -B. A program beside another checkout's modules (a copy of
the repository) imports that checkout's own: its process forgets the modules the server imported from this one.

    python preloaded.py serve SOCKET    the server (running.start_preloaded_server: one per pytest run)
    python preloaded.py ARGS...         the shim: `python ARGS...`"""

import json
import os
import signal
import socket
import struct
import sys

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# inductor's compiler too: a compiled run's process would spend 1.5 s importing it
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed", "train")
SOCKET_ENV = "PRELOADED_PYTHON_SOCKET"  # where the shim finds the server
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def program(args):
    """(flags, mode, target, rest) of `python args`: mode "script", "-m", "-c" or "-"; None for a command line the
    server does not run (the interactive interpreter, other options)."""
    flags = []
    while args and args[0] in ("-u", "-B"):
        flags, args = flags + [args[0]], args[1:]
    if not args or (args[0] in ("-m", "-c") and len(args) < 2):
        return None
    if args[0] in ("-m", "-c"):
        return flags, args[0], args[1], args[2:]
    if args[0] == "-":
        return flags, "-", None, args[1:]
    return None if args[0].startswith("-") else (flags, "script", args[0], args[1:])


def other_checkout(directory):
    """Whether directory holds modules of its own that the server's imports would hide (another checkout)."""
    directory = os.path.realpath(directory or ".")
    return directory != REPO and any(os.path.exists(os.path.join(directory, name)) for name in ("model.py", "pretrain"))


def beside_other_checkout(mode, target, env, cwd):
    """Whether the program (mode and target as program gives them) finds its modules in another checkout first:
    its script's directory, or the working directory, or a PYTHONPATH entry."""
    first = os.path.dirname(os.path.join(cwd, target)) if mode == "script" else cwd
    return any(other_checkout(d) for d in [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])


def from_this_checkout(module):
    """Whether module (an entry of sys.modules) was imported from this checkout's files."""
    try:
        files = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
    except TypeError:  # a module-like object whose __path__ is no list of directories (torch.ops' namespaces)
        return False
    return any(os.path.realpath(f).startswith(REPO + os.sep) for f in files if isinstance(f, str) and os.path.isabs(f))


# ---------------------------------------------------------------------------------------------------------------
# the shim

def send_message(conn, obj, fds=()):
    data = json.dumps(obj).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data)) + data], list(fds))


def shim(args):
    env, cwd = dict(os.environ), os.getcwd()
    address = env.get(SOCKET_ENV)
    conn = None
    if address and program(args) is not None:
        try:
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(address)
        except OSError:
            conn = None
    if conn is None:
        os.execv(sys.executable, [sys.executable, *args])
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    send_message(conn, {"args": args, "env": env, "cwd": cwd, "ignored": ignored}, [0, 1, 2])
    replies = conn.makefile("r")
    pid = int(replies.readline())
    for signum in FORWARDED:
        if signum not in ignored:
            signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
    status = int(replies.readline() or -signal.SIGKILL)
    if status < 0:  # killed by a signal: so is the shim, for its caller's sake (a shell's 128 + N)
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


# ---------------------------------------------------------------------------------------------------------------
# the server and the forked program

def receive_message(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    (length,) = struct.unpack("!I", data[:4])
    while len(data) < 4 + length:
        data += conn.recv(4 + length - len(data))
    return json.loads(data[4:4 + length]), fds


def print_traceback(e):
    """The traceback Python prints, from the program's first frame (none of this file's or runpy's)."""
    import traceback
    tb = e.__traceback__
    while tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) in ("preloaded.py", "runpy.py",
                                                                                  "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def run_program(request, fds, base_path, shim_path):
    """In the forked process: the program, as Python runs it; never returns. torchrun (`-m torch.distributed.run`)
    starts its ranks with sys.executable: the shim's path there, so that they too are forked from the server."""
    import atexit
    import io
    import runpy
    import threading
    import types
    import torch
    os.setsid()  # a session of its own: the server kills it and its children whole if the shim dies
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    flags, mode, target, rest = program(request["args"])
    env = request["env"]
    os.chdir(request["cwd"])
    if beside_other_checkout(mode, target, env, request["cwd"]):
        for name, module in list(sys.modules.items()):
            if name != "__main__" and from_this_checkout(module):
                del sys.modules[name]
    bpe_encodings = getattr(sys.modules.get("tiktoken.registry"), "ENCODINGS", {})
    if env.get("TIKTOKEN_CACHE_DIR") != os.environ.get("TIKTOKEN_CACHE_DIR"):
        bpe_encodings.clear()  # the server's GPT-2 encoding came from another cache: load it as this one gives it
    os.environ.clear()
    os.environ.update(env)
    for signum in request["ignored"]:
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS") or 1)))  # as torch's import reads it
    unbuffered = "-u" in flags or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in flags or bool(env.get("PYTHONDONTWRITEBYTECODE"))

    def stream(fd, line_buffering):
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        if fd == 0:
            return io.TextIOWrapper(io.BufferedReader(raw))
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), line_buffering=line_buffering,
                                write_through=unbuffered, errors="backslashreplace" if fd == 2 else "strict")
    sys.stdin, sys.stdout, sys.stderr = stream(0, False), stream(1, os.isatty(1)), stream(2, True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    status, killed_by = 0, None
    try:
        if mode == "script":
            sys.argv = [target, *rest]
            sys.path[:] = [os.path.dirname(os.path.abspath(target)), *paths, *base_path]
            runpy.run_path(target, run_name="__main__")
        elif mode == "-m":
            sys.argv = [target, *rest]  # run_module puts the module's file in sys.argv[0]
            sys.path[:] = [os.getcwd(), *paths, *base_path]
            sys.modules.pop(target, None)  # imported by the server: `python -m` runs it afresh
            if target == "torch.distributed.run":
                sys.executable = shim_path
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            source = sys.stdin.read() if mode == "-" else target
            sys.argv = [mode, *rest]
            sys.path[:] = ["", *paths, *base_path]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(source, "<stdin>" if mode == "-" else "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt as e:
        print_traceback(e)
        killed_by = signal.SIGINT  # as Python ends on a Ctrl-C it did not handle
    except BaseException as e:
        print_traceback(e)
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if killed_by:
            signal.signal(killed_by, signal.SIG_DFL)
            os.kill(os.getpid(), killed_by)
        os._exit(status & 0xFF)


def kill_session(pid):
    """SIGKILL pid's session (its program and that one's children), or pid alone before it has made one."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(address):
    """Import PRELOAD (and load GPT-2's encoding, where TIKTOKEN_CACHE_DIR names a cache), then listen on address
    (a socket in the shim's directory, beside its `python`): a process forked per request, its pid and then its
    exit status (negative: the signal that ended it) sent back. A shim that goes away takes its program with it
    (SIGKILL to its session); the server ends when its parent does."""
    import select
    for name in PRELOAD:
        __import__(name)
    if os.environ.get("TIKTOKEN_CACHE_DIR"):  # GPT-2's encoding, which each train.py run loads (a quarter second)
        from eval.common import TokenizerUnavailable, gpt2_encoding
        try:
            gpt2_encoding()
        except TokenizerUnavailable:  # not in that cache: each program loads it, or fails to, as it would have
            pass
    base_path = [p for p in sys.path[1:] if os.path.realpath(p) != REPO]
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.rename(address + ".tmp", address)  # ready once it is there
    children = {}  # pid: the shim's connection
    while os.getppid() == parent:
        readable, _, _ = select.select([listener, *children.values()], [], [], 0.1)
        for conn in readable:
            if conn is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = receive_message(conn)
                except (OSError, ValueError, struct.error):  # a shim gone before its request was whole
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        listener.close()
                        for other in children.values():
                            other.close()
                        conn.close()
                        run_program(request, fds, base_path, os.path.join(os.path.dirname(address), "python"))
                    finally:
                        os._exit(1)  # never back into the server's loop
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:  # the shim is gone: its program goes too
                    kill_session(pid)
            else:
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone:  # the shim is gone: its program goes too
                    kill_session(next(p for p, c in children.items() if c is conn))
        while children:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        shim(sys.argv[1:])
