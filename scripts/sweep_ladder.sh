#!/usr/bin/env bash
# Model-size ladder (does XSA's gain grow with scale?): SA and XSA at a ladder of sizes, each trained on
# TOKENS_PER_PARAM tokens per non-embedding parameter, then the scaling laws fitted by eval/scaling.py:
# L = E + A x^-alpha per attention type with one shared floor E, in N and in training FLOPs C, the XSA - SA
# gap, XSA's compute multiplier k and its growth gamma, with Student t intervals over seeds.
#
#     SIZES=tiny SEEDS="1 2 3" INPUT='tests/fixtures/corpus/*.txt' scripts/sweep_ladder.sh   # 2 CPU cores
#     SIZES=paper SEEDS="1 2 3" scripts/sweep_ladder.sh                         # GPUs, up to 2.7B
#     DRY_RUN=1 SIZES=paper scripts/sweep_ladder.sh     # the rungs: shape, N, tokens, FLOPs, GPU-hours
#
#   SIZES=tiny         the ladder: tiny (CPU) or paper (GPUs)
#   DEPTHS             its rungs made by the rule, by depth; tiny "1 2 3 4", paper "8 12 16 20"
#   PAPER_RUNGS        paper only: the paper's own configs as rungs, default "0p7b 1p4b 2p7b" ("" for none)
#   TOKENS_PER_PARAM   training tokens per non-embedding parameter N; paper 20 (Chinchilla's), tiny 2
#   SEEDS="1"          seeds (a later, longer SEEDS reuses the finished runs); intervals need 2 or more
#   DATA_DIR, INPUT, MAX_TOKENS   tiny only: the shards, as in scripts/small_study.sh (scripts/tiny_data.sh)
# The rule for the rungs by depth (nanochat's depth-parameterised models): depth L, width n_embd = ASPECT x
# L, heads of a fixed head_dim, n_head = ceil(n_embd / head_dim). paper: ASPECT 64 and head_dim 128 (the
# paper's 1.4B and 2.7B heads), depths 8 to 20 (25M to 0.2B parameters); above them the paper's three
# models exactly as config/sa_{0p7b,1p4b,2p7b}.py have them: layers, width, heads, head_dim and learning
# rate (0.7B: 24 x 1536 with 6 heads of 256; 1.4B: 24 x 2048 and 2.7B: 32 x 2560, each with 24 heads of 128),
# so the paper's sizes are measured on the ladder, not extrapolated. Their shapes follow no one rule (0.7B
# and 1.4B share depth 24; the head width drops from 256 to 128): eval/scaling.py says so and refits
# without the rungs of the other head width. tiny: ASPECT 32 and head_dim 32 (the tiny config's: a head of
# 128 would be wider than the smallest models), so depth 4 is config/sa_tiny.py's shape. Learning rate
# inversely proportional to the width, anchored at a config of the ladder: paper 5e-4 x 1536 / n_embd (the
# paper's LRs: 5e-4 at 0.7B and 3e-4 at 2.7B exactly; its 1.4B's 4e-4 is 7% above the rule), tiny 2e-3 x
# 128 / n_embd (the tiny config's).
# Steps: ceil(TOKENS_PER_PARAM x N / total_batch_size); warmup: the config's, at most a tenth of the run.
# Everything else is the config's: config/{sa,xsa}_tiny.py, or for the rungs by depth the narrowest of
# config/{sa,xsa}_{0p7b,1p4b,2p7b}.py at least as wide (its micro-batch and parallelism fit the memory).
# Why tiny is 2 tokens per parameter: a tiny model's compute is mostly its 50,304-token output layer, and
# at the tiny config's 2,500 tokens/s on 2 CPU cores (0.8 s a step of 2,048) the four rungs would take about
# 5 hours at 20; at 2 (12.4K to 0.79M parameters, 13 to 770 steps) about 30 minutes for one seed
# (docs/experiments.md: measured). Undertrained pipeline checks, not a law about the paper's sizes.
# Runs: $OUT_ROOT/sweep_ladder/{sa,xsa}_<SIZES>_<RUNG>_seed<S> (RUNG: d<depth>, or the paper config's
# size), wandb groups sweep_ladder_<SIZES>_sa and sweep_ladder_<SIZES>_xsa; the fit:
# $OUT_ROOT/sweep_ladder/<SIZES>/scaling.{json,md,png}. Rerun to resume; finished runs are skipped. Other
# options (NPROC, GPUS, OUT_ROOT, DRY_RUN, --key=value overrides for every run): scripts/sweep_common.sh.
# GPU-hours as docs/experiments.md estimates them: H100 SXM (dense bf16) at an assumed 40% MFU.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZES=${SIZES:-tiny}
SEEDS=${SEEDS:-1}
case $SIZES in
    tiny)
        ASPECT=32 HEAD_DIM=32 BASES="tiny" ANCHOR=tiny PAPER_RUNGS=""
        DEPTHS=${DEPTHS:-"1 2 3 4"} TOKENS_PER_PARAM=${TOKENS_PER_PARAM:-2} ;;
    paper)
        ASPECT=64 HEAD_DIM=128 BASES="0p7b 1p4b 2p7b" ANCHOR=0p7b PAPER_RUNGS=${PAPER_RUNGS-"0p7b 1p4b 2p7b"}
        DEPTHS=${DEPTHS:-"8 12 16 20"} TOKENS_PER_PARAM=${TOKENS_PER_PARAM:-20} ;;
    *) die "SIZES: unknown ladder '$SIZES' (tiny, paper)" ;;
esac
SWEEP_RESERVED=(n_layer n_embd n_head head_dim learning_rate max_iters warmup_iters)
[[ $SIZES == tiny ]] && SWEEP_RESERVED+=(data_dir)  # DATA_DIR / INPUT say which shards

# plan_ladder: one line per rung, smallest first, "RUNG N_LAYER N_EMBD N_HEAD HEAD_DIM BASE LR N TOKENS STEPS
# WARMUP FLOPS GPU_HOURS": the shape by the rule (RUNG d<depth>) or a paper config's own (RUNG its size), N and
# the FLOPs per token as model.py counts them (on the meta device), for the base config with the sweep's
# overrides (PASSTHROUGH: a --total_batch_size or --block_size counts).
plan_ladder() {
    "$PYTHON" - "$ASPECT" "$HEAD_DIM" "$TOKENS_PER_PARAM" "$ANCHOR" "$BASES" "$DEPTHS" "$PAPER_RUNGS" \
        ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"} <<'PY'
import math
import sys

import torch

from configurator import ConfigError
from model import GPT
from pretrain.runtime import PEAK_BF16_FLOPS
from pretrain.train_config import model_config, resolve

ASSUMED_MFU = 0.4  # docs/experiments.md, "What the sweeps cost": H100 SXM at 40% MFU
aspect, head_dim, tokens_per_param, anchor, bases, depths, paper_rungs, *overrides = sys.argv[1:]
aspect, head_dim, tokens_per_param = int(aspect), int(head_dim), float(tokens_per_param)


def counts(config):
    """(N, training FLOPs per token) of the config's GPT, as model.py counts them."""
    with torch.device("meta"):
        model = GPT(model_config(config))
    return model.num_params(), model.flops_per_token(config.block_size)


def base_config(name, **shape):
    try:
        config, _ = resolve([f"config/sa_{name}.py", *overrides, *(f"--{k}={v}" for k, v in shape.items())])
    except ConfigError as e:
        sys.exit(f"config error: config/sa_{name}.py: {e}")
    return config


widths = sorted((base_config(name).n_embd, name) for name in bases.split())
reference = base_config(anchor)
rungs = []
for depth in map(int, depths.split()):
    width = aspect * depth
    shape = dict(n_layer=depth, n_embd=width, n_head=math.ceil(width / head_dim), head_dim=head_dim)
    base = next((name for base_width, name in widths if base_width >= width), widths[-1][1])
    learning_rate = float(f"{reference.learning_rate * reference.n_embd / width:.3g}")
    rungs.append((f"d{depth}", base, base_config(base, **shape, learning_rate=learning_rate)))
for name in paper_rungs.split():  # the paper's models as its configs have them
    rungs.append((name, name, base_config(name)))
plan = []
for rung, base, config in rungs:
    n, flops_per_token = counts(config)
    steps = max(1, math.ceil(tokens_per_param * n / config.total_batch_size))
    tokens = steps * config.total_batch_size
    warmup = min(config.warmup_iters, steps // 10)
    flops = flops_per_token * tokens
    gpu_hours = flops / (PEAK_BF16_FLOPS["H100"] * ASSUMED_MFU) / 3600
    plan.append((n, rung, config.n_layer, config.n_embd, config.n_head, config.head_dim, base,
                 f"{config.learning_rate:g}", n, tokens, steps, warmup, f"{flops:.4g}", f"{gpu_hours:.4g}"))
for line in sorted(plan):
    print(*line[1:])
PY
}

sweep_begin sweep_ladder "sweep_ladder_${SIZES}_{sa,xsa}" "$@"
# a positive number: 20, 0.5, 1e3, 2.5E-1
[[ $TOKENS_PER_PARAM =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$ ]] &&
    awk -v t="$TOKENS_PER_PARAM" 'BEGIN { exit !(t + 0 > 0) }' ||
    die "TOKENS_PER_PARAM=$TOKENS_PER_PARAM: expected a positive number (e.g. 20, 0.5, 1e3)"
for depth in $DEPTHS; do
    [[ $depth =~ ^[1-9][0-9]*$ ]] || die "DEPTHS: '$depth' is not a positive number of layers"
done
read -ra rung_words <<<"$DEPTHS $PAPER_RUNGS"
((${#rung_words[@]})) || die "DEPTHS='$DEPTHS'${PAPER_RUNGS:+ and PAPER_RUNGS='$PAPER_RUNGS'}: the ladder has no rungs"
for rung in $PAPER_RUNGS; do
    [[ " $BASES " == *" $rung "* ]] || die "PAPER_RUNGS: '$rung' is not one of the paper's configs ($BASES)"
done

data_args=()
if [[ $SIZES == tiny ]]; then
    source "$SWEEP_REPO/scripts/tiny_data.sh"
    tiny_data_command || exit 2
    if [[ -z $DRY_RUN ]]; then
        tiny_data_prepare
    elif ((${#TINY_PREPARE[@]})); then
        quote_command "${TINY_PREPARE[@]}"
    fi
    data_args=("--data_dir=$TINY_DATA_DIR")
fi

plan=$(plan_ladder) || die "the ladder cannot run as asked (see above)"
mapfile -t rungs <<<"$plan"
total_flops=0 total_hours=0
echo "# ladder $SIZES: ${#rungs[@]} sizes x SA, XSA x ${#SEED_LIST[@]} seed(s), $TOKENS_PER_PARAM tokens per parameter"
for rung in "${rungs[@]}"; do
    read -r name n_layer n_embd n_head head_dim base lr params tokens steps warmup flops hours <<<"$rung"
    echo "# rung name=$name n_layer=$n_layer n_embd=$n_embd n_head=$n_head head_dim=$head_dim config=$base" \
        "lr=$lr params=$params tokens=$tokens steps=$steps flops=$flops gpu_hours=$hours"
    read -r total_flops total_hours <<<"$(awk -v f="$total_flops" -v h="$total_hours" -v rf="$flops" -v rh="$hours" \
        -v n="$((2 * ${#SEED_LIST[@]}))" 'BEGIN { printf "%.4g %.4g\n", f + n * rf, h + n * rh }')"
done
echo "# ladder $SIZES in all: $total_flops FLOPs, $total_hours GPU-hours (H100 SXM at an assumed 40% MFU)"

# seed by seed, small rungs first: one seed's whole ladder is ready to fit before the next seed starts
for seed in "${SEED_LIST[@]}"; do
    for rung in "${rungs[@]}"; do
        read -r name n_layer n_embd n_head head_dim base lr params tokens steps warmup flops hours <<<"$rung"
        for attn in sa xsa; do
            sweep_run "{variant}_${SIZES}_${name}${seed:+_seed$seed}" "config/${attn}_${base}.py" \
                "--n_layer=$n_layer" "--n_embd=$n_embd" "--n_head=$n_head" "--head_dim=$head_dim" \
                "--learning_rate=$lr" "--max_iters=$steps" "--warmup_iters=$warmup" \
                "--wandb_group=sweep_ladder_${SIZES}_$attn" ${data_args[@]+"${data_args[@]}"} ${seed:+"--seed=$seed"}
        done
    done
done
sweep_end

runs=()
for name in "${SWEEP_RUNS[@]}"; do
    runs+=("$OUT_ROOT/sweep_ladder/$name")
done
fit=("$PYTHON" -m eval.scaling "${runs[@]}" --out "$OUT_ROOT/sweep_ladder/$SIZES")
if [[ -n $DRY_RUN ]]; then
    quote_command "${fit[@]}"
else
    echo "+ $(quote_command "${fit[@]}")"
    "${fit[@]}"
fi
