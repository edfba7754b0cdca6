"""data/fineweb/prepare.py and download.py as the tests run them: the commands, their arguments, and readers of
the shards and files they write."""

import os
import sys

from running import HANG_GUARD_S, run_script

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
