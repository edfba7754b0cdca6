"""data/fineweb/prepare.py, run as a script on FineWeb-shaped local files, checked against tiktoken
called directly; its errors on bad input and on an out_dir it cannot write; its progress bar and lock;
prepare.py, download.py and quickstart.sh without the Hub; and the commands docs/data.md gives."""

import errno
import fcntl
import glob
import importlib.util
import io
import json
import os
import pty
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken

from conftest import CORPUS, EOT, HANG_GUARD_S, REPO, run_script
from fakes.hub import closed_port, no_hub_env, unavailable_hub
from files import DirectoryLock
from shards import read_header, read_shard, write_shard

FINEWEB = os.path.join(REPO, "data", "fineweb")
sys.path.append(FINEWEB)  # its scripts import their sibling modules (hub_access, paragraphs), as when run
from paragraphs import split_into_documents  # noqa: E402

PREPARE = os.path.join(FINEWEB, "prepare.py")
DOWNLOAD = os.path.join(FINEWEB, "download.py")
LOCK = ".prepare.lock"
SHARD_SIZE, VAL_TOKENS = 20_000, 30_000  # ~240k tokens of test documents -> 1 val + 11 train shards


def load_script(name):
    """Import data/fineweb/<name>.py under a name of its own, for its functions."""
    spec = importlib.util.spec_from_file_location(f"fineweb_{name}", os.path.join(FINEWEB, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where a worker process looks up the functions it is sent
    spec.loader.exec_module(module)
    return module


def run_prepare(*args, check=True):
    """prepare.py with args; its worker processes may deadlock, hence the time limit."""
    result = run_script([PREPARE, *args], timeout=HANG_GUARD_S)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def prepare_args(inputs, out_dir, *extra):
    return ["--input", *inputs, "--out_dir", out_dir, "--shard_size", SHARD_SIZE, "--val_tokens", VAL_TOKENS,
            "--num_proc", 2, *extra]


def write_fineweb_parquet(path, docs, row_group_size=64):
    """FineWeb's schema; small row groups so that resuming skips some and starts inside another."""
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


def token_stream(out_dir):
    return np.concatenate([read_shard(p) for p in shard_paths(out_dir)])


def shard_bytes(out_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in shard_paths(out_dir)}


def leftover_temp_files(out_dir):
    return [n for n in os.listdir(out_dir) if ".tmp" in n]


def read_manifest(out_dir):
    with open(os.path.join(out_dir, "manifest.json")) as f:
        return json.load(f)


def expected_tokens(docs):
    enc = tiktoken.get_encoding("gpt2")
    return np.concatenate([[EOT] + enc.encode_ordinary(d) for d in docs]).astype(np.uint16)


@pytest.fixture(scope="session")
def docs(corpus_docs):
    """~360 documents of ~2KB, plus the awkward ones: empty, and text that spells a special token."""
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


def copy_of(out_dir, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(out_dir, dst)
    return dst

# -----------------------------------------------------------------------------
# the shards


def test_shards_are_valid_and_sized_val_then_train(prepared):
    paths = shard_paths(prepared)
    names = [os.path.basename(p) for p in paths]
    assert names == ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, len(names))]
    sizes = [read_header(p) for p in paths]
    assert all(os.path.getsize(p) == 1024 + 2 * n for p, n in zip(paths, sizes))
    assert sizes[0] == VAL_TOKENS
    assert all(n == SHARD_SIZE for n in sizes[1:-1]) and 0 < sizes[-1] <= SHARD_SIZE
    assert len(names) > 5


def test_shards_hold_every_document_after_an_eot(prepared, docs):
    stream = token_stream(prepared)
    expected = expected_tokens(docs)
    assert len(stream) == len(expected)  # the count made here, independently of prepare.py
    assert np.array_equal(stream, expected)
    enc = tiktoken.get_encoding("gpt2")
    assert enc.decode(stream.tolist()) == "".join("<|endoftext|>" + d for d in docs)
    assert np.count_nonzero(stream == EOT) == len(docs)  # a literal "<|endoftext|>" in a text is plain text


def test_manifest_records_where_each_shard_lies_in_the_documents(prepared, docs):
    manifest = read_manifest(prepared)
    lengths = [len(tiktoken.get_encoding("gpt2").encode_ordinary(d)) + 1 for d in docs]
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    start = 0
    for shard in manifest["shards"]:
        end = start + shard["tokens"]
        assert doc_starts[shard["first_doc"]] + shard["first_offset"] == start
        assert doc_starts[shard["next_doc"]] + shard["next_offset"] == end
        assert doc_starts[shard["last_doc"]] < end <= doc_starts[shard["last_doc"] + 1]
        start = end
    assert manifest["complete"] and manifest["tokens"] == start == doc_starts[-1]
    assert manifest["documents"] == len(docs)
    settings = manifest["settings"]
    assert (settings["shard_size"], settings["val_tokens"], settings["max_tokens"]) == (SHARD_SIZE, VAL_TOKENS, None)
    assert (settings["tokenizer"], settings["eot"]) == ("gpt2", EOT)


def test_jsonl_input_gives_the_same_shards_as_parquet(prepared, docs, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": str(i)}) + "\n" for i, d in enumerate(docs)))
    out_dir = str(tmp_path / "out")
    run_prepare(*prepare_args([str(path)], out_dir))
    assert shard_bytes(out_dir) == shard_bytes(prepared)


def test_txt_files_are_one_document_each_in_glob_order(tmp_path):
    for name in ["b.txt", "a.txt"]:
        shutil.copy(CORPUS[0] if name == "a.txt" else CORPUS[1], tmp_path / name)
    out_dir = str(tmp_path / "out")
    run_prepare("--input", str(tmp_path / "*.txt"), "--out_dir", out_dir, "--val_tokens", 10_000, "--num_proc", 1)
    texts = [open(CORPUS[0]).read(), open(CORPUS[1]).read()]
    assert np.array_equal(token_stream(out_dir), expected_tokens(texts))


def test_max_tokens_stops_at_exactly_that_many(parquet_file, docs, tmp_path):
    out_dir = str(tmp_path / "out")
    run_prepare(*prepare_args([parquet_file], out_dir, "--max_tokens", 55_555))
    assert [read_header(p) for p in shard_paths(out_dir)] == [VAL_TOKENS, SHARD_SIZE, 5_555]
    assert np.array_equal(token_stream(out_dir), expected_tokens(docs)[:55_555])


def test_hub_stream_resumes_at_a_document_index(parquet_file, docs, monkeypatch):
    """The Hub path, offline: load_dataset pointed at the local parquet file, still streaming."""
    import datasets
    prepare = load_script("prepare")
    calls, load_dataset = [], datasets.load_dataset

    def local_load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return load_dataset("parquet", data_files=parquet_file, split=split, streaming=streaming)
    monkeypatch.setattr(datasets, "load_dataset", local_load_dataset)
    texts = prepare.iter_hub_documents("HuggingFaceFW/fineweb", "sample-100BT", start=100)
    assert list(texts) == docs[100:]
    assert calls == [("HuggingFaceFW/fineweb", "sample-100BT", "train", True)]


def test_local_files_resume_at_a_document_index(parquet_file, docs, tmp_path):
    prepare = load_script("prepare")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs[:10]) + "\n\n")  # blank lines are not documents
    files = [str(jsonl), parquet_file, CORPUS[0]]
    everything = docs[:10] + docs + [open(CORPUS[0]).read()]
    for start in [0, 5, 10, 10 + 64, 10 + 100, len(everything) - 1, len(everything)]:
        assert list(prepare.iter_local_documents(files, start)) == everything[start:]


def test_tokenize_batch_is_eot_then_encode_ordinary():
    prepare = load_script("prepare")
    texts = ["hello world", "", "a <|endoftext|> b <|fim_prefix|>", "naïve café"]
    tokens, lengths = prepare.tokenize_batch(texts)
    assert tokens.dtype == np.uint16
    assert np.array_equal(tokens, expected_tokens(texts))
    assert lengths.tolist() == [len(tiktoken.get_encoding("gpt2").encode_ordinary(t)) + 1 for t in texts]


def test_a_token_that_does_not_fit_uint16_fails_loudly(monkeypatch):
    prepare = load_script("prepare")

    class HugeVocab:
        def encode_to_numpy(self, text, disallowed_special):
            return np.array([5, 70_000], dtype=np.uint32)
    monkeypatch.setattr(prepare.tiktoken, "get_encoding", lambda name: HugeVocab())
    with pytest.raises(ValueError, match="70000 does not fit in uint16"):
        prepare.tokenize_batch(["x"])

@pytest.mark.parametrize("doc_chars", [1, 2000, 10**9])
def test_split_into_documents_cuts_at_paragraph_breaks_once_long_enough(corpus_docs, doc_chars):
    for text in corpus_docs:
        docs = split_into_documents(text, doc_chars)
        assert "".join(docs) == text + "\n\n"  # nothing lost, nothing reordered
        assert all(d.endswith("\n\n") for d in docs)
        for doc in docs[:-1]:  # long enough, and not one paragraph longer than needed
            last_paragraph = doc[:-2].split("\n\n")[-1]
            assert len(doc) >= doc_chars > len(doc) - len(last_paragraph) - 2
    assert len(split_into_documents(corpus_docs[0], 10**9)) == 1


def test_bench_tokenize_documents_are_the_shared_split(corpus_docs):
    bench = load_script("bench_tokenize")
    assert bench.load_documents([CORPUS[0]], 3000, repeat=2) == split_into_documents(corpus_docs[0], 3000) * 2


# -----------------------------------------------------------------------------
# bad input: one line naming the file (and line or row), not a traceback


def write_parquet_without_text(path):
    pq.write_table(pa.table({"content": ["a document"], "url": ["https://example.com/"]}), path)


def write_parquet_with_a_null_text(path):
    pq.write_table(pa.table({"text": ["one", "two", None, "four"]}), path)


BAD_INPUTS = [
    ("latin1.txt", "first line\nsecond line\ncaf\xe9\n".encode("latin-1"),
     "latin1.txt, line 3: not UTF-8 text (byte 0xe9)"),
    ("latin1.jsonl", '{"text": "ok"}\n\n{"text": "caf\xe9"}\n'.encode("latin-1"),
     "latin1.jsonl, line 3: not UTF-8 text"),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": "no end\n', "broken.jsonl, line 3: not valid JSON"),
    ("no_text.jsonl", b'{"text": "ok"}\n\n{"content": "x"}\n', "no_text.jsonl, line 3: no `text` field"),
    ("number.jsonl", b'{"text": 42}\n', "number.jsonl, line 1: `text` is int, not a string"),
    ("no_text.parquet", write_parquet_without_text, "no_text.parquet: no `text` column (its columns: content, url)"),
    ("null.parquet", write_parquet_with_a_null_text, "null.parquet: row 2 (counting from 0) has no text"),
    ("not_parquet.parquet", b"PAR1 but not really", "not_parquet.parquet: not a readable parquet file"),
]


@pytest.mark.parametrize("name, content, error", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_fails_in_one_line_naming_the_file(tmp_path, name, content, error):
    path = tmp_path / name
    content(str(path)) if callable(content) else path.write_bytes(content)
    # after a good file, so that the bad one is met while reading, with the pool running
    result = run_prepare("--input", CORPUS[0], str(path), "--out_dir", tmp_path / "out", "--num_proc", 1, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"{tmp_path}/{error}")  # the error's own line


# -----------------------------------------------------------------------------
# reruns and resume


def test_rerun_of_a_finished_run_does_nothing(prepared, parquet_file):
    before = {p: os.stat(p).st_mtime_ns for p in shard_paths(prepared)}
    result = run_prepare(*prepare_args([parquet_file], prepared))
    assert "nothing to do" in result.stdout
    assert {p: os.stat(p).st_mtime_ns for p in shard_paths(prepared)} == before


def test_rerun_with_other_settings_is_refused(prepared, parquet_file):
    result = run_prepare("--input", parquet_file, "--out_dir", prepared, "--shard_size", SHARD_SIZE + 1,
                         "--val_tokens", VAL_TOKENS, check=False)
    assert result.returncode != 0
    assert "other settings" in result.stderr and "shard_size" in result.stderr


def test_out_dir_with_shards_but_no_manifest_is_refused(parquet_file, tmp_path):
    write_shard(str(tmp_path / "fineweb_train_000001.bin"), np.arange(10, dtype=np.uint16))
    result = run_prepare(*prepare_args([parquet_file], str(tmp_path)), check=False)
    assert result.returncode != 0 and "no manifest.json" in result.stderr


def test_the_manifest_is_written_before_the_first_shard(tmp_path, monkeypatch):
    """Else a kill between the first shard and the first manifest leaves a directory that holds
    shards but no manifest, which a rerun must refuse (it cannot tell it from another tool's)."""
    prepare = load_script("prepare")
    out_dir = str(tmp_path)
    manifest_there, write_shard = [], prepare.shards.write_shard

    def watched_write_shard(path, tokens):
        manifest_there.append(os.path.exists(os.path.join(out_dir, "manifest.json")))
        write_shard(path, tokens)
    monkeypatch.setattr(prepare.shards, "write_shard", watched_write_shard)
    settings = {"shard_size": 4, "val_tokens": 4, "max_tokens": None}
    writer = prepare.ShardWriter(out_dir, {"settings": settings, "shards": [], "complete": False})
    writer.add(np.arange(10, dtype=np.uint16), np.array([3, 7]))
    assert manifest_there == [True, True]
    assert read_manifest(out_dir)["shards"][0]["file"] == "fineweb_val_000000.bin"


def shard_inodes(out_dir):
    """name -> inode of every shard file: a rewrite (temp file renamed over it) changes the inode."""
    if not os.path.isdir(out_dir):
        return {}
    with os.scandir(out_dir) as entries:
        return {e.name: e.inode() for e in entries if e.name.endswith(".bin")}


def listed_shards(out_dir):
    with open(os.path.join(out_dir, "manifest.json")) as f:
        return [s["file"] for s in json.load(f)["shards"]]


def prepare_processes(out_dir):
    """Processes (main or worker) of a prepare.py writing to out_dir."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if PREPARE.encode() in cmdline and out_dir.encode() in cmdline:
            found.append(int(pid))
    return found


def test_killed_the_moment_each_shard_appears_resumes_to_identical_shards(docs, tmp_path):
    """SIGKILL as soon as a new shard file is there (on a disk, mostly before its manifest update),
    then rerun, until a run finishes: every kill resumes, no shard is written twice, no worker
    outlives its run, and the shards come out byte-identical to an uninterrupted run's. Shards of
    200k tokens, more than a batch of documents holds, appear a batch's tokenization apart, so the
    poll sees each one alone."""
    parquet = str(tmp_path / "docs.parquet")
    write_fineweb_parquet(parquet, docs * 3)  # ~720k tokens: 4 shards
    reference, out_dir = str(tmp_path / "reference"), str(tmp_path / "out")
    sizes = ["--shard_size", 200_000, "--val_tokens", 200_000, "--num_proc", 1]
    run_prepare("--input", parquet, "--out_dir", reference, *sizes)
    args = [sys.executable, PREPARE, "--input", parquet, "--out_dir", out_dir, *map(str, sizes)]
    first_inode, kills = {}, 0
    for _ in range(10):
        listed_before = listed_shards(out_dir) if os.path.exists(os.path.join(out_dir, "manifest.json")) else []
        seen = shard_inodes(out_dir)
        with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
            proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err)
        new, deadline = {}, time.time() + HANG_GUARD_S
        while not new and proc.poll() is None:
            assert time.time() < deadline, "prepare.py hangs"
            time.sleep(0.0002)  # short: the window before the manifest update is a few fsyncs long
            new = {n: i for n, i in shard_inodes(out_dir).items() if seen.get(n) != i}
        if new:
            proc.kill()
        proc.wait(timeout=HANG_GUARD_S)
        for name, inode in new.items():
            assert first_inode.setdefault(name, inode) == inode, f"{name} was written again"
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
        kills += 1
        listed = listed_shards(out_dir)  # there is a manifest once there is a shard, whenever the kill landed
        assert listed[:len(listed_before)] == listed_before
        deadline = time.time() + HANG_GUARD_S
        while prepare_processes(out_dir):
            assert time.time() < deadline, "a worker of the killed run lives on"
            time.sleep(0.01)
    else:
        pytest.fail("no run finished")
    stdout = (tmp_path / "stdout").read_text()
    assert f"keeping {len(listed_before)} shards" in stdout or "nothing to do" in stdout  # a kill after the last update
    assert kills >= 1  # usually 4, one per shard; a starved poller may see two shards appear as one

    assert shard_inodes(out_dir) == first_inode  # each shard written once, by the run that was killed
    assert shard_bytes(out_dir) == shard_bytes(reference)
    assert read_manifest(out_dir) == read_manifest(reference)
    assert leftover_temp_files(out_dir) == []


def copy_with_manifest_cut_to_4_shards(prepared, tmp_path):
    """A copy of a prepared directory whose manifest lists only its first 4 shards, as if the run
    had been killed before recording the rest."""
    out_dir = copy_of(prepared, tmp_path)
    manifest = read_manifest(out_dir)
    manifest["shards"], manifest["complete"] = manifest["shards"][:4], False
    del manifest["documents"], manifest["tokens"]
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return out_dir


def test_killed_before_the_manifest_caught_up_resumes_to_identical_shards(prepared, parquet_file, tmp_path):
    """The states a kill can leave: a shard renamed into place but not yet in the manifest (kept
    as it is, not written again), and the temp files of a shard and of a manifest being written."""
    out_dir = copy_with_manifest_cut_to_4_shards(prepared, tmp_path)
    for name in os.listdir(out_dir):
        if name.startswith("fineweb_train_") and int(name[-10:-4]) > 4:  # shard 4 exists, 5.. not yet
            os.remove(os.path.join(out_dir, name))
    open(os.path.join(out_dir, "fineweb_train_000005.bin.tmp4242"), "wb").write(b"\0" * 100)
    open(os.path.join(out_dir, "manifest.json.tmp4242"), "w").write("{")
    kept = shard_inodes(out_dir)

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "keeping 4 shards" in result.stdout
    assert {n: i for n, i in shard_inodes(out_dir).items() if n in kept} == kept  # shard 4 too
    assert shard_bytes(out_dir) == shard_bytes(prepared)
    assert read_manifest(out_dir) == read_manifest(prepared)
    assert leftover_temp_files(out_dir) == []


def test_an_unlisted_shard_that_differs_is_written_again(prepared, parquet_file, tmp_path):
    """A shard beyond the manifest is kept only if it is byte for byte the one the rerun makes."""
    out_dir = copy_with_manifest_cut_to_4_shards(prepared, tmp_path)
    stale = os.path.join(out_dir, "fineweb_train_000004.bin")
    tokens = read_shard(stale).copy()
    tokens[-1] ^= 1
    write_shard(stale, tokens)  # same size, one token off
    run_prepare(*prepare_args([parquet_file], out_dir))
    assert shard_bytes(out_dir) == shard_bytes(prepared)


def test_resume_refuses_a_kept_shard_that_was_damaged(prepared, parquet_file, tmp_path):
    out_dir = copy_of(prepared, tmp_path)
    manifest = read_manifest(out_dir)
    manifest["complete"] = False
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(out_dir, "fineweb_train_000002.bin"), "r+b") as f:
        f.truncate(2000)
    result = run_prepare(*prepare_args([parquet_file], out_dir), check=False)
    assert result.returncode != 0
    assert "cannot resume" in result.stderr and "fineweb_train_000002.bin" in result.stderr

# -----------------------------------------------------------------------------
# the lock on out_dir, and an out_dir that cannot be written


def test_no_lock_file_is_left_behind(prepared, parquet_file, tmp_path):
    """Finished, with nothing to do, refused, or stopped by bad input: the lock file goes with the run."""
    assert not os.path.exists(os.path.join(prepared, LOCK))
    assert "nothing to do" in run_prepare(*prepare_args([parquet_file], prepared)).stdout
    assert not os.path.exists(os.path.join(prepared, LOCK))
    refused = run_prepare("--input", parquet_file, "--out_dir", prepared, "--shard_size", 7, check=False)
    assert refused.returncode == 1 and "other settings" in refused.stderr
    assert not os.path.exists(os.path.join(prepared, LOCK))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no text": 1}\n')
    failed = run_prepare("--input", CORPUS[0], str(bad), "--out_dir", tmp_path / "out", "--num_proc", 1, check=False)
    assert failed.returncode == 1 and "no `text` field" in failed.stderr
    assert LOCK not in os.listdir(tmp_path / "out")


def test_a_second_writer_is_refused_and_leaves_the_first_ones_lock(parquet_file, tmp_path):
    out_dir = str(tmp_path / "out")
    os.makedirs(out_dir)
    with DirectoryLock(out_dir, LOCK) as held:
        result = run_prepare(*prepare_args([parquet_file], out_dir), check=False)
        assert result.returncode == 1 and "another prepare.py is writing to" in result.stderr
        assert f"PID {os.getpid()}" in result.stderr
        with open(held.path) as f:  # the refused run neither removed nor rewrote the holder's lock file
            assert f.read() == f"{os.getpid()}\n"
    assert os.listdir(out_dir) == []


def out_dir_under_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "out")


def read_only_dir(tmp_path):
    """Read-only for a user; root writes through the mode bits, so then the case is skipped."""
    if os.geteuid() == 0:
        pytest.skip("root can write to a read-only directory")
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    return str(path)


@pytest.mark.parametrize("make_out_dir", [out_dir_under_a_file, read_only_dir])
def test_an_out_dir_that_cannot_be_written_fails_in_one_line(parquet_file, tmp_path, make_out_dir):
    out_dir = make_out_dir(tmp_path)
    result = run_prepare(*prepare_args([parquet_file], out_dir), check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith(f"cannot write to {out_dir} (")
    assert "choose an --out_dir you can write to" in message[0]


def test_a_full_disk_stops_in_one_line_and_the_rerun_resumes(prepared, parquet_file, tmp_path, monkeypatch, capsys):
    """No space left for the third shard: one line saying what to do, the two shards before it kept, no
    lock left, and the same command finishes the job with the shards of an uninterrupted run."""
    prepare = load_script("prepare")
    out_dir = str(tmp_path / "out")
    write_shard = prepare.shards.write_shard

    def disk_full_at_the_third_shard(path, tokens):
        if path.endswith("_000002.bin"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_shard(path, tokens)
    monkeypatch.setattr(prepare.shards, "write_shard", disk_full_at_the_third_shard)
    monkeypatch.setattr(sys, "argv", [PREPARE, *map(str, prepare_args([parquet_file], out_dir, "--quiet"))])
    with pytest.raises(SystemExit) as stop:
        prepare.main()
    assert str(stop.value).startswith(f"cannot write to {out_dir} ([Errno {errno.ENOSPC}] No space left on device)")
    assert "rerun the same command" in str(stop.value)
    assert listed_shards(out_dir) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert not os.path.exists(os.path.join(out_dir, LOCK))
    assert leftover_temp_files(out_dir) == []

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "keeping 2 shards" in result.stdout
    assert shard_bytes(out_dir) == shard_bytes(prepared)

# -----------------------------------------------------------------------------
# progress bars: with an ETA on a terminal, none in a log or with --quiet


def run_on_a_terminal(cmd):
    """Run cmd with its stderr on a pseudo-terminal (100 columns); returns (exit status, stderr text)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    output = b""
    while True:  # read as it comes, so that a full terminal buffer never blocks the process
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    return proc.wait(), output.decode()


def last_bar(stderr):
    return re.split(r"[\r\n]+", stderr.strip())[-1]


ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d")  # [elapsed<remaining


def test_progress_bar_counts_documents_to_the_total_of_the_input(parquet_file, docs, tmp_path):
    status, stderr = run_on_a_terminal([sys.executable, PREPARE, *map(str, prepare_args([parquet_file], tmp_path / "a"))])
    assert status == 0
    bar = last_bar(stderr)
    assert bar.startswith("100%") and f" {len(docs)}/{len(docs)} " in bar and ETA.search(bar), bar


def test_progress_bar_counts_tokens_to_max_tokens(parquet_file, tmp_path):
    cmd = [sys.executable, PREPARE, *map(str, prepare_args([parquet_file], tmp_path / "a", "--max_tokens", 55_555))]
    status, stderr = run_on_a_terminal(cmd)
    assert status == 0
    bar = last_bar(stderr)
    assert bar.startswith("100%") and " 55.6k/55.6k " in bar and ETA.search(bar), bar


def test_no_progress_bar_with_quiet_or_in_a_log(parquet_file, tmp_path):
    status, stderr = run_on_a_terminal([sys.executable, PREPARE, *map(str, prepare_args([parquet_file], tmp_path / "a",
                                                                                        "--quiet"))])
    assert status == 0 and stderr.strip() == ""
    logged = run_prepare(*prepare_args([parquet_file], tmp_path / "b"))  # stderr is a pipe
    assert logged.stderr.strip() == "" and "done:" in logged.stdout


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_download_shows_a_bar_of_the_shards_left(tmp_path, monkeypatch, capsys, quiet):
    """download.py with a stand-in for the Hub: the bar counts the shards to fetch (one is already there)."""
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    download = load_script("download")
    fetched = []

    def fake_hf_hub_download(repo_id, filename, repo_type, local_dir, force_download):
        fetched.append(filename)
        write_shard(os.path.join(local_dir, filename), np.arange(10, dtype=np.uint16))
        return os.path.join(local_dir, filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    monkeypatch.setattr(download, "check_hub", lambda repo_id, instead: None)
    write_shard(str(tmp_path / "fineweb_train_000001.bin"), np.arange(10, dtype=np.uint16))
    monkeypatch.setattr(sys, "argv", [DOWNLOAD, "--shards", "3", "--out_dir", str(tmp_path)] + ["--quiet"] * quiet)
    monkeypatch.setattr(sys, "stderr", Terminal())
    try:
        download.main()
        assert are_progress_bars_disabled() == quiet  # huggingface_hub's bar of each file too
    finally:
        enable_progress_bars()
    assert fetched == ["fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    bar = last_bar(sys.stderr.getvalue())
    if quiet:
        assert bar == ""
    else:
        assert bar.startswith("100%") and " 4/4 " in bar and ETA.search(bar), bar
    assert "done: 4 shards, 40 tokens" in capsys.readouterr().out

# -----------------------------------------------------------------------------
# --verify


def test_verify_passes_on_good_shards(prepared):
    result = run_prepare("--verify", "--out_dir", prepared)
    assert "ok:" in result.stdout and "complete" in result.stdout


def test_verify_names_a_truncated_shard(prepared, tmp_path):
    out_dir = copy_of(prepared, tmp_path)
    with open(os.path.join(out_dir, "fineweb_train_000002.bin"), "r+b") as f:
        f.truncate(1024 + 2 * 100)
    result = run_prepare("--verify", "--out_dir", out_dir, check=False)
    assert result.returncode != 0
    assert "fineweb_train_000002.bin" in result.stderr and "truncated" in result.stderr


def test_verify_names_a_shard_with_a_wrong_magic(prepared, tmp_path):
    out_dir = copy_of(prepared, tmp_path)
    with open(os.path.join(out_dir, "fineweb_val_000000.bin"), "r+b") as f:
        f.write(np.array([1234], dtype="<i4").tobytes())
    result = run_prepare("--verify", "--out_dir", out_dir, check=False)
    assert result.returncode != 0
    assert "fineweb_val_000000.bin" in result.stderr and "magic" in result.stderr

# -----------------------------------------------------------------------------
# docs/data.md as written


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
        flags.setdefault((program, target), set()).update(a.split("=")[0] for a in args if a.startswith("--"))
    for (program, target), used in flags.items():
        cmd = [sys.executable, target] if program == "python" else [shutil.which(program), target]
        result = run_script([*cmd, "--help"])
        assert result.returncode == 0, result.stderr
        unknown = {flag for flag in used if not re.search(rf"{re.escape(flag)}\b", result.stdout)}
        assert not unknown, f"docs/data.md gives `{program} {target}` flags its --help does not list: {unknown}"


# -----------------------------------------------------------------------------
# download.py


def test_download_file_list_is_val_then_numbered_train_shards():
    download = load_script("download")
    assert download.shard_filenames(0) == ["fineweb_val_000000.bin"]
    assert download.shard_filenames(3) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                           "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    assert download.shard_filenames(1030)[-1] == "fineweb_train_001030.bin"


# -----------------------------------------------------------------------------
# the Hub out of reach: one line pointing to local files, at once


HUB_DOWN = {  # offline mode, and a Hub that is unavailable
    "offline": {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    "unreachable": {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"},
}


# requests a script that gives up at once makes: none offline, else its one check (two requests at most);
# the libraries' own retries make 8 over half a minute
GIVING_UP_AT_ONCE = {"offline": {0}, "unreachable": {1, 2}}


def run_without_hub(cmd, hub, tmp_path, **env):
    """Run cmd with the Hub down; returns the result and how many requests reached the Hub: counting
    them, not the seconds, tells whether the script gave up at once, whatever the machine's speed."""
    with unavailable_hub() as (endpoint, requests):
        env = no_hub_env(endpoint, tmp_path, **{**HUB_DOWN[hub], **env})  # no cached Hub files either
        result = run_script(cmd, env=env, timeout=HANG_GUARD_S)
    return result, len(requests)


def hub_message(result, repo_id):
    """The one line a script without the Hub prints, checked for the form that prepare.py and download.py share."""
    assert result.returncode == 3  # quickstart.sh tells this failure from the others by its status
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith(f"cannot read {repo_id} from the Hugging Face Hub (")
    return message[0]


@pytest.mark.parametrize("hub", HUB_DOWN)
def test_prepare_without_the_hub_says_to_use_input(hub, tmp_path):
    result, requests = run_without_hub([PREPARE, "--out_dir", tmp_path / "out"], hub, tmp_path)
    assert "--input" in hub_message(result, "HuggingFaceFW/fineweb")
    assert requests in GIVING_UP_AT_ONCE[hub]
    assert not os.path.exists(tmp_path / "out" / LOCK)


def test_prepare_without_the_bpe_files_says_to_set_tiktoken_cache_dir(tmp_path):
    """tiktoken downloads its files on first use; a proxy that refuses connections stands in for no network."""
    proxy = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": proxy, "https_proxy": proxy,
           "NO_PROXY": "", "no_proxy": ""}
    result = run_script([PREPARE, "--input", CORPUS[0], "--out_dir", tmp_path / "out"], env=env, timeout=HANG_GUARD_S)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "TIKTOKEN_CACHE_DIR" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("hub", HUB_DOWN)
def test_download_without_the_hub_says_to_use_prepare_input(hub, tmp_path):
    out_dir = tmp_path / "out"
    cmd = [DOWNLOAD, "--shards", "2", "--out_dir", out_dir]
    result, requests = run_without_hub(cmd, hub, tmp_path)
    assert "prepare.py --input" in hub_message(result, "kjj0/fineweb100B-gpt2")
    assert requests in GIVING_UP_AT_ONCE[hub]
    assert not out_dir.exists()


def test_download_of_a_complete_directory_needs_no_hub(tmp_path):
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        write_shard(str(tmp_path / name), np.arange(100, dtype=np.uint16))
    cmd = [DOWNLOAD, "--shards", "1", "--out_dir", tmp_path]
    result, _ = run_without_hub(cmd, "offline", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "done: 2 shards, 200 tokens" in result.stdout
    assert result.stderr == ""  # no progress bar in a log


def test_quickstart_without_the_hub_says_to_set_input(tmp_path):
    data_dir = tmp_path / "data"
    result, _ = run_without_hub(["bash", os.path.join(REPO, "scripts", "quickstart.sh")], "offline", tmp_path,
                                DATA_DIR=str(data_dir))
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert "set INPUT=" in result.stderr.strip().splitlines()[-1]
    assert not glob.glob(os.path.join(data_dir, "*.bin"))
