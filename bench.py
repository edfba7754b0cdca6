"""
Benchmark the real training step (forward, backward, AdamW) of SA and XSA in one process.

    python bench.py config/sa_tiny.py
    python bench.py config/sa_0p7b.py --n_layer=4 --batch_size=8      # a quick check on one GPU
    python bench.py --n_layer=12 --n_embd=768 --n_head=12 --block_size=1024 --batch_size=4 --compile=False

    python bench.py config/sa_tiny.py --bench_variants=sa,xsa,xsa:xsa_gate=True

Every variant is built from the same config and seed (differing only in its attn_type and
overrides) and timed in alternating rounds (A, B, A, B, ...) so drifting clocks, thermals and
neighbours hit all alike. Timing starts after warm-up (and compilation) and excludes data loading:
tokens are random and already on the device. Reports per variant: ms/step, tokens/s, MFU (model
FLOPs per token x tokens/s / device peak), peak memory (CUDA: the variant's own model, optimizer
state and activations, measured during its warm-up), and the ratios to the first variant.
"""

import json
import statistics
import sys

import torch

from checkpoint import model_config
from configurator import TRAIN_PY, ConfigError, load_config, parse_config, read_defaults
from metrics import ThroughputMeter
from model import GPT
from optimizers import build_optimizer
from runtime import autocast, enable_tf32, peak_flops, pick_device, resolve_dtype

# bench-only settings, added to train.py's keys (every train.py key works here too)
bench_rounds = 10  # alternating timing rounds per variant
bench_steps = 3  # training steps per round
bench_warmup = 3  # untimed steps per variant before the first round (compilation happens here)
bench_variants = "sa,xsa"  # comma-separated variants, the first the baseline: an attn_type, then any overrides, e.g. "xsa:xsa_gate=True"
profile = False  # write a torch profiler trace per variant to bench_trace_<variant>.json
bench_json = ""  # also write the results to this JSON file
BENCH_KEYS = ("bench_rounds", "bench_steps", "bench_warmup", "bench_variants", "profile", "bench_json")


def parse_variants(spec, config):
    """{name: config} for each variant of "sa,xsa,xsa:xsa_gate=True": its attn_type, then --key=value
    overrides of train.py's keys, checked as the command line's are."""
    variants = {}
    for name in spec.split(","):
        attn_type, *overrides = name.split(":")
        variant, _ = parse_config(config, [f"--attn_type={attn_type}"] + [f"--{o}" for o in overrides])
        variants[name] = variant
    return variants


class PeakMemory:
    """Peak CUDA memory of what runs inside, above what was allocated when it began: a variant's own
    model, optimizer state and activations, without the variants built before it. None off CUDA."""

    def __init__(self, device_type):
        self.cuda = device_type == "cuda"
        self.gb = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.gb = (torch.cuda.max_memory_allocated() - self.base) / 1e9


def build(config, device):
    torch.manual_seed(config["seed"])
    model = GPT(model_config(config)).to(device)
    optimizer = build_optimizer(model, config, device.split(":")[0])
    step_model = torch.compile(model) if config["compile"] else model
    return model, step_model, optimizer


def make_step(step_model, optimizer, x, y, device_type, dtype, grad_clip):
    def step():
        with autocast(device_type, dtype):
            _, loss = step_model(x, y)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(step_model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main():
    defaults = {**read_defaults()[0], **{k: globals()[k] for k in BENCH_KEYS}}
    c, _ = load_config(defaults, source_path=(TRAIN_PY, __file__), prog="bench.py")
    device = pick_device(c["device"])
    device_type = device.split(":")[0]
    dtype = resolve_dtype(c["dtype"], device_type)
    if device_type == "cuda":
        enable_tf32()
    try:
        variants = parse_variants(c["bench_variants"], c)
    except ConfigError as e:
        sys.exit(f"bench_variants: {e}")
    vocab = min(50257, c["vocab_size"])  # GPT-2's ids, or fewer for a smaller vocabulary
    x = torch.randint(0, vocab, (c["batch_size"], c["block_size"]), device=device)
    y = torch.randint(0, vocab, (c["batch_size"], c["block_size"]), device=device)
    tokens_per_step = c["batch_size"] * c["block_size"]
    device_peak = peak_flops(device)

    runs = {}
    for name, variant in variants.items():
        with PeakMemory(device_type) as memory:  # building and warm-up: the variant's whole footprint
            model, step_model, optimizer = build(variant, device)
            step = make_step(step_model, optimizer, x, y, device_type, dtype, c["grad_clip"])
            for _ in range(c["bench_warmup"]):
                step()
        runs[name] = {"model": model, "step": step, "times": [], "peak_mem_gb": memory.gb,
                      "meter": ThroughputMeter(model.flops_per_token(c["block_size"]), device_peak, device_type)}

    for _ in range(c["bench_rounds"]):
        for run in runs.values():
            run["meter"].start()
            for _ in range(c["bench_steps"]):
                run["step"]()
            run["meter"].count(c["bench_steps"] * tokens_per_step)
            run["times"].append(run["meter"].stop() / c["bench_steps"])

    if c["profile"]:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        for name, run in runs.items():
            with torch_profile(activities=activities, record_shapes=True) as prof:
                for _ in range(2):
                    run["step"]()
                if device_type == "cuda":
                    torch.cuda.synchronize()
            path = f"bench_trace_{name.replace(':', '_').replace('=', '')}.json"
            prof.export_chrome_trace(path)
            print(f"wrote {path}")

    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else f"{device} ({torch.get_num_threads()} threads)"
    print(f"device: {device_name}, dtype {dtype}, compile {c['compile']}; {tokens_per_step:,} tokens per step "
          f"({c['batch_size']} x {c['block_size']}); median of {c['bench_rounds']} rounds x {c['bench_steps']} steps")
    results = {}
    for name, run in runs.items():
        ms = 1000 * statistics.median(run["times"])
        tokens_per_sec = tokens_per_step / (ms / 1000)
        results[name] = {
            "ms_per_step": ms, "tokens_per_sec": tokens_per_sec, "mfu": run["meter"].mfu(tokens_per_sec),
            "peak_mem_gb": run["peak_mem_gb"], "params_M": run["model"].num_params() / 1e6,
            "spread_pct": 100 * (max(run["times"]) - min(run["times"])) / min(run["times"]),
        }
    baseline = next(iter(variants))
    base = results[baseline]
    width = max(len(name) for name in results)
    for name, r in results.items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "n/a" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.2f} GB"
        r["throughput_ratio"] = r["tokens_per_sec"] / base["tokens_per_sec"]
        r["memory_ratio"] = r["peak_mem_gb"] / base["peak_mem_gb"] if r["peak_mem_gb"] else None
        print(f"{name:>{width}}: {r['ms_per_step']:9.2f} ms/step | {r['tokens_per_sec']:12,.0f} tok/s | MFU {mfu:>6} | "
              f"peak mem {mem} | {r['params_M']:.1f}M params | tok/s vs {baseline} {r['throughput_ratio']:.4f}"
              + ("" if r["memory_ratio"] is None else f" | memory vs {baseline} {r['memory_ratio']:.4f}")
              + f" | round spread {r['spread_pct']:.1f}%")
    if c["bench_json"]:
        with open(c["bench_json"], "w") as f:
            json.dump({"config": c, "device": device_name, "dtype": dtype, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
