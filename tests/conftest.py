"""What pytest needs from one place: the environment every test runs in (offline tokenizer and wandb, one CPU
thread), pytest-xdist's workers and file order, and the session fixtures (the fixture plays as shards, the
shared trained runs, prepare.py's inputs and output). The helpers live beside it, each module one job:
running.py (running the repo's programs), micro.py (the micro model, its arguments and shared runs),
prepare_helpers.py (prepare.py's commands and readers) and helpers.py (what several test files check)."""

import glob
import os
import pathlib
import signal
import sys
import tempfile
import threading

import pytest

from running import fast_tier, preloaded_python, python_shim, share_preloaded_server, usable_cores

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tiktoken downloads GPT-2's BPE files on first use; offline, TIKTOKEN_CACHE_DIR or ../shared/tiktoken_cache has them
OFFLINE_BPE = os.path.join(os.path.dirname(REPO), "shared", "tiktoken_cache")
if os.path.isdir(OFFLINE_BPE):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", OFFLINE_BPE)
os.environ.setdefault("WANDB_MODE", "disabled")
# the scripts the tests start run "python", "torchrun" and "hf": those of the interpreter running pytest, its
# "python" through the preloaded server where that can stand in (running.python_shim)
os.environ["PATH"] = os.pathsep.join([python_shim(), os.path.dirname(sys.executable), os.environ.get("PATH", "")])
os.environ.setdefault("PYTHON", preloaded_python())
# transformers copies the code of exported models (scripts/export_hf.py) into a module cache: one per
# test process, so that parallel workers never import each other's half-written copies
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf_modules_")
# the tests' git calls (a clone of the checkout, its file list) work in a checkout another user owns
os.environ["GIT_CONFIG_GLOBAL"] = os.path.join(REPO, "tests", "fixtures", "trust_any_checkout.gitconfig")
# Tests started in the background (nohup, `&` in a script) inherit SIGINT ignored, and so would the scripts they
# start, whose Ctrl-C handling the tests check: a shell cannot trap a signal ignored at its start. Handled here, it
# is default again in every child (xdist runs tests in the main thread); nohup's SIGHUP alike (launchers' tests).
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


CORES = usable_cores()
# The CPU threads of one test. A float32 run's numbers depend on the thread count (how a matmul splits its
# sums), so every mode (-n 0, pytest-xdist on any number of cores) uses the same one: 1, which also keeps
# the workers' spinning OpenMP threads off each other's cores. An explicit OMP_NUM_THREADS is respected.
CPU_THREADS = max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
os.environ["OMP_NUM_THREADS"] = str(CPU_THREADS)
# inductor compiles in the compiling process, not in a pool of processes importing torch (206 -> 179 core-s), and
# scalar C++ kernels: compiled runs check graphs and numbers, not the CPU's vector code (test_fsdp's: 195 -> 145)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core and one more, as a slow test's worker often waits on a subprocess, a file lock or
    a run another trains, its core idle (2 cores: 8:01 with 3 workers, 9:00 with 2); the fast tier waits on
    nothing: a worker per core (54 s, 62 with 3). No more workers than test files asked for."""
    waiting = not fast_tier(config)
    files = set()
    for arg in config.args:
        path = arg.split("::")[0]
        if os.path.isdir(path):
            files.update(glob.glob(os.path.join(path, "**", "test_*.py"), recursive=True))
        elif os.path.isfile(path):
            files.add(path)
    workers = CORES + waiting
    return max(1, min(workers, len(files) or workers))


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, each file's tests in their order: pytest-xdist hands whole files
    to the workers in this order (pytest.ini turns off its own, by number of tests), so the long files start
    at once rather than last, where one of them would keep a worker busy after the others are done."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {path: i for i, path in enumerate(slow)}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


def pytest_configure(config):
    """pytest-xdist's controller starts the preloaded server its workers share (running.share_preloaded_server)."""
    share_preloaded_server(config)


def pytest_unconfigure(config):
    """The preloaded server's processes count in this one's CPU time (running.stop_preloaded_server)."""
    from running import stop_preloaded_server
    stop_preloaded_server()


@pytest.fixture(scope="session")
def corpus_docs():
    """The fixture plays as documents (one play = one document)."""
    from micro import CORPUS
    assert len(CORPUS) == 6, "tests/fixtures/corpus/ should hold six plays"
    return [pathlib.Path(path).read_text(encoding="utf-8") for path in CORPUS]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_docs):
    """The plays in GPT-2's tokens, each preceded by the end-of-text token, as llm.c shards made directly
    (independently of prepare.py): micro.write_micro_shards."""
    import tiktoken
    from micro import EOT, write_micro_shards
    enc = tiktoken.get_encoding("gpt2")
    return write_micro_shards(tmp_path_factory.mktemp("shards"), [[EOT] + enc.encode_ordinary(d) for d in corpus_docs])


@pytest.fixture(scope="session")
def byte_data_dir(tmp_path_factory, corpus_docs):
    """The plays as bytes (BYTE_TOKENS: token = byte, and a document start), laid out as data_dir."""
    from micro import BYTE_TOKENS, write_micro_shards
    docs = [[BYTE_TOKENS["eot_token"]] + list(d.encode()) for d in corpus_docs]
    return write_micro_shards(tmp_path_factory.mktemp("byte_shards"), docs)


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, data_dir, worker_id):
    """Micro SA and XSA runs trained once for the session (micro.shared_trained_runs): {"sa": dir, "xsa": dir}."""
    from micro import shared_trained_runs
    return shared_trained_runs(tmp_path_factory, data_dir, worker_id)


@pytest.fixture(scope="session")
def docs(corpus_docs):
    """~360 documents of ~2KB, plus the awkward ones: empty, and text that spells a special token."""
    from data.fineweb.paragraphs import split_into_documents
    docs = [d for play in corpus_docs for d in split_into_documents(play, 2000)]
    return docs[:300] + ["", "a literal <|endoftext|> in the text", "naïve café, 日本語 ✓"] + docs[300:]


@pytest.fixture(scope="session")
def parquet_file(tmp_path_factory, docs):
    from prepare_helpers import write_fineweb_parquet
    path = str(tmp_path_factory.mktemp("fineweb") / "000_00000.parquet")
    write_fineweb_parquet(path, docs)
    return path


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, parquet_file):
    """An uninterrupted run on the parquet file, shared by the tests that only read it."""
    from prepare_helpers import prepare_args, run_prepare
    out_dir = str(tmp_path_factory.mktemp("prepared"))
    run_prepare(*prepare_args([parquet_file], out_dir))
    return out_dir
