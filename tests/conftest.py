"""Shared test setup: offline tokenizer, offline wandb, one micro model config and shards built once."""

import glob
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
CORPUS = sorted(glob.glob(os.path.join(SHARED, "corpus", "shakespeare", "*.txt")))

sys.path.insert(0, REPO)
if os.path.isdir(os.path.join(SHARED, "tiktoken_cache")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken_cache"))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "2")

EOT = 50256

# one micro model for every test that trains: small enough for a 2-core CPU
MICRO = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=32, vocab_size=50304)


@pytest.fixture(scope="session")
def corpus_docs():
    """A few Shakespeare texts as documents (one play = one document)."""
    assert CORPUS, f"no corpus under {SHARED}"
    docs = []
    for path in CORPUS[:6]:
        with open(path, encoding="utf-8") as f:
            docs.append(f.read())
    return docs


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_docs):
    """llm.c shards made directly (independently of prepare.py): one val shard and three
    train shards of uneven sizes, every document preceded by the end-of-text token."""
    import tiktoken
    from shards import write_shard
    enc = tiktoken.get_encoding("gpt2")
    tokens = np.concatenate([np.array([EOT] + enc.encode_ordinary(d), dtype=np.uint16) for d in corpus_docs])
    out = tmp_path_factory.mktemp("shards")
    n_val = 20_000
    write_shard(str(out / "fineweb_val_000000.bin"), tokens[:n_val])
    train = tokens[n_val:n_val + 150_000]
    for i, (a, b) in enumerate([(0, 60_000), (60_000, 95_000), (95_000, 150_000)]):
        write_shard(str(out / f"fineweb_train_{i + 1:06d}.bin"), train[a:b])
    return str(out)
