"""
Benchmark the real training step (forward, backward, AdamW) of SA and XSA in one process.

    python bench.py config/sa_tiny.py
    python bench.py config/sa_0p7b.py --n_layer=4 --batch_size=8      # a quick check on one GPU
    python bench.py --n_layer=12 --n_embd=768 --n_head=12 --block_size=1024 --batch_size=4 --compile=False

Both models are built from the same config (only attn_type differs) and timed in alternating
rounds (A, B, A, B, ...) so drifting clocks, thermals and neighbours hit both alike. Timing starts
after warm-up (and compilation) and excludes data loading: tokens are random and already on the
device. Reports per variant: ms/step, tokens/s, MFU (model FLOPs per token x tokens/s / device peak),
peak memory, and the XSA/SA ratios.
"""

import json
import statistics
import time

import torch

from checkpoint import model_config
from configurator import TRAIN_PY, load_config, read_defaults
from model import GPT
from runtime import autocast, enable_tf32, peak_flops, pick_device, resolve_dtype

# bench-only settings, added to train.py's keys (every train.py key works here too)
bench_rounds = 10  # alternating timing rounds per variant
bench_steps = 3  # training steps per round
bench_warmup = 3  # untimed steps per variant before the first round (compilation happens here)
bench_variants = "sa,xsa"  # comma-separated attn_type values to compare; the first is the baseline
profile = False  # write a torch profiler trace per variant to bench_trace_<variant>.json
bench_json = ""  # also write the results to this JSON file


def build(config, attn_type, device):
    torch.manual_seed(config["seed"])
    model = GPT(model_config({**config, "attn_type": attn_type})).to(device)
    optimizer = model.configure_optimizers(config["weight_decay"], config["learning_rate"],
                                           (config["beta1"], config["beta2"]), device.split(":")[0])
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


def sync(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()


def main():
    bench_keys = ["bench_rounds", "bench_steps", "bench_warmup", "bench_variants", "profile", "bench_json"]
    defaults = {**read_defaults()[0], **{k: globals()[k] for k in bench_keys}}
    c, _ = load_config(defaults, source_path=(TRAIN_PY, __file__), prog="bench.py")
    device = pick_device(c["device"])
    device_type = device.split(":")[0]
    dtype = resolve_dtype(c["dtype"], device_type)
    if device_type == "cuda":
        enable_tf32()
    variants = c["bench_variants"].split(",")
    x = torch.randint(0, 50257, (c["batch_size"], c["block_size"]), device=device)
    y = torch.randint(0, 50257, (c["batch_size"], c["block_size"]), device=device)

    runs = {}
    for attn_type in variants:
        model, step_model, optimizer = build(c, attn_type, device)
        step = make_step(step_model, optimizer, x, y, device_type, dtype, c["grad_clip"])
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(c["bench_warmup"]):
            step()
        sync(device_type)
        runs[attn_type] = {"model": model, "step": step, "times": [],
                           "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device_type == "cuda" else None}

    for _ in range(c["bench_rounds"]):
        for attn_type in variants:
            run = runs[attn_type]
            sync(device_type)
            t0 = time.perf_counter()
            for _ in range(c["bench_steps"]):
                run["step"]()
            sync(device_type)
            run["times"].append((time.perf_counter() - t0) / c["bench_steps"])

    if c["profile"]:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        for attn_type in variants:
            with torch_profile(activities=activities, record_shapes=True) as prof:
                for _ in range(2):
                    runs[attn_type]["step"]()
                sync(device_type)
            prof.export_chrome_trace(f"bench_trace_{attn_type}.json")
            print(f"wrote bench_trace_{attn_type}.json")

    tokens_per_step = c["batch_size"] * c["block_size"]
    device_peak = peak_flops(device)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else f"{device} ({torch.get_num_threads()} threads)"
    print(f"device: {device_name}, dtype {dtype}, compile {c['compile']}; {tokens_per_step:,} tokens per step "
          f"({c['batch_size']} x {c['block_size']}); median of {c['bench_rounds']} rounds x {c['bench_steps']} steps")
    results = {}
    for attn_type in variants:
        run = runs[attn_type]
        ms = 1000 * statistics.median(run["times"])
        tokens_per_sec = tokens_per_step / (ms / 1000)
        flops = run["model"].flops_per_token(c["block_size"])
        results[attn_type] = {
            "ms_per_step": ms, "tokens_per_sec": tokens_per_sec,
            "mfu": flops * tokens_per_sec / device_peak if device_peak else None,
            "peak_mem_gb": run["peak_mem_gb"], "params_M": run["model"].num_params() / 1e6,
            "spread_pct": 100 * (max(run["times"]) - min(run["times"])) / min(run["times"]),
        }
    base = results[variants[0]]
    for attn_type, r in results.items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "n/a" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.2f} GB"
        ratio = r["tokens_per_sec"] / base["tokens_per_sec"]
        r["throughput_ratio"] = ratio
        r["memory_ratio"] = r["peak_mem_gb"] / base["peak_mem_gb"] if r["peak_mem_gb"] else None
        print(f"{attn_type:>4}: {r['ms_per_step']:9.2f} ms/step | {r['tokens_per_sec']:12,.0f} tok/s | MFU {mfu:>6} | "
              f"peak mem {mem} | {r['params_M']:.1f}M params | tok/s vs {variants[0]} {ratio:.4f} "
              f"| round spread {r['spread_pct']:.1f}%")
    if c["bench_json"]:
        with open(c["bench_json"], "w") as f:
            json.dump({"config": c, "device": device_name, "dtype": dtype, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
