"""The training loader: global batches independent of world size, exact resume, clear errors."""

import os
import shutil

import numpy as np
import pytest
import torch

from pretrain.dataloader import TrainLoader, val_sequences
from pretrain.shards import ShardError, list_shards, read_shard, write_shard

T, STEP_TOKENS = 32, 8 * 32


def stream(data_dir, data_seed, epoch):
    """The training token stream of one epoch, built independently from the shard order."""
    paths = list_shards(data_dir, "train")
    order = np.random.default_rng([data_seed, epoch]).permutation(len(paths))
    return np.concatenate([np.asarray(read_shard(paths[i])) for i in order]).astype(np.int64)


def test_batches_follow_the_shuffled_shard_stream(data_dir):
    loader = TrainLoader(data_dir, T, STEP_TOKENS, data_seed=5)
    tokens = stream(data_dir, 5, 0)
    for step in range(3):
        x, y = loader.next_batch()
        span = tokens[step * STEP_TOKENS: (step + 1) * STEP_TOKENS + 1]
        assert torch.equal(x.flatten(), torch.from_numpy(span[:-1]))
        assert torch.equal(y.flatten(), torch.from_numpy(span[1:]))
    assert TrainLoader(data_dir, T, STEP_TOKENS, data_seed=6).next_batch()[0].ne(x).any()


def test_two_ranks_read_exactly_the_single_rank_batch(data_dir):
    single = TrainLoader(data_dir, T, STEP_TOKENS, data_seed=1)
    ranks = [TrainLoader(data_dir, T, STEP_TOKENS, rank=r, world_size=2, data_seed=1) for r in range(2)]
    for _ in range(4):
        x, y = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_restored_position_continues_with_the_next_tokens(data_dir):
    loader = TrainLoader(data_dir, T, STEP_TOKENS, data_seed=2)
    for _ in range(3):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(3)]
    restored = TrainLoader(data_dir, T, STEP_TOKENS, rank=1, world_size=2, data_seed=99)
    restored.load_state_dict(state)  # another world size: the position is global
    for x, _ in expected:
        assert torch.equal(restored.next_batch()[0], x[len(x) // 2:])


def test_stream_crosses_shards_and_epochs(data_dir):
    total = sum(len(read_shard(p)) for p in list_shards(data_dir, "train"))
    step_tokens = 64 * 1024
    loader = TrainLoader(data_dir, 1024, step_tokens, data_seed=3)
    tokens = np.concatenate([stream(data_dir, 3, 0), stream(data_dir, 3, 1)])
    steps = total // step_tokens + 2  # runs into the second epoch
    for step in range(steps):
        x, _ = loader.next_batch()
        assert torch.equal(x.flatten(), torch.from_numpy(tokens[step * step_tokens:(step + 1) * step_tokens]))
    assert loader.state_dict()["epoch"] == 1


def test_val_sequences_are_the_first_val_tokens(data_dir):
    x, y = val_sequences(data_dir, T, 1000)
    val = np.asarray(read_shard(list_shards(data_dir, "val")[0])).astype(np.int64)
    assert x.shape == (1000 // T, T)
    assert torch.equal(x.flatten(), torch.from_numpy(val[:x.numel()]))
    assert torch.equal(y.flatten(), torch.from_numpy(val[1:x.numel() + 1]))
    capped, _ = val_sequences(data_dir, T, 10 ** 9)
    assert capped.numel() == (len(val) - 1) // T * T


def test_missing_and_empty_data_dirs_are_clear_errors(tmp_path):
    with pytest.raises(ShardError, match="does not exist"):
        TrainLoader(str(tmp_path / "nowhere"), T, STEP_TOKENS)
    with pytest.raises(ShardError, match="no train shards"):
        TrainLoader(str(tmp_path), T, STEP_TOKENS)


@pytest.mark.parametrize("damage", ["truncate", "magic"])
def test_corrupt_shard_is_an_error_naming_the_file(data_dir, tmp_path, damage):
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    bad = copy / "fineweb_train_000002.bin"
    raw = bytearray(bad.read_bytes())
    if damage == "truncate":
        raw = raw[:-100]
    else:
        raw[0:4] = (12345).to_bytes(4, "little")
    bad.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="fineweb_train_000002.bin"):
        TrainLoader(str(copy), T, STEP_TOKENS)


def test_reads_public_style_shards_of_uneven_size_without_manifest(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [1000, 37, 4096, 513]
    for i, n in enumerate(sizes):
        write_shard(str(tmp_path / f"fineweb_train_{i + 1:06d}.bin"), rng.integers(0, 50257, n))
    write_shard(str(tmp_path / "fineweb_val_000000.bin"), rng.integers(0, 50257, 300))
    assert not os.path.exists(tmp_path / "manifest.json")
    loader = TrainLoader(str(tmp_path), 16, 64)
    tokens = stream(str(tmp_path), 0, 0)
    for step in range(sum(sizes) // 64):
        assert torch.equal(loader.next_batch()[0].flatten(), torch.from_numpy(tokens[step * 64:(step + 1) * 64]))
