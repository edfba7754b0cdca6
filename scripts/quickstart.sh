#!/usr/bin/env bash
# The main job, end to end on any machine: tokenize a small slice of FineWeb, train the tiny SA and XSA
# models on it, and print their validation losses side by side.
#
#   bash scripts/quickstart.sh                                     # FineWeb sample-100BT, streamed from the Hub
#   INPUT='tests/fixtures/corpus/*.txt' bash scripts/quickstart.sh   # local text instead (txt/parquet/jsonl)
#
# The data: DATA_DIR, INPUT and MAX_TOKENS as in scripts/tiny_data.sh; small_study.sh uses the same
# shards. Extra --key=value arguments go to both training runs (e.g. --max_iters=300). Each run keeps
# only its newest checkpoint, in out/sa_tiny and out/xsa_tiny; the comparison is written to
# out/quickstart/compare.md and compare.png. Run again, it starts over: train.py moves the earlier
# runs' files aside within those directories (--overwrite=True), it deletes nothing. One seed of a
# model this small is not a result: scripts/small_study.sh trains several seeds and gives the
# XSA - SA difference a confidence interval.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_common.sh
source scripts/tiny_data.sh

# the runs' config as train.py will resolve it: a mistyped override fails before the data is made
read -r max_iters tokens_per_step <<<"$(resolve_config "max_iters total_batch_size" config/sa_tiny.py "$@")"
[[ -n $tokens_per_step ]] || exit 2
tiny_data_command || exit 2
tiny_data_prepare

for attn_type in sa xsa; do
    python train.py "config/${attn_type}_tiny.py" --data_dir="$TINY_DATA_DIR" --keep_checkpoints=1 --overwrite=True "$@"
done

python -m eval.compare out/sa_tiny out/xsa_tiny --out out/quickstart

# what the numbers above rest on: how much text, seen how many times, and by how many seeds
python - "$TINY_DATA_DIR" "$max_iters" "$tokens_per_step" out/sa_tiny out/xsa_tiny <<'PY'
import os, sys
from pretrain.checkpointer import list_checkpoints
from pretrain.shards import list_shards, read_header
data_dir, steps, per_step, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
train, val = (sum(read_header(path) for path in list_shards(data_dir, split)) for split in ("train", "val"))
seen = steps * per_step
print(f"quickstart: {train:,} train tokens and {val:,} val tokens in {data_dir}; each run trained on "
      f"{steps} x {per_step:,} = {seen:,} tokens, {seen / train:.2f} epochs of the train tokens")
if seen > 1.5 * train:
    print("quickstart: several epochs of so little text: the models start to memorise it (a val loss that "
          "rises while the train loss falls); a larger MAX_TOKENS or INPUT gives more text")
print("quickstart: XSA - SA above is one seed of a tiny model, not a result: the seed alone moves it. "
      "scripts/small_study.sh trains several seeds on the same shards and gives a 95% confidence interval.")

def size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

for run in runs:
    kept = list_checkpoints(run)
    print(f"quickstart: {run}: {len(kept)} checkpoint(s), {sum(map(size, kept)) / 1e6:.0f} MB "
          f"({', '.join(os.path.basename(p) for p in kept)}); {size(run) / 1e6:.0f} MB in all, with the "
          f"logs and the files of earlier runs")
PY
