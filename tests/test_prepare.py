"""data/fineweb/prepare.py, run as a script on FineWeb-shaped local files, checked against tiktoken
called directly: the shards it writes and their manifest, its inputs (parquet, jsonl, txt, the Hub's
stream), reruns and resumes after a kill, and --verify."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken

from micro import CORPUS, EOT
from prepare_helpers import (PREPARE, SHARD_SIZE, VAL_TOKENS, leftover_temp_files, listed_shards, load_script,
                             prepare_args, run_prepare, shard_bytes, shard_paths, write_fineweb_parquet)

from data.fineweb.paragraphs import split_into_documents
from pretrain.shards import read_header, read_shard, write_shard
from running import HANG_GUARD_S, REPO


def token_stream(out_dir):
    return np.concatenate([read_shard(p) for p in shard_paths(out_dir)])


def read_manifest(out_dir):
    with open(os.path.join(out_dir, "manifest.json")) as f:
        return json.load(f)


def expected_tokens(docs):
    enc = tiktoken.get_encoding("gpt2")
    return np.concatenate([[EOT] + enc.encode_ordinary(d) for d in docs]).astype(np.uint16)


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


@pytest.mark.slow
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
    args = [sys.executable, "-m", PREPARE, "--input", parquet, "--out_dir", out_dir, *map(str, sizes)]
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
