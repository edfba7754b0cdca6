"""
The token shard format, stated once: llm.c's, so our shards and the public pre-tokenized
FineWeb shards (llm.c, modded-nanogpt) are interchangeable.

    header: 256 little-endian int32 (1024 bytes): [0] magic 20240520, [1] version 1,
            [2] number of tokens, the rest zero
    body:   that many little-endian uint16 tokens; file size is exactly 1024 + 2 * ntok

prepare.py writes shards, the training loader and the evaluation scripts read them,
all through this module.
"""

import glob
import os

import numpy as np

from pretrain.files import write_atomically

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A shard file that is missing, truncated or not in the llm.c format."""


def write_shard(path, tokens):
    """Write tokens as a shard, atomically: a crash leaves either the old file or the full new one."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 16):
        raise ShardError(f"{path}: token ids must fit in uint16, got range [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size

    def write(f):
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
    write_atomically(path, write)


def read_header(path):
    """Validate a shard's header and size; return its number of tokens."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror})") from e
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); not an llm.c token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {VERSION})")
    ntok = int(header[2])
    expected = HEADER_BYTES + 2 * ntok
    if ntok < 0 or size != expected:
        what = "truncated" if size < expected else "oversized"
        raise ShardError(f"{path}: {what} shard, header says {ntok} tokens ({expected} bytes) but file has {size} bytes")
    return ntok


def read_shard(path):
    """The shard's tokens as a read-only uint16 memmap, after validation."""
    ntok = read_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(ntok,))


def check_token_ids(path, tokens, vocab_size, offset=0):
    """Raise if a shard's tokens (tokens[i] is token offset + i of the file) hold an id the model
    has no embedding for: a shard of another tokenizer, or a corrupt one."""
    if vocab_size is None or not len(tokens):
        return
    top = int(tokens.max())
    if top >= vocab_size:
        position = offset + int(np.argmax(np.asarray(tokens) >= vocab_size))
        raise ShardError(f"{path}: token id {top} at token {position} is out of range for vocab_size {vocab_size} "
                         f"(a shard of another tokenizer, or corrupt)")


def list_shards(data_dir, split):
    """Sorted shard paths of a split ("train" or "val") in data_dir; an error if there are none."""
    if not os.path.isdir(data_dir):
        raise ShardError(f"data directory {data_dir!r} does not exist; run data/fineweb/prepare.py "
                         "(python -m data.fineweb.prepare) first")
    paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"*_{split}_*.bin")))
    if not paths:
        raise ShardError(f"no {split} shards (*_{split}_*.bin) in {data_dir!r}")
    return paths
