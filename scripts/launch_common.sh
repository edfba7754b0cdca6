# Shared by the scripts that launch train.py (sourced, not run): how many processes a run gets, the
# command that starts them, the config they will train with, and waiting for them through signals.

# torchrun gives its ranks this long to stop after it forwards them a signal, then SIGKILLs them;
# its own default, 30 s, can cut short the checkpoint that train.py writes when it is stopped.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}

# The comment block at the top of the running script, as its --help.
print_usage() {
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# A command line as the shell reads it back (arguments quoted only where needed).
quote_command() {
    local quoted
    quoted=$(printf '%q ' "$@")
    echo "${quoted% }"
}

# The GPUs a run may use: the ones CUDA_VISIBLE_DEVICES lists when it is set (set but empty hides
# them all, as CUDA reads it), else the ones nvidia-smi finds, else none.
count_gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        local ids=()
        IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

# Processes for a run on this machine: NPROC if set, else one per GPU, else 1.
default_nproc() {
    if [[ -n ${NPROC:-} ]]; then
        echo "$NPROC"
    else
        local n
        n=$(count_gpus)
        echo $((n > 1 ? n : 1))
    fi
}

# train_command N: TRAIN_COMMAND, what starts train.py in N processes on this machine. torchrun's
# --standalone picks a free rendezvous port, so runs side by side do not collide.
train_command() {
    if [[ ! $1 =~ ^[1-9][0-9]*$ ]]; then
        echo "error: NPROC=$1: expected a positive number of processes" >&2
        return 2
    fi
    if (($1 > 1)); then
        TRAIN_COMMAND=(torchrun --standalone "--nproc_per_node=$1" train.py)
    else
        TRAIN_COMMAND=("${PYTHON:-python}" train.py)
    fi
}

# resolve_config "KEY ..." CONFIG_FILE [--key=value ...]: the values (one line, space-separated)
# of these keys in the config train.py would run with (train_config.resolve, which train.py uses),
# and for the key "variant" the config's attention variant as run names spell it
# (train_config.variant_name: sa, xsa, xsa_gate, ...). A key this misses fails loudly (unknown key,
# or KeyError), never with a wrong value.
resolve_config() {
    "${PYTHON:-python}" - "$@" <<'PY'
import sys
from configurator import ConfigError
from pretrain.train_config import resolve, variant_name
keys, argv = sys.argv[1].split(), sys.argv[2:]
try:
    config, _ = resolve(argv)
except ConfigError as e:
    sys.exit(f"config error: {e}")
values = {**config.to_dict(), "variant": variant_name(config)}
print(*(values[key] for key in keys))
PY
}

# wait_for PID: wait until the child process PID has ended and return its exit status. A trapped
# signal (Ctrl-C, a scheduler's warning) cuts `wait` short while the run is still writing its
# checkpoint, so wait again while it lives; bash keeps the status of its children for the last wait.
wait_for() {
    while kill -0 "$1" 2>/dev/null; do
        wait "$1"
    done
    wait "$1"
}

# read_exit_status FILE: the status train.py's processes chose (TRAIN_EXIT_STATUS_FILE: 2, 3, 130 or
# 143), or nothing. torchrun and srun exit 1 whatever their ranks chose, so the file is what tells a
# config error from a crash. Ranks may write at once: the first line is one whole number.
read_exit_status() {
    local status=
    [[ -s $1 ]] && read -r status <"$1"
    [[ $status =~ ^[0-9]+$ ]] && echo "$status"
    return 0
}
