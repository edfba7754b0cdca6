#!/usr/bin/env bash
# Optimizer sweep (the paper's open question: does XSA's gain hold under Muon?): SA and XSA of one
# size with AdamW (the paper's) and with Muon for the blocks' matrices, passed as --optimizer=NAME.
# Muon's default learning-rate rule (muon_adjust_lr="match_rms_adamw") gives its updates the RMS
# of AdamW's, so both optimizers run at the config's learning rate and weight decay.
#
#     scripts/sweep_optimizer.sh                            # 4 runs at 1.4B
#     SIZE=0p7b scripts/sweep_optimizer.sh --max_iters=20000
#     scripts/sweep_optimizer.sh --muon_adjust_lr=original --muon_learning_rate=0.02
#
#   SIZE=1p4b              config/{sa,xsa}_$SIZE.py
#   OPTIMIZERS="adamw muon"
# Runs: $OUT_ROOT/sweep_optimizer/{sa,xsa}_<SIZE>_<optimizer>, wandb group sweep_optimizer_<SIZE>.
# Rerun to resume; finished runs are skipped. Common options: scripts/sweep_common.sh.
# Compare: python -m eval.compare out/sweep_optimizer (one setting per optimizer)
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZE=${SIZE:-1p4b}
OPTIMIZERS=${OPTIMIZERS:-"adamw muon"}
SWEEP_RESERVED=(optimizer)

sweep_begin sweep_optimizer "sweep_optimizer_$SIZE" "$@"
for optimizer in $OPTIMIZERS; do
    sweep_pair "$SIZE" "_$optimizer" "--optimizer=$optimizer"
done
sweep_end
