"""The shard format (shards.py) checked against llm.c's layout, unpacked by hand with struct."""

import os
import struct

import numpy as np
import pytest

from pretrain import shards
from pretrain.shards import ShardError, read_header, read_shard, write_shard


def test_write_read_roundtrip(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 31373, 995], dtype=np.uint16)
    path = str(tmp_path / "fineweb_train_000001.bin")
    write_shard(path, tokens)
    assert read_header(path) == len(tokens)
    assert np.array_equal(read_shard(path), tokens)


def test_header_bytes_are_llmc(tmp_path):
    path = str(tmp_path / "s.bin")
    write_shard(path, np.arange(10, dtype=np.uint16))
    with open(path, "rb") as f:
        raw = f.read()
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240520, 1, 10)
    assert header[3:] == (0,) * 253
    assert struct.unpack("<10H", raw[1024:]) == tuple(range(10))


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_file_size_is_header_plus_two_bytes_per_token(tmp_path, n):
    path = str(tmp_path / "s.bin")
    write_shard(path, np.zeros(n, dtype=np.uint16))
    assert os.path.getsize(path) == 1024 + 2 * n
    assert len(read_shard(path)) == n


def test_truncated_shard_raises_naming_the_file(tmp_path):
    path = str(tmp_path / "fineweb_train_000007.bin")
    write_shard(path, np.arange(100, dtype=np.uint16))
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 99)
    with pytest.raises(ShardError, match="fineweb_train_000007.bin.*truncated"):
        read_shard(path)


def test_shorter_than_header_raises_naming_the_file(tmp_path):
    path = tmp_path / "fineweb_val_000000.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(ShardError, match="fineweb_val_000000.bin.*truncated"):
        read_header(str(path))


def test_wrong_magic_raises_naming_the_file(tmp_path):
    path = tmp_path / "fineweb_train_000003.bin"
    path.write_bytes(struct.pack("<256i", 12345, 1, 0, *[0] * 253))
    with pytest.raises(ShardError, match="fineweb_train_000003.bin.*magic"):
        read_header(str(path))


def test_wrong_version_raises(tmp_path):
    path = tmp_path / "s.bin"
    path.write_bytes(struct.pack("<256i", 20240520, 2, 0, *[0] * 253))
    with pytest.raises(ShardError, match="version"):
        read_header(str(path))


def test_missing_file_raises_naming_it(tmp_path):
    with pytest.raises(ShardError, match="nope.bin"):
        read_header(str(tmp_path / "nope.bin"))


@pytest.mark.parametrize("bad", [65536, -1])
def test_token_outside_uint16_raises(tmp_path, bad):
    path = str(tmp_path / "s.bin")
    with pytest.raises(ShardError, match="uint16"):
        write_shard(path, np.array([1, bad, 2], dtype=np.int64))
    assert not os.path.exists(path)


def test_write_leaves_no_temp_file(tmp_path):
    write_shard(str(tmp_path / "s.bin"), np.arange(5, dtype=np.uint16))
    assert os.listdir(tmp_path) == ["s.bin"]


@pytest.mark.parametrize("call,error", [("replace", "disk full"), ("fsync", "I/O error")])
def test_a_failed_write_or_rename_keeps_the_old_shard_and_no_temp_file(tmp_path, monkeypatch, call, error):
    path = str(tmp_path / "s.bin")
    write_shard(path, np.arange(5, dtype=np.uint16))
    before = open(path, "rb").read()

    def failing(*args):
        raise OSError(error)
    monkeypatch.setattr(shards.os, call, failing)
    with pytest.raises(OSError, match=error):
        write_shard(path, np.arange(50, dtype=np.uint16))
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["s.bin"]


def test_list_shards_sorted_by_split(tmp_path):
    for name in ["fineweb_train_000002.bin", "fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        write_shard(str(tmp_path / name), np.arange(3, dtype=np.uint16))
    names = [os.path.basename(p) for p in shards.list_shards(str(tmp_path), "train")]
    assert names == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    with pytest.raises(ShardError, match="no test shards"):
        shards.list_shards(str(tmp_path), "test")
