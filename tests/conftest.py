"""Shared test setup: offline tokenizer, offline wandb, one micro model config and shards built once, and
the one way the tests run a script."""

import dataclasses
import glob
import os
import shutil
import signal
import sys
import tempfile
import threading

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# six public-domain Shakespeare plays (Project Gutenberg texts), shipped with the tests
CORPUS = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "corpus", "*.txt")))

# the GPT-2 BPE files are downloaded by tiktoken on first use; an offline machine points
# TIKTOKEN_CACHE_DIR at a copy of them, or keeps one in ../shared/tiktoken_cache beside the checkout
OFFLINE_BPE = os.path.join(os.path.dirname(REPO), "shared", "tiktoken_cache")
if os.path.isdir(OFFLINE_BPE):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", OFFLINE_BPE)
os.environ.setdefault("WANDB_MODE", "disabled")
# the scripts the tests start run "python", "torchrun" and "hf": those of the interpreter running pytest
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("PYTHON", sys.executable)
# transformers copies the code of exported models (scripts/export_hf.py) into a module cache: one per
# test process, so that parallel workers never import each other's half-written copies
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf_modules_")
# the tests' git calls (a clone of the checkout, its file list) work in a checkout another user owns
os.environ["GIT_CONFIG_GLOBAL"] = os.path.join(REPO, "tests", "fixtures", "trust_any_checkout.gitconfig")
# Tests started in the background (nohup, `&` in a script) inherit SIGINT ignored, and so would the scripts
# they start, whose Ctrl-C handling the tests check: a shell cannot trap a signal ignored at its start.
# Handled here, it is default again in every child (pytest-xdist runs tests in the main thread).
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


CORES = usable_cores()
# The CPU threads of one test. A float32 run's numbers depend on the thread count (how a matmul splits its
# sums), so every mode (-n 0, pytest-xdist on any number of cores) uses the same one: 1, which also keeps
# the workers' spinning OpenMP threads off each other's cores. An explicit OMP_NUM_THREADS is respected.
CPU_THREADS = max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
os.environ["OMP_NUM_THREADS"] = str(CPU_THREADS)

EOT = 50256
# Time limits in tests only end hangs, never judge speed: 8 minutes is far beyond any correct run on a busy
# machine. pytest-timeout (pytest.ini) ends any test after 10, dumping every thread's stack; this one, shorter,
# lets a test that waits on processes kill them and say what it waited for.
HANG_GUARD_S = 480
# torchrun kills its ranks 30 s after relaying a signal; a busy machine may need longer to checkpoint
TORCHRUN_GRACE = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(HANG_GUARD_S)}

# one micro model for every test that trains: small enough for a 2-core CPU
MICRO = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=32, vocab_size=50304)


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core and one more, as a worker often waits (for a subprocess to start, a run
    another worker trains, a file lock) with its core idle: on 2 cores, 3 workers ran the suite in 565 s
    where 2 took 726. No more workers than test files asked for (a file's tests share a worker)."""
    files = set()
    for arg in config.args:
        path = arg.split("::")[0]
        if os.path.isdir(path):
            files.update(glob.glob(os.path.join(path, "**", "test_*.py"), recursive=True))
        elif os.path.isfile(path):
            files.add(path)
    return max(1, min(CORES + 1, len(files) or CORES + 1))


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, each file's tests in their order: pytest-xdist hands whole files
    to the workers in this order (pytest.ini turns off its own, by number of tests), so the long files start
    at once rather than last, where one of them would keep a worker busy after the others are done."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {path: i for i, path in enumerate(slow)}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


@pytest.fixture(scope="session")
def corpus_docs():
    """The fixture plays as documents (one play = one document)."""
    assert len(CORPUS) == 6, "tests/fixtures/corpus/ should hold six plays"
    docs = []
    for path in CORPUS:
        with open(path, encoding="utf-8") as f:
            docs.append(f.read())
    return docs


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_docs):
    """llm.c shards made directly (independently of prepare.py): one val shard and three
    train shards of uneven sizes, every document preceded by the end-of-text token."""
    import tiktoken
    from pretrain.shards import write_shard
    enc = tiktoken.get_encoding("gpt2")
    tokens = np.concatenate([np.array([EOT] + enc.encode_ordinary(d), dtype=np.uint16) for d in corpus_docs])
    out = tmp_path_factory.mktemp("shards")
    n_val = 20_000
    write_shard(str(out / "fineweb_val_000000.bin"), tokens[:n_val])
    train = tokens[n_val:n_val + 150_000]
    for i, (a, b) in enumerate([(0, 60_000), (60_000, 95_000), (95_000, 150_000)]):
        write_shard(str(out / f"fineweb_train_{i + 1:06d}.bin"), train[a:b])
    return str(out)


def micro_args(data_dir, out_dir, **overrides):
    """train.py arguments for the micro model: a few seconds per dozen steps on 2 cores."""
    settings = dict(MICRO, data_dir=data_dir, out_dir=out_dir, batch_size=4, total_batch_size=2 * 4 * 32,
                    max_iters=20, warmup_iters=4, learning_rate=3e-3, eval_interval=10, val_tokens=4096,
                    log_interval=1, checkpoint_interval=10, compile=False, device="cpu", dtype="float32",
                    wandb_log=False)
    settings.update(overrides)
    return [f"--{k}={v}" for k, v in settings.items()]


def make_optimizer(model, **overrides):
    """The optimizer train.py would build for model on the CPU, with train.py's defaults and overrides."""
    from pretrain.optimizers import build_optimizer
    from pretrain.train_config import make_config
    return build_optimizer(model, make_config(**overrides), "cpu")


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


def run_script(cmd, *, cwd=REPO, env=None, timeout=HANG_GUARD_S):
    """Run cmd (a program and its arguments, or a program alone) from cwd, the repo root unless told, and
    return its Result; a Python script (.py) runs under the interpreter running pytest. env, when given,
    is the whole environment. It runs in a session of its own: past timeout (a hang), the whole session is
    killed, torchrun's ranks and a script's children with it, and the test fails saying so."""
    import subprocess
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


def run_train(args, nproc=1, check=True, env=None, script="train.py"):
    """Run train.py (or a stand-in script) from the repo root, in this process (one process: the training is
    the same, and a test spends its time training rather than starting Python), or under torchrun with nproc
    processes; returns its Result. A run that logs to wandb, which takes over stdout, gets a process of its
    own; a deadlock between processes ends after HANG_GUARD_S."""
    if nproc == 1 and "--wandb_log=True" not in args:
        result = run_in_process([script, *args], env)
    else:
        cmd = [script, *args] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
             *args]
        full_env = {**os.environ, **TORCHRUN_GRACE, "OMP_NUM_THREADS": str(max(1, CPU_THREADS // nproc)),
                    **(env or {})}
        result = run_script(cmd, env=full_env)
    if check and result.status != 0:
        raise AssertionError(f"train.py failed ({result.status}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


# the SA run shows the val loss falling over 100 steps; the XSA run is shorter; both serve the evaluation tests
TRAINED_RUN = dict(batch_size=8, total_batch_size=1024, learning_rate=3e-2, warmup_iters=5,
                   eval_interval=50, checkpoint_interval=50, val_tokens=4096)
TRAINED_STEPS = {"sa": 100, "xsa": 50}


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, data_dir, worker_id):
    """Micro SA and XSA runs trained once for the session: {"sa": out_dir, "xsa": out_dir}. Under
    pytest-xdist they are trained in the session's shared temp dir, each under a file lock of its own: a
    worker trains the first run nobody is training, the next one to ask trains the other meanwhile, and
    then every worker waits for both and reads the same runs."""
    import filelock
    if worker_id == "master":  # one process: this session's own temp dir
        root = tmp_path_factory.mktemp("trained_runs")
        return {attn_type: train_run(root / attn_type, attn_type, data_dir) for attn_type in TRAINED_STEPS}
    shared = tmp_path_factory.getbasetemp().parent / "trained_runs"  # unique to this session's workers
    shared.mkdir(exist_ok=True)

    def train_unless_done(attn_type, lock):
        with lock:
            if not (shared / f"{attn_type}.done").exists():
                shutil.rmtree(shared / attn_type, ignore_errors=True)  # a failed attempt: train again, fail alike
                train_run(shared / attn_type, attn_type, data_dir)
                (shared / f"{attn_type}.done").touch()

    locks = {attn_type: filelock.FileLock(f"{shared / attn_type}.lock") for attn_type in TRAINED_STEPS}
    for attn_type, lock in locks.items():  # those nobody trains yet
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue
        try:
            train_unless_done(attn_type, lock)
        finally:
            lock.release()
    for attn_type, lock in locks.items():  # then wait for the others'
        train_unless_done(attn_type, lock)
    return {attn_type: str(shared / attn_type) for attn_type in TRAINED_STEPS}


def train_run(out_dir, attn_type, data_dir):
    run_train(micro_args(data_dir, str(out_dir), attn_type=attn_type, max_iters=TRAINED_STEPS[attn_type],
                         **TRAINED_RUN))
    return str(out_dir)


# -----------------------------------------------------------------------------
# data/fineweb/prepare.py: its shards of the fixture plays, made once

# the modules, run from the repo root as `python -m data.fineweb.prepare`
PREPARE = "data.fineweb.prepare"
DOWNLOAD = "data.fineweb.download"
LOCK = ".prepare.lock"
SHARD_SIZE, VAL_TOKENS = 20_000, 30_000  # ~240k tokens of test documents -> 1 val + 11 train shards


def load_script(name):
    """data/fineweb/<name>.py as a module, for its functions."""
    import importlib
    return importlib.import_module(f"data.fineweb.{name}")


def run_prepare(*args, check=True):
    """prepare.py with args; its worker processes may deadlock, hence the time limit."""
    result = run_script([sys.executable, "-m", PREPARE, *args], timeout=HANG_GUARD_S)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def prepare_args(inputs, out_dir, *extra):
    return ["--input", *inputs, "--out_dir", out_dir, "--shard_size", SHARD_SIZE, "--val_tokens", VAL_TOKENS,
            "--num_proc", 2, *extra]


def write_fineweb_parquet(path, docs, row_group_size=64):
    """FineWeb's schema; small row groups so that resuming skips some and starts inside another."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    n = len(docs)
    table = pa.table({
        "text": docs, "id": [f"<urn:uuid:{i}>" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.com/{i}" for i in range(n)], "date": ["2024-02-20T00:00:00Z"] * n,
        "file_path": ["s3://commoncrawl/x.warc.gz"] * n, "language": ["en"] * n,
        "language_score": [0.9] * n, "token_count": [len(d) // 4 for d in docs]})
    pq.write_table(table, path, row_group_size=row_group_size)


def shard_paths(out_dir):
    names = sorted(n for n in os.listdir(out_dir) if n.endswith(".bin"))
    return [os.path.join(out_dir, n) for n in names[-1:] + names[:-1]]  # fineweb_val_000000 first


def shard_bytes(out_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in shard_paths(out_dir)}


def listed_shards(out_dir):
    import json
    with open(os.path.join(out_dir, "manifest.json")) as f:
        return [s["file"] for s in json.load(f)["shards"]]


def leftover_temp_files(out_dir):
    return [n for n in os.listdir(out_dir) if ".tmp" in n]


@pytest.fixture(scope="session")
def docs(corpus_docs):
    """~360 documents of ~2KB, plus the awkward ones: empty, and text that spells a special token."""
    from data.fineweb.paragraphs import split_into_documents
    docs = [d for play in corpus_docs for d in split_into_documents(play, 2000)]
    return docs[:300] + ["", "a literal <|endoftext|> in the text", "naïve café, 日本語 ✓"] + docs[300:]


@pytest.fixture(scope="session")
def parquet_file(tmp_path_factory, docs):
    path = str(tmp_path_factory.mktemp("fineweb") / "000_00000.parquet")
    write_fineweb_parquet(path, docs)
    return path


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, parquet_file):
    """An uninterrupted run on the parquet file, shared by the tests that only read it."""
    out_dir = str(tmp_path_factory.mktemp("prepared"))
    run_prepare(*prepare_args([parquet_file], out_dir))
    return out_dir
