#!/usr/bin/env bash
# Attention-sink sweep (paper: "Attention sinks"): SA and XSA with 0, 1 or 4 learned sink tokens
# prepended to every sequence, passed as --n_sinks=N. The paper found XSA keeps its margin when
# SA gets explicit sinks. It does not say which size it used; we default to the 1.4B configs, the
# size of its other ablations (LR and sequence length).
#
#     scripts/sweep_sinks.sh                                # 6 runs at 1.4B
#     SIZE=0p7b SINKS="0 4" scripts/sweep_sinks.sh --max_iters=20000
#
#   SIZE=1p4b          config/{sa,xsa}_$SIZE.py
#   SINKS="0 1 4"
# Runs: $OUT_ROOT/sweep_sinks/{sa,xsa}_<SIZE>_sinks<N>, wandb group sweep_sinks_<SIZE>. Rerun to
# resume; finished runs are skipped. Common options: scripts/sweep_common.sh.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZE=${SIZE:-1p4b}
SINKS=${SINKS:-"0 1 4"}
SWEEP_RESERVED=(n_sinks)

sweep_begin sweep_sinks "sweep_sinks_$SIZE" "$@"
for n in $SINKS; do
    sweep_pair "$SIZE" "_sinks$n" "--n_sinks=$n"
done
sweep_end
