#!/usr/bin/env bash
# The main job, end to end on any machine: tokenize a small slice of FineWeb, train the tiny SA and XSA
# models on it, and print their validation losses side by side.
#
#   bash scripts/quickstart.sh                                     # FineWeb sample-100BT, streamed from the Hub
#   INPUT='tests/fixtures/corpus/*.txt' bash scripts/quickstart.sh   # local text instead (txt/parquet/jsonl)
#
# DATA_DIR (default data/fineweb/fineweb_tiny) and MAX_TOKENS (default 2M) choose the slice; extra
# --key=value arguments go to both training runs (e.g. --max_iters=300).
set -euo pipefail
cd "$(dirname "$0")/.."

DATA_DIR=${DATA_DIR:-data/fineweb/fineweb_tiny}
MAX_TOKENS=${MAX_TOKENS:-2000000}
source_args=()
if [ -n "${INPUT:-}" ]; then
    read -r -a patterns <<< "$INPUT"  # globs stay quoted: prepare.py expands them
    source_args=(--input "${patterns[@]}")
fi

status=0
python data/fineweb/prepare.py "${source_args[@]}" --out_dir "$DATA_DIR" --max_tokens "$MAX_TOKENS" \
    --val_tokens 200000 --shard_size 1000000 || status=$?
if [ "$status" -eq 3 ]; then  # prepare.py could not reach the Hub
    echo "quickstart: FineWeb cannot be streamed from the Hub here; set INPUT=<local text files> (txt, parquet" \
         "or jsonl), e.g. INPUT='tests/fixtures/corpus/*.txt' bash scripts/quickstart.sh" >&2
fi
[ "$status" -eq 0 ] || exit "$status"

for attn_type in sa xsa; do
    python train.py "config/${attn_type}_tiny.py" --data_dir="$DATA_DIR" "$@"
done

python eval/compare.py out/sa_tiny out/xsa_tiny --out out/quickstart
