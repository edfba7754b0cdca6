"""
Memory per GPU of a training run, before launching it, and the largest micro-batch that fits.

    python -m scripts.memory_plan config/xsa_2p7b.py --parallelism=fsdp --world_size=8
    python -m scripts.memory_plan config/xsa_2p7b.py --gpu_mem_gb=80 --activation_checkpointing=block
    python -m scripts.memory_plan config/sa_tiny.py --device=cpu --measure=True   # and one real micro-step here

Keys are train.py's (config files, then --key=value overrides; batch_size is the micro-batch per
GPU, block_size the sequence length, parallelism/activation_checkpointing/reshard_after_forward
the strategy), plus the planner's own below. With device "auto" it plans for CUDA GPUs; dtype
"auto" means bf16 autocast there: fp32 parameters, gradients and AdamW states (the master copy),
bf16 matmul inputs and outputs, an fp32 residual stream, LayerNorm outputs and loss.

What is counted, per GPU (W processes, P parameters with the tied embedding once):
  DDP:  parameters 4P, gradients 4P, AdamW 8P (Muon: 4 bytes per hidden-matrix parameter, AdamW's
        8 for the rest), and under autocast the bf16 copies of the Linear weights that the backward
        keeps (2 bytes each). DDP's gradient buckets add nothing: train.py's DDP has
        gradient_as_bucket_view=True, so the gradients are views into the buckets
  FSDP: 16P / W of sharded fp32 state; the gathered (bf16 on GPU) parameters of the root and of
        two blocks (current, prefetched), or of all blocks with reshard_after_forward=False; with
        several micro-steps, the unsharded fp32 gradients accumulated until the last one (4P)
  activations saved for the backward, per token and block: 2 fp32 residuals (8d bytes) and
        (10d + 4a + 3k) bf16 elements (LayerNorm outputs as matmul inputs d + d, q a, k and v 2k,
        rotated q and k a + k, attention output a, its reshaped copy a, MLP hidden 4d + GELU output
        4d), where d = n_embd, a = n_head * head_dim and k = n_kv_head * head_dim (k = a without
        GQA); in fp32 the same with 4 bytes. XSA keeps no more: its
        inputs are kept already and its output is what gets reshaped (on CUDA, SA's flash-attention
        output needs no copy: one a less than counted); gated XSA keeps one more a. A checkpointed
        block keeps only its input (4d bytes). Outside the blocks: embedding, final norm, the
        output layer's input and the fp32 log-probabilities (4V bytes per token, V = vocab_size).
  working memory at the peak: the fp32 gradients of log-probabilities and logits (8V bytes per
        token) at the start of the backward, or later a block's backward: its gradients and, when
        checkpointed, its recomputed activations.
This is eager PyTorch, as --measure runs it; it agrees with measured CPU peaks to a few percent
(tests/test_fsdp.py). torch.compile usually keeps fewer activations (it fuses and recomputes
element-wise ops), so for compiled runs the activation lines are an upper bound. Not counted: the
CUDA context and NCCL buffers (reserved_gb), allocator fragmentation, the optimizer step's own
temporaries (after the activations are freed), and attention's math fallback (T x T per head).
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m scripts.memory_plan", file=sys.stderr)
    sys.exit(2)

import json
import os
from dataclasses import dataclass, replace

from configurator import key, non_negative, positive


@dataclass
class Planner:
    """The planner's own keys, beside every key of train.py."""
    world_size: int = key(8, "processes (GPUs) the run is spread over", check=positive)
    gpu_mem_gb: float = key(80.0, "memory of one GPU in GB (1e9 bytes), for the largest micro-batch that fits",
                            check=positive)
    reserved_gb: float = key(4.0, "memory not available to tensors: CUDA context, NCCL buffers, fragmentation",
                             check=non_negative)
    measure: bool = key(False, "also run one micro-step of this config in this process and print its measured peak")
    json_output: bool = key(False, "print the plan as one JSON object instead of a table")


GB = 1e9


def parameter_counts(c):
    """Parameter counts of the config's GPT, built on the meta device (no memory)."""
    import torch
    from pretrain.train_config import model_config
    from model import GPT
    from pretrain.optimizers import is_hidden_matrix
    with torch.device("meta"):
        model = GPT(model_config(c))
    block = model.transformer.h[0]
    linear = lambda m: sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear))  # noqa: E731
    total = sum(p.numel() for p in model.parameters())
    per_block = sum(p.numel() for p in block.parameters())
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    return {"total": total, "block": per_block, "root": total - c.n_layer * per_block,
            "linear": linear(model), "block_linear": linear(block), "hidden_matrices": hidden}


def plan_target(c, measuring=False):
    """(device type, dtype) the plan is for: this machine when measuring, else a CUDA GPU
    unless the config names another device."""
    from pretrain.runtime import pick_device, resolve_dtype
    if measuring:
        device_type = pick_device(c.device).split(":")[0]
        return device_type, resolve_dtype(c.dtype, device_type)
    device_type = "cuda" if c.device == "auto" else c.device.split(":")[0]
    dtype = c.dtype if c.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    return device_type, dtype


def plan(c, world_size, device_type="cuda", dtype="bfloat16", counts=None):
    """Expected peak memory per GPU in bytes, by component: a dict name -> bytes (and 'total')."""
    from pretrain.parallelize import checkpointed_blocks
    n = counts or parameter_counts(c)
    P, L, V, d = n["total"], c.n_layer, c.vocab_size, c.n_embd
    head_dim = c.head_dim or d // c.n_head
    a = c.n_head * head_dim
    kv = (c.n_kv_head or c.n_head) * head_dim
    amp = dtype != "float32"
    e = 2 if amp else 4  # bytes per activation element (matmul inputs and outputs)
    fsdp = c.parallelism == "fsdp" and world_size > 1
    W = world_size if fsdp else 1
    gathered = 2 if fsdp and amp and device_type == "cuda" else 4  # FSDP's all-gather dtype
    tokens_per_micro_step = c.batch_size * c.block_size * world_size
    grad_accum = max(1, c.total_batch_size // tokens_per_micro_step)
    n_ckpt = len(checkpointed_blocks(L, c.activation_checkpointing))

    parts = {"parameters (fp32)": 4 * P / W, "gradients (fp32)": 4 * P / W}
    if c.optimizer == "muon":  # one momentum buffer per hidden matrix, AdamW's two for the rest
        M = n["hidden_matrices"]
        parts["Muon momentum + AdamW states (fp32)"] = (4 * M + 8 * (P - M)) / W
    else:
        parts["AdamW states (fp32)"] = 8 * P / W
    if fsdp:
        in_flight = n["root"] + min(2, L) * n["block"] if c.reshard_after_forward else P
        parts[f"gathered parameters ({'bf16' if gathered == 2 else 'fp32'})"] = gathered * in_flight
        if grad_accum > 1:  # kept unsharded over the micro-steps before the last, in fp32
            parts["unsharded gradients (fp32, micro-steps)"] = 4 * P
        else:  # the root's, until its reduce-scatter at the end of the backward
            parts["unsharded root gradients"] = gathered * n["root"]
    if amp and gathered == 4:  # autocast's bf16 weight copies, kept for the backward (not those of checkpointed blocks)
        parts["bf16 weight copies (autocast)"] = 2 * (n["linear"] - n_ckpt * n["block_linear"])

    tokens = c.batch_size * c.block_size  # scored positions
    block_tokens = c.batch_size * (c.block_size + c.n_sinks)  # sinks go through the blocks
    block = 8 * d + e * (10 * d + 4 * a + 3 * kv) + 4 * c.n_head + 16 + (e * a if c.xsa_gate else 0)
    kept = (L - n_ckpt) * block + n_ckpt * 4 * d
    outside = 16 + 4 * d + 4 * d + e * d + 4 * V + 16  # ids, targets, embedding, last residual, head input, log-probs
    parts["activations"] = kept * block_tokens + outside * tokens
    # at the peak: the loss's backward (fp32 gradients of log-probs and logits), or later, with the
    # head's activations freed, a block's backward (its gradients; its recomputed activations)
    block_grads = e * 8 * d + 4 * 3 * d
    in_block = ((block if n_ckpt else 0) + block_grads) * block_tokens - (4 * V + e * d) * tokens
    parts["working memory (loss / backward)"] = max(8 * V * tokens, in_block)
    parts["total"] = sum(parts.values())
    return parts


def valid_micro_batches(c, world_size):
    """Micro-batches for which total_batch_size is a whole number of micro-steps."""
    sequences = c.total_batch_size // (c.block_size * world_size)
    if c.total_batch_size % (c.block_size * world_size):
        return []
    return [b for b in range(1, sequences + 1) if sequences % b == 0]


def largest_micro_batch(c, world_size, budget, device_type, dtype, counts=None):
    """The largest valid micro-batch whose planned peak fits in `budget` bytes, or None."""
    counts = counts or parameter_counts(c)
    fits = [b for b in valid_micro_batches(c, world_size)
            if plan(replace(c, batch_size=b), world_size, device_type, dtype, counts)["total"] <= budget]
    return max(fits) if fits else None


def measure_peak(c):
    """Peak memory in bytes of one micro-step (forward and backward, with gradients and AdamW's
    states already there, as under gradient accumulation) of the config's model, in this
    process, above what was in use before the model was built. CPU: resident set size (the
    high-water mark reset after setup), with freed tensors returned to the OS at once; CUDA: the
    allocator's peak."""
    import torch
    from pretrain.train_config import model_config
    from model import GPT
    from pretrain.optimizers import build_optimizer
    from pretrain.parallelize import apply_activation_checkpointing
    from pretrain.runtime import autocast, pick_device, set_malloc_thresholds
    device = pick_device(c.device)
    device_type, dtype = plan_target(c, measuring=True)
    if device_type == "cpu":  # undo runtime.reuse_freed_memory: a freed tensor must leave the resident set
        set_malloc_thresholds(mmap_bytes=64 * 1024, trim_bytes=128 * 1024)  # large blocks mmap'ed; glibc's trim

    def resident():
        if device_type == "cuda":
            return torch.cuda.memory_allocated()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def setup(config):
        model = GPT(model_config(config)).to(device)
        apply_activation_checkpointing(model, config.activation_checkpointing)
        optimizer = build_optimizer(model, config, device_type)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the optimizer's states; the gradients stay, as between micro-steps
        return model, optimizer

    def step(model, batch_size):
        x = torch.randint(0, model.config.vocab_size, (batch_size, model.config.block_size), device=device)
        with autocast(device_type, dtype):
            loss = model(x, x)[1]  # as in train.py, the logits are not kept through the backward
        loss.backward()

    torch.manual_seed(0)
    tiny = replace(c, n_layer=1, n_embd=64, n_head=2, n_kv_head=None, head_dim=32, vocab_size=256, block_size=16,
                   xsa_layers=None)
    step(setup(tiny)[0], 1)  # loads kernels and thread pools before the baseline
    base = resident()
    model, optimizer = setup(c)  # both kept alive through the step
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
    step(model, c.batch_size)
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return hwm_kb * 1024 - base


def main():
    from configurator import ConfigError, config_class
    from pretrain import exits, train_config
    PlanConfig = config_class("PlanConfig", *train_config.SECTIONS, Planner, base=train_config.RunConfig)
    try:
        c, files = train_config.resolve(sys.argv[1:], config_class=PlanConfig, prog="python -m scripts.memory_plan")
    except ConfigError as e:
        exits.fail(f"config error: {e}", exits.CONFIG_ERROR)
    W = c.world_size if not c.measure else 1
    device_type, dtype = plan_target(c, c.measure)
    counts = parameter_counts(c)
    parts = plan(c, W, device_type, dtype, counts)
    budget = (c.gpu_mem_gb - c.reserved_gb) * GB
    largest = {mode: largest_micro_batch(replace(c, activation_checkpointing=mode), W, budget, device_type, dtype, counts)
               for mode in ("none", "selective", "block")}
    result = {"config": files[-1] if files else None, "parallelism": c.parallelism, "world_size": W,
              "micro_batch": c.batch_size, "seq_len": c.block_size, "dtype": dtype, "device": device_type,
              "activation_checkpointing": c.activation_checkpointing, "parameters": counts["total"],
              "bytes": parts, "gpu_mem_gb": c.gpu_mem_gb, "largest_micro_batch": largest}
    if c.measure:
        result["measured_bytes"] = measure_peak(c)

    if c.json_output:
        print(json.dumps(result))
        return
    tokens_per_micro_step = c.batch_size * c.block_size * W
    steps = (f"{c.total_batch_size // tokens_per_micro_step} micro-steps per step"
             if c.total_batch_size % tokens_per_micro_step == 0 else
             f"total_batch_size {c.total_batch_size:,} is not a whole number of micro-steps")
    print(f"{result['config'] or 'train.py defaults'}: {counts['total'] / 1e6:,.0f}M parameters, "
          f"{c.parallelism if W > 1 else 'one process'} on {W} {device_type} device{'s' * (W > 1)}, "
          f"micro-batch {c.batch_size} x {c.block_size} tokens ({steps}), {dtype}, "
          f"activation checkpointing {c.activation_checkpointing}")
    for name, size in parts.items():
        print(f"  {name:<40} {size / GB:8.2f} GB")
    if not valid_micro_batches(c, W):
        print(f"no micro-batch makes total_batch_size {c.total_batch_size:,} a whole number of micro-steps "
              f"of micro-batch x {c.block_size} tokens x {W} processes")
    else:
        print(f"largest micro-batch in {c.gpu_mem_gb:g} GB ({c.gpu_mem_gb - c.reserved_gb:g} GB for "
              f"tensors), by activation checkpointing: "
              + ", ".join(f"{m} {b if b else 'none fits'}" for m, b in largest.items()))
    if c.measure:
        measured = result["measured_bytes"]
        print(f"measured peak of one micro-step on this {device_type}: {measured / GB:.2f} GB "
              f"(estimate {parts['total'] / GB:.2f} GB, {100 * (parts['total'] / measured - 1):+.0f}%)")


if __name__ == "__main__":
    main()
