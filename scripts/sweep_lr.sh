#!/usr/bin/env bash
# Learning-rate sweep (paper: "LR robustness"): SA and XSA of one size at several peak learning
# rates, passed as --learning_rate=LR. The paper ran the 1.4B ("1.3B") model at 1e-4, 2e-4, 4e-4
# and 6e-4 and saw a near-constant XSA margin.
#
#     scripts/sweep_lr.sh                                   # the paper's sweep, 8 runs
#     SIZE=0p7b LRS="1e-4 2e-4" scripts/sweep_lr.sh --max_iters=2000
#     GPUS="0 1 2 3 4 5 6 7" scripts/sweep_lr.sh           # 8 single-GPU runs at once
#
#   SIZE=1p4b          config/{sa,xsa}_$SIZE.py (0p7b, 1p4b, 2p7b, tiny)
#   LRS="1e-4 2e-4 4e-4 6e-4"
# Runs: $OUT_ROOT/sweep_lr/{sa,xsa}_<SIZE>_lr<LR>, wandb group sweep_lr_<SIZE>. Rerun to resume;
# finished runs are skipped. Common options (NPROC, GPUS, SEEDS, OUT_ROOT, DRY_RUN, --key=value
# overrides for every run): scripts/sweep_common.sh. Compare: python -m eval.compare out/sweep_lr/*
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZE=${SIZE:-1p4b}
LRS=${LRS:-"1e-4 2e-4 4e-4 6e-4"}
SWEEP_RESERVED=(learning_rate)

sweep_begin sweep_lr "sweep_lr_$SIZE" "$@"
for lr in $LRS; do
    sweep_pair "$SIZE" "_lr$lr" "--learning_rate=$lr"
done
sweep_end
