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

Every config key, its default and meaning: train_config.py, or `python train.py --help`.
"""

import collections
import errno
import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import train_config
from checkpoint import Checkpointer, NonFiniteState, clean_run_dir, list_checkpoints, set_aside_run
from configurator import ConfigError
from dataloader import TrainLoader, val_sequences
from files import DirectoryLock, DirectoryLocked, write_atomically
from metrics import MetricsLogger, ThroughputMeter, format_count, format_duration, wandb_problem
from model import GPT
from optimizers import build_optimizer, set_hyperparameters
from parallelize import clip_grad_norm, compile_summary, gradient_sync, is_sharded, parallelize
from runtime import (DeviceError, StopSignals, autocast, enable_tf32, git_diff, peak_flops, peak_memory_gb,
                     provenance, reset_peak_memory, resolve_dtype, setup_runtime, teardown_runtime)


class TrainingStopped(RuntimeError):
    """A condition under which continuing would waste compute or corrupt the run."""


class LossSpikeGuard:
    """A finite blow-up, which the non-finite check cannot see: a train loss above `factor` x the mean of
    the recent non-spiking losses is a spike. A spiking step's state is not checkpointed (it would
    become the newest checkpoint, the one a resume takes); `steps` spikes in a row stop the run.
    Its state goes into checkpoints, so a resumed run judges its steps as the uninterrupted one."""

    def __init__(self, factor, steps, window=50):
        self.factor, self.steps = factor, steps
        self.recent = collections.deque(maxlen=window)  # the last non-spiking losses
        self.in_a_row = 0

    def is_spike(self, loss):
        """Record this step's loss; True if it is a spike."""
        if self.factor and len(self.recent) >= 3 and loss > self.factor * sum(self.recent) / len(self.recent):
            self.in_a_row += 1
            return True
        self.in_a_row = 0
        self.recent.append(loss)
        return False

    @property
    def diverged(self):
        return self.factor > 0 and self.in_a_row >= self.steps

    def state_dict(self):
        return {"recent": list(self.recent), "in_a_row": self.in_a_row}

    def load_state_dict(self, state):
        self.recent.clear()
        self.recent.extend(state["recent"])
        self.in_a_row = state["in_a_row"]


def lr_at(step, c):
    """Linear warmup to the peak, then cosine decay to min_lr at lr_decay_iters; step counts from 1."""
    if step <= c["warmup_iters"]:
        return c["learning_rate"] * step / c["warmup_iters"]
    decay_iters = c["lr_decay_iters"] or c["max_iters"]
    if step >= decay_iters:
        return c["min_lr"]
    ratio = (step - c["warmup_iters"]) / (decay_iters - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


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


@torch.no_grad()
def sample_text(model, runtime, dtype, seed, max_new_tokens=64):
    """A continuation of the end-of-text token, drawn with its own seed: the training RNG is untouched.
    Every rank samples (FSDP's forward is collective); the text is only printed by rank 0."""
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    model.eval()
    with torch.random.fork_rng(devices=[runtime.device] if runtime.device_type == "cuda" else []):
        torch.manual_seed(seed)
        prompt = torch.tensor([[enc.eot_token]], device=runtime.device)
        with autocast(runtime.device_type, dtype):
            ids = model.generate(prompt, max_new_tokens, temperature=0.8, top_k=200)[0, 1:].tolist()
    model.train()
    return enc.decode([i for i in ids if i < enc.n_vocab])  # the padded ids past GPT-2's vocabulary have no text


@dataclass
class Training:
    """What a run trains with, once set up."""
    raw_model: GPT  # the module whose parameters the optimizer and the checkpoints hold
    model: torch.nn.Module  # raw_model compiled, for evaluation (raw_model itself under FSDP)
    train_model: torch.nn.Module  # what the training step calls: DDP-wrapped, or the sharded model
    optimizer: torch.optim.Optimizer
    loader: TrainLoader
    val_x: torch.Tensor
    val_y: torch.Tensor
    checkpointer: Checkpointer
    dtype: str
    grad_accum: int  # micro-steps per optimizer step on each process


def setup(c, runtime):
    """Data, model, parallelism, optimizer and checkpointer for the run described by c."""
    dtype = resolve_dtype(c["dtype"], runtime.device_type)
    if runtime.device_type == "cuda":
        enable_tf32()
    tokens_per_micro_step = c["batch_size"] * c["block_size"] * runtime.world_size
    if c["total_batch_size"] % tokens_per_micro_step:
        raise ConfigError(f"total_batch_size={c['total_batch_size']} is not a multiple of batch_size * block_size * "
                          f"world_size = {c['batch_size']} * {c['block_size']} * {runtime.world_size}")
    loader = TrainLoader(c["data_dir"], c["block_size"], c["total_batch_size"], runtime.rank,
                         runtime.world_size, c["data_seed"], c["vocab_size"])
    val_x, val_y = val_sequences(c["data_dir"], c["block_size"], c["val_tokens"], c["vocab_size"])

    torch.manual_seed(c["seed"])  # same initialisation on every rank
    raw_model = GPT(train_config.model_config(c)).to(runtime.device)
    # the optimizer comes after parallelize: FSDP replaces the parameters with sharded ones
    model, train_model = parallelize(raw_model, runtime, dtype, parallelism=c["parallelism"], compile=c["compile"],
                                     activation_checkpointing=c["activation_checkpointing"],
                                     reshard_after_forward=c["reshard_after_forward"])
    optimizer = build_optimizer(raw_model, c, runtime.device_type)
    checkpointer = Checkpointer(c["out_dir"], c["keep_checkpoints"], raw_model, optimizer, loader, runtime,
                                sharded=is_sharded(raw_model))
    return Training(raw_model, model, train_model, optimizer, loader, val_x, val_y, checkpointer, dtype,
                    c["total_batch_size"] // tokens_per_micro_step)


def resume(c, run, runtime, log):
    """Continue from the newest readable checkpoint when c asks to; returns the run state it holds
    (step, best_val_loss, wandb_run_id, elapsed_s, loss_spike_guard), or that of a new run. From scratch,
    an out_dir holding an earlier run's checkpoints is refused unless overwrite moves them aside: a later
    resume would otherwise take whichever of the two runs saved last."""
    fresh = {"step": 0, "best_val_loss": float("inf"), "wandb_run_id": uuid.uuid4().hex[:12], "elapsed_s": 0.0,
             "loss_spike_guard": None}
    if c["init_from"] == "scratch":
        earlier = list_checkpoints(c["out_dir"])
        if earlier and not c["overwrite"]:
            raise ConfigError(f"out_dir {c['out_dir']} holds checkpoints of an earlier run (newest "
                              f"{os.path.basename(earlier[-1])}): continue it with --init_from=resume, choose "
                              f"another out_dir, or pass --overwrite=True to move its files aside")
        if earlier and runtime.is_main:
            log.print(f"overwrite: the earlier run's files are moved to {set_aside_run(c['out_dir'])}")
        return fresh
    if not list_checkpoints(c["out_dir"]):
        # nothing saved yet (a crash before the first checkpoint): resuming means starting over
        log.print(f"init_from='resume': no checkpoint in {c['out_dir']} yet, starting from scratch")
        return fresh
    path, state = run.checkpointer.resume(c)
    if path is None:
        raise FileNotFoundError(f"init_from='resume' but no checkpoint in {c['out_dir']} is readable")
    set_hyperparameters(run.optimizer, c)  # the config given now decides them, not the checkpoint
    if len(state["rng"]) != runtime.world_size:
        log.print(f"note: checkpoint has RNG states of {len(state['rng'])} ranks, resuming on {runtime.world_size}")
    saved = state["config"]
    step = state["step"]
    if step > c["warmup_iters"] and step < c["max_iters"] and lr_at(step, saved) != lr_at(step, c):
        log.print(f"warning: the learning-rate schedule differs from the checkpoint's (max_iters {saved['max_iters']} "
                  f"-> {c['max_iters']}, lr_decay_iters {saved['lr_decay_iters']} -> {c['lr_decay_iters']}): at step "
                  f"{step} the learning rate jumps from {lr_at(step, saved):.3e} to {lr_at(step, c):.3e}. To extend a "
                  f"run on its old schedule, pass --lr_decay_iters={saved['lr_decay_iters'] or saved['max_iters']}")
    log.print(f"resuming from {path} at step {step}")
    return {**fresh, **{k: state[k] for k in fresh if k in state}}


def train_loop(c, run, runtime, log, run_state, run_provenance, stop):
    """Optimizer steps from the one after run_state["step"] to max_iters, with evaluation, logging,
    samples and checkpoints at their intervals; after a stop signal, the current step's checkpoint ends it."""
    start_step, best_val_loss = run_state["step"], run_state["best_val_loss"]
    flops_per_token = run.raw_model.flops_per_token(c["block_size"])
    device_peak = peak_flops(runtime.device)
    meter = ThroughputMeter(flops_per_token, device_peak * runtime.world_size if device_peak else None,
                            runtime.device_type)
    started = time.perf_counter()  # elapsed time adds up over resumed runs; ETA uses this process's pace
    pin = runtime.device_type == "cuda"

    def elapsed():
        return run_state["elapsed_s"] + time.perf_counter() - started

    def fetch_batch():
        x, y = run.loader.next_batch()
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)

    if c["compile"]:
        log.print("compiling the model: the first evaluation and the first step take longer")
    if start_step == 0:  # the loss of the initialisation: about ln(vocab_size), a check of the setup
        val_loss = evaluate(run.model, run.val_x, run.val_y, runtime, c["batch_size"], run.dtype)
        # to the log and wandb; metrics.jsonl holds optimizer steps only, from step 1
        log.log({"step": 0, "val_loss": val_loss, "tokens": 0}, jsonl=False)
        log.print(f"step 0/{c['max_iters']} | val loss {val_loss:.4f}")

    reset_peak_memory(runtime.device_type)  # the first record's peak: training steps, not the evaluation
    spike_guard = LossSpikeGuard(c["loss_spike_factor"], c["loss_spike_steps"])
    if run_state["loss_spike_guard"]:
        spike_guard.load_state_dict(run_state["loss_spike_guard"])
    batch = fetch_batch()
    skipped_steps = 0
    first_timed_step, first_timed_at = None, None  # the ETA leaves out the first step (compilation)
    for step in range(start_step + 1, c["max_iters"] + 1):
        last_step = step == c["max_iters"]
        lr = lr_at(step, c)
        for group in run.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]  # Muon's groups may run at their own peak

        x, y = batch
        loss_sum = torch.zeros((), device=runtime.device)
        for micro in range(run.grad_accum):
            rows = slice(micro * c["batch_size"], (micro + 1) * c["batch_size"])
            xb = x[rows].to(runtime.device, non_blocking=True)
            yb = y[rows].to(runtime.device, non_blocking=True)
            # gradients are reduced across processes only on the last micro-step
            with gradient_sync(run.train_model, micro == run.grad_accum - 1):
                with autocast(runtime.device_type, run.dtype):
                    loss = run.train_model(xb, yb)[1]  # the logits are not kept through the backward
                (loss / run.grad_accum).backward()
            loss_sum += loss.detach()
        data_state = run.loader.state_dict()  # the position after this step's batch
        if not last_step:
            batch = fetch_batch()  # read while the device works through the queued kernels
        grad_norm = clip_grad_norm(run.raw_model.parameters(), c["grad_clip"] if c["grad_clip"] > 0 else float("inf"))
        train_loss = loss_sum / run.grad_accum

        # checked before every update (one small all-reduce and host sync per step): a non-finite loss or
        # gradient never reaches the weights. The same all-reduce shares a stop request (a signal may reach
        # the processes at different steps), so every rank sees the same numbers and all decide alike
        stop_votes = torch.tensor(float(stop.requested), device=runtime.device)
        if runtime.distributed:
            shared = torch.stack([train_loss, stop_votes])
            dist.all_reduce(shared)
            train_loss, stop_votes = shared[0] / runtime.world_size, shared[1]
        stopping = stop_votes.item() > 0 and not last_step
        if math.isfinite(grad_norm.item()) and math.isfinite(train_loss.item()):
            run.optimizer.step()
        else:
            skipped_steps += 1
            if skipped_steps > c["skip_nonfinite_steps"]:
                raise TrainingStopped(
                    f"non-finite loss or gradient norm at step {step} (loss {train_loss.item()}, grad norm "
                    f"{grad_norm.item()}); stopping without writing a checkpoint of this state. The last "
                    f"checkpoint in {c['out_dir']} is intact; lower learning_rate or raise warmup_iters")
            log.print(f"step {step}: non-finite loss or gradient, step skipped "
                      f"({skipped_steps}/{c['skip_nonfinite_steps']})")
        spike = math.isfinite(train_loss.item()) and spike_guard.is_spike(train_loss.item())
        if spike_guard.diverged:
            raise TrainingStopped(
                f"train loss {train_loss.item():.4g} at step {step}: {spike_guard.in_a_row} steps in a row above "
                f"loss_spike_factor={c['loss_spike_factor']:g} x its recent mean, the run diverged. The spiking "
                f"steps were not checkpointed; the checkpoints in {c['out_dir']} (the best validation loss's "
                f"among them) are intact; lower learning_rate or raise warmup_iters")

        eval_step = step % c["eval_interval"] == 0 or last_step
        checkpoint_step = (c["checkpoint_interval"] > 0 and step % c["checkpoint_interval"] == 0) or last_step \
            or stopping
        log_step = step % c["log_interval"] == 0 or eval_step or last_step or stopping
        sample_step = c["sample_interval"] > 0 and (step % c["sample_interval"] == 0 or last_step)
        run.optimizer.zero_grad(set_to_none=True)

        if meter.running:
            meter.count(c["total_batch_size"])
        if log_step or checkpoint_step or sample_step:
            meter.stop()  # evaluation, logging, samples and checkpoints are not throughput
        if log_step:
            tokens_per_sec, mfu = meter.read()
            now = time.perf_counter()
            eta = ((now - first_timed_at) / (step - first_timed_step) * (c["max_iters"] - step)
                   if first_timed_step is not None and step > first_timed_step else None)
            record = {"step": step, "train_loss": train_loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_sec": tokens_per_sec, "mfu": mfu, "peak_mem_gb": peak_memory_gb(runtime.device_type),
                      "tokens": step * c["total_batch_size"], "elapsed_s": elapsed(), "time": time.time()}
            if eval_step:
                record["val_loss"] = evaluate(run.model, run.val_x, run.val_y, runtime, c["batch_size"], run.dtype)
                best_val_loss = min(best_val_loss, record["val_loss"])
            log.log(record)
            log.print(f"step {step}/{c['max_iters']} | loss {record['train_loss']:.4f} | lr {lr:.3e} | "
                      f"grad norm {record['grad_norm']:.3f} | "
                      f"{'n/a' if tokens_per_sec is None else f'{tokens_per_sec:,.0f}'} tok/s | "
                      f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                      f"peak mem {record['peak_mem_gb']:.2f} GB | tokens {format_count(record['tokens'])} | "
                      f"elapsed {format_duration(record['elapsed_s'])} | eta {format_duration(eta)}"
                      + (f" | val loss {record['val_loss']:.4f}" if eval_step else ""))
        if sample_step:
            text = sample_text(run.raw_model, runtime, run.dtype, seed=c["seed"] + step)
            log.print(f"step {step} sample: {text!r}")
        if checkpoint_step and spike:
            log.print(f"step {step}: train loss {train_loss.item():.4g} is a spike (above loss_spike_factor="
                      f"{c['loss_spike_factor']:g} x its recent mean): no checkpoint of this state")
        elif checkpoint_step:
            run_info = {"config": c, "wandb_run_id": run_state["wandb_run_id"], "best_val_loss": best_val_loss,
                        "elapsed_s": elapsed(), "provenance": run_provenance,
                        "loss_spike_guard": spike_guard.state_dict()}
            try:
                path = run.checkpointer.save(step, data_state, run_info, val_loss=record["val_loss"] if eval_step else None)
            except NonFiniteState as e:
                raise TrainingStopped(f"{e}; lower learning_rate or raise warmup_iters") from e
            except OSError as e:
                raise TrainingStopped(f"checkpoint write failed at step {step}: {e}") from e
            log.print(f"saved checkpoint {path}")
        if stopping:
            log.print(f"stopped by {stop.name} after step {step}; continue with --init_from=resume")
            return
        if log_step:  # each record's peak memory is that of the training steps since the previous one
            reset_peak_memory(runtime.device_type)
        if first_timed_step is None:
            first_timed_step, first_timed_at = step, time.perf_counter()
            if c["compile"]:
                log.print(compile_summary())
        if not meter.running:
            meter.start()
    log.print(f"finished {c['max_iters']} steps in {format_duration(elapsed())}; best val loss {best_val_loss:.4f}")


def lock_run_dir(out_dir, runtime):
    """One run per out_dir: rank 0 takes out_dir's lock (creating out_dir), and every rank stops alike
    if another live process holds it. Returns the lock (None on the other ranks)."""
    lock, error = None, None
    if runtime.is_main:
        try:
            os.makedirs(out_dir, exist_ok=True)
            lock = DirectoryLock(out_dir, ".train.lock").acquire()
        except DirectoryLocked as e:
            error = str(e)
    if runtime.distributed:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise TrainingStopped(f"{error}; two runs in one out_dir would interleave their checkpoints and logs")
    return lock


def train(c, runtime, log, stop):
    """The training run described by the resolved config c: setup, resume, loop."""
    run = setup(c, runtime)
    lock = lock_run_dir(c["out_dir"], runtime)
    try:
        if runtime.is_main:
            clean_run_dir(c["out_dir"])  # left by a process killed mid-write
        if runtime.distributed:
            dist.barrier()
        run_state = resume(c, run, runtime, log)
        if runtime.distributed:
            dist.barrier()  # an overwritten run's files are moved aside before anyone writes
        run_provenance = provenance(runtime)  # git and device queries: once per run, not per checkpoint
        if runtime.is_main:
            info = json.dumps({"config": c, "provenance": run_provenance}, indent=2)
            write_atomically(os.path.join(c["out_dir"], "config.json"), lambda f: f.write(info.encode()))
            if run_provenance["git_dirty"]:  # the commit alone would not reproduce this run
                diff = git_diff() or ""
                write_atomically(os.path.join(c["out_dir"], "git.diff"), lambda f: f.write(diff.encode()))
        log.keep_steps_up_to(run_state["step"])
        log.print(f"provenance: {json.dumps(run_provenance)}")
        log.print(f"config: {json.dumps(c)}")
        log.print(f"model: {run.raw_model.num_params() / 1e6:.2f}M non-embedding parameters, attn_type={c['attn_type']}; "
                  f"{c['total_batch_size']:,} tokens per step = {runtime.world_size} processes x {run.grad_accum} "
                  f"micro-steps x {c['batch_size']} x {c['block_size']}; dtype {run.dtype}")
        strategy = ("fsdp" if run.checkpointer.sharded else "ddp" if runtime.distributed
                    else "none: one process, nothing to shard")
        log.print(f"parallelism {strategy}; activation checkpointing {c['activation_checkpointing']}")
        if c["wandb_log"]:
            log.start_wandb(c["wandb_project"], c["wandb_group"], c["wandb_run_name"], run_state["wandb_run_id"], c)
        if run_state["step"] >= c["max_iters"]:
            log.print(f"run already finished: checkpoint step {run_state['step']} >= max_iters {c['max_iters']}")
            return
        train_loop(c, run, runtime, log, run_state, run_provenance, stop)
    finally:
        if lock:
            lock.release()


# exit statuses, for scripts/train_forever.sh and schedulers: only a crash (1, or a signal's default
# action) is worth relaunching as it is
EXIT_CONFIG_ERROR = 2  # a bad config, or an out_dir holding another run's checkpoints: nothing was started
EXIT_STOPPED = 3  # bad data, an unusable checkpoint, a diverged run, a full disk, out_dir in use
# and, with a checkpoint of the step it stopped after: 130 stopped by SIGINT (Ctrl-C), 143 by SIGTERM


def run(argv):
    """The whole run; returns its exit status. An error that a relaunch cannot fix ends in one line."""
    try:
        c, _ = train_config.resolve(argv)
        if c["wandb_log"] and (problem := wandb_problem()):
            raise ConfigError(problem)
        runtime = setup_runtime(c["device"], c["backend"])
    except (ConfigError, DeviceError) as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    # under torchrun the launcher forwards a signal it got to the ranks as well: one stop, not two
    stop = StopSignals(ignore_repeats=runtime.distributed)
    log = MetricsLogger(c["out_dir"], enabled=runtime.is_main)
    status = 0
    try:
        train(c, runtime, log, stop)
        status = stop.exit_status or 0
    except ConfigError as e:  # found only once the world size or out_dir is known
        print(f"[rank {runtime.rank}] config error: {e}", file=sys.stderr, flush=True)
        status = EXIT_CONFIG_ERROR
    except (TrainingStopped, ValueError, FileNotFoundError, PermissionError, NotADirectoryError) as e:
        print(f"[rank {runtime.rank}] error: {e}", file=sys.stderr, flush=True)
        status = EXIT_STOPPED
    except KeyboardInterrupt:  # a second Ctrl-C: at once, without the checkpoint the first one asked for
        print(f"[rank {runtime.rank}] interrupted; the checkpoints in {c['out_dir']} are intact",
              file=sys.stderr, flush=True)
        status = stop.exit_status or 130
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):  # a full or read-only disk
            raise  # possibly passing (a network filesystem): a relaunch may get past it
        print(f"[rank {runtime.rank}] error: {e} (in {c['out_dir']})", file=sys.stderr, flush=True)
        status = EXIT_STOPPED
    finally:
        log.finish()
        if status == 0:
            teardown_runtime(runtime)
        elif runtime.distributed and dist.is_initialized():
            dist.destroy_process_group()
    return status


def main():
    status = run(sys.argv[1:])
    # torchrun and srun exit 1 whatever their processes chose: a launching script reads the status here
    if status and os.environ.get("TRAIN_EXIT_STATUS_FILE"):
        write_atomically(os.environ["TRAIN_EXIT_STATUS_FILE"], lambda f: f.write(f"{status}\n".encode()))
    sys.exit(status)


if __name__ == "__main__":
    main()
