#!/usr/bin/env bash
# Train on several nodes under SLURM: one torchrun per node (srun, one task per node), joined by
# torchrun's c10d rendezvous on the job's first node. Submit from the repository root:
#
#   sbatch --nodes=4 scripts/slurm_train.sh config/xsa_2p7b.py --parallelism=fsdp
#
# Arguments are train.py's (config files, --key=value). out_dir must be on a filesystem all nodes
# share: FSDP checkpoints are one directory that every process writes its shards into, and rank 0
# writes the logs. To continue a run, submit again with --init_from=resume; a requeued job
# (sbatch --requeue, preemption) adds --init_from=resume itself.
# Environment: GPUS_PER_NODE (default: SLURM's count, else 8), MASTER_PORT (default 29500),
# PYTHON_ENV (a virtualenv to activate on every node, if the job does not inherit one).
#SBATCH --job-name=xsa
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"  # sbatch runs a copy of this script: the repo is where it was submitted
[ -n "${PYTHON_ENV:-}" ] && source "$PYTHON_ENV/bin/activate"

gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
resume=()
[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && resume=(--init_from=resume)  # the last argument wins

echo "slurm_train: $SLURM_JOB_NUM_NODES nodes x $gpus_per_node GPUs, rendezvous at $head_node:${MASTER_PORT:-29500}"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$gpus_per_node" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:${MASTER_PORT:-29500}" \
    train.py "$@" "${resume[@]}"
