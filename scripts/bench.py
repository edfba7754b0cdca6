"""
Benchmark the training step of SA and XSA in one process: train.py's own TrainStep (forward, backward,
clipping, the guards' check, the optimizer update), imported, not copied.

    python -m scripts.bench config/sa_tiny.py
    python -m scripts.bench config/sa_0p7b.py --n_layer=4 --batch_size=8      # a quick check on one GPU
    python -m scripts.bench --n_layer=12 --n_embd=768 --n_head=12 --block_size=1024 --batch_size=4 --compile=False

    python -m scripts.bench config/sa_tiny.py --bench_variants=sa,xsa,xsa:xsa_gate=True
    python -m scripts.bench config/sa_0p7b.py --block_size=8192 --batch_size=1 --attn_mask=document

With --attn_mask=document the tokens hold documents of FineWeb-like lengths (log-normal, median
--bench_doc_median tokens), and every variant also runs with the causal mask on the same tokens: the
report adds each variant's step time ratio document / causal at equal shapes.

Every variant is built from the same config and seed (differing only in its attn_type and
overrides) and timed in alternating rounds (A, B, A, B, ...) so drifting clocks, thermals and
neighbours hit all alike. Timing starts after warm-up (and compilation) and excludes data loading:
tokens are random and already on the device. Reports per variant: ms/step, tokens/s, MFU (model
FLOPs per token x tokens/s / device peak), peak memory (CUDA: the variant's own model, optimizer
state and activations, measured during its warm-up), and the ratios to the first variant.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m scripts.bench", file=sys.stderr)
    sys.exit(2)

import functools
import json
import statistics
import time
from dataclasses import dataclass

import torch

from configurator import ConfigError, config_class, key, non_negative, positive
from model import exclude_self
from pretrain import exits, train_config
from pretrain.guards import Guards
from pretrain.metrics import ThroughputMeter
from pretrain.parallelize import compile_counts
from pretrain.runtime import REPO, DeviceError, Runtime, enable_tf32, peak_flops, pick_device, resolve_dtype
from train import TrainStep, build_model


@dataclass
class Bench:
    """scripts/bench.py's own keys, beside every key of train.py."""
    bench_rounds: int = key(10, "alternating timing rounds per variant", check=positive)
    bench_steps: int = key(3, "training steps per round", check=positive)
    bench_warmup: int = key(3, "untimed steps per variant before the first round (compilation happens here)",
                            check=non_negative)
    bench_variants: str = key("sa,xsa", 'comma-separated variants, the first the baseline: an attn_type, then any '
                                        'overrides, e.g. "xsa:xsa_gate=True"')
    bench_doc_median: int = key(400, "median document length of the tokens under attn_mask=document (log-normal, "
                                     "sigma 1: mean ~660 tokens, FineWeb-like; prepare.py's doc_lengths.json has "
                                     "your data's)", check=positive)
    profile: bool = key(False, "write a torch profiler trace per variant to bench_trace_<variant>.json")
    bench_in_loop: bool = key(False, "also time the baseline's in-loop evaluation (one similarity pass, one downstream "
                                     "evaluation as the downstream_* keys say) as a share of the training between two")
    bench_json: str = key("", "also write the results to this JSON file")


BenchConfig = config_class("BenchConfig", *train_config.SECTIONS, Bench, base=train_config.RunConfig)


def resolve(argv):
    return train_config.resolve(argv, config_class=BenchConfig, prog="python -m scripts.bench")[0]


def parse_variants(c, argv):
    """{name: config} for each variant of c.bench_variants ("sa,xsa,xsa:xsa_gate=True"), c being argv resolved:
    the command line argv, then its
    attn_type, then its --key=value overrides, resolved and checked as the command line's are. Under a
    document mask each variant has a causal twin, "<name>:attn_mask=causal", timed on the same tokens."""
    names = c.bench_variants.split(",")
    if c.attn_mask == "document":
        names += [f"{name}:attn_mask=causal" for name in names]
    variants = {}
    for name in names:
        attn_type, *overrides = name.split(":")
        variants[name] = resolve(argv + [f"--attn_type={attn_type}"] + [f"--{o}" for o in overrides])
    return variants


def with_documents(x, median, eot_token, seed=0):
    """x (B, T) with an eot_token at the start of each document, the documents' lengths log-normal around
    `median` tokens (sigma 1, as web pages: many short, a long tail), laid end to end across the rows."""
    g = torch.Generator().manual_seed(seed)
    x, position = x.clone(), 0
    while position < x.numel():
        x.view(-1)[position] = eot_token
        length = torch.empty(1).log_normal_(mean=torch.tensor(median).log().item(), std=1.0, generator=g)
        position += max(1, round(length.item()))
    return x


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


def build(config, runtime, dtype):
    """A variant's model and the training step train.py would run on it, on one process."""
    raw_model, _, train_model, optimizer = build_model(config, runtime, dtype)
    guards = Guards(config, runtime, stop_signals=None)
    step = TrainStep(train_model, raw_model, optimizer, guards, runtime, dtype, config.batch_size, grad_accum=1,
                     grad_clip=config.grad_clip)
    return raw_model, step


SDPA_KERNELS = {  # the aten op each scaled_dot_product_attention backend dispatches to
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient (memory-efficient)",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_attention_math": "math (unfused: T x T scores in memory)",
}


def attention_inputs(config, device, dtype, batch_size):
    """Random q (n_head heads), k and v (n_kv_head heads) of the config's attention shape."""
    n_kv_head = config.n_kv_head or config.n_head
    head_dim = config.head_dim or config.n_embd // config.n_head
    T = config.block_size + config.n_sinks
    shape = lambda heads: (batch_size, heads, T, head_dim)
    q = torch.randn(shape(config.n_head), device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shape(n_kv_head), device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def sdpa_backend(config, device, dtype):
    """The SDPA backend that runs this config's attention (forward and backward), read off the profiler."""
    from torch.profiler import profile as torch_profile
    q, k, v = attention_inputs(config, device, getattr(torch, dtype), batch_size=1)
    with torch_profile() as prof:
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
        y.sum().backward()
    ran = {event.name for event in prof.events()}
    return ", ".join(label for op, label in SDPA_KERNELS.items() if op in ran) or "unknown"


def xsa_orthogonality(config, device, dtype):
    """|z.v| / (|v| |y|) of fast XSA's output under `dtype`, over heads and positions: (mean, max).
    XSA makes it 0 in exact arithmetic; what remains is the rounding of z to dtype."""
    q, k, v = attention_inputs(config, device, getattr(torch, dtype), batch_size=2)
    with torch.no_grad():
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
        z = exclude_self(y, v).float()
        groups = q.size(1) // k.size(1)
        vf, yf = v.float().repeat_interleave(groups, dim=1), y.float()
        ratio = (z * vf).sum(-1).abs() / (vf.norm(dim=-1) * yf.norm(dim=-1)).clamp_min(1e-12)
    ratio = ratio[:, :, 1:]  # at position 0, y = v: z is rounding noise over a zero vector
    return ratio.mean().item(), ratio.max().item()


# -----------------------------------------------------------------------------
# the cost of train.py's in-loop evaluation

PAPER_CONFIGS = ("config/xsa_0p7b.py", "config/xsa_1p4b.py", "config/xsa_2p7b.py")


def in_loop_share(seconds, interval, step_seconds):
    """The share of the time between two evaluations at `interval` steps that the evaluation takes."""
    return seconds / (interval * step_seconds + seconds) if interval else None


def flop_shares(c, downstream_tokens):
    """(downstream share, similarity share) of the training FLOPs between two evaluations at the config's intervals,
    for downstream_tokens forward positions per evaluation: a forward costs a third of a training step's FLOPs per
    token (2N of 6N), whatever the model, so the shares depend on tokens alone. The similarity pass counts as two
    forwards of batch_size sequences (the model's, then the explicit attention of the statistics)."""
    step_tokens = c.total_batch_size
    downstream = downstream_tokens / 3 / (c.downstream_interval * step_tokens) if c.downstream_interval else None
    similarity = (2 * c.batch_size * c.block_size / 3 / (c.similarity_interval * step_tokens)
                  if c.similarity_interval else None)
    return downstream, similarity


def in_loop_downstream(c, runtime):
    """The in-loop downstream evaluation of train.py for the config c, its tasks loaded and checked (an error is
    one line and an exit, as in train.py)."""
    from eval.common import gpt2_encoding_or_exit
    from eval.downstream import InLoopDownstream
    gpt2_encoding_or_exit()  # downstream scoring tokenizes with it
    try:
        return InLoopDownstream(c.downstream_tasks, c.downstream_limit, c.downstream_include_path, runtime,
                                c.block_size)
    except ConfigError as e:
        exits.fail(f"config error: {e}", exits.CONFIG_ERROR)


def in_loop_cost(c, model, runtime, dtype, step_seconds, tokens_per_step, downstream):
    """Time one similarity pass and one downstream evaluation (the second of two: the first builds lm-eval's
    caches) of the model on this process; print them as shares of the training between two evaluations at
    the config's intervals, measured here (train.py's step of total_batch_size tokens being total_batch_size /
    tokens_per_step bench steps), and as FLOP shares, here and for the paper's configs at their intervals with
    the forward tokens per example measured here."""
    from eval.downstream import working_dir
    from eval.similarity import in_loop_record
    step_seconds *= c.total_batch_size / tokens_per_step
    batch = torch.randint(0, min(50257, c.vocab_size), (c.batch_size, c.block_size))
    similarity_times = []
    for _ in range(3):
        started = time.perf_counter()
        in_loop_record(model, batch, runtime, dtype)
        similarity_times.append(time.perf_counter() - started)
    similarity_s = statistics.median(similarity_times)
    for _ in range(2):
        started = time.perf_counter()
        downstream(model, runtime, dtype, c.batch_size)
        downstream_s = time.perf_counter() - started
    per_example = downstream.forward_tokens / downstream.examples
    flop_downstream, flop_similarity = flop_shares(c, downstream.forward_tokens)
    report = {"similarity_s": similarity_s, "downstream_s": downstream_s, "downstream_examples": downstream.examples,
              "forward_tokens_per_example": per_example, "train_step_s": step_seconds,
              "similarity_share": in_loop_share(similarity_s, c.similarity_interval, step_seconds),
              "downstream_share": in_loop_share(downstream_s, c.downstream_interval, step_seconds),
              "similarity_flop_share": flop_similarity, "downstream_flop_share": flop_downstream}
    pct = lambda share: "n/a (interval 0)" if share is None else f"{100 * share:.3f}%"  # noqa: E731
    print(f"in-loop evaluation, measured ({step_seconds:.3f} s per train.py step of {c.total_batch_size:,} tokens): "
          f"similarity pass {similarity_s:.3f} s = {pct(report['similarity_share'])} of the time between two at "
          f"similarity_interval {c.similarity_interval} (FLOPs: {pct(flop_similarity)}); downstream "
          f"{downstream_s:.2f} s for {downstream.examples} examples ({per_example:.0f} forward tokens each) = "
          f"{pct(report['downstream_share'])} at downstream_interval {c.downstream_interval} (FLOPs: "
          f"{pct(flop_downstream)})")
    report["paper"] = {}
    for path in PAPER_CONFIGS:
        with working_dir(REPO):  # config files, and those they exec, are named from the repo root
            paper = train_config.resolve([path])[0]
        examples = len(set(paper.downstream_tasks.split(","))) * paper.downstream_limit  # each task once
        shares = flop_shares(paper, per_example * examples)
        report["paper"][path] = {"downstream_flop_share": shares[0], "similarity_flop_share": shares[1]}
        print(f"  {path}: downstream {examples} examples every {paper.downstream_interval} steps: "
              f"{pct(shares[0])} of the training FLOPs; similarity every {paper.similarity_interval} steps: "
              f"{pct(shares[1])}")
    return report


def main():
    argv = sys.argv[1:]
    try:
        c = resolve(argv)
        variants = parse_variants(c, argv)
        device = pick_device(c.device)
    except (ConfigError, DeviceError) as e:
        exits.fail(f"config error: {e}", exits.CONFIG_ERROR)
    device_type = device.split(":")[0]
    runtime = Runtime(0, 0, 1, device, device_type, distributed=False)
    dtype = resolve_dtype(c.dtype, device_type)
    if device_type == "cuda":
        enable_tf32()
    given = [a for a in argv if not a.startswith("--")]
    print(f"bench: {', '.join(variants)} at {c.n_layer} x {c.n_embd} ({c.n_head} heads), {c.batch_size} x "
          f"{c.block_size} tokens per step, on {device} in {dtype}, compile {c.compile}: {c.bench_warmup} warm-up "
          f"steps and {c.bench_rounds} rounds of {c.bench_steps} steps per variant"
          + ("" if given else "; no config file given: train.py's defaults (a 124M model), e.g. config/sa_tiny.py "
                              "for a small one"), flush=True)
    # the in-loop evaluation's tasks are loaded and checked before any timing: a task that cannot be scored
    # fails here, not after minutes of benchmarking
    in_loop_tasks = in_loop_downstream(variants[next(iter(variants))], runtime) if c.bench_in_loop else None
    vocab = min(50257, c.vocab_size)  # GPT-2's ids, or fewer for a smaller vocabulary
    x = torch.randint(0, vocab, (c.batch_size, c.block_size), device=device)
    if c.attn_mask == "document":
        x = with_documents(x.cpu(), c.bench_doc_median, c.eot_token).to(device)
    y = torch.randint(0, vocab, (c.batch_size, c.block_size), device=device)
    tokens_per_step = c.batch_size * c.block_size
    device_peak = peak_flops(device)

    runs = {}
    for name, variant in variants.items():
        graphs_before, breaks_before, _ = compile_counts()
        with PeakMemory(device_type) as memory:  # building and warm-up: the variant's whole footprint
            model, train_step = build(variant, runtime, dtype)
            step = functools.partial(train_step, 1, x, y, variant.learning_rate)
            for _ in range(c.bench_warmup):
                step()
        graphs, breaks, _ = compile_counts()
        runs[name] = {"model": model, "step": step, "times": [], "peak_mem_gb": memory.gb,
                      "graphs": graphs - graphs_before, "graph_breaks": breaks - breaks_before,
                      "meter": ThroughputMeter(model.flops_per_token(c.block_size), device_peak, device_type)}

    for _ in range(c.bench_rounds):
        for run in runs.values():
            run["meter"].start()
            for _ in range(c.bench_steps):
                run["step"]()
            run["meter"].count(c.bench_steps * tokens_per_step)
            run["times"].append(run["meter"].stop() / c.bench_steps)

    if c.profile:
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

    backend = sdpa_backend(c, device, dtype)
    ortho_mean, ortho_max = xsa_orthogonality(c, device, dtype)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else f"{device} ({torch.get_num_threads()} threads)"
    print(f"device: {device_name}, dtype {dtype}, compile {c.compile}; {tokens_per_step:,} tokens per step "
          f"({c.batch_size} x {c.block_size}); median of {c.bench_rounds} rounds x {c.bench_steps} steps")
    results = {}
    for name, run in runs.items():
        ms = 1000 * statistics.median(run["times"])
        tokens_per_sec = tokens_per_step / (ms / 1000)
        results[name] = {
            "ms_per_step": ms, "tokens_per_sec": tokens_per_sec, "mfu": run["meter"].mfu(tokens_per_sec),
            "peak_mem_gb": run["peak_mem_gb"], "params_M": run["model"].num_params() / 1e6,
            "spread_pct": 100 * (max(run["times"]) - min(run["times"])) / min(run["times"]),
            "graphs": run["graphs"], "graph_breaks": run["graph_breaks"],  # compiled in the warm-up
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
              + f" | round spread {r['spread_pct']:.1f}%"
              + (f" | {r['graphs']} graphs, {r['graph_breaks']} graph breaks" if c.compile else ""))
    for name in results:  # each document-masked variant against its causal twin
        if (twin := results.get(f"{name}:attn_mask=causal")) is not None:
            results[name]["document_over_causal"] = results[name]["ms_per_step"] / twin["ms_per_step"]
            print(f"{name}: step time document / causal {results[name]['document_over_causal']:.3f} "
                  f"({(x == c.eot_token).sum().item()} documents in {x.numel():,} tokens)")
    print(f"sdpa backend: {backend} | XSA orthogonality |z.v|/(|v||y|) in {dtype}: mean {ortho_mean:.2e}, "
          f"max {ortho_max:.2e}")
    if c.bench_in_loop:
        baseline_run = runs[baseline]
        results["in_loop"] = in_loop_cost(variants[baseline], baseline_run["model"], runtime, dtype,
                                          base["ms_per_step"] / 1000, tokens_per_step, in_loop_tasks)
    if c.bench_json:
        with open(c.bench_json, "w") as f:
            json.dump({"config": c.to_dict(), "device": device_name, "dtype": dtype, "results": results, "sdpa_backend": backend,
                       "xsa_orthogonality": {"mean": ortho_mean, "max": ortho_max}}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
