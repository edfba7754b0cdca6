#!/usr/bin/env bash
# Model-size sweep (paper: "Loss vs size"): SA and XSA at 0.7B, 1.4B and 2.7B non-embedding
# parameters, each with the paper's recipe and its own peak LR (config/*.py). The paper saw XSA
# below SA in training and validation loss at all three sizes through all of training.
#
#     scripts/sweep_sizes.sh                                # 6 runs, the paper's main result
#     SIZES="0p7b" scripts/sweep_sizes.sh --max_iters=20000
#
#   SIZES="0p7b 1p4b 2p7b"   config/{sa,xsa}_$SIZE.py
# Runs: $OUT_ROOT/sweep_sizes/{sa,xsa}_<SIZE>, wandb group sweep_sizes. Rerun to resume; finished
# runs are skipped. Common options: scripts/sweep_common.sh.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZES=${SIZES:-"0p7b 1p4b 2p7b"}
SWEEP_RESERVED=()

sweep_begin sweep_sizes sweep_sizes "$@"
for size in $SIZES; do
    sweep_pair "$size" ""
done
sweep_end
