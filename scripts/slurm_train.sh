#!/usr/bin/env bash
# Train on several nodes under SLURM: one torchrun per node (srun, one task per node), joined by
# torchrun's c10d rendezvous on the job's first node. Submit from the repository root:
#
#   sbatch --nodes=4 scripts/slurm_train.sh config/xsa_2p7b.py --parallelism=fsdp
#
# Arguments are train.py's (config files, --key=value). out_dir must be on a filesystem all nodes
# share: FSDP checkpoints are one directory that every process writes its shards into, and rank 0
# writes the logs.
# A run longer than the time limit continues by itself: 10 minutes before the limit, Slurm signals
# this script (--signal=B:USR1@600), which stops the training (SIGTERM: train.py finishes its step,
# writes a checkpoint and exits 143) and then requeues the job. The requeued job, like one requeued
# after a node failure or a preemption, resumes from the newest checkpoint (--init_from=resume). A
# run that finishes, or that stops with an error no restart fixes (config error, non-finite loss:
# train.py's status 2 or 3), is not requeued. Nor is a crash (any other status): by choice, since a
# crash that a bug, a bad node or NCCL caused would most often crash the requeued job too and burn its
# allocation in a loop; Slurm itself requeues after a node failure. To continue a run by hand, submit
# again with --init_from=resume.
# Environment: GPUS_PER_NODE (default: SLURM's count, else 8), MASTER_PORT (default 29500),
# PYTHON_ENV (a virtualenv to activate on every node, if the job does not inherit one).
#SBATCH --job-name=xsa
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"  # sbatch runs a copy of this script: the repo is where it was submitted
[ -n "${PYTHON_ENV:-}" ] && source "$PYTHON_ENV/bin/activate"
source scripts/launch_common.sh

gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
resume=()
[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && resume=(--init_from=resume)  # the last argument wins

time_up=
on_time_limit() {
    time_up=1
    echo "slurm_train: the time limit is near: stopping the run at a checkpoint, then requeueing the job"
    # scancel signals every process of the job's steps (torchrun and its ranks, on every node) and not
    # this script. Not `kill $srun_pid`: srun answers a SIGTERM by SIGKILLing its tasks.
    scancel --signal=TERM "$SLURM_JOB_ID"
}
trap on_time_limit USR1
# At a preemption or a cancel, Slurm sends SIGTERM to the training and to this script alike: this
# script waits for the training's checkpoint instead of ending the job under it.
trap 'echo "slurm_train: SIGTERM: waiting for the training to write its checkpoint"' TERM

# a file on this node, the first: its ranks say there why they stopped (srun exits 1 for them all)
export TRAIN_EXIT_STATUS_FILE
TRAIN_EXIT_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/train_exit_status.XXXXXX")
trap 'rm -f "$TRAIN_EXIT_STATUS_FILE"' EXIT

echo "slurm_train: $SLURM_JOB_NUM_NODES nodes x $gpus_per_node GPUs, rendezvous at $head_node:${MASTER_PORT:-29500}"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$gpus_per_node" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:${MASTER_PORT:-29500}" \
    train.py "$@" ${resume[@]+"${resume[@]}"} &
wait_for $!
status=$?
chosen=$(read_exit_status "$TRAIN_EXIT_STATUS_FILE")
((status == 0)) || status=${chosen:-$status}

if [[ -n $time_up && ! $status =~ ^(0|2|3)$ ]]; then
    echo "slurm_train: requeueing job $SLURM_JOB_ID (exit status $status); it resumes from the newest checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
