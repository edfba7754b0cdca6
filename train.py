"""
Train a GPT with standard (SA) or exclusive (XSA) self-attention on llm.c token shards.

Single process (CPU, one GPU):
    python train.py config/xsa_tiny.py
DDP on one node, or many with torchrun's rendezvous (scripts/slurm_train.sh):
    torchrun --standalone --nproc_per_node=8 train.py config/xsa_2p7b.py
FSDP2, for models whose training state does not fit on one GPU (scripts/memory_plan.py says):
    torchrun --standalone --nproc_per_node=8 train.py config/xsa_2p7b.py --parallelism=fsdp
Continue an interrupted (or finished, with a larger max_iters) run:
    torchrun --standalone --nproc_per_node=8 train.py config/xsa_2p7b.py --init_from=resume
"""

import json
import math
import os
import random
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# config: defaults, overridden by config files and --key=value (configurator.py; --help lists them)
# I/O
out_dir = None  # run directory (checkpoints, logs); None derives out/<config file name>
data_dir = "data/fineweb/fineweb100B"  # directory of llm.c token shards (*_train_*.bin, *_val_*.bin)
init_from = "scratch"  # "scratch", or "resume" from the newest checkpoint in out_dir
eval_interval = 1000  # optimizer steps between validation-loss evaluations (and at the last step)
val_tokens = 10_485_760  # validation tokens per evaluation, capped at the val shards, split across ranks
log_interval = 10  # optimizer steps between log lines and metrics.jsonl records
checkpoint_interval = 1000  # optimizer steps between checkpoints (and at the last step); 0: last only
keep_checkpoints = 2  # newest checkpoints kept in out_dir
skip_nonfinite_steps = 0  # optimizer steps with a non-finite loss/grad norm to skip before stopping
# wandb
wandb_log = False  # send metrics and the config to Weights & Biases
wandb_project = "xsa"  # wandb project
wandb_group = None  # wandb group; None: the config name without its sa_/xsa_ prefix, shared by SA and XSA
wandb_run_name = None  # wandb run name; None: the config file name
# model (model.GPTConfig)
n_layer = 12  # transformer blocks
n_head = 12  # attention heads per block
n_embd = 768  # model width
head_dim = None  # width of one head; None means n_embd // n_head
block_size = 1024  # context length in tokens
vocab_size = 50304  # GPT-2's 50257 padded up to a multiple of 64
attn_type = "sa"  # "sa" (standard) or "xsa" (exclusive self-attention)
xsa_gate = False  # XSA with a learnable per-head gate, z = y - tanh(alpha) * proj, alpha zero-init
n_sinks = 0  # learned attention-sink tokens prepended to every sequence
rope_theta = 10000.0  # RoPE base frequency
bias = False  # biases in Linear and LayerNorm layers
dropout = 0.0  # dropout probability (pretraining: 0)
# batch
total_batch_size = 524_288  # tokens per optimizer step over all processes (paper: 256 x 2048)
batch_size = 8  # sequences per process per micro-step; gradient accumulation makes up the rest
# optimizer: AdamW, linear warmup, cosine decay to min_lr
learning_rate = 6e-4  # peak learning rate
max_iters = 200_000  # total optimizer steps
warmup_iters = 2000  # steps of linear warmup from 0
lr_decay_iters = None  # step where the cosine reaches min_lr; None means max_iters
min_lr = None  # final learning rate; None means learning_rate / 10
weight_decay = 0.1  # AdamW weight decay on matrices (not norms, biases or gates)
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # clip the global gradient norm to this value; 0 disables clipping
# system
device = "auto"  # "auto" (cuda > mps > cpu), or e.g. "cpu", "cuda", "cuda:1"
dtype = "auto"  # "auto" (bfloat16 on GPUs that support it, else float32), "float32", "bfloat16"
compile = True  # torch.compile the model
backend = "auto"  # torch.distributed backend; "auto" is nccl with CUDA and gloo without
# parallelism and memory (parallelize.py; scripts/memory_plan.py estimates the memory per GPU)
parallelism = "ddp"  # "ddp": a full replica per process; "fsdp": FSDP2, parameters/gradients/optimizer sharded
reshard_after_forward = True  # fsdp: free gathered block parameters after forward (False: more memory, less traffic)
activation_checkpointing = "none"  # "none", "block" (recompute every block in the backward), "selective" (every other)
seed = 1337  # initialisation and dropout seed
data_seed = None  # shard order seed; None means seed (SA and XSA with one seed see the same batches)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))]

from checkpoint import (check_architecture, list_checkpoints, load_latest_checkpoint,  # noqa: E402
                        load_training_state, model_config, save_checkpoint, save_sharded_checkpoint)
from configurator import load_config  # noqa: E402
from dataloader import TrainLoader, val_sequences  # noqa: E402
from metrics import MetricsLogger  # noqa: E402
from model import GPT  # noqa: E402
from parallelize import clip_grad_norm, gradient_sync, is_sharded, parallelize  # noqa: E402
from runtime import (autocast, enable_tf32, peak_flops, peak_memory_gb, provenance,  # noqa: E402
                     resolve_dtype, setup_runtime, teardown_runtime)


class TrainingStopped(RuntimeError):
    """A condition under which continuing would waste compute or corrupt the run."""


def derive_names(config, config_files):
    """out_dir, wandb run name and group from the config file's name where not set."""
    name = os.path.splitext(os.path.basename(config_files[-1]))[0] if config_files else "run"
    config["out_dir"] = config["out_dir"] or os.path.join("out", name)
    config["wandb_run_name"] = config["wandb_run_name"] or name
    if config["wandb_group"] is None:
        config["wandb_group"] = name.split("_", 1)[1] if name.startswith(("sa_", "xsa_")) else name


def lr_at(step, c):
    """Linear warmup to the peak, then cosine decay to min_lr at lr_decay_iters; step counts from 1."""
    if step <= c["warmup_iters"]:
        return c["learning_rate"] * step / c["warmup_iters"]
    decay_iters = c["lr_decay_iters"] or c["max_iters"]
    if step >= decay_iters:
        return c["min_lr"]
    ratio = (step - c["warmup_iters"]) / (decay_iters - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def rng_state(device_type):
    """This process's RNG states in plain containers (weights_only-loadable)."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (np_state[0], np_state[1].tolist()) + tuple(np_state[2:]),
             "torch": torch.get_rng_state()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state, device_type):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states(runtime):
    """Every rank's RNG state, in rank order (on every rank)."""
    state = rng_state(runtime.device_type)
    if not runtime.distributed:
        return [state]
    states = [None] * runtime.world_size
    dist.all_gather_object(states, state)
    return states


@torch.no_grad()
def evaluate(model, val_x, val_y, runtime, batch_size, dtype):
    """Mean loss over the fixed validation tokens; rank r scores sequences r, r+W, r+2W, ...
    Every rank runs the same number of forwards (FSDP's forward is collective)."""
    model.eval()
    mine = torch.arange(runtime.rank, len(val_x), runtime.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=runtime.device)  # loss sum, token count
    per_rank = math.ceil(len(val_x) / runtime.world_size)
    for i in range(0, per_rank, batch_size):
        rows = mine[i:i + batch_size]
        scored = len(rows) > 0  # else this rank has run out of sequences: a forward all the same
        rows = rows if scored else torch.zeros(1, dtype=torch.long)
        x, y = val_x[rows].to(runtime.device), val_y[rows].to(runtime.device)
        with autocast(runtime.device_type, dtype):
            logits, _ = model(x)
        if scored:
            totals[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double()
            totals[1] += y.numel()
    if runtime.distributed:
        dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def all_ranks_ok(ok, runtime):
    """True only if `ok` holds on every rank: lets all ranks stop together instead of hanging."""
    if not runtime.distributed:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=runtime.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def train(c, runtime, log):
    """The training run described by the resolved config c."""
    dtype = resolve_dtype(c["dtype"], runtime.device_type)
    if runtime.device_type == "cuda":
        enable_tf32()
    tokens_per_micro_step = c["batch_size"] * c["block_size"] * runtime.world_size
    if c["total_batch_size"] % tokens_per_micro_step:
        raise ValueError(f"total_batch_size={c['total_batch_size']} is not a multiple of batch_size * block_size * "
                         f"world_size = {c['batch_size']} * {c['block_size']} * {runtime.world_size}")
    grad_accum = c["total_batch_size"] // tokens_per_micro_step

    loader = TrainLoader(c["data_dir"], c["block_size"], c["total_batch_size"], runtime.rank,
                         runtime.world_size, c["data_seed"])
    val_x, val_y = val_sequences(c["data_dir"], c["block_size"], c["val_tokens"])

    torch.manual_seed(c["seed"])  # same initialisation on every rank
    raw_model = GPT(model_config(c)).to(runtime.device)
    # model: compiled, for evaluation; train_model: what the step calls (DDP-wrapped); under FSDP both
    # are raw_model itself, sharded in place. The optimizer comes after: FSDP replaces the parameters
    model, train_model = parallelize(raw_model, c, runtime, dtype)
    sharded = is_sharded(raw_model)  # checkpoints: a DCP directory of shards, else one file
    optimizer = raw_model.configure_optimizers(c["weight_decay"], c["learning_rate"],
                                               (c["beta1"], c["beta2"]), runtime.device_type)

    start_step, best_val_loss, wandb_run_id = 0, float("inf"), uuid.uuid4().hex[:12]
    if c["init_from"] not in ("scratch", "resume"):
        raise ValueError(f"init_from must be 'scratch' or 'resume', got {c['init_from']!r}")
    if c["init_from"] == "scratch" and list_checkpoints(c["out_dir"]):
        # not deleted (nothing is lost), but a later resume must not mix them up with this run's
        log.print(f"warning: starting from scratch in {c['out_dir']}, which holds checkpoints of an earlier run: "
                  f"this run replaces them as it saves; use another out_dir to keep both")
    if c["init_from"] == "resume" and not list_checkpoints(c["out_dir"]):
        # nothing saved yet (a crash before the first checkpoint): resuming means starting over
        log.print(f"init_from='resume': no checkpoint in {c['out_dir']} yet, starting from scratch")
    elif c["init_from"] == "resume":
        path, ckpt = load_latest_checkpoint(c["out_dir"])
        if path is None:
            raise FileNotFoundError(f"init_from='resume' but no checkpoint in {c['out_dir']} is readable")
        check_architecture(ckpt["config"], c, path)
        load_training_state(path, ckpt, raw_model, optimizer)  # either format, any parallelism and world size
        for group in optimizer.param_groups:  # hyperparameters come from the config given now
            group["betas"] = (c["beta1"], c["beta2"])
            group["weight_decay"] = c["weight_decay"] if group["weight_decay"] > 0 else 0.0
        loader.load_state_dict(ckpt["loader"])
        start_step, best_val_loss = ckpt["step"], ckpt["best_val_loss"]
        wandb_run_id = ckpt["wandb_run_id"]
        states = ckpt["rng"]
        if len(states) != runtime.world_size:
            log.print(f"note: checkpoint has RNG states of {len(states)} ranks, resuming on {runtime.world_size}")
        set_rng_state(states[runtime.rank % len(states)], runtime.device_type)
        log.print(f"resuming from {path} at step {start_step}")

    run_provenance = provenance(runtime)  # git and device queries: once per run, not per checkpoint
    # nothing is written before the config, data and checkpoint have been checked
    if runtime.is_main:
        os.makedirs(c["out_dir"], exist_ok=True)
        run_info = {"config": c, "provenance": run_provenance}
        with open(os.path.join(c["out_dir"], "config.json"), "w") as f:
            json.dump(run_info, f, indent=2)
    log.keep_steps_up_to(start_step)
    log.print(f"provenance: {json.dumps(run_provenance)}")
    log.print(f"config: {json.dumps(c)}")
    log.print(f"model: {raw_model.num_params() / 1e6:.2f}M non-embedding parameters, attn_type={c['attn_type']}; "
              f"{c['total_batch_size']:,} tokens per step = {runtime.world_size} processes x {grad_accum} "
              f"micro-steps x {c['batch_size']} x {c['block_size']}; dtype {dtype}")
    strategy = "fsdp" if sharded else "ddp" if runtime.distributed else "none: one process, nothing to shard"
    log.print(f"parallelism {strategy}; activation checkpointing {c['activation_checkpointing']}")
    if c["wandb_log"]:
        log.start_wandb(c["wandb_project"], c["wandb_group"], c["wandb_run_name"], wandb_run_id, c)
    if start_step >= c["max_iters"]:
        log.print(f"run already finished: checkpoint step {start_step} >= max_iters {c['max_iters']}")
        return

    flops_per_token = raw_model.flops_per_token(c["block_size"])
    device_peak = peak_flops(runtime.device)
    pin = runtime.device_type == "cuda"

    def fetch_batch():
        x, y = loader.next_batch()
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)

    def write_checkpoint(step, data_state):
        """Every rank calls it; returns the path written (None on ranks that write nothing)."""
        state = {"step": step, "loader": data_state, "rng": gather_rng_states(runtime), "config": c,
                 "wandb_run_id": wandb_run_id, "best_val_loss": best_val_loss, "provenance": run_provenance}
        if sharded:  # every rank writes its shards
            return save_sharded_checkpoint(raw_model, optimizer, state, c["out_dir"], step, c["keep_checkpoints"])
        if runtime.is_main:
            state.update(model=raw_model.state_dict(), optimizer=optimizer.state_dict())
            return save_checkpoint(state, c["out_dir"], step, c["keep_checkpoints"])
        return None

    batch = fetch_batch()
    skipped_steps = 0
    timed_tokens, timed_since = 0, None  # throughput excludes the first step (compile), eval and checkpoints
    for step in range(start_step + 1, c["max_iters"] + 1):
        last_step = step == c["max_iters"]
        lr = lr_at(step, c)
        for group in optimizer.param_groups:
            group["lr"] = lr

        x, y = batch
        loss_sum = torch.zeros((), device=runtime.device)
        for micro in range(grad_accum):
            rows = slice(micro * c["batch_size"], (micro + 1) * c["batch_size"])
            xb = x[rows].to(runtime.device, non_blocking=True)
            yb = y[rows].to(runtime.device, non_blocking=True)
            # gradients are reduced across processes only on the last micro-step
            with gradient_sync(train_model, micro == grad_accum - 1):
                with autocast(runtime.device_type, dtype):
                    loss = train_model(xb, yb)[1]  # the logits are not kept through the backward
                (loss / grad_accum).backward()
            loss_sum += loss.detach()
        data_state = loader.state_dict()  # the position after this step's batch
        if not last_step:
            batch = fetch_batch()  # read while the device works through the queued kernels
        grad_norm = clip_grad_norm(raw_model.parameters(), c["grad_clip"] if c["grad_clip"] > 0 else float("inf"))
        train_loss = loss_sum / grad_accum

        eval_step = step % c["eval_interval"] == 0 or last_step
        checkpoint_step = (c["checkpoint_interval"] > 0 and step % c["checkpoint_interval"] == 0) or last_step
        log_step = step % c["log_interval"] == 0 or eval_step or last_step
        # a host sync only where the answer is needed: skipping steps, or before anything is logged or saved
        if c["skip_nonfinite_steps"] or log_step or checkpoint_step:
            # grad_norm is the same on every rank after the all-reduce, so all ranks decide alike
            if not (math.isfinite(grad_norm.item()) and math.isfinite(train_loss.item())):
                skipped_steps += 1
                if skipped_steps > c["skip_nonfinite_steps"]:
                    raise TrainingStopped(
                        f"non-finite loss or gradient norm at step {step} (loss {train_loss.item()}, grad norm "
                        f"{grad_norm.item()}); stopping without writing a checkpoint of this state. The last "
                        f"checkpoint in {c['out_dir']} is intact; lower learning_rate or raise warmup_iters")
                log.print(f"step {step}: non-finite loss or gradient, step skipped "
                          f"({skipped_steps}/{c['skip_nonfinite_steps']})")
                optimizer.zero_grad(set_to_none=True)
                continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if timed_since is None:
            if runtime.device_type == "cuda":
                torch.cuda.synchronize()
            timed_since = time.perf_counter()
        else:
            timed_tokens += c["total_batch_size"]

        if log_step:
            if runtime.distributed:
                dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            if runtime.device_type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - timed_since
            tokens_per_sec = timed_tokens / elapsed if timed_tokens else None
            mfu = (flops_per_token * tokens_per_sec / (device_peak * runtime.world_size)
                   if tokens_per_sec and device_peak else None)
            record = {"step": step, "train_loss": train_loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_sec": tokens_per_sec, "mfu": mfu,
                      "peak_mem_gb": peak_memory_gb(runtime.device_type)}
            if eval_step:
                record["val_loss"] = evaluate(model, val_x, val_y, runtime, c["batch_size"], dtype)
                best_val_loss = min(best_val_loss, record["val_loss"])
            log.log(record)
            log.print(f"step {step}/{c['max_iters']} | loss {record['train_loss']:.4f} | lr {lr:.3e} | "
                      f"grad norm {record['grad_norm']:.3f} | "
                      f"{'n/a' if tokens_per_sec is None else f'{tokens_per_sec:,.0f}'} tok/s | "
                      f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                      f"peak mem {record['peak_mem_gb']:.2f} GB"
                      + (f" | val loss {record['val_loss']:.4f}" if eval_step else ""))
        if checkpoint_step:
            error = None
            try:
                path = write_checkpoint(step, data_state)
                log.print(f"saved checkpoint {path}")
            except OSError as e:
                error = e
            if not all_ranks_ok(error is None, runtime):
                raise TrainingStopped(f"checkpoint write failed at step {step}: {error or 'on another rank'}")
        if log_step or checkpoint_step:  # time spent on eval, logging and checkpoints is not throughput
            if runtime.device_type == "cuda":
                torch.cuda.synchronize()
            timed_tokens, timed_since = 0, time.perf_counter()
    log.print(f"finished {c['max_iters']} steps; best val loss {best_val_loss:.4f}")


def main():
    defaults = {k: globals()[k] for k in config_keys}
    c, config_files = load_config(defaults, source_path=__file__)
    derive_names(c, config_files)
    c["data_seed"] = c["seed"] if c["data_seed"] is None else c["data_seed"]
    c["min_lr"] = c["learning_rate"] / 10 if c["min_lr"] is None else c["min_lr"]
    runtime = setup_runtime(c["device"], c["backend"])
    log = MetricsLogger(c["out_dir"], enabled=runtime.is_main)
    status = 0
    try:
        train(c, runtime, log)
    except (TrainingStopped, ValueError, FileNotFoundError) as e:
        # a stop that relaunching cannot fix: status 3 tells scripts/train_forever.sh not to retry
        print(f"[rank {runtime.rank}] error: {e}", file=sys.stderr, flush=True)
        status = 3
    finally:
        log.finish()
        if status == 0:
            teardown_runtime(runtime)
        elif runtime.distributed and dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()
