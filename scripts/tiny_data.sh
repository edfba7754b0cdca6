# Shared by quickstart.sh and small_study.sh (sourced after launch_common.sh, not run): the token
# shards of the tiny configs, made with the same settings by both, so that each reuses the other's
# (prepare.py refuses to add to a directory made with other settings).
#
#   DATA_DIR=data/fineweb/fineweb_tiny   the shards (default: the tiny configs' data_dir)
#   INPUT       local .txt, .jsonl or .parquet files, or quoted globs, to make them from; unset: the
#               shards already in DATA_DIR, else FineWeb sample-100BT streamed from the Hub
#   MAX_TOKENS=2000000                   tokens at most
# The val split holds what the tiny config evaluates (its val_tokens, and one more token for the
# last target), at most a tenth of MAX_TOKENS; every other token is training text.

# tiny_data_command: TINY_DATA_DIR, and TINY_PREPARE: the prepare.py command that makes (or
# finishes) the shards there, or nothing when DATA_DIR holds shards and no INPUT asks for others.
tiny_data_command() {
    local data_dir val_tokens max_tokens=${MAX_TOKENS:-2000000} input=()
    read -r data_dir val_tokens <<<"$(resolve_config "data_dir val_tokens" config/sa_tiny.py)"
    [[ -n $val_tokens ]] || return 2
    TINY_DATA_DIR=${DATA_DIR:-$data_dir}
    TINY_PREPARE=()
    [[ -z ${INPUT:-} && -d $TINY_DATA_DIR ]] && return 0
    val_tokens=$((val_tokens + 1))
    ((val_tokens <= max_tokens / 10)) || val_tokens=$((max_tokens / 10))
    if [[ -n ${INPUT:-} ]]; then
        read -ra input <<<"$INPUT"  # split, not expanded: prepare.py expands globs in a reproducible order
        input=(--input "${input[@]}")
    fi
    TINY_PREPARE=("${PYTHON:-python}" -m data.fineweb.prepare ${input[@]+"${input[@]}"} --out_dir "$TINY_DATA_DIR"
        --max_tokens "$max_tokens" --val_tokens "$val_tokens" --shard_size 500000)
}

# tiny_data_prepare: run TINY_PREPARE, if there is one, with the way out when the Hub is out of reach.
tiny_data_prepare() {
    if ((${#TINY_PREPARE[@]} == 0)); then
        echo "# using the shards in $TINY_DATA_DIR (INPUT=<files> makes them from other text, DATA_DIR=<dir> elsewhere)"
        return 0
    fi
    local status=0
    echo "+ $(quote_command "${TINY_PREPARE[@]}")"
    "${TINY_PREPARE[@]}" || status=$?
    # prepare's status for a stop that running again cannot fix (its line above says which), a Hub out of reach among them
    if ((status == 3)) && [[ -z ${INPUT:-} ]]; then
        echo "without FineWeb from the Hub, make the shards from local text: set INPUT=<local text files> (txt," \
             "parquet or jsonl), e.g. INPUT='tests/fixtures/corpus/*.txt'" >&2
    fi
    return "$status"
}
