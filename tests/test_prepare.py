"""data/fineweb/prepare.py, run as a script on FineWeb-shaped local files, checked against tiktoken
called directly; and the file list of data/fineweb/download.py."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken

from conftest import CORPUS, EOT, REPO
from shards import read_header, read_shard, write_shard

PREPARE = os.path.join(REPO, "data", "fineweb", "prepare.py")
SHARD_SIZE, VAL_TOKENS = 20_000, 30_000  # ~240k tokens of test documents -> 1 val + 11 train shards


def load_script(name):
    """Import data/fineweb/<name>.py under a name of its own, for its functions."""
    spec = importlib.util.spec_from_file_location(f"fineweb_{name}", os.path.join(REPO, "data", "fineweb", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_prepare(*args, check=True):
    result = subprocess.run([sys.executable, PREPARE, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def prepare_args(inputs, out_dir, *extra):
    return ["--input", *inputs, "--out_dir", out_dir, "--shard_size", SHARD_SIZE, "--val_tokens", VAL_TOKENS,
            "--num_proc", 2, *extra]


def split_into_documents(text, size=2000):
    """Paragraphs joined into documents of about `size` characters, like FineWeb's web pages."""
    docs, current = [], ""
    for paragraph in text.split("\n\n"):
        current += paragraph + "\n\n"
        if len(current) >= size:
            docs.append(current)
            current = ""
    return docs + [current] if current else docs


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
    docs = [d for play in corpus_docs for d in split_into_documents(play)]
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


def wait_for(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def listed_shards(out_dir):
    try:
        return len(read_manifest(out_dir)["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_killed_between_shards_resumes_without_rebuilding(prepared, parquet_file, tmp_path):
    out_dir = str(tmp_path / "out")
    args = [sys.executable, PREPARE, *map(str, prepare_args([parquet_file], out_dir))]
    # the test hook sleeps after each shard, so the kill lands between shard 3 and shard 4
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PREPARE_SLOW_SHARD_WRITE_S": "0.3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: listed_shards(out_dir) >= 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not read_manifest(out_dir)["complete"]
    kept = {p: os.stat(p).st_mtime_ns for p in shard_paths(out_dir)}

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert f"keeping {len(kept)} shards" in result.stdout
    assert all(os.stat(p).st_mtime_ns == mtime for p, mtime in kept.items())  # not rebuilt
    assert shard_bytes(out_dir) == shard_bytes(prepared)
    assert leftover_temp_files(out_dir) == []


def test_killed_mid_shard_resumes_to_identical_shards(tmp_path, docs):
    # more data (6 x the test documents) so the run is still going when the kill lands
    parquet = str(tmp_path / "big.parquet")
    write_fineweb_parquet(parquet, docs * 6)
    reference, out_dir = str(tmp_path / "reference"), str(tmp_path / "out")
    run_prepare(*prepare_args([parquet], reference))

    proc = subprocess.Popen([sys.executable, PREPARE, *map(str, prepare_args([parquet], out_dir))], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(os.path.join(out_dir, "fineweb_train_000001.bin")))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before the kill: give it more data"
    assert not read_manifest(out_dir)["complete"]
    assert len(shard_paths(out_dir)) < len(shard_paths(reference))

    run_prepare(*prepare_args([parquet], out_dir))
    assert shard_bytes(out_dir) == shard_bytes(reference)
    assert leftover_temp_files(out_dir) == []


def test_killed_before_the_manifest_caught_up_resumes_to_identical_shards(prepared, parquet_file, tmp_path):
    """The states a kill can leave: a shard renamed into place but not yet in the manifest, and the
    temp files of a shard and of a manifest being written."""
    out_dir = copy_of(prepared, tmp_path)
    manifest = read_manifest(out_dir)
    manifest["shards"], manifest["complete"] = manifest["shards"][:4], False
    del manifest["documents"], manifest["tokens"]
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    for name in os.listdir(out_dir):
        if name.startswith("fineweb_train_") and int(name[-10:-4]) > 4:  # shard 4 exists, 5.. not yet
            os.remove(os.path.join(out_dir, name))
    open(os.path.join(out_dir, "fineweb_train_000005.bin.tmp4242"), "wb").write(b"\0" * 100)
    open(os.path.join(out_dir, "manifest.json.tmp4242"), "w").write("{")

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "keeping 4 shards" in result.stdout
    assert shard_bytes(out_dir) == shard_bytes(prepared)
    assert read_manifest(out_dir) == read_manifest(prepared)
    assert leftover_temp_files(out_dir) == []

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

# -----------------------------------------------------------------------------
# download.py


def test_download_file_list_is_val_then_numbered_train_shards():
    download = load_script("download")
    assert download.shard_filenames(0) == ["fineweb_val_000000.bin"]
    assert download.shard_filenames(3) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                           "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    assert download.shard_filenames(1030)[-1] == "fineweb_train_001030.bin"
