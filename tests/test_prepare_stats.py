"""The document-length statistics of data/fineweb/prepare.py (doc_stats.py, doc_lengths.json): checked
against document lengths known to the test, computed here in plain Python: on shards made directly,
and on prepare.py's shards of the test documents (tokenized here with tiktoken), after a resume too."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import tiktoken

from micro import EOT
from prepare_helpers import VAL_TOKENS, leftover_temp_files, prepare_args, run_prepare
from pretrain.shards import read_header, write_shard

from data.fineweb import doc_stats

LONGER_THAN = [512, 1024, 2048, 4096, 8192, 16384]


def nearest_rank(values, percent):
    """The documented percentile: the value ceil(percent% of n) in sorted order (1-based)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(percent * len(ordered) / 100)) - 1]


def expected_split(lengths):
    n, tokens = len(lengths), sum(lengths)
    return {"documents": n, "tokens": tokens, "mean": tokens / n, "median": nearest_rank(lengths, 50),
            "p90": nearest_rank(lengths, 90), "p99": nearest_rank(lengths, 99), "max": max(lengths),
            "token_share_longer_than": {str(limit): sum(x for x in lengths if x > limit) / tokens
                                        for limit in LONGER_THAN}}


def expected_splits(lengths, val_tokens):
    """Per split, the documents that start (at their EOT) among its first val_tokens tokens or after."""
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    val = [x for start, x in zip(starts, lengths) if start < val_tokens]
    train = [x for start, x in zip(starts, lengths) if start >= val_tokens]
    return {"val": expected_split(val), "train": expected_split(train), "all": expected_split(lengths)}


def write_documents(out_dir, lengths, val_tokens, shard_size, seed=0):
    """Shards of documents of these lengths (an EOT, then random other tokens), cut as prepare.py cuts
    them; their paths in stream order."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, EOT, size=sum(lengths)).astype(np.uint16)
    stream[np.cumsum([0] + lengths[:-1])] = EOT
    cuts = [0, val_tokens, *range(val_tokens + shard_size, len(stream), shard_size), len(stream)]
    paths = []
    for index, (a, b) in enumerate(zip(cuts, cuts[1:])):
        paths.append(os.path.join(out_dir, f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"))
        write_shard(paths[-1], stream[a:b])
    return paths


def known_lengths(seed=0):
    """Mostly short documents, a few long ones; one of a lone EOT, one longer than 16384 and than a shard,
    and some of exactly a limit's length (not longer than it)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, size=150).tolist() + rng.integers(1000, 20_000, size=6).tolist() + \
        [1, 25_000, 512, 2048, 16384]
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def test_the_test_percentile_is_numpys_inverted_cdf():
    """The convention documented (nearest rank) is numpy's, so that a researcher can reproduce it."""
    rng = np.random.default_rng(1)
    for n in [1, 2, 3, 10, 99, 100, 101, 1000]:
        values = rng.integers(1, 5000, size=n).tolist()
        for p in [50, 90, 99]:
            assert nearest_rank(values, p) == int(np.percentile(values, p, method="inverted_cdf"))


@pytest.mark.parametrize("chunk_tokens", [7, 1000, doc_stats.CHUNK_TOKENS])
def test_statistics_of_shards_with_known_document_lengths(tmp_path, monkeypatch, chunk_tokens):
    """Documents that straddle shards, the val/train boundary and (small) read chunks count once, whole."""
    monkeypatch.setattr(doc_stats, "CHUNK_TOKENS", chunk_tokens)
    lengths = known_lengths()
    val_tokens, shard_size = 20_000, 9_000
    paths = write_documents(str(tmp_path), lengths, val_tokens, shard_size)
    starts = set(np.cumsum([0] + lengths[:-1]).tolist())
    assert val_tokens not in starts and len(paths) > 5  # the boundary cuts a document in two
    assert max(lengths) > 2 * shard_size  # a shard holds no EOT at all

    statistics = doc_stats.document_statistics(paths)
    assert statistics["splits"] == expected_splits(lengths, val_tokens)
    assert statistics["eot"] == EOT and statistics["shards"] == len(paths)
    assert statistics["splits"]["all"]["tokens"] == sum(read_header(p) for p in paths)


def test_a_split_without_documents_and_data_that_starts_without_an_eot(tmp_path):
    """A train split inside a document that started in val has no documents of its own; tokens before
    the first EOT (shards that prepare.py did not make) are a document too."""
    val, train = str(tmp_path / "fineweb_val_000000.bin"), str(tmp_path / "fineweb_train_000001.bin")
    write_shard(val, np.array([7, 7, 7, EOT, 1, 1, 1, 1, EOT, 2], dtype=np.uint16))
    write_shard(train, np.full(600, 3, dtype=np.uint16))
    statistics = doc_stats.document_statistics([val, train])
    assert statistics["splits"]["val"] == expected_split([3, 5, 2 + 600])
    assert statistics["splits"]["train"]["documents"] == 0
    assert statistics["splits"]["train"]["median"] is None
    rows = {line.split()[0]: line.split()[1:] for line in doc_stats.table(statistics).splitlines()[2:]}
    assert rows["train"] == ["0"] and rows["val"][0] == "3"


# -----------------------------------------------------------------------------
# prepare.py: doc_lengths.json beside the shards, and the table it prints


def token_lengths(docs):
    enc = tiktoken.get_encoding("gpt2")
    return [len(enc.encode_ordinary(d)) + 1 for d in docs]  # the leading EOT counts


def read_statistics(out_dir):
    with open(os.path.join(out_dir, "doc_lengths.json")) as f:
        return json.load(f)


def test_prepare_writes_the_statistics_of_its_documents(prepared, docs):
    statistics = read_statistics(prepared)
    assert set(statistics) == {"convention", "eot", "shards", "splits"}
    assert statistics["eot"] == EOT
    assert "counts that EOT" in statistics["convention"] and "inverted_cdf" in statistics["convention"]
    assert statistics["shards"] == len([n for n in os.listdir(prepared) if n.endswith(".bin")])
    assert statistics["splits"] == expected_splits(token_lengths(docs), VAL_TOKENS)
    assert list(statistics["splits"]) == ["val", "train", "all"]
    assert list(statistics["splits"]["train"]["token_share_longer_than"]) == [str(x) for x in LONGER_THAN]


def row(split, s):
    """The table's row as the test expects it, field by field."""
    shares = [f"{s['token_share_longer_than'][str(limit)]:.1%}" for limit in LONGER_THAN]
    return [split, f"{s['documents']:,}", f"{s['mean']:,.1f}", *(f"{s[k]:,}" for k in ("median", "p90", "p99", "max")),
            *shares]


def test_prepare_prints_the_table_of_what_it_wrote(parquet_file, docs, tmp_path):
    """With --max_tokens, the last document is cut: the statistics are of what the shards hold."""
    out_dir = str(tmp_path / "out")
    result = run_prepare(*prepare_args([parquet_file], out_dir, "--max_tokens", 55_555))
    lengths = token_lengths(docs)
    ends = np.cumsum(lengths)
    kept = int(np.searchsorted(ends, 55_555))  # the document holding the last token written
    written = lengths[:kept] + [55_555 - int(ends[kept - 1])]
    expected = expected_splits(written, VAL_TOKENS)
    assert read_statistics(out_dir)["splits"] == expected

    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("document lengths"))
    assert lines[at - 1].startswith("done:")  # at the end of the run
    assert lines[at + 1].split() == ["split", "documents", "mean", "median", "p90", "p99", "max",
                                     *(f">{limit}" for limit in LONGER_THAN)]
    assert [line.split() for line in lines[at + 2:at + 5]] == [row(split, s) for split, s in expected.items()]
    assert lines[at + 5] == f"written to {os.path.join(out_dir, 'doc_lengths.json')}"


def test_a_resumed_preparation_counts_the_documents_of_every_run(prepared, parquet_file, docs, tmp_path):
    """The statistics cover the shards an earlier, killed run wrote, not only the resumed run's."""
    out_dir = str(tmp_path / "copy")
    shutil.copytree(prepared, out_dir)
    with open(os.path.join(out_dir, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["shards"], manifest["complete"] = manifest["shards"][:4], False  # as if killed after shard 3
    del manifest["documents"], manifest["tokens"]
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    os.remove(os.path.join(out_dir, "doc_lengths.json"))
    for name in os.listdir(out_dir):
        if name.startswith("fineweb_train_") and int(name[-10:-4]) > 3:
            os.remove(os.path.join(out_dir, name))
    open(os.path.join(out_dir, "doc_lengths.json.tmp4242"), "w").write("{")  # a kill while writing it

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "keeping 4 shards" in result.stdout
    assert read_statistics(out_dir)["splits"] == expected_splits(token_lengths(docs), VAL_TOKENS)
    assert leftover_temp_files(out_dir) == []


def test_a_finished_directory_without_statistics_gets_them_on_a_rerun(prepared, parquet_file, docs, tmp_path):
    """As after a kill between the manifest's last update and the statistics file."""
    out_dir = str(tmp_path / "copy")
    shutil.copytree(prepared, out_dir)
    os.remove(os.path.join(out_dir, "doc_lengths.json"))
    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "nothing to do" in result.stdout and "document lengths" in result.stdout
    assert read_statistics(out_dir)["splits"] == expected_splits(token_lengths(docs), VAL_TOKENS)
    again = run_prepare(*prepare_args([parquet_file], out_dir))  # once there, it is kept: no rescan
    assert "nothing to do" in again.stdout and "document lengths" not in again.stdout
