"""
Download the public pre-tokenized GPT-2 FineWeb shards (llm.c format, the ones modded-nanogpt
uses) instead of tokenizing with prepare.py: the val shard and the first --shards train shards
(about 100M tokens each).

    python -m data.fineweb.download --shards 10                                   # 1B train tokens
    python -m data.fineweb.download --dataset kjj0/fineweb10B-gpt2 --out_dir data/fineweb/fineweb10B

Files already there and valid are kept, so an interrupted download resumes.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m data.fineweb.download", file=sys.stderr)
    sys.exit(2)

import argparse
import os

from tqdm import tqdm

from pretrain import exits, shards
from pretrain.exits import check_hub

TRAIN_SHARDS = {"kjj0/fineweb100B-gpt2": 1030, "kjj0/fineweb10B-gpt2": 103}  # all of each dataset


def shard_filenames(num_train_shards):
    """The val shard, then train shards 1..num_train_shards, named as in the public repos."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train_shards + 1)]


def is_valid_shard(path):
    try:
        shards.read_header(path)
        return True
    except shards.ShardError:
        return False


def download_shard(repo_id, filename, out_dir):
    """Fetch one shard and check its header and size."""
    from huggingface_hub import hf_hub_download  # only this script needs it
    path = os.path.join(out_dir, filename)
    try:
        path = hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset", local_dir=out_dir,
                               force_download=os.path.exists(path))  # a damaged copy: fetch it again
    except Exception as e:  # the connection lost midway, a file the repo does not have, ...
        exits.fail(f"{filename}: download from {repo_id} failed ({exits.one_line(e)}); rerun to resume", exits.RETRY)
    try:
        return shards.read_header(path)
    except shards.ShardError as e:
        exits.fail(f"downloaded file is not a token shard: {e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="kjj0/fineweb100B-gpt2", help="a Hugging Face dataset repo of llm.c shards")
    parser.add_argument("--shards", type=int, default=None, help="number of train shards (default: all)")
    parser.add_argument("--out_dir", default="data/fineweb/fineweb100B")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (there are none either when stderr is not a terminal)")
    args = parser.parse_args()
    num_train = args.shards if args.shards is not None else TRAIN_SHARDS.get(args.dataset)
    if num_train is None or num_train < 0:
        parser.error(f"give --shards N (a number >= 0) for {args.dataset}")

    filenames = shard_filenames(num_train)
    missing = {name for name in filenames if not is_valid_shard(os.path.join(args.out_dir, name))}
    if missing:  # a complete directory needs no Hub
        check_hub(args.dataset, "make the shards from local text files instead: "
                                "python -m data.fineweb.prepare --input 'my_texts/*.txt'")
    os.makedirs(args.out_dir, exist_ok=True)
    no_bars = args.quiet or not sys.stderr.isatty()  # a log would fill with carriage returns
    if no_bars:  # huggingface_hub's own bar, one per file, too
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    total = 0
    # an ETA from the downloads alone: the shards already there count as done from the start
    with tqdm(total=len(filenames), initial=len(filenames) - len(missing), unit="shard", dynamic_ncols=True,
              disable=no_bars) as bar:
        for filename in filenames:
            if filename in missing:
                ntok = download_shard(args.dataset, filename, args.out_dir)
                bar.update()
            else:
                ntok = shards.read_header(os.path.join(args.out_dir, filename))
            total += ntok
            bar.write(f"{filename}: {ntok:,} tokens", file=sys.stdout)
            sys.stdout.flush()
    print(f"done: {num_train + 1} shards, {total:,} tokens in {args.out_dir}")


if __name__ == "__main__":
    main()
