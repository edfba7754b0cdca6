#!/usr/bin/env bash
# Sequence-length sweep (paper: "Sequence length"): SA and XSA of one size at context lengths
# 512 ... 16384, passed as --block_size=L, with the same LR and the same 524,288 tokens per
# optimizer step at every length. The paper (1.4B) saw XSA's gain grow with the length.
#
#     scripts/sweep_seqlen.sh                               # 12 runs at 1.4B
#     MASKS="causal document" scripts/sweep_seqlen.sh       # 24: and each within documents only
#     SIZE=0p7b LENGTHS="512 8192" scripts/sweep_seqlen.sh --max_iters=20000
#
#   SIZE=1p4b              config/{sa,xsa}_$SIZE.py
#   LENGTHS="512 1024 2048 4096 8192 16384"
#   MASKS=causal           attention masks (--attn_mask): causal (the paper's), document, or both. At long
#                          lengths most of a causal window is earlier, unrelated documents; the document
#                          mask tells "uses long context better" from "ignores the previous document better"
#   TOTAL_BATCH_SIZE=524288   tokens per optimizer step (--total_batch_size)
#   TOKENS_PER_MICRO       tokens per GPU per micro-step; default: the config's batch_size x
#                          block_size (4 x 2048 at 1.4B), which the memory planner says fits
# Each run gets --batch_size=B with B x L = TOKENS_PER_MICRO, so memory stays about the same at every
# length and train.py raises gradient accumulation to keep TOTAL_BATCH_SIZE = B x L x processes x
# accumulation steps. A length above TOKENS_PER_MICRO still needs one whole sequence, which holds
# more tokens: those runs recompute activations in the backward to fit the same memory,
# --activation_checkpointing=selective up to 2x the tokens, =block beyond (an explicit
# --activation_checkpointing=... given to the sweep wins).
# Runs: $OUT_ROOT/sweep_seqlen/{sa,xsa}_<SIZE>_seqlen<L>, wandb group sweep_seqlen_<SIZE> (causal, as the
# sweep's runs have always been named), and {sa,xsa}_<SIZE>_seqlen<L>_document, wandb group
# sweep_seqlen_<SIZE>_document. Rerun to resume; finished runs are skipped. Common options:
# scripts/sweep_common.sh.
set -euo pipefail
source "$(dirname "$0")/sweep_common.sh"

SIZE=${SIZE:-1p4b}
LENGTHS=${LENGTHS:-"512 1024 2048 4096 8192 16384"}
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-524288}
MASKS=${MASKS:-causal}
SWEEP_RESERVED=(block_size batch_size total_batch_size attn_mask)
for mask in $MASKS; do
    [[ $mask == causal || $mask == document ]] || die "MASKS: unknown attention mask '$mask' (causal, document)"
done

sweep_begin sweep_seqlen "sweep_seqlen_$SIZE" "$@"
if [[ -z ${TOKENS_PER_MICRO:-} ]]; then
    [[ -f config/sa_$SIZE.py ]] || die "no config file config/sa_$SIZE.py"
    read -r config_batch_size config_block_size <<<"$(resolve_config "batch_size block_size" "config/sa_$SIZE.py")"
    TOKENS_PER_MICRO=$((config_batch_size * config_block_size))
fi
for length in $LENGTHS; do
    batch_size=$((TOKENS_PER_MICRO / length))
    ((batch_size >= 1)) || batch_size=1
    recompute=()  # activations are about proportional to the tokens of a micro-step
    if ((length > 2 * TOKENS_PER_MICRO)); then
        recompute=(--activation_checkpointing=block)
    elif ((length > TOKENS_PER_MICRO)); then
        recompute=(--activation_checkpointing=selective)
    fi
    # train.py needs whole micro-steps: check here rather than fail after the sweep has started
    for slot in "${SLOTS[@]}"; do
        nproc=$(slot_nproc "$slot")
        ((TOTAL_BATCH_SIZE % (batch_size * length * nproc) == 0)) ||
            die "block_size $length: TOTAL_BATCH_SIZE=$TOTAL_BATCH_SIZE is not a multiple of" \
                "batch_size $batch_size x $length x $nproc processes"
    done
    for mask in $MASKS; do
        if [[ $mask == causal ]]; then
            sweep_pair "$SIZE" "_seqlen$length" "--block_size=$length" "--total_batch_size=$TOTAL_BATCH_SIZE" \
                "--batch_size=$batch_size" ${recompute[@]+"${recompute[@]}"} --attn_mask=causal
        else
            sweep_pair "$SIZE" "_seqlen${length}_$mask" "--block_size=$length" \
                "--total_batch_size=$TOTAL_BATCH_SIZE" "--batch_size=$batch_size" ${recompute[@]+"${recompute[@]}"} \
                "--attn_mask=$mask" "--wandb_group=sweep_seqlen_${SIZE}_$mask"
        fi
    done
done
sweep_end
