#!/usr/bin/env bash
# The small study that fits a CPU: SA vs XSA on the tiny configs (config/{sa,xsa}_tiny.py: 4 layers,
# width 128, 0.8M non-embedding parameters, 120 steps of 2,048 tokens) over several seeds, ending with
# eval/compare.py's table: the final validation losses and the mean, std and 95% confidence interval
# of the XSA - SA difference paired by seed. A run takes about 3 minutes on 2 idle CPU cores, so the
# default 3 seeds x 2 take about 20 minutes. It checks the pipeline end to end and shows the seed noise;
# it says little about the paper's claim, which is about 0.7B-2.7B models trained on 100B tokens, while
# models of a few million parameters often differ by noise alone (hence several seeds; docs/paper.md).
#
#     INPUT='tests/fixtures/corpus/*.txt' scripts/small_study.sh     # prepare shards, then train
#     SEEDS="1 2 3 4 5" scripts/small_study.sh --max_iters=240
#
#   SEEDS="1 2 3"
#   DATA_DIR=data/fineweb/fineweb_tiny   the token shards; if missing, made from INPUT with
#                                        data/fineweb/prepare.py (MAX_TOKENS=2000000 tokens at most)
#   INPUT                                text/jsonl/parquet files or globs (quoted) for prepare.py
# Runs: $OUT_ROOT/small_study/{sa,xsa}_tiny_seed<S>; the table and plot: $OUT_ROOT/small_study/compare.{md,png}.
# Rerun to resume; finished runs are skipped. Other options as for every sweep (GPUS, DRY_RUN,
# --key=value overrides): scripts/sweep_common.sh.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SEEDS=${SEEDS:-"1 2 3"}
DATA_DIR=${DATA_DIR:-data/fineweb/fineweb_tiny}
MAX_TOKENS=${MAX_TOKENS:-2000000}
SWEEP_RESERVED=(data_dir)

sweep_begin small_study small_study "$@"

if [[ ! -d $DATA_DIR && -z ${INPUT:-} ]]; then
    msg="no shards in $DATA_DIR: set INPUT to text files to make them from, or DATA_DIR"
    [[ -n $DRY_RUN ]] && echo "# $msg" || die "$msg"
elif [[ ! -d $DATA_DIR ]]; then
    set -f  # prepare.py expands the globs itself, in a reproducible order
    read -ra inputs <<<"$INPUT"
    set +f
    # a val shard of 64K tokens (the tiny config evaluates 16K of them), the rest in 500K-token shards
    prepare=("$PYTHON" data/fineweb/prepare.py --input "${inputs[@]}" --out_dir "$DATA_DIR"
        --max_tokens "$MAX_TOKENS" --val_tokens 65536 --shard_size 500000)
    if [[ -n $DRY_RUN ]]; then
        quote_command "${prepare[@]}"
    else
        echo "+ $(quote_command "${prepare[@]}")"
        "${prepare[@]}"
    fi
fi

sweep_pair tiny "" "--data_dir=$DATA_DIR"
sweep_end

runs=()
for seed in "${SEED_LIST[@]}"; do
    runs+=("$OUT_ROOT/small_study/sa_tiny${seed:+_seed$seed}" "$OUT_ROOT/small_study/xsa_tiny${seed:+_seed$seed}")
done
compare=("$PYTHON" eval/compare.py "${runs[@]}" --out "$OUT_ROOT/small_study")
if [[ -n $DRY_RUN ]]; then
    quote_command "${compare[@]}"
else
    echo "+ $(quote_command "${compare[@]}")"
    "${compare[@]}"
fi
