#!/usr/bin/env bash
# Keep a training run alive on one machine: after a crash (a preempted node, an NCCL timeout, an OOM)
# relaunch it from its newest checkpoint until it finishes, as llm.c does for long runs.
#
#   scripts/train_forever.sh config/xsa_2p7b.py [--key=value ...]     (train.py's arguments)
#
# Environment:
#   NPROC=N          processes, started with torchrun --standalone --nproc_per_node=N; default: one
#                    per GPU that CUDA_VISIBLE_DEVICES lists (or nvidia-smi finds), else 1 (plain python)
#   MAX_RESTARTS=10  relaunches before giving up
#   RESTART_DELAY=5  seconds before each relaunch
#
# train.py's exit status decides: 0 finished; 2 (a bad config) or 3 (non-finite loss, a checkpoint of
# another architecture, bad data, a full disk, out_dir used by another run) end the loop, as no
# restart fixes them; 130 or 143 (stopped by Ctrl-C or SIGTERM, after writing a checkpoint) end it
# too; anything else is a crash, relaunched with --init_from=resume. Under torchrun, which exits 1
# whatever its ranks chose, the status is the one they leave in the file TRAIN_EXIT_STATUS_FILE names.
# Ctrl-C or a kill (SIGTERM, SIGHUP) of this script reaches the training, which checkpoints and
# stops, and ends the loop. Whatever is left of a launch when its first process exits (the ranks of
# a torchrun killed with -9) is stopped before the next launch starts and before this script ends.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_common.sh

for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then
        print_usage
        echo
        exec "${PYTHON:-python}" train.py --help
    fi
done

MAX_RESTARTS=${MAX_RESTARTS:-10}
train_command "$(default_nproc)" || exit 2

leader=      # the running launch's first process: torchrun, or train.py itself
delay=       # the sleep before a relaunch, while there is one
stop_signal= # the signal that stopped this script, if one did

on_signal() {
    stop_signal=$1
    [[ -z $leader ]] || kill -s "$1" "$leader" 2>/dev/null  # torchrun relays it to its ranks
    [[ -z $delay ]] || kill "$delay" 2>/dev/null
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM HUP  # a closed terminal too: its SIGHUP does not reach the setsid'd training

# The live processes of the launch whose TRAIN_EXIT_STATUS_FILE is $1: each of them has it in its
# environment, also the ranks, which torchrun detaches from its process group (setsid) and which
# outlive a torchrun killed with -9. (A zombie's environment reads empty: those are dead already.)
launch_pids() {
    grep -lzxF "TRAIN_EXIT_STATUS_FILE=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}

# Stop what is left of a launch: its ranks are asked to checkpoint and stop (SIGTERM), and killed
# after the grace that torchrun gives them. The next launch must not find them holding out_dir.
end_launch() {
    local pids tenths
    pids=$(launch_pids "$1")
    [[ -n $pids ]] || return 0
    kill -TERM $pids 2>/dev/null
    for ((tenths = 0; tenths < TORCH_ELASTIC_SHUTDOWN_TIMEOUT * 10; tenths++)); do
        pids=$(launch_pids "$1")
        [[ -n $pids ]] || return 0
        sleep 0.1
    done
    kill -KILL $pids 2>/dev/null
    for tenths in {1..100}; do  # SIGKILL ends a process soon, unless the kernel holds it (a dead NFS server)
        [[ -n $(launch_pids "$1") ]] || return 0
        sleep 0.1
    done
}
trap '[[ -z $leader ]] || end_launch "$status_file"; rm -f "${status_file:-}"' EXIT

restarts=0
resume=()
while [[ -z $stop_signal ]]; do
    status_file=$(mktemp "${TMPDIR:-/tmp}/train_exit_status.XXXXXX")
    # setsid: Ctrl-C at the terminal reaches this script alone, which passes it on once. A non-interactive
    # shell starts a `&` child with SIGINT and SIGQUIT ignored, and Python keeps them ignored until train.py
    # installs its handler: a Ctrl-C relayed while it starts up would be lost. `trap -` gives the child the
    # default dispositions back, so a signal that comes that early ends it (status 130) and the loop with it.
    (trap - INT QUIT; TRAIN_EXIT_STATUS_FILE=$status_file exec setsid "${TRAIN_COMMAND[@]}" "$@" \
        ${resume[@]+"${resume[@]}"}) &
    leader=$!
    [[ -z $stop_signal ]] || kill -s "$stop_signal" "$leader"  # a signal that came during the launch
    wait_for "$leader"
    status=$?
    chosen=$(read_exit_status "$status_file")  # read before end_launch: its SIGTERM makes ranks write 143
    end_launch "$status_file"
    leader=
    rm -f "$status_file"
    ((status == 0)) || status=${chosen:-$status}
    if [[ -n $stop_signal && ! $status =~ ^(0|2|3|130|143)$ ]]; then
        status=$([[ $stop_signal == INT ]] && echo 130 || echo 143)  # stopped before train.py could say
    fi

    case $status in
        0) echo "train_forever: run finished"; exit 0 ;;
        2|3) echo "train_forever: train.py stopped with status $status, which a restart cannot fix"; exit "$status" ;;
        130|143)
            echo "train_forever: stopped by a signal (status $status); to continue, run the same command" \
                 "with --init_from=resume"
            exit "$status" ;;
    esac
    restarts=$((restarts + 1))
    if ((restarts > MAX_RESTARTS)); then
        echo "train_forever: giving up after $MAX_RESTARTS restarts (last status $status)"
        exit "$status"
    fi
    echo "train_forever: exit status $status, restarting ($restarts/$MAX_RESTARTS) from the newest checkpoint"
    resume=(--init_from=resume)  # the last argument wins over any init_from given in "$@"
    sleep "${RESTART_DELAY:-5}" &  # in the background, so that a signal ends the delay at once
    delay=$!
    [[ -n $stop_signal ]] || wait $delay  # a signal between the test and the wait kills the delay itself
    kill $delay 2>/dev/null
    delay=
done
echo "train_forever: stopped by SIG$stop_signal before relaunching"
exit $([[ $stop_signal == INT ]] && echo 130 || echo 143)
