#!/usr/bin/env bash
# The small study that fits a CPU: SA vs XSA on the tiny configs (config/{sa,xsa}_tiny.py: 4 layers,
# width 128, 0.8M non-embedding parameters, 120 steps of 2,048 tokens) over several seeds, ending with
# eval/compare.py's table: the final validation losses and the mean, std and 95% confidence interval
# of the XSA - SA difference paired by seed. A run takes under 2 minutes on 2 idle CPU cores, so the
# default 3 seeds x 2 take about 10 minutes. It checks the pipeline end to end and shows the seed noise;
# it says little about the paper's claim, which is about 0.7B-2.7B models trained on 100B tokens, while
# models of a few million parameters often differ by noise alone (hence several seeds; docs/paper.md).
#
#     INPUT='tests/fixtures/corpus/*.txt' scripts/small_study.sh     # prepare shards, then train
#     SEEDS="1 2 3 4 5" scripts/small_study.sh --max_iters=240
#     scripts/small_study.sh --attn_mask=document                     # attention within documents only
#
#   SEEDS="1 2 3"
#   DATA_DIR, INPUT, MAX_TOKENS   the shards, as in scripts/tiny_data.sh: INPUT makes them (or checks that
#                                 DATA_DIR was made from it); with no INPUT, the shards already in DATA_DIR,
#                                 else FineWeb streamed from the Hub. The quickstart uses the same ones.
# Runs: $OUT_ROOT/small_study/{sa,xsa}_tiny_seed<S>; the table and plot: $OUT_ROOT/small_study/compare.{md,png}.
# With --attn_mask=document: {sa,xsa}_tiny_document_seed<S> (wandb group small_study_document), and
# $OUT_ROOT/small_study/document/compare.{md,png}.
# Rerun to resume; finished runs are skipped. Other options as for every sweep (GPUS, DRY_RUN,
# --key=value overrides): scripts/sweep_common.sh.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"
source "$(dirname "$0")/tiny_data.sh"

SEEDS=${SEEDS:-"1 2 3"}
SWEEP_RESERVED=(data_dir)

sweep_begin small_study small_study "$@"
MASK=causal
for arg in "$@"; do  # train.py takes --attn_mask as it is; the runs' names and the table's place carry it
    [[ $arg == --attn_mask=* ]] && MASK=${arg#--attn_mask=}
done
MASK_SUFFIX=$([[ $MASK == causal ]] || echo "_$MASK")

tiny_data_command || exit 2
if [[ -z $DRY_RUN ]]; then
    tiny_data_prepare
elif ((${#TINY_PREPARE[@]})); then
    quote_command "${TINY_PREPARE[@]}"
fi

sweep_pair tiny "$MASK_SUFFIX" "--data_dir=$TINY_DATA_DIR" ${MASK_SUFFIX:+"--wandb_group=small_study$MASK_SUFFIX"}
sweep_end

runs=()
for name in "${SWEEP_RUNS[@]}"; do
    runs+=("$OUT_ROOT/small_study/$name")
done
compare=("$PYTHON" -m eval.compare "${runs[@]}" --out "$OUT_ROOT/small_study${MASK_SUFFIX:+/$MASK}")
if [[ -n $DRY_RUN ]]; then
    quote_command "${compare[@]}"
else
    echo "+ $(quote_command "${compare[@]}")"
    "${compare[@]}"
fi
