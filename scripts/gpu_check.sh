#!/usr/bin/env bash
# The production paths checked on one GPU (H100 or H200), offline, in one run of about 6 minutes, compiles
# included; each stage gets a verdict (pass, fail, or skipped with the reason) and its figures:
#   1. bench: SA and XSA at the 0.7B's width, heads and context (24 x 1536 cut to BENCH_LAYERS blocks, 6 heads
#      of 256, T = 2048, bf16), compile off and on: ms/step, tokens/s, MFU, peak memory, XSA/SA, graphs and breaks
#   2. the SDPA backend attention runs on, and XSA's orthogonality |z.v|/(|v||y|) in bf16
#   3. DDP under torchrun (one process, NCCL): config/xsa_0p7b.py cut to 9 blocks (so that a recompile per block
#      would pass dynamo's limit of 8), compiled, 2 micro-steps, activation checkpointing, TORCH_LOGS=recompiles;
#      then a resume from its step-2 checkpoint, whose losses must equal the uninterrupted run's
#   4. FSDP, the same (2 micro-steps: the no-sync gradient accumulation), and its peak memory against
#      scripts/memory_plan.py's plan for the same shape
#   5. Muon under DDP and under FSDP, 3 steps each: the losses agree within 1e-3
#   6. the document mask: FlexAttention compiled in bf16 under torchrun against the dense mask (loss and every
#      gradient, measured against an fp32 reference), the float32 check outside it, and the step time of
#      document / causal at T = 2048 and 8192
#   7. in-loop evaluation compiled under FSDP: similarity, samples and downstream on the fixture tasks every step,
#      with no recompile storm, and each pass's seconds (needs GPT-2's BPE files: skipped without them)
#
#   bash scripts/gpu_check.sh                  # on a machine with a GPU
#   STAGES=3,6 bash scripts/gpu_check.sh       # a subset, e.g. a rerun of what failed
#   DRY_RUN=1 bash scripts/gpu_check.sh        # every stage at toy size on the CPU (compile off, gloo): the plumbing
#
# OUT: where the report (gpu_check.json, table.md), the logs and the runs go (default out/gpu_check, emptied
# first); BATCH_SIZE: sequences per step in stage 1 (default 8); BENCH_LAYERS: stage 1's blocks (default 6; 24 is
# the whole 0.7B, about 2 minutes more). Nothing reads the network: the Hub and datasets are offline, and HTTP(S)
# goes to a closed local port, so a stray download fails at once instead of waiting on a node with no route out.
# GPT-2's BPE files come from TIKTOKEN_CACHE_DIR. Exit status: 0 if every stage that ran passed (or was skipped),
# 1 if one failed, 2 for unknown STAGES.
set -uo pipefail  # not -e: a failed stage is recorded and the next one runs
cd "$(dirname "$0")/.."

requested=${STAGES:-1,2,3,4,5,6,7}
stages=()
IFS=', ' read -ra items <<<"$requested"
for item in "${items[@]}"; do
    if [[ ! $item =~ ^[1-7]$ ]]; then
        echo "gpu_check: STAGES=$requested: no stage '$item' (the stages are 1 to 7, comma-separated)" >&2
        exit 2
    fi
    stages+=("$item")
done
if ((${#stages[@]} == 0)); then
    echo "gpu_check: STAGES is empty (the stages are 1 to 7, comma-separated)" >&2
    exit 2
fi
mapfile -t stages < <(printf '%s\n' "${stages[@]}" | sort -un)

source scripts/launch_common.sh  # count_gpus
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 \
    HTTPS_PROXY=http://127.0.0.1:9 no_proxy= NO_PROXY=
OUT=${OUT:-out/gpu_check}
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "${DRY_RUN:-0}" != 0 ] || [ "$(count_gpus)" -eq 0 ]; then
    dry_run=1
    # toy sizes with GPT-2's vocabulary (the downstream tasks and samples are GPT-2 tokens)
    toy=(--n_layer=2 --n_embd=64 --n_head=2 --head_dim=32 --block_size=64 --vocab_size=50304)
    system=(--device=cpu --dtype=float32 --backend=gloo)
    bench_model=(config/sa_0p7b.py "${toy[@]}")
    bench_batch=${BATCH_SIZE:-2}
    bench_timing=(--bench_rounds=2 --bench_steps=1 --bench_warmup=1)
    bench_compiles=(False)  # a compile on the CPU costs more than the whole dry run
    compile=False
    train_model=(config/xsa_0p7b.py "${toy[@]}")
    muon_model=("${train_model[@]}")
    batch=2
    val_tokens=1024
    mask_model=(config/sa_0p7b.py "${toy[@]}")
    mask_lengths=(32 64)
    mask_tokens=128
    flex_check=(64 32)  # the float32 check's length and head widths: on the CPU both sides are the dense mask
    downstream_limit=1
else
    dry_run=0
    system=(--device=cuda --dtype=bfloat16 --backend=nccl)
    bench_model=(config/sa_0p7b.py --n_layer="${BENCH_LAYERS:-6}")
    bench_batch=${BATCH_SIZE:-8}
    bench_timing=(--bench_rounds=3 --bench_steps=2 --bench_warmup=2)
    bench_compiles=(False True)
    compile=True
    train_model=(config/xsa_0p7b.py --n_layer=9)
    muon_model=(config/xsa_0p7b.py --n_layer=2)
    batch=2
    val_tokens=16384
    mask_model=(config/sa_0p7b.py --n_layer=2)  # the ratio is attention's: two blocks show it
    mask_lengths=(2048 8192)
    mask_tokens=16384
    flex_check=(1024 32 128 256)  # the paper's sizes have heads of 128 (1.4B, 2.7B) and 256 (0.7B)
    downstream_limit=2
fi

# The Python half (the verdicts, the report, the document-mask gradients run under torchrun), run from the repo
checks="$OUT/checks.py"
cat >"$checks" <<'EOF'
"""gpu_check.sh's Python half: python checks.py COMMAND ARGS (the repo on PYTHONPATH)."""
import json
import math
import os
import re
import sys

STAGES = {  # name, estimated seconds on one H100 with cold compile caches (estimates, not measurements)
    1: ("bench: SA and XSA at the 0.7B's shape, compile off and on", 75),
    2: ("SDPA backend and XSA's orthogonality in bf16", 5),
    3: ("DDP under torchrun: compiled, 2 micro-steps, activation checkpointing, resume", 80),
    4: ("FSDP under torchrun: the same, and peak memory against memory_plan", 60),
    5: ("Muon under DDP and under FSDP", 25),
    6: ("document mask: FlexAttention against the dense mask, and its step time", 65),
    7: ("in-loop evaluation (similarity, samples, downstream) compiled under FSDP", 45),
}
# stage 2 on its own (without stage 1's bench to read) runs a small bench of its own
STAGE_2_ALONE_S = 20
# dynamo's line when a function has been recompiled up to its limit (recompile_limit, cache_size_limit in older
# torch): from there on that frame runs eagerly, a recompile storm
LIMIT_LINE = re.compile(r"torch\._dynamo hit config\.\w+")
RECOMPILE_LINE = re.compile(r"Recompiling function")
# A resumed run's losses against the uninterrupted run's, relative. Both runs compute each step's loss in fp32
# from bf16 activations over the same 8,192 tokens; only run-to-run nondeterminism separates them (atomic adds
# in the embedding's and attention's backward reorder fp32 sums), which moves a loss by ~1e-6 relative after a
# couple of steps. 1e-3 allows 100 times that and is a quarter of bf16's unit roundoff (2^-8 = 3.9e-3): a resume
# that loses state (the optimizer's moments, a step of the schedule, weights restored at bf16 precision) moves
# the next losses by more.
RESUME_REL_TOL = 1e-3
# Muon under DDP and under FSDP, in float32 so that the comparison is Muon's two paths (replicated matrices;
# DTensor shards, the Newton-Schulz split over the processes), not the bf16 policies' different roundings (FSDP
# gathers LayerNorm's weights and the embedding in bf16, autocast does not; tests/test_fsdp.py bounds that at
# 1e-2). Newton-Schulz itself runs in bf16 on both paths: 1e-3 (relative) is what the CPU test allows it.
MUON_REL_TOL = 1e-3
# FlexAttention in bf16 against the dense mask: each side's error against an fp32 eager reference with the dense
# mask. Rounding alone makes the dense bf16 kernel's error; FlexAttention orders its sums differently (and the
# compiled graph fuses differently) but may be no worse than twice that, plus a floor of a few unit roundoffs
# (2^-9 = 2e-3) for a lucky small dense error. A wrong mask moves attention's gradients by tens of percent.
FLEX_GRAD_FLOOR, FLEX_LOSS_FLOOR = 1e-2, 1e-3
# the float32 check (no torchrun): FlexAttention against the dense mask, both float32 without TF32
FLEX_FP32_LOSS_TOL, FLEX_FP32_GRAD_TOL = 1e-5, 1e-4
# XSA's |z.v|/(|v||y|): z rounded to the dtype moves z.v/|v| by at most the unit roundoff times |z| <= |y|
# (2^-9 in bf16); twice that in bf16. In float32 the fp32 dot products' rounding, far below 1e-5.
ORTHOGONALITY_BOUND = {"bfloat16": 2 ** -8, "float32": 1e-5}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def records(path):
    """metrics.jsonl's records, a torn last line skipped: pretrain.metrics.read_metrics, without the 3-4 s of
    importing torch that its module costs each verdict."""
    out = []
    for line in read_text(path).splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def exit_statuses(d):
    """{name: exit status} of the processes a stage ran (gpu_check.sh's run_logged)."""
    return {name: int(status) for name, status in (line.split() for line in read_text(f"{d}/exits").splitlines())}


def why(log):
    """The line of a log that says why a process failed: train.py's own one-line error, else the last line."""
    lines = [line.strip() for line in read_text(log).splitlines() if line.strip()]
    said = [line for line in lines if re.search(r"(config )?error: ", line) and "Traceback" not in line]
    return (said or lines or ["(empty log)"])[-1][:300]


def ran(d, name, problems):
    """Whether process `name` of stage dir d exited 0; else a problem naming its exit and its log's reason."""
    status = exit_statuses(d).get(name)
    if status == 0:
        return True
    problems.append(f"{name} " + ("did not run" if status is None else f"exited {status}: {why(f'{d}/{name}.log')}"))
    return False


def rel(a, b):
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def recompiles(d, names, problems):
    """Recompile and limit lines in the logs of processes `names` (TORCH_LOGS=recompiles); a limit line fails."""
    counts = {"recompiles": 0, "recompile_limit_lines": 0}
    for name in names:
        text = read_text(f"{d}/{name}.log")
        counts["recompiles"] += len(RECOMPILE_LINE.findall(text))
        hits = LIMIT_LINE.findall(text)
        counts["recompile_limit_lines"] += len(hits)
        if hits:
            problems.append(f"{name}: {hits[0]} (a recompile storm; {name}.log has the function and the reason)")
    return counts


def described(d, name, parallelism, problems, micro_steps=2):
    """What train.py's log says the run was: processes, micro-steps, parallelism, checkpointing, compile."""
    text = read_text(f"{d}/{name}.log")
    figures = {}
    if m := re.search(r"= (\d+) processes x (\d+) micro-steps", text):
        figures["processes"], figures["micro_steps"] = int(m.group(1)), int(m.group(2))
        if figures["micro_steps"] < micro_steps:
            problems.append(f"{name} ran {figures['micro_steps']} micro-steps per step, not {micro_steps} or more")
    if m := re.search(r"parallelism (\w+); activation checkpointing (\w+)", text):
        figures["parallelism"], figures["activation_checkpointing"] = m.group(1), m.group(2)
        if m.group(1) != parallelism:
            problems.append(f"{name} ran parallelism {m.group(1)}, not {parallelism}")
    if m := re.search(r"torch\.compile: (\d+) graphs, (\d+) graph breaks", text):
        figures["graphs"], figures["graph_breaks"] = int(m.group(1)), int(m.group(2))
    return figures


# -----------------------------------------------------------------------------
# the stages' verdicts: each returns (problems, figures)

def bench_figures(report):
    keep = ("ms_per_step", "tokens_per_sec", "mfu", "peak_mem_gb", "throughput_ratio", "memory_ratio", "graphs",
            "graph_breaks", "params_M", "spread_pct", "document_over_causal")
    return {name: {k: r[k] for k in keep if k in r} for name, r in report["results"].items()}


def judge_1(d, *compiles):
    problems, figures = [], {}
    for compile in ("False", "True"):
        key = f"compile_{'on' if compile == 'True' else 'off'}"
        if compile not in compiles:
            figures[key] = None  # the dry run: a compile on the CPU costs more than the whole dry run
            continue
        if not ran(d, f"bench_compile_{compile}", problems):
            continue
        report = read_json(f"{d}/bench_compile_{compile}.json")
        figures[key] = bench_figures(report)
        c = report["config"]
        figures["shape"] = {k: c[k] for k in ("n_layer", "n_embd", "n_head", "head_dim", "block_size", "batch_size")}
        figures["device"], figures["dtype"] = report["device"], report["dtype"]
        if compile == "True":
            for name, r in figures[key].items():
                if r["graph_breaks"] or r["graphs"] < 1:
                    problems.append(f"{name} compiled to {r['graphs']} graphs with {r['graph_breaks']} graph breaks "
                                    f"(one graph, no break expected)")
    return problems, figures


def judge_2(d, bench_json):
    problems = []
    if not os.path.exists(bench_json):
        ran(d, "bench", problems)
        return problems or ["no bench report"], {}
    report = read_json(bench_json)
    device_type = "cuda" if report["config"]["device"].startswith("cuda") else report["config"]["device"]
    ortho, dtype = report["xsa_orthogonality"], report["dtype"]
    bound = ORTHOGONALITY_BOUND.get(dtype, ORTHOGONALITY_BOUND["bfloat16"])
    figures = {"sdpa_backend": report["sdpa_backend"], "dtype": dtype, "device": report["device"],
               "xsa_orthogonality_mean": ortho["mean"], "xsa_orthogonality_max": ortho["max"],
               "xsa_orthogonality_bound": bound, "from": os.path.relpath(bench_json, os.path.dirname(d))}
    if report["sdpa_backend"] == "unknown":
        problems.append("no SDPA kernel seen in the profile")
    elif device_type == "cuda" and report["sdpa_backend"].startswith("math"):
        problems.append("attention runs on SDPA's unfused math fallback (T x T scores in memory)")
    if not ortho["max"] <= bound:
        problems.append(f"XSA's output is not orthogonal to v: max |z.v|/(|v||y|) {ortho['max']:.2e} > {bound:.1e}")
    return problems, figures


def judge_resume(d, parallelism):
    """Stages 3 and 4: the uninterrupted run, the resume from its step-2 checkpoint, their logs."""
    problems, figures = [], {}
    runs = [name for name in ("full", "resumed") if ran(d, name, problems)]
    figures.update(recompiles(d, ("full", "resumed"), problems))
    if "full" in runs:
        figures.update(described(d, "full", parallelism, problems))
    full = {r["step"]: r for r in records(f"{d}/full/metrics.jsonl")}
    resumed = {r["step"]: r for r in records(f"{d}/resumed/metrics.jsonl")}
    figures["losses"] = {step: r["train_loss"] for step, r in full.items()}
    figures["resumed_losses"] = {step: r["train_loss"] for step, r in resumed.items()}
    figures["resume_rel_tol"] = RESUME_REL_TOL
    if full:
        last = full[max(full)]
        figures["tokens_per_sec"], figures["mfu"] = last.get("tokens_per_sec"), last.get("mfu")
        figures["peak_mem_gb"] = max(r["peak_mem_gb"] for r in full.values())
    if runs == ["full", "resumed"]:
        after = sorted(step for step in full if step > 2)
        if sorted(resumed) != after or not after:
            problems.append(f"the resumed run logged steps {sorted(resumed)}, not {after}")
        else:
            diffs = [rel(resumed[step]["train_loss"], full[step]["train_loss"]) for step in after]
            figures["resume_max_rel_diff"] = max(diffs)
            if max(diffs) > RESUME_REL_TOL:
                problems.append(f"the resumed losses differ from the uninterrupted run's by up to {max(diffs):.1e} "
                                f"(relative; tolerance {RESUME_REL_TOL:.0e})")
    return problems, figures


def judge_3(d):
    return judge_resume(d, "ddp")


def judge_4(d):
    problems, figures = judge_resume(d, "fsdp")
    if ran(d, "memory_plan", problems):
        lines = [line for line in read_text(f"{d}/memory_plan.log").splitlines() if line.startswith("{")]
        plan = json.loads(lines[-1])
        figures["planned_peak_gb"] = plan["bytes"]["total"] / 1e9
        figures["plan_items_gb"] = {k: v / 1e9 for k, v in plan["bytes"].items() if k != "total"}
        figures["plan_device"] = plan["device"]
        if figures.get("peak_mem_gb") is not None:
            # reported, not judged: the plan counts eager PyTorch (an upper bound under compile) and its
            # parallelism at one process; on the CPU train.py's peak is the resident set, libraries and all
            figures["measured_over_planned"] = figures["peak_mem_gb"] / figures["planned_peak_gb"]
    return problems, figures


def judge_5(d):
    problems, figures = [], {"rel_tol": MUON_REL_TOL}
    losses = {}
    for parallelism in ("ddp", "fsdp"):
        if ran(d, parallelism, problems):
            figures[parallelism] = described(d, parallelism, parallelism, problems, micro_steps=1)
            losses[parallelism] = {r["step"]: r["train_loss"] for r in records(f"{d}/{parallelism}/metrics.jsonl")}
            figures[f"{parallelism}_losses"] = losses[parallelism]
    if len(losses) == 2:
        if sorted(losses["ddp"]) != sorted(losses["fsdp"]) or len(losses["ddp"]) != 3:
            problems.append(f"steps logged: ddp {sorted(losses['ddp'])}, fsdp {sorted(losses['fsdp'])}; 3 each expected")
        else:
            diff = max(rel(losses["fsdp"][s], losses["ddp"][s]) for s in losses["ddp"])
            figures["max_rel_diff"] = diff
            if diff > MUON_REL_TOL:
                problems.append(f"Muon's losses under FSDP differ from DDP's by up to {diff:.1e} (relative; "
                                f"tolerance {MUON_REL_TOL:.0e})")
    return problems, figures


def judge_6(d, *lengths):
    problems, figures = [], {}
    if ran(d, "grads", problems):
        g = read_json(f"{d}/grads.json")
        figures["torchrun"] = g
        figures.update(recompiles(d, ("grads",), problems))
        bf16 = g["bf16"]
        loss_bound = max(2 * bf16["loss_rel_dense"], FLEX_LOSS_FLOOR)
        grad_bound = max(2 * bf16["worst_grad_rel_dense"], FLEX_GRAD_FLOOR)
        bf16["loss_bound"], bf16["grad_bound"] = loss_bound, grad_bound
        if not bf16["loss_rel_flex"] <= loss_bound:
            problems.append(f"document mask, {g['dtype']}: the compiled model's loss is {bf16['loss_rel_flex']:.1e} "
                            f"from the fp32 reference (the dense mask's {bf16['loss_rel_dense']:.1e}; bound "
                            f"{loss_bound:.1e})")
        if not bf16["worst_grad_rel_flex"] <= grad_bound:
            problems.append(f"document mask, {g['dtype']}: {bf16['worst_param_flex']}'s gradient is "
                            f"{bf16['worst_grad_rel_flex']:.1e} from the fp32 reference (the dense mask's worst "
                            f"{bf16['worst_grad_rel_dense']:.1e}; bound {grad_bound:.1e})")
        fp32 = g["float32"]
        if not (fp32["loss_rel"] <= FLEX_FP32_LOSS_TOL and fp32["worst_grad_rel"] <= FLEX_FP32_GRAD_TOL):
            problems.append(f"document mask in float32: FlexAttention against the dense mask, loss rel "
                            f"{fp32['loss_rel']:.1e} (tolerance {FLEX_FP32_LOSS_TOL:.0e}), worst gradient rel "
                            f"{fp32['worst_grad_rel']:.1e} ({FLEX_FP32_GRAD_TOL:.0e})")
    figures["timing"] = {}
    for length in lengths:
        if ran(d, f"document_{length}", problems):
            results = read_json(f"{d}/document_{length}.json")["results"]
            figures["timing"][length] = {
                name: {"document_ms": r["ms_per_step"], "causal_ms": results[f"{name}:attn_mask=causal"]["ms_per_step"],
                       "document_tokens_per_sec": r["tokens_per_sec"],
                       "causal_tokens_per_sec": results[f"{name}:attn_mask=causal"]["tokens_per_sec"],
                       "document_over_causal": r["document_over_causal"]}
                for name, r in results.items() if "document_over_causal" in r}
    return problems, figures


def judge_7(d, steps):
    problems, figures = [], {}
    steps = int(steps)
    if not ran(d, "inloop", problems):
        return problems, figures
    figures.update(recompiles(d, ("inloop",), problems))
    figures.update(described(d, "inloop", "fsdp", problems, micro_steps=1))
    text = read_text(f"{d}/inloop.log")
    by_step = {r["step"]: r for r in records(f"{d}/inloop/metrics.jsonl")}
    for name in ("similarity", "downstream"):
        seconds = {int(s): float(t) for s, t in re.findall(rf"^step (\d+) {name} \|.* \| ([\d.]+)s$", text, re.M)}
        figures[f"{name}_s"] = seconds
        if sorted(seconds) != list(range(1, steps + 1)):
            problems.append(f"the {name} pass ran at steps {sorted(seconds)}, not at each of 1-{steps}")
    samples = sorted(int(s) for s in re.findall(r"^step (\d+) sample: ", text, re.M))
    figures["samples_at"] = samples
    figures["sample_s"] = None  # train.py logs no seconds for a sample
    if samples != list(range(1, steps + 1)):
        problems.append(f"samples were printed at steps {samples}, not at each of 1-{steps}")
    figures["downstream_avg"] = {s: r.get("downstream/avg") for s, r in by_step.items()}
    figures["similarity_mean_cos_yv"] = {s: r.get("similarity/mean_cos_yv") for s, r in by_step.items()}
    missing = [s for s in range(1, steps + 1) if s not in by_step or "downstream/avg" not in by_step[s]
               or "similarity/mean_cos_yv" not in by_step[s]]
    if missing:
        problems.append(f"metrics.jsonl lacks downstream/avg or similarity/mean_cos_yv at steps {missing}")
    return problems, figures


def judge(n, d, *args):
    n = int(n)
    problems, figures = globals()[f"judge_{n}"](d, *args)
    write_stage(n, d, "fail" if problems else "pass", "; ".join(problems) or "every check passed", figures)


def write_stage(n, d, status, reason, figures):
    with open(f"{os.path.dirname(d)}/stage{n}.json", "w") as f:
        json.dump({"stage": n, "name": STAGES[n][0], "status": status, "reason": reason, "figures": figures}, f,
                  indent=2)
    print(f"stage {n}: {status}" + ("" if status == "pass" else f": {reason}"))


def skip(n, d, reason):
    write_stage(int(n), d, "skipped", reason, {})


# -----------------------------------------------------------------------------
# what the stages run

def plan(*stages):
    """The estimate per stage, printed before the run."""
    stages = [int(s) for s in stages]
    print("estimated seconds on one H100, compiles included (estimates, not measurements):")
    total = 0
    for n in stages:
        seconds = STAGES[n][1] if n != 2 or 1 in stages else STAGE_2_ALONE_S
        total += seconds
        print(f"  stage {n}: {seconds:>4} s  {STAGES[n][0]}")
    print(f"  total:   {total:>4} s")


def tokenizer():
    """Why GPT-2's BPE files cannot be loaded from tiktoken's cache (TIKTOKEN_CACHE_DIR), or nothing: tiktoken
    itself looks them up, with its download replaced by an error, so that this check never reads the network."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as e:
        print(f"no tokenizer files: tiktoken is not installed ({e})")
        return

    def no_download(blobpath):
        raise OSError(f"{os.path.basename(blobpath)} is not in tiktoken's cache")
    tiktoken.load.read_file = no_download
    try:
        tiktoken.get_encoding("gpt2")
    except Exception as e:
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or "tiktoken's default cache (TIKTOKEN_CACHE_DIR unset)"
        print(f"no tokenizer files: GPT-2's encoding is not in {cache} ({str(e).splitlines()[0]})")


def shards(out):
    """Random tokens in llm.c shards: enough to train, resume and evaluate."""
    import numpy as np
    from pretrain.shards import write_shard
    os.makedirs(out)
    rng = np.random.default_rng(0)
    write_shard(f"{out}/fineweb_val_000000.bin", rng.integers(0, 512, 200_000))
    write_shard(f"{out}/fineweb_train_000001.bin", rng.integers(0, 512, 2_000_000))


def document_grads(out, *argv):
    """Under torchrun: the model train.py builds (build_model: compiled, DDP) with the document mask, its loss
    and gradients on documents of FineWeb-like lengths in the run's dtype through FlexAttention, against the
    dense mask in that dtype and an fp32 eager reference with the dense mask (the same weights); then today's
    float32 check, FlexAttention against the dense mask at the paper's head widths (FLEX_CHECK)."""
    import torch
    import model as M
    from pretrain import train_config
    from pretrain.runtime import autocast, resolve_dtype, setup_runtime, teardown_runtime
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the reference: fp32 proper
    from scripts.bench import with_documents
    from train import build_model
    c = train_config.resolve(list(argv))[0]
    runtime = setup_runtime(c.device, c.backend)
    dtype = resolve_dtype(c.dtype, runtime.device_type)
    raw, _, train_model, _ = build_model(c, runtime, dtype)
    g = torch.Generator().manual_seed(0)
    vocab = min(50257, c.vocab_size)
    x = with_documents(torch.randint(0, vocab, (c.batch_size, c.block_size), generator=g), max(2, c.block_size // 5),
                       c.eot_token).to(runtime.device)
    y = torch.randint(0, vocab, (c.batch_size, c.block_size), generator=g).to(runtime.device)

    def loss_and_grads(model, dtype, flex_devices):
        with M.flex_attention_devices(*flex_devices):
            raw.zero_grad(set_to_none=True)
            with autocast(runtime.device_type, dtype):
                loss = model(x, y)[1]
            loss.backward()
        return loss.item(), {n: p.grad.detach().float().clone() for n, p in raw.named_parameters()}

    def errors(result, reference):
        (loss, grads), (ref_loss, ref_grads) = result, reference
        worst = max(((torch.linalg.vector_norm(grads[n] - ref_grads[n]) /
                      torch.linalg.vector_norm(ref_grads[n]).clamp_min(1e-30)).item(), n) for n in ref_grads)
        return rel(loss, ref_loss), worst

    flex = loss_and_grads(train_model, dtype, ("cuda",))  # compiled, through DDP, FlexAttention on CUDA
    dense = loss_and_grads(raw, dtype, ())  # eager, the dense boolean mask
    reference = loss_and_grads(raw, "float32", ())
    (loss_flex, (grad_flex, param_flex)), (loss_dense, (grad_dense, param_dense)) = \
        errors(flex, reference), errors(dense, reference)
    report = {"device": runtime.device, "dtype": dtype, "compile": c.compile, "world_size": runtime.world_size,
              "flex_used": runtime.device_type == "cuda", "documents": int((x == c.eot_token).sum()),
              "tokens": x.numel(), "n_layer": c.n_layer,
              "bf16": {"loss_flex": flex[0], "loss_dense": dense[0], "loss_reference_fp32": reference[0],
                       "loss_rel_flex": loss_flex, "loss_rel_dense": loss_dense,
                       "worst_grad_rel_flex": grad_flex, "worst_param_flex": param_flex,
                       "worst_grad_rel_dense": grad_dense, "worst_param_dense": param_dense}}
    report["float32"] = flex_float32(runtime.device, *(int(a) for a in os.environ["FLEX_CHECK"].split()))
    if runtime.is_main:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    teardown_runtime(runtime)


def flex_float32(device, length, *head_dims):
    """FlexAttention's document mask against SDPA with the same mask as a dense boolean matrix, float32 without
    TF32 on both sides: (loss rel, worst gradient rel) over the head widths (on the CPU both sides are dense)."""
    import torch
    import model as M
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
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
        loss_rel = max(loss_rel, rel(flex_loss, dense_loss))
        worst = max(worst, *(((flex[n] - dense[n]).norm() / dense[n].norm()).item() for n in dense))
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {"flex_used": str(device).startswith("cuda"), "length": length, "head_dims": list(head_dims),
            "loss_rel": loss_rel, "worst_grad_rel": worst}


# -----------------------------------------------------------------------------
# the report: gpu_check.json and table.md

def report(out, dry_run, tokenizer_problem, *stages):
    import torch
    stages = [int(s) for s in stages]
    results = {}
    for n in stages:
        path = f"{out}/stage{n}.json"
        if os.path.exists(path):
            results[n] = read_json(path)
        else:  # its verdict itself failed: the traceback is in the stage's judge.log
            results[n] = {"stage": n, "name": STAGES[n][0], "status": "fail", "figures": {},
                          "reason": f"no verdict: {why(f'{out}/stage{n}/judge.log')}"}
        results[n]["seconds"] = float(read_text(f"{out}/stage{n}/seconds") or "nan")
        results[n]["estimate_s"] = STAGES[n][1] if n != 2 or 1 in stages else STAGE_2_ALONE_S
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not int(dry_run) else "cpu"
    passed = all(r["status"] != "fail" for r in results.values())
    summary = {"device": device, "torch": torch.__version__, "dry_run": bool(int(dry_run)), "stages_run": stages,
               "tokenizer": {"available": not tokenizer_problem, "problem": tokenizer_problem or None},
               "passed": passed, "stages": {str(n): r for n, r in results.items()}}
    with open(f"{out}/gpu_check.json", "w") as f:
        json.dump(summary, f, indent=2)
    table = "\n".join(table_lines(summary, results)) + "\n"
    with open(f"{out}/table.md", "w") as f:
        f.write(table)
    print(table)
    print(f"gpu_check: {'every stage that ran passed' if passed else 'a stage failed'}; the report is in "
          f"{out}/gpu_check.json and {out}/table.md")
    sys.exit(0 if passed else 1)


def fmt(value, spec=".3f", unit=""):
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def table_lines(summary, results):
    lines = [f"{summary['device']}, torch {summary['torch']}" + (" (dry run: toy sizes on the CPU)"
                                                                   if summary["dry_run"] else ""), "",
             "| stage | check | verdict | seconds (estimate) |", "|---|---|---|---|"]
    for n, r in results.items():
        verdict = r["status"] if r["status"] == "pass" else f"{r['status']}: {r['reason']}"
        lines.append(f"| {n} | {r['name']} | {verdict.replace('|', '/')} | {r['seconds']:.0f} ({r['estimate_s']}) |")
    for n, r in results.items():
        if r["status"] != "skipped" and r["figures"]:
            lines += ["", *globals()[f"table_{n}"](r["figures"])]
    return lines


def table_1(f):
    shape = f.get("shape")
    if not shape:
        return []
    lines = [f"Stage 1: {f['device']}, {f['dtype']}; {shape['n_layer']} x {shape['n_embd']} ({shape['n_head']} heads "
             f"of {shape['head_dim']}), {shape['batch_size']} x {shape['block_size']} tokens per step:", "",
             "| variant | compile | ms/step | tokens/s | MFU | peak mem | tokens/s vs SA | memory vs SA | graphs / breaks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in ("compile_off", "compile_on"):
        for name, r in (f.get(key) or {}).items():
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            graphs = f"{r['graphs']} / {r['graph_breaks']}" if key == "compile_on" else "-"
            lines.append(f"| {name} | {key.removeprefix('compile_')} | {r['ms_per_step']:.2f} | "
                         f"{r['tokens_per_sec']:,.0f} | {mfu} | {fmt(r['peak_mem_gb'], '.1f', ' GB')} | "
                         f"{r['throughput_ratio']:.3f} | {fmt(r['memory_ratio'])} | {graphs} |")
    if f.get("compile_on") is None:
        lines.append("\n(compile on: not run in a dry run)")
    return lines


def table_2(f):
    return [f"- Stage 2: SDPA backend: {f['sdpa_backend']}",
            f"- XSA orthogonality in {f['dtype']}: mean {f['xsa_orthogonality_mean']:.2e}, max "
            f"{f['xsa_orthogonality_max']:.2e} (bound {f['xsa_orthogonality_bound']:.1e})"]


def table_resume(n, f, what):
    lines = [f"Stage {n}: {what}, {f.get('processes', '?')} process(es) x {f.get('micro_steps', '?')} micro-steps, "
             f"activation checkpointing {f.get('activation_checkpointing', '?')}; torch.compile "
             f"{f.get('graphs', '-')} graphs, {f.get('graph_breaks', '-')} breaks; {f['recompiles']} recompiles, "
             f"{f['recompile_limit_lines']} recompile-limit lines:", "",
             "| step | loss | resumed from step 2 | relative difference |", "|---|---|---|---|"]
    for step, loss in f["losses"].items():
        again = f["resumed_losses"].get(step)
        lines.append(f"| {step} | {loss:.4f} | {fmt(again, '.4f')} | "
                     f"{'-' if again is None else f'{rel(again, loss):.1e}'} |")
    lines.append(f"\n- tokens/s {fmt(f.get('tokens_per_sec'), ',.0f')}, peak mem {fmt(f.get('peak_mem_gb'), '.2f', ' GB')}"
                 f"; resume tolerance {f['resume_rel_tol']:.0e} (relative)")
    return lines


def table_3(f):
    return table_resume(3, f, "DDP")


def table_4(f):
    lines = table_resume(4, f, "FSDP")
    if "planned_peak_gb" in f:
        lines.append(f"- peak memory {fmt(f.get('peak_mem_gb'), '.2f', ' GB')} measured, "
                     f"{f['planned_peak_gb']:.2f} GB planned by scripts/memory_plan.py ({f['plan_device']}): "
                     f"measured / planned {fmt(f.get('measured_over_planned'))}")
    return lines


def table_5(f):
    lines = ["Stage 5: Muon, 3 steps:", "", "| step | DDP loss | FSDP loss |", "|---|---|---|"]
    for step, loss in f.get("ddp_losses", {}).items():
        lines.append(f"| {step} | {loss:.5f} | {fmt(f.get('fsdp_losses', {}).get(step), '.5f')} |")
    lines.append(f"\n- largest relative difference {fmt(f.get('max_rel_diff'), '.1e')} (tolerance {f['rel_tol']:.0e})")
    return lines


def table_6(f):
    lines = []
    if "torchrun" in f:
        g, b = f["torchrun"], f["torchrun"]["bf16"]
        lines += [f"- Stage 6: document mask, compiled {g['compile']}, {g['dtype']}, torchrun ({g['world_size']} "
                  f"process), {g['documents']} documents in {g['tokens']:,} tokens, "
                  f"{'FlexAttention' if g['flex_used'] else 'dense mask (no FlexAttention off CUDA)'}: against the fp32 "
                  f"reference, loss rel {b['loss_rel_flex']:.1e} (dense mask {b['loss_rel_dense']:.1e}), worst "
                  f"gradient rel {b['worst_grad_rel_flex']:.1e} (dense mask {b['worst_grad_rel_dense']:.1e}; bound "
                  f"{b['grad_bound']:.1e})",
                  f"- float32, FlexAttention vs dense on {g['device']}: loss rel {g['float32']['loss_rel']:.1e}, worst "
                  f"gradient rel {g['float32']['worst_grad_rel']:.1e}"
                  + ("" if g["float32"]["flex_used"] else " (no FlexAttention off CUDA)")]
    if f.get("timing"):
        lines += ["", "| variant | T | mask | ms/step | tokens/s | document / causal |", "|---|---|---|---|---|---|"]
        for length, variants in f["timing"].items():
            for name, t in variants.items():
                lines.append(f"| {name} | {length} | document | {t['document_ms']:.2f} | "
                             f"{t['document_tokens_per_sec']:,.0f} | {t['document_over_causal']:.3f} |")
                lines.append(f"| {name} | {length} | causal | {t['causal_ms']:.2f} | {t['causal_tokens_per_sec']:,.0f} | - |")
    return lines


def table_7(f):
    if "similarity_s" not in f:
        return []
    steps = sorted({int(s) for s in f["similarity_s"]} | {int(s) for s in f["downstream_s"]})  # JSON's keys: strings
    lines = [f"Stage 7: in-loop evaluation under {f.get('parallelism', '?')}, {f['recompiles']} recompiles, "
             f"{f['recompile_limit_lines']} recompile-limit lines:", "",
             "| step | similarity s | downstream s | downstream avg | sample |", "|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s} | {fmt(f['similarity_s'].get(str(s)), '.2f')} | "
                     f"{fmt(f['downstream_s'].get(str(s)), '.2f')} | {fmt(f['downstream_avg'].get(str(s)), '.4f')} | "
                     f"{'yes' if s in f['samples_at'] else 'no'} (seconds not logged) |")
    return lines


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
EOF
checks() {
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python "$checks" "$@"
}

# run_logged NAME COMMAND...: COMMAND's output in $dir/NAME.log, its exit status noted in $dir/exits
run_logged() {
    local name=$1 status
    shift
    "$@" >"$dir/$name.log" 2>&1
    status=$?
    echo "$name $status" >>"$dir/exits"
    echo "  $name: exit $status ($dir/$name.log)"
}

# train.py under torchrun, one process (two NCCL ranks cannot share a GPU), dynamo's recompiles in its log
torchrun_train() {
    TORCH_LOGS=recompiles python -m torch.distributed.run --standalone --nproc_per_node=1 train.py "$@"
}

# what every training stage passes: the shards, no wandb, no in-loop pass it does not test (the paper recipe
# would evaluate downstream, which needs the Hub or local tasks), a record per step, 2 micro-steps per step, and
# a learning rate at full strength from step 2 on, so that a few steps move the losses well past the tolerances
block_size=$(PYTHONPATH=$PWD python -c "
import sys; from pretrain.train_config import resolve; print(resolve(sys.argv[1:])[0].block_size)" "${train_model[@]}")
train_common=(--data_dir="$OUT/shards" --wandb_log=False --downstream_interval=0 --similarity_interval=0
              --sample_interval=0 --log_interval=1 --val_tokens="$val_tokens" --warmup_iters=1 --learning_rate=1e-3
              --batch_size="$batch" --total_batch_size=$((2 * batch * block_size)) --overwrite=True)

# 1: scripts/bench.py, compile off then on
stage1() {
    for c in "${bench_compiles[@]}"; do
        run_logged "bench_compile_$c" python -m scripts.bench "${bench_model[@]}" "${system[@]:0:2}" \
            --batch_size="$bench_batch" --compile="$c" "${bench_timing[@]}" --bench_variants=sa,xsa \
            --bench_json="$dir/bench_compile_$c.json"
    done
    checks judge 1 "$dir" "${bench_compiles[@]}"
}

# 2: read off stage 1's bench; alone, a bench of one block, untimed
stage2() {
    local bench_json
    for bench_json in "$OUT/stage1/bench_compile_True.json" "$OUT/stage1/bench_compile_False.json" ""; do
        [[ -f $bench_json ]] && break
    done
    if [[ -z $bench_json ]]; then
        bench_json="$dir/bench.json"
        run_logged bench python -m scripts.bench "${bench_model[@]}" "${system[@]:0:2}" --n_layer=1 --batch_size=1 \
            --compile=False --bench_rounds=1 --bench_steps=1 --bench_warmup=0 --bench_variants=xsa \
            --bench_json="$bench_json"
    fi
    checks judge 2 "$dir" "$bench_json"
}

# 3 and 4: a compiled run of 4 steps with a checkpoint at step 2, and its resume from that checkpoint
resume_check() {
    local run=("${train_model[@]}" "${system[@]}" "${train_common[@]}" --parallelism="$1" --compile="$compile"
               --activation_checkpointing=block --max_iters=4 --eval_interval=4 --checkpoint_interval=2)
    run_logged full torchrun_train "${run[@]}" --out_dir="$dir/full"
    mkdir -p "$dir/resumed"
    # hard links: the resumed run only reads the step-2 checkpoint (a DDP .pt file, an FSDP folder)
    cp -al "$dir"/full/ckpt_0000002* "$dir/resumed/" 2>/dev/null || cp -r "$dir"/full/ckpt_0000002* "$dir/resumed/"
    run_logged resumed torchrun_train "${run[@]}" --out_dir="$dir/resumed" --init_from=resume
    if [[ $1 == fsdp ]]; then
        run_logged memory_plan python -m scripts.memory_plan "${run[@]}" --out_dir="$dir/full" --world_size=1 \
            --json_output=True
    fi
}
stage3() {
    resume_check ddp
    checks judge 3 "$dir"
}
stage4() {
    resume_check fsdp
    checks judge 4 "$dir"
}

# 5: Muon, 3 steps under each parallelism, float32 (see MUON_REL_TOL in checks.py), eager: the optimizer's paths
stage5() {
    local parallelism
    for parallelism in ddp fsdp; do
        run_logged "$parallelism" torchrun_train "${muon_model[@]}" "${system[@]}" "${train_common[@]}" \
            --dtype=float32 --optimizer=muon --parallelism="$parallelism" --compile=False --max_iters=3 \
            --eval_interval=3 --checkpoint_interval=0 --out_dir="$dir/$parallelism"
    done
    checks judge 5 "$dir"
}

# 6: the document mask's gradients under torchrun, then its step time against the causal mask's
stage6() {
    run_logged grads env FLEX_CHECK="${flex_check[*]}" TORCH_LOGS=recompiles PYTHONPATH="$PWD" \
        python -m torch.distributed.run --standalone --nproc_per_node=1 "$checks" document_grads "$dir/grads.json" \
        "${mask_model[@]}" "${system[@]}" --attn_type=xsa --attn_mask=document --compile="$compile" --batch_size=2
    local length
    for length in "${mask_lengths[@]}"; do
        run_logged "document_$length" python -m scripts.bench "${mask_model[@]}" "${system[@]:0:2}" \
            --block_size="$length" --batch_size=$((mask_tokens / length)) --compile=False "${bench_timing[@]}" \
            --bench_variants=xsa --attn_mask=document --bench_json="$dir/document_$length.json"
    done
    checks judge 6 "$dir" "${mask_lengths[@]}"
}

# 7: every in-loop pass at every step, compiled under FSDP, on the fixture tasks (tests/helpers.py writes them
# from tests/fixtures/lm_eval, as the tests do)
stage7() {
    if [[ -n $tokenizer_problem ]]; then
        checks skip 7 "$dir" "$tokenizer_problem"
        return
    fi
    run_logged tasks env PYTHONPATH="$PWD/tests:$PWD" python -c \
        "import sys; from helpers import write_fixture_tasks; write_fixture_tasks(sys.argv[1])" "$dir/tasks"
    run_logged inloop torchrun_train "${train_model[@]}" "${system[@]}" "${train_common[@]}" --parallelism=fsdp \
        --compile="$compile" --activation_checkpointing=block --max_iters=2 --eval_interval=2 \
        --checkpoint_interval=0 --similarity_interval=1 --sample_interval=1 --downstream_interval=1 \
        --downstream_limit="$downstream_limit" --downstream_include_path="$dir/tasks" --out_dir="$dir/inloop"
    checks judge 7 "$dir" 2
}

echo "gpu_check: stages ${stages[*]}$( ((dry_run)) && echo ', dry run: toy sizes on the CPU, compile off, gloo')"
checks plan "${stages[@]}"
tokenizer_problem=$(checks tokenizer)
[[ -n $tokenizer_problem ]] && echo "gpu_check: $tokenizer_problem (stage 7 needs them)"
if [[ " ${stages[*]} " =~ " "[3457]" " ]]; then
    checks shards "$OUT/shards"
fi
# run_stages N...: each stage in turn, in $OUT/stage<N>, its seconds noted
run_stages() {
    local n dir started
    for n in "$@"; do
        dir="$OUT/stage$n"
        mkdir -p "$dir"
        : >"$dir/exits"
        echo "== stage $n"
        started=$SECONDS
        "stage$n" 2>"$dir/judge.log"
        echo $((SECONDS - started)) >"$dir/seconds"
        rm -rf "$dir"/*/ckpt_* "$dir"/*/*.old  # checkpoints of the 0.7B width: gigabytes each
    done
}

# One GPU runs the stages one after another. A dry run on 2 or more CPU cores runs them in two lanes side by
# side, stages 1-4 and 5-7 (stage 2 reads stage 1's bench, so they share a lane; each process has one
# thread): its time is mostly Python starting, which the lanes overlap. Each lane's output follows its end.
lane_a=() lane_b=()
for n in "${stages[@]}"; do
    if ((n <= 4)); then lane_a+=("$n"); else lane_b+=("$n"); fi
done
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc alone counts OMP_NUM_THREADS, not cores
if ((dry_run)) && ((cores >= 2)) && ((${#lane_a[@]})) && ((${#lane_b[@]})); then
    echo "gpu_check: stages ${lane_a[*]} and ${lane_b[*]} in two lanes side by side (dry run, one per CPU core)"
    export OMP_NUM_THREADS=1
    run_stages "${lane_b[@]}" >"$OUT/lane_b.out" 2>&1 &
    lane_b_pid=$!
    run_stages "${lane_a[@]}"
    wait "$lane_b_pid"
    cat "$OUT/lane_b.out"
    rm -f "$OUT/lane_b.out"
else
    run_stages "${stages[@]}"
fi
checks report "$OUT" "$dry_run" "$tokenizer_problem" "${stages[@]}"
