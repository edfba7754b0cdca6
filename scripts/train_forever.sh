#!/usr/bin/env bash
# Keep a training run alive: after a crash (preempted node, NCCL timeout, OOM) relaunch it from its
# newest checkpoint until it finishes, as llm.c does for long runs.
#
#   scripts/train_forever.sh config/xsa_2p7b.py [--key=value ...]
#
# NPROC: processes on this node (default: one per GPU, else a single process)
# MAX_RESTARTS: give up after this many relaunches (default 10); RESTART_DELAY: seconds between them (default 5)
# train.py exit codes: 0 finished, 2 bad config, 3 a stop that a restart cannot fix (non-finite loss,
# wrong checkpoint, missing data): those end the loop; anything else is a crash and is relaunched.
set -uo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NPROC" -ge 1 ] 2>/dev/null || NPROC=1
MAX_RESTARTS=${MAX_RESTARTS:-10}
if [ "$NPROC" -gt 1 ]; then
    launch=(torchrun --standalone --nproc_per_node="$NPROC" train.py)
else
    launch=(python train.py)
fi

restarts=0
resume=()
while true; do
    "${launch[@]}" "$@" "${resume[@]}"
    status=$?
    case $status in
        0) echo "train_forever: run finished"; exit 0 ;;
        2|3) echo "train_forever: train.py stopped with status $status, which a restart cannot fix"; exit "$status" ;;
    esac
    restarts=$((restarts + 1))
    if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
        echo "train_forever: giving up after $MAX_RESTARTS restarts (last status $status)"
        exit "$status"
    fi
    echo "train_forever: exit status $status, restarting ($restarts/$MAX_RESTARTS) from the newest checkpoint"
    resume=(--init_from=resume)  # the last argument wins over any init_from given in "$@"
    sleep "${RESTART_DELAY:-5}"
done
