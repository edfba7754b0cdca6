# Shared by the sweep scripts (sourced, not run): naming, launching, resuming and skipping runs.
#
# A sweep script calls
#     sweep_begin NAME GROUP "$@"      cd to the repo root, read the environment and the passthrough args
#     sweep_pair SIZE SUFFIX --key=value ...
#                                      add the SA and the XSA run of one setting (once per seed)
#     sweep_end                        start the runs, wait for them, print a summary, fail if any
#                                      run failed; SWEEP_RUNS then holds their names
#
# Environment (every sweep):
#   NPROC=N       processes (GPUs) per run, launched with torchrun --standalone --nproc_per_node=N;
#                 default: one per GPU that CUDA_VISIBLE_DEVICES lists (or nvidia-smi finds), else 1
#                 (plain python); scripts/launch_common.sh counts them, as for train_forever.sh
#   GPUS="0 1 2 3"  run several runs at once, one per entry, each with CUDA_VISIBLE_DEVICES=<entry>;
#                 an entry may hold several GPUs ("0,1 2,3"), NPROC then defaults to their number
#   SEEDS="1 2 3" repeat every run per seed (--seed=S, names end in _seedS); default: the config's seed
#   OUT_ROOT=out  runs go to $OUT_ROOT/<sweep>/<run name> (a relative OUT_ROOT is under the repo root)
#   DRY_RUN=1     print the commands (a runnable shell script) instead of running them; with GPUS it
#                 places runs round-robin, where a real sweep gives each run the next GPU to free up
#   PYTHON=python the interpreter for train.py (torchrun brings its own)
# Arguments: --key=value overrides passed to every run (e.g. --max_iters=2000 --wandb_log=False).
# --seed=S is taken as SEEDS=S, so runs of different seeds never share a directory.
#
# A run whose out_dir holds a checkpoint at or beyond the run's max_iters (resolved from its config
# file and overrides as train.py resolves them) is skipped without touching its files: no launch,
# no checkpoint load, no wandb resume just to learn that it is done (train.py would also say "run
# already finished", after loading a multi-GB checkpoint and rewriting config.json); a run
# with an earlier checkpoint is resumed with --init_from=resume; any other run starts from scratch.
# So an interrupted sweep is continued by running the same command again, and a finished sweep is
# extended by rerunning it with a larger --max_iters.

set -euo pipefail

SWEEP_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

source "$SWEEP_REPO/scripts/launch_common.sh"  # GPU count, launcher, resolve_config, print_usage, quote_command

die() {
    echo "error: $*" >&2
    exit 2
}

# sweep_begin NAME GROUP [--key=value ...] (SWEEP_RESERVED: the keys the sweep sets per run)
sweep_begin() {
    SWEEP_NAME=$1
    SWEEP_GROUP=$2
    shift 2
    cd "$SWEEP_REPO"

    PYTHON=${PYTHON:-python}
    OUT_ROOT=${OUT_ROOT:-out}
    DRY_RUN=${DRY_RUN:-0}
    [[ $DRY_RUN == 0 ]] && DRY_RUN=

    # passthrough arguments: only --key=value, never a key the sweep sets itself
    # (the sweep script lists the keys it sweeps in SWEEP_RESERVED)
    PASSTHROUGH=()
    local arg key reserved
    for arg in "$@"; do
        case $arg in
            -h | --help) print_usage; exit 0 ;;
            --seed=*) SEEDS=${arg#--seed=} ;;
            --*=*)
                key=${arg%%=*}
                key=${key#--}
                for reserved in out_dir wandb_run_name wandb_group init_from ${SWEEP_RESERVED[@]+"${SWEEP_RESERVED[@]}"}; do
                    [[ $key == "$reserved" ]] && die "$arg: $SWEEP_NAME sets --$key itself for every run"
                done
                PASSTHROUGH+=("$arg") ;;
            *) die "unexpected argument '$arg': extra arguments are --key=value overrides for train.py (see --help)" ;;
        esac
    done
    read -ra SEED_LIST <<<"${SEEDS:-}"
    [[ ${#SEED_LIST[@]} -gt 0 ]] || SEED_LIST=("")  # one run per setting, with the config's seed

    # where runs go: one slot per GPUS entry running in parallel, or one slot running in order
    read -ra SLOTS <<<"${GPUS:-}"
    SWEEP_PARALLEL=$([[ ${#SLOTS[@]} -gt 0 ]] && echo 1 || true)
    [[ -n $SWEEP_PARALLEL ]] || SLOTS=("")
    SLOT_PID=()
    SLOT_RUN=()
    SLOT_STATUS_FILE=()
    SWEEP_DISPATCHED=0  # for DRY_RUN's round-robin GPU assignment
    PLANNED=() PLANNED_ARGS=()  # the runs sweep_run adds, for sweep_end to start
    SWEEP_RUNS=() RUNS_STARTED=() RUNS_SKIPPED=() RUNS_FAILED=()  # their names, and what became of them
    trap 'sweep_interrupted INT' INT
    trap 'sweep_interrupted TERM' TERM HUP  # a closed terminal too: its SIGHUP does not reach the setsid'd runs

    local where="one run at a time"
    [[ -n $SWEEP_PARALLEL ]] && where="${#SLOTS[@]} runs at once on GPUS=\"${GPUS}\""
    echo "# $SWEEP_NAME: wandb group $SWEEP_GROUP, runs in $OUT_ROOT/$SWEEP_NAME/, $where${DRY_RUN:+ (dry run)}"
}

# Processes per run in a slot: NPROC if set, else the slot's GPU count, else all GPUs found.
slot_nproc() {
    if [[ -n $1 ]]; then
        CUDA_VISIBLE_DEVICES=$1 default_nproc
    else
        default_nproc
    fi
}

# plan_runs SWEEP_DIR [--run NAME_TEMPLATE CONFIG_FILE --key=value ...] ...: for each run, one line
# "NAME MAX_ITERS [STEP]": its name (the template with {variant} replaced by the attention variant of its
# config, as train_config.variant_name spells it: sa, xsa, xsa_gate, xsa_last6, ...), the max_iters it
# trains to (resolved as train.py resolves it) and the step of the newest checkpoint in
# SWEEP_DIR/NAME, if it has one, as pretrain/checkpointer.py lists them. One process for the whole
# sweep: importing torch once, not once per run.
plan_runs() {
    "$PYTHON" - "$@" <<'PY'
import os
import sys
from pretrain.checkpoint_format import checkpoint_step
from pretrain.checkpointer import list_checkpoints
from configurator import ConfigError
from pretrain.train_config import resolve, variant_name
sweep_dir, argv = sys.argv[1], sys.argv[2:]
runs, names = [], set()
for arg in argv:
    if arg == "--run":
        runs.append([])
    else:
        runs[-1].append(arg)
for template, *run_argv in runs:
    try:
        config, _ = resolve(run_argv)
    except ConfigError as e:
        sys.exit(f"config error: {template.format(variant='<variant>')}: {e}")
    name = template.format(variant=variant_name(config))
    if name in names:  # one out_dir for two runs: e.g. SA's config turned into XSA by an override
        sys.exit(f"config error: two runs of this sweep are both {name} (same attention variant and settings)")
    names.add(name)
    steps = [checkpoint_step(path) for path in list_checkpoints(os.path.join(sweep_dir, name))]
    print(name, config.max_iters, max(steps, default=""))
PY
}

# sweep_pair SIZE SUFFIX [--key=value ...]: the SA and XSA runs of one setting (once per seed), from
# config/{sa,xsa}_<SIZE>.py, named <variant>_<SIZE><SUFFIX>[_seedS], the variant as
# train_config.variant_name spells it (sa_1p4b_lr2e-4 and xsa_1p4b_lr2e-4).
sweep_pair() {
    local size=$1 suffix=$2 seed attn
    shift 2
    for seed in "${SEED_LIST[@]}"; do
        for attn in sa xsa; do
            sweep_run "{variant}_${size}${suffix}${seed:+_seed$seed}" "config/${attn}_${size}.py" "$@" \
                ${seed:+"--seed=$seed"}
        done
    done
}

# sweep_run NAME_TEMPLATE CONFIG_FILE [--key=value ...]: add one run to the sweep; sweep_end starts it
# (or resumes it, or skips it). {variant} in the name stands for the run's attention variant.
sweep_run() {
    local config=$2
    [[ -f $config ]] || die "no config file $config"
    PLANNED+=(--run "$1" "$config" "${@:3}" "${PASSTHROUGH[@]}")
    PLANNED_ARGS+=("$(quote_command "$config" "${@:3}")")
}

# launch_run NAME MAX_ITERS STEP CONFIG_FILE [--key=value ...]: start, resume or skip one planned run.
launch_run() {
    local name=$1 max_iters=$2 step=$3 config=$4
    shift 4
    SWEEP_RUNS+=("$name")
    local out_dir="$OUT_ROOT/$SWEEP_NAME/$name"
    local status_file="$out_dir/exit_status" last
    last=$(read_exit_status "$status_file")
    if [[ $last == 2 || $last == 3 ]]; then  # a permanent failure: running it again as it is would fail alike
        echo "# $name: skip (its last launch stopped with exit status $last, which a relaunch cannot fix; see" \
            "$out_dir/train.log, then delete $status_file to run it again)"
        RUNS_FAILED+=("$name")
        return 0
    fi
    local group=$SWEEP_GROUP arg run_args=()
    for arg in "$@"; do  # a run may have a wandb group of its own (sweep_seqlen's document-masked runs)
        if [[ $arg == --wandb_group=* ]]; then group=${arg#--wandb_group=}; else run_args+=("$arg"); fi
    done
    local args=("$config" "--out_dir=$out_dir" "--wandb_run_name=$name" "--wandb_group=$group"
        ${run_args[@]+"${run_args[@]}"} "${PASSTHROUGH[@]}")
    if [[ -n $step ]]; then
        if ((step >= max_iters)); then
            echo "# $name: skip (finished: checkpoint step $step >= max_iters $max_iters)"
            RUNS_SKIPPED+=("$name")
            return 0
        fi
        args+=(--init_from=resume)
    fi

    # a free slot (in a dry run: the next one, round-robin)
    local i
    if [[ -n $DRY_RUN ]]; then
        i=$((SWEEP_DISPATCHED % ${#SLOTS[@]}))
    else
        wait_for_free_slot
        i=$FREE_SLOT
    fi
    SWEEP_DISPATCHED=$((SWEEP_DISPATCHED + 1))
    local slot=${SLOTS[i]}
    train_command "$(slot_nproc "$slot")" || exit 2
    local env_prefix=${slot:+CUDA_VISIBLE_DEVICES=$slot} cmd=("${TRAIN_COMMAND[@]}" "${args[@]}")

    local what="new"
    [[ -n $step ]] && what="resume from step $step of $max_iters"
    echo "# $name: $what"
    if [[ -n $DRY_RUN ]]; then
        echo "${env_prefix:+$env_prefix }$(quote_command "${cmd[@]}")"
        return 0
    fi
    echo "+ ${env_prefix:+$env_prefix }$(quote_command "${cmd[@]}")"
    RUNS_STARTED+=("$name")
    # train.py writes the status it chose there: torchrun exits 1 whatever its processes chose
    mkdir -p "$out_dir"
    rm -f "$status_file"
    # setsid: a signal to the terminal's process group (Ctrl-C) reaches the sweep alone, whose trap passes it on
    # once; a run that got it from the terminal as well would take the trap's as a second signal and stop at once,
    # without its checkpoint. `trap -` gives the run the default dispositions of SIGINT and SIGQUIT back, which a
    # non-interactive shell ignores in a `&` child (as scripts/train_forever.sh).
    if [[ -n $SWEEP_PARALLEL ]]; then
        # parallel runs would interleave on the terminal: each writes to its own console.log
        echo "#   on CUDA_VISIBLE_DEVICES=$slot, output in $out_dir/console.log"
        (trap - INT QUIT; exec setsid env ${env_prefix:+"$env_prefix"} TRAIN_EXIT_STATUS_FILE="$status_file" \
            "${cmd[@]}") >>"$out_dir/console.log" 2>&1 &
    else
        (trap - INT QUIT; TRAIN_EXIT_STATUS_FILE="$status_file" exec setsid "${cmd[@]}") &
    fi
    SLOT_PID[i]=$!
    SLOT_RUN[i]=$name
    SLOT_STATUS_FILE[i]=$status_file
    # in order: wait here (a background job + wait lets the INT/TERM trap stop it at once)
    [[ -n $SWEEP_PARALLEL ]] || reap_slot "$i" wait
}

# reap_slot I [wait]: if slot I's run has ended (or, with "wait", once it ends), record how.
# Returns 1 if it is still running.
reap_slot() {
    local i=$1 mode=${2:-} pid=${SLOT_PID[$1]:-}
    [[ -n $pid ]] || return 0
    if [[ $mode != wait ]] && kill -0 "$pid" 2>/dev/null; then
        return 1
    fi
    local status=0 chosen
    wait "$pid" || status=$?
    chosen=$(read_exit_status "${SLOT_STATUS_FILE[i]}")
    status=${chosen:-$status}
    case $status in
        0) echo "# ${SLOT_RUN[i]}: done" ;;
        2 | 3) echo "# ${SLOT_RUN[i]}: FAILED (exit status $status: a bad config, or a stop that a relaunch cannot" \
            "fix; see its train.log); a rerun of the sweep skips it" ;;
        130 | 143) echo "# ${SLOT_RUN[i]}: STOPPED by a signal (exit status $status) after a checkpoint; a rerun" \
            "of the sweep resumes it" ;;
        *) echo "# ${SLOT_RUN[i]}: FAILED (exit status $status, a crash); a rerun of the sweep resumes it" ;;
    esac
    ((status == 0)) || RUNS_FAILED+=("${SLOT_RUN[i]}")
    SLOT_PID[i]=
}

# Wait (polling once a second) until a slot has no run; its index in FREE_SLOT.
# Runs in this shell, not in $(...), so that the runs it reaps are recorded.
wait_for_free_slot() {
    local i
    while :; do
        for i in "${!SLOTS[@]}"; do
            if reap_slot "$i"; then
                FREE_SLOT=$i
                return 0
            fi
        done
        sleep 1
    done
}

# Ctrl-C or kill (SIGNAL: INT or TERM): stop the runs this sweep started, passing the signal on once to each
# (they checkpoint, stop, and resume on the next invocation).
sweep_interrupted() {
    trap - INT TERM HUP
    echo "# $SWEEP_NAME interrupted: stopping its runs; run the same command again to resume" >&2
    local pid
    for pid in "${SLOT_PID[@]}"; do
        [[ -n $pid ]] && kill -s "$1" "$pid" 2>/dev/null || true
    done
    wait || true
    exit 130
}

# sweep_end: resolve every planned run (a mistyped override fails here, before any run starts, and in a
# DRY_RUN, instead of in every run the sweep launches), start them, wait for them, print a summary and
# fail if any run failed. SWEEP_RUNS then holds the runs' names, in order. Whether a run starts, resumes
# or is skipped is decided here, from the checkpoints there are when the sweep starts.
sweep_end() {
    local plan=() line name max_iters step n=0 run_args
    if ((${#PLANNED[@]})); then
        plan=$(plan_runs "$OUT_ROOT/$SWEEP_NAME" "${PLANNED[@]}") || die "the sweep cannot run as asked (see above)"
        mapfile -t plan <<<"$plan"
    fi
    for line in "${plan[@]}"; do
        read -r name max_iters step <<<"$line"
        eval "run_args=(${PLANNED_ARGS[n]})"  # quote_command's quoting, read back
        n=$((n + 1))
        launch_run "$name" "$max_iters" "$step" "${run_args[@]}"
    done
    local i
    for i in "${!SLOTS[@]}"; do
        reap_slot "$i" wait || true
    done
    [[ -n $DRY_RUN ]] && return 0
    echo "# $SWEEP_NAME: ${#RUNS_STARTED[@]} started, ${#RUNS_SKIPPED[@]} skipped as finished," \
        "${#RUNS_FAILED[@]} failed${RUNS_FAILED[*]:+ (${RUNS_FAILED[*]})}"
    [[ ${#RUNS_FAILED[@]} -eq 0 ]] || exit 1
}
