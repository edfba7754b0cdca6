#!/usr/bin/env bash
# The GPU path checked in one run (about 8 minutes on one H100 or H200), ending in one table in
# docs/performance.md's format:
#   1. the 0.7B model (24 x 1536, 6 heads of 256) at context 2048 in bf16, SA and XSA, compile off and
#      on: ms/step, tokens/s, MFU, peak memory, XSA/SA, and the graphs and graph breaks compiled (scripts/bench.py)
#   2. the SDPA backend its attention runs on, and XSA's orthogonality |z.v|/(|v||y|) in bf16 (scripts/bench.py)
#   3. one compiled FSDP training run on NCCL (torchrun, one process per GPU), and a resume from its
#      checkpoint that must reach the uninterrupted run's loss
#   4. the document mask (FlexAttention) against the causal one at T = 2048 and 8192, the same tokens per
#      step, FineWeb-like documents: ms/step and the ratio document / causal (scripts/bench.py --attn_mask=document)
#   5. FlexAttention's document mask against SDPA with the same mask as a dense boolean matrix: the loss and
#      every parameter's gradient (the CPU has no FlexAttention backward: only here is it checked)
#
#   bash scripts/gpu_check.sh
#   DRY_RUN=1 bash scripts/gpu_check.sh      # every stage at toy size on the CPU, as on a machine without a GPU
#
# BATCH_SIZE: sequences per step in stage 1 (default 8); NPROC: processes in stage 3 (default: the GPUs,
# 2 in a dry run); OUT: where the JSON files, logs and table.md go (default out/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_common.sh  # count_gpus, resolve_config

OUT=${OUT:-out/gpu_check}
if [ "${DRY_RUN:-0}" != 0 ] || [ "$(count_gpus)" -eq 0 ]; then
    echo "gpu_check: dry run, every stage at toy size on the CPU"
    model=(--n_layer=2 --n_embd=64 --n_head=2 --head_dim=32 --block_size=64 --vocab_size=512)
    system=(--device=cpu --dtype=float32)
    batch=${BATCH_SIZE:-2}
    timing=(--bench_rounds=2 --bench_steps=1 --bench_warmup=2)
    fsdp_model=("${model[@]}")
    nproc=${NPROC:-2}
    fsdp_compile=False  # the compiled FSDP path at toy size is the test suite's
    mask_lengths=(32 64)
    mask_tokens=128
    eot=511  # in the toy vocabulary
    flex_check=(128 32)  # stage 5's length and head widths: on the CPU both sides are the dense mask
else
    model=(config/sa_0p7b.py)
    system=(--device=cuda --dtype=bfloat16)
    batch=${BATCH_SIZE:-8}
    timing=(--bench_rounds=5 --bench_steps=3 --bench_warmup=3)
    fsdp_model=(config/sa_0p7b.py --n_layer=4)  # full width, fewer blocks: the path, not the size
    nproc=${NPROC:-$(count_gpus)}
    fsdp_compile=True
    mask_lengths=(2048 8192)
    mask_tokens=16384
    eot=50256
    flex_check=(1024 32 128 256)  # the paper's sizes have heads of 128 (1.4B, 2.7B) and 256 (0.7B)
fi
rm -rf "$OUT"
mkdir -p "$OUT"

# 1 and 2: scripts/bench.py, compile off then on
for compile in False True; do
    python -m scripts.bench "${model[@]}" "${system[@]}" --batch_size="$batch" --compile="$compile" "${timing[@]}" \
        --bench_variants=sa,xsa --bench_json="$OUT/bench_compile_$compile.json" | tee "$OUT/bench_compile_$compile.log"
done

# 3: random tokens are enough to train and resume
python - "$OUT/shards" <<'EOF'
import os, sys
import numpy as np
from pretrain.shards import write_shard
out = sys.argv[1]
os.makedirs(out)
rng = np.random.default_rng(0)
write_shard(f"{out}/fineweb_val_000000.bin", rng.integers(0, 512, 200_000))
write_shard(f"{out}/fineweb_train_000001.bin", rng.integers(0, 512, 2_000_000))
EOF
run=(--data_dir="$OUT/shards" --parallelism=fsdp --compile="$fsdp_compile" --batch_size="$batch"
     --total_batch_size=$((batch * nproc * $(resolve_config block_size "${fsdp_model[@]}")))
     --max_iters=3 --warmup_iters=1 --learning_rate=3e-4 --eval_interval=3 --val_tokens=65536
     --checkpoint_interval=2 --log_interval=1 --wandb_log=False)
launch=(python -m torch.distributed.run --standalone --nproc_per_node="$nproc" train.py "${fsdp_model[@]}" "${system[@]}")
"${launch[@]}" "${run[@]}" --out_dir="$OUT/fsdp_full" > "$OUT/fsdp_full.log" 2>&1
mkdir -p "$OUT/fsdp_resumed"
cp -r "$OUT/fsdp_full/ckpt_0000002" "$OUT/fsdp_resumed/"
"${launch[@]}" "${run[@]}" --out_dir="$OUT/fsdp_resumed" --init_from=resume > "$OUT/fsdp_resumed.log" 2>&1

# 4: document mask against causal, at two lengths
for length in "${mask_lengths[@]}"; do
    python -m scripts.bench "${model[@]}" "${system[@]}" --block_size="$length" --batch_size=$((mask_tokens / length)) \
        --compile="$fsdp_compile" "${timing[@]}" --bench_variants=sa,xsa --attn_mask=document --eot_token="$eot" \
        --bench_json="$OUT/bench_document_$length.json" | tee "$OUT/bench_document_$length.log"
done

# 5: FlexAttention's gradients against the dense mask's
python - "$OUT" "${system[0]#--device=}" "${flex_check[@]}" <<'EOF'
import json, os, sys
import torch
import model as M
device = sys.argv[2]
length, head_dims = int(sys.argv[3]), [int(d) for d in sys.argv[4:]]
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 on both sides
loss_rel, worst = 0.0, 0.0
for head_dim in head_dims:
    torch.manual_seed(0)
    config = M.GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, head_dim=head_dim, block_size=length,
                         attn_type="xsa", n_sinks=2, attn_mask="document")
    net = M.GPT(config).to(device)
    idx = torch.randint(0, 50257, (2, length), device=device)
    idx[:, torch.randint(1, length, (12,))] = config.eot_token
    results = {}
    for name, devices in (("flex", ("cuda",)), ("dense", ())):
        with M.flex_attention_devices(*devices):
            net.zero_grad(set_to_none=True)
            loss = net(idx, idx)[1]
            loss.backward()
        results[name] = (loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()})
    (flex_loss, flex), (dense_loss, dense) = results["flex"], results["dense"]
    loss_rel = max(loss_rel, abs(flex_loss - dense_loss) / dense_loss)
    worst = max(worst, *(((flex[n] - dense[n]).norm() / dense[n].norm()).item() for n in dense))
report = {"device": device, "flex_used": device == "cuda", "loss_rel": loss_rel, "worst_grad_rel": worst}
json.dump(report, open(f"{sys.argv[1]}/flex_gradients.json", "w"), indent=2)
print(f"flex vs dense document mask on {device}: loss rel {report['loss_rel']:.1e}, worst gradient rel {worst:.1e}")
if worst > 1e-4 or report["loss_rel"] > 1e-5:
    sys.exit("gpu_check: FlexAttention's document mask does not match the dense mask")
EOF

python - "$OUT" "${mask_lengths[@]}" <<'EOF'
import json, os, sys
from pretrain.metrics import read_metrics
out = sys.argv[1]
bench = {compile: json.load(open(f"{out}/bench_compile_{compile}.json")) for compile in ("False", "True")}
first = bench["False"]
c = first["config"]
full = {r["step"]: r for r in read_metrics(f"{out}/fsdp_full/metrics.jsonl")}
resumed = {r["step"]: r for r in read_metrics(f"{out}/fsdp_resumed/metrics.jsonl")}
rel = abs(resumed[3]["train_loss"] - full[3]["train_loss"]) / abs(full[3]["train_loss"])
lines = [f"{first['device']}, {first['dtype']}, torch {__import__('torch').__version__}; "
         f"{c['n_layer']} x {c['n_embd']} ({c['n_head']} heads of {c['head_dim']}), "
         f"{c['batch_size']} x {c['block_size']} tokens per step:", "",
         "| variant | compile | ms/step | tokens/s | MFU | peak mem | tokens/s vs SA | memory vs SA | graphs / breaks |",
         "|---|---|---|---|---|---|---|---|---|"]
for compile, report in bench.items():
    for name, r in report["results"].items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "n/a" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f} GB"
        mem_ratio = "n/a" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
        graphs = f"{r['graphs']} / {r['graph_breaks']}" if compile == "True" else "-"
        lines.append(f"| {name} | {'on' if compile == 'True' else 'off'} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_sec']:,.0f} | {mfu} | {mem} | {r['throughput_ratio']:.3f} | {mem_ratio} | {graphs} |")
ortho = bench["True"]["xsa_orthogonality"]
lines += ["", f"- SDPA backend: {bench['True']['sdpa_backend']}",
          f"- XSA orthogonality in {first['dtype']}: mean {ortho['mean']:.2e}, max {ortho['max']:.2e}",
          f"- FSDP ({full[1]['tokens'] // 1} tokens per step): step-3 loss {full[3]['train_loss']:.4f}; resumed from "
          f"the step-2 checkpoint {resumed[3]['train_loss']:.4f} (relative difference {rel:.1e})"]
lines += ["", "| variant | T | mask | ms/step | tokens/s | document / causal |", "|---|---|---|---|---|---|"]
for length in sys.argv[2:]:
    results = json.load(open(f"{out}/bench_document_{length}.json"))["results"]
    for name in ("sa", "xsa"):
        for mask, r in (("document", results[name]), ("causal", results[f"{name}:attn_mask=causal"])):
            ratio = f"{r['document_over_causal']:.3f}" if mask == "document" else "-"
            lines.append(f"| {name} | {length} | {mask} | {r['ms_per_step']:.2f} | {r['tokens_per_sec']:,.0f} | {ratio} |")
flex = json.load(open(f"{out}/flex_gradients.json"))
lines.append(f"\n- document mask, FlexAttention vs dense on {flex['device']}: loss rel {flex['loss_rel']:.1e}, "
             f"worst gradient rel {flex['worst_grad_rel']:.1e}" + ("" if flex["flex_used"] else " (no FlexAttention off CUDA)"))
table = "\n".join(lines) + "\n"
open(f"{out}/table.md", "w").write(table)
print(table)
if sorted(resumed) != [3] or rel > 1e-3:
    sys.exit(f"gpu_check: the resumed FSDP run does not continue the uninterrupted one (relative difference {rel:.1e})")
EOF
echo "gpu_check: done; the table is in $OUT/table.md"
