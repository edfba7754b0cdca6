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

Every config key, its default and meaning: pretrain/train_config.py, or `python train.py --help`.
"""

import collections
import errno
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from configurator import ConfigError
from eval.common import TokenizerUnavailable, gpt2_encoding
from eval.downstream import InLoopDownstream
from eval.similarity import in_loop_record as similarity_record
from model import GPT
from pretrain import exits, train_config
from pretrain.checkpointer import (Checkpointer, NonFiniteState, RunState, clean_run_dir, list_checkpoints,
                                   lock_run_dir, record_run, set_aside_run)
from pretrain.dataloader import TrainLoader, val_sequences
from pretrain.exits import TrainingStopped
from pretrain.files import write_atomically
from pretrain.guards import Guards
from pretrain.metrics import MetricsLogger, ThroughputMeter, format_count, format_duration, wandb_problem
from pretrain.optimizers import build_optimizer, set_hyperparameters
from pretrain.parallelize import clip_grad_norm, compile_summary, gradient_sync, is_sharded, parallelize
from pretrain.runtime import (DeviceError, StopSignals, autocast, enable_tf32, peak_flops, peak_memory_gb,
                              provenance, reset_peak_memory, resolve_dtype, setup_runtime, teardown_runtime)


def lr_at(step, c):
    """Linear warmup to the peak, then cosine decay to min_lr at lr_decay_iters; step counts from 1.
"""
    if step <= c.warmup_iters:
        return c.learning_rate * step / c.warmup_iters
    decay_iters = c.lr_decay_iters or c.max_iters
    if step >= decay_iters:
        return c.min_lr
    ratio = (step - c.warmup_iters) / (decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


def token_bytes(vocab_size, log):
    """The UTF-8 bytes of each token id's text under GPT-2's encoding (the shards' tokenizer), (vocab_size,)
    int16: 0 for the end-of-text token and the padded ids past the vocabulary, which are no text, so that bits
    per byte count neither their loss nor their bytes. None, with a line in the log, where the encoding
    cannot be loaded (offline without tiktoken's cache): the run then logs no val_bpb."""
    try:
        enc = gpt2_encoding()
    except TokenizerUnavailable as e:
        log.print(f"val_bpb is not logged: {e}")
        return None
    counts = [0] * vocab_size  # a list, then one tensor: 50K tensor element writes take a quarter of a second
    for token in range(min(vocab_size, enc.n_vocab)):
        if token != enc.eot_token:
            counts[token] = len(enc.decode_single_token_bytes(token))
    return torch.tensor(counts, dtype=torch.int16)


@torch.no_grad()
def evaluate(model, val_x, val_y, runtime, batch_size, dtype, val_bytes=None):
    """(mean loss, bits per byte) over the fixed validation tokens; rank r scores sequences r, r+W, r+2W, ...
    Every rank runs the same number of forwards (FSDP's forward is collective). val_bytes: the UTF-8 bytes of
    each target token (val_y's shape; 0: not text), or None: no bits per byte (None)."""
    model.eval()
    mine = torch.arange(runtime.rank, len(val_x), runtime.world_size)
    # loss sum, token count; for bits per byte, the loss sum over the text tokens and their bytes
    totals = torch.zeros(4, dtype=torch.float64, device=runtime.device)
    per_rank = math.ceil(len(val_x) / runtime.world_size)
    for i in range(0, per_rank, batch_size):
        rows = mine[i:i + batch_size]
        scored = len(rows)  # the last batch may be short, or empty where this rank has run out of sequences
        # every forward has the batch's shape, a short one filled up with sequence 0 and not scored: a compiled
        # model compiles evaluation once, and training keeps static shapes (a second batch size would make
        # dynamo recompile with the batch dimension dynamic)
        padded = torch.cat((rows, torch.zeros(batch_size - scored, dtype=torch.long)))
        x = val_x[padded].to(runtime.device)
        with autocast(runtime.device_type, dtype):
            logits, _ = model(x)
        if scored:
            logits, y = logits[:scored], val_y[rows].to(runtime.device)
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
            totals[0] += losses.sum()
            totals[1] += y.numel()
            if val_bytes is not None:
                n_bytes = val_bytes[rows].to(runtime.device).flatten()
                totals[2] += losses[n_bytes > 0].sum()
                totals[3] += n_bytes.sum()
    if runtime.distributed:
        dist.all_reduce(totals)
    model.train()
    loss_sum, n_tokens, text_loss_sum, n_bytes = totals.tolist()
    return loss_sum / n_tokens, (text_loss_sum / math.log(2) / n_bytes if val_bytes is not None else None)


@torch.no_grad()
def sample_text(model, runtime, dtype, seed, max_new_tokens=64):
    """A continuation of the end-of-text token, drawn with its own seed: the training RNG is untouched.
    Every rank samples (FSDP's forward is collective); the text is only printed by rank 0. Eagerly, as the
    similarity and downstream passes run: under FSDP the blocks are compiled one by one, and decoding with the
    KV cache (a new length at every token) would recompile them up to dynamo's limit and then fall back to eager
    anyway, quietly. FlexAttention (attn_mask="document") runs eagerly here too: slower, and a dense score
    matrix per head, which at 64 tokens of one sequence costs nothing."""
    enc = gpt2_encoding()
    model.eval()
    with torch.random.fork_rng(devices=[runtime.device] if runtime.device_type == "cuda" else []):
        torch.manual_seed(seed)
        prompt = torch.tensor([[enc.eot_token]], device=runtime.device)
        with autocast(runtime.device_type, dtype), torch.compiler.set_stance("force_eager"):
            ids = model.generate(prompt, max_new_tokens, temperature=0.8, top_k=200)[0, 1:].tolist()
    model.train()
    return enc.decode([i for i in ids if i < enc.n_vocab])  # the padded ids past GPT-2's vocabulary have no text


# -----------------------------------------------------------------------------
# One step, judged by the guards (pretrain/guards.py); scripts/bench.py times this very step

class TrainStep:
    """One optimizer step, as train.py runs it and scripts/bench.py times it: grad_accum micro-steps of forward
    and backward (gradients reduced across processes on the last one only), the global gradient norm
    clipped, the guards' verdict, then the update unless they refuse it (a non-finite step)."""

    def __init__(self, train_model, raw_model, optimizer, guards, runtime, dtype, batch_size, grad_accum, grad_clip):
        self.train_model, self.raw_model, self.optimizer, self.guards = train_model, raw_model, optimizer, guards
        self.runtime, self.dtype = runtime, dtype
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")

    def __call__(self, step, x, y, lr, meanwhile=None):
        """x, y: this process's batch, grad_accum x batch_size sequences. meanwhile: called once the
        backward is queued and before the host waits for the device (reading the next batch)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]  # Muon's groups may run at their own peak
        loss_sum = torch.zeros((), device=self.runtime.device)
        for micro in range(self.grad_accum):
            rows = slice(micro * self.batch_size, (micro + 1) * self.batch_size)
            xb = x[rows].to(self.runtime.device, non_blocking=True)
            yb = y[rows].to(self.runtime.device, non_blocking=True)
            with gradient_sync(self.train_model, micro == self.grad_accum - 1):
                with autocast(self.runtime.device_type, self.dtype):
                    loss = self.train_model(xb, yb)[1]  # the logits are not kept through the backward
                (loss / self.grad_accum).backward()
            loss_sum += loss.detach()
        if meanwhile:
            meanwhile()
        grad_norm = clip_grad_norm(self.raw_model.parameters(), self.max_norm)
        result = self.guards.judge(step, loss_sum / self.grad_accum, grad_norm)
        if math.isfinite(result.loss) and math.isfinite(result.grad_norm):  # else skipped (Guards)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result


# -----------------------------------------------------------------------------
# The run: setup, the starting state, the loop

@dataclass
class Training:
    """What a run trains with, once set up."""
    raw_model: GPT  # the module whose parameters the optimizer and the checkpoints hold
    model: torch.nn.Module  # raw_model compiled, for evaluation (raw_model itself under FSDP)
    optimizer: torch.optim.Optimizer
    loader: TrainLoader
    val_x: torch.Tensor
    val_y: torch.Tensor
    val_bytes: torch.Tensor | None  # the UTF-8 bytes of each token of val_y, for bits per byte (token_bytes)
    downstream: InLoopDownstream | None  # the downstream tasks, where downstream_interval > 0
    checkpointer: Checkpointer
    guards: Guards
    train_step: TrainStep
    dtype: str
    grad_accum: int  # micro-steps per optimizer step on each process


def build_model(c, runtime, dtype):
    """(raw model, model to evaluate, model to train, optimizer) of config c on this process's device:
    the same initialisation on every rank, fitted to the processes by parallelize."""
    torch.manual_seed(c.seed)
    raw_model = GPT(c.model_config()).to(runtime.device)
    # the optimizer comes after parallelize: FSDP replaces the parameters with sharded ones
    model, train_model = parallelize(raw_model, runtime, dtype, parallelism=c.parallelism, compile=c.compile,
                                     activation_checkpointing=c.activation_checkpointing,
                                     reshard_after_forward=c.reshard_after_forward)
    return raw_model, model, train_model, build_optimizer(raw_model, c, runtime.device_type)


def check_in_loop_passes(c, runtime):
    """What the in-loop passes need, checked before the model is built and anything is written: GPT-2's encoding
    (downstream scoring and samples; TrainingStopped, exit 3, where it cannot be loaded), and the downstream tasks,
    loaded and checked (InLoopDownstream: an unknown task, one with no accuracy or a continuation longer than
    block_size is a ConfigError, exit 2; unreadable data exits 3). Returns the InLoopDownstream, or None.
    Under torchrun the processes then agree: where one failed, every one ends with its status, so that none
    is left waiting in a collective for it."""
    downstream, problem, status = None, None, 0
    try:
        if c.downstream_interval or c.sample_interval:
            try:
                gpt2_encoding()
            except TokenizerUnavailable as e:
                uses = [what for what, interval in (("downstream_interval", c.downstream_interval),
                                                    ("sample_interval", c.sample_interval)) if interval]
                raise TrainingStopped(f"{e}; or set {' and '.join(f'{u}=0' for u in uses)}") from None
        if c.downstream_interval:
            downstream = InLoopDownstream(c.downstream_tasks, c.downstream_limit, c.downstream_include_path, runtime,
                                          c.block_size)
    except ConfigError as e:
        problem, status = e, exits.CONFIG_ERROR
    except TrainingStopped as e:
        problem, status = e, exits.STOPPED
    except SystemExit as e:  # load_tasks: one line said, exits.fail's status
        problem = exits.Reported(e.code if isinstance(e.code, int) else exits.STOPPED)
        status = problem.status
    if runtime.distributed:
        verdict = torch.tensor([status], device=runtime.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if problem is None and verdict.item():
            problem = (ConfigError if verdict.item() == exits.CONFIG_ERROR else TrainingStopped)(
                "another process failed the checks before step 1 (its line says why)")
    if problem is not None:
        raise problem
    return downstream


def setup(c, runtime, log, stop_signals, run_provenance):
    """Data, model, parallelism, optimizer, guards and checkpointer for the run described by c."""
    dtype = resolve_dtype(c.dtype, runtime.device_type)
    if runtime.device_type == "cuda":
        enable_tf32()
    tokens_per_micro_step = c.batch_size * c.block_size * runtime.world_size
    if c.total_batch_size % tokens_per_micro_step:
        raise ConfigError(f"total_batch_size={c.total_batch_size} is not a multiple of batch_size * block_size * "
                          f"world_size = {c.batch_size} * {c.block_size} * {runtime.world_size}")
    grad_accum = c.total_batch_size // tokens_per_micro_step
    loader = TrainLoader(c.data_dir, c.block_size, c.total_batch_size, runtime.rank, runtime.world_size,
                         c.data_seed, c.vocab_size)
    val_x, val_y = val_sequences(c.data_dir, c.block_size, c.val_tokens, c.vocab_size)
    byte_counts = token_bytes(c.vocab_size, log)
    val_bytes = None if byte_counts is None else byte_counts[val_y]
    downstream = check_in_loop_passes(c, runtime)
    raw_model, model, train_model, optimizer = build_model(c, runtime, dtype)
    checkpointer = Checkpointer(c.out_dir, c.keep_checkpoints, raw_model, optimizer, loader, runtime,
                                sharded=is_sharded(raw_model), config=c.to_dict(), provenance=run_provenance)
    guards = Guards(c, runtime, stop_signals, log)
    step = TrainStep(train_model, raw_model, optimizer, guards, runtime, dtype, c.batch_size, grad_accum, c.grad_clip)
    return Training(raw_model, model, optimizer, loader, val_x, val_y, val_bytes, downstream, checkpointer, guards,
                    step, dtype, grad_accum)


def starting_state(c, training, runtime, log):
    """The RunState to start from: the newest readable checkpoint's when c asks to resume (model,
    optimizer, loader and RNGs restored), else a new run's. From scratch, an out_dir holding an earlier
    run's checkpoints is refused unless overwrite moves them aside: a later resume would otherwise take
    whichever of the two runs saved last."""
    if c.init_from == "scratch":
        earlier = list_checkpoints(c.out_dir)
        if earlier and not c.overwrite:
            raise ConfigError(f"out_dir {c.out_dir} holds checkpoints of an earlier run (newest "
                              f"{os.path.basename(earlier[-1])}): continue it with --init_from=resume, choose "
                              f"another out_dir, or pass --overwrite=True to move its files aside")
        if earlier and runtime.is_main:
            log.print(f"overwrite: the earlier run's files are moved to {set_aside_run(c.out_dir)}")
        return RunState()
    if not list_checkpoints(c.out_dir):
        # nothing saved yet (a crash before the first checkpoint): resuming means starting over
        log.print(f"init_from='resume': no checkpoint in {c.out_dir} yet, starting from scratch")
        return RunState()
    path, state, saved = training.checkpointer.load_newest(c.to_dict())
    if path is None:
        raise FileNotFoundError(f"init_from='resume' but no checkpoint in {c.out_dir} is readable")
    set_hyperparameters(training.optimizer, c)  # the config given now decides them, not the checkpoint
    if state.guards:
        training.guards.load_state_dict(state.guards)
    if len(saved["rng"]) != runtime.world_size:
        log.print(f"note: checkpoint has RNG states of {len(saved['rng'])} ranks, resuming on {runtime.world_size}")
    before, step = train_config.TrainConfig.from_dict(saved["config"]), state.step
    if c.warmup_iters < step < c.max_iters and lr_at(step, before) != lr_at(step, c):
        log.print(f"warning: the learning-rate schedule differs from the checkpoint's (max_iters {before.max_iters} "
                  f"-> {c.max_iters}, lr_decay_iters {before.lr_decay_iters} -> {c.lr_decay_iters}): at step "
                  f"{step} the learning rate jumps from {lr_at(step, before):.3e} to {lr_at(step, c):.3e}. To extend "
                  f"a run on its old schedule, pass --lr_decay_iters={before.lr_decay_iters or before.max_iters}")
    if (tasks_then := in_loop_tasks(before)) != (tasks_now := in_loop_tasks(c)) and c.downstream_interval:
        log.print(f"warning: the downstream tasks differ from the checkpoint's ({', '.join(tasks_then) or 'none'} -> "
                  f"{', '.join(tasks_now)}): downstream/avg after step {step} averages other tasks than before it")
    log.print(f"resuming from {path} at step {step}")
    return state


def in_loop_tasks(c):
    """The downstream tasks config c evaluates in the loop, sorted (none where downstream_interval is 0)."""
    return sorted(c.downstream_tasks.replace(",", " ").split()) if c.downstream_interval else []


@dataclass
class StepPlan:
    """What a step does besides training, decided from the config and the step alone (and a stop)."""
    evaluate: bool
    similarity: bool  # the similarity bias on the fixed val batch
    downstream: bool  # the downstream tasks
    log: bool
    sample: bool
    checkpoint: bool
    stop: bool  # a signal asked to stop: after this step's checkpoint

    @classmethod
    def at(cls, step, c, stop_requested):
        last = step == c.max_iters
        stop = stop_requested and not last
        evaluate = step % c.eval_interval == 0 or last
        similarity = c.similarity_interval > 0 and (step % c.similarity_interval == 0 or last)
        downstream = c.downstream_interval > 0 and (step % c.downstream_interval == 0 or last)
        return cls(evaluate=evaluate, similarity=similarity, downstream=downstream,
                   log=step % c.log_interval == 0 or evaluate or similarity or downstream or last or stop,
                   sample=c.sample_interval > 0 and (step % c.sample_interval == 0 or last),
                   checkpoint=(c.checkpoint_interval > 0 and step % c.checkpoint_interval == 0) or last or stop,
                   stop=stop)


class Pace:
    """Training time and speed: tokens/s and MFU over the steps alone (not evaluation, logging, samples,
    checkpoints, nor the first step, which compiles), the elapsed training time of the whole run (over
    resumed processes) and the time left at this process's pace."""

    def __init__(self, training, c, runtime, elapsed_before):
        peak = peak_flops(runtime.device)
        self.meter = ThroughputMeter(training.raw_model.flops_per_token(c.block_size),
                                     peak * runtime.world_size if peak else None, runtime.device_type)
        self.started, self.elapsed_before = time.perf_counter(), elapsed_before
        self.first_timed = None  # (step, time) after the first step

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.started

    def eta(self, step, max_iters):
        if self.first_timed is None or step <= self.first_timed[0]:
            return None
        first_step, first_time = self.first_timed
        return (time.perf_counter() - first_time) / (step - first_step) * (max_iters - step)

    def step_done(self, tokens, timed):
        """After a step's training: count its tokens if timed; stop the clock for what follows unless timed."""
        if self.meter.running:
            self.meter.count(tokens)
        if not timed:
            self.meter.stop()

    def restart_clock(self, step):
        """After a step's evaluation, logging and checkpoint: the clock runs again for the next step."""
        if self.first_timed is None:
            self.first_timed = (step, time.perf_counter())
        if not self.meter.running:
            self.meter.start()


def validate(c, training, runtime, plan):
    """This step's validation, as plan says: {"val_loss", "val_bpb"} (or {}), before its checkpoint, which keeps the
    best val_loss; with the seconds it took (for the log only)."""
    if not plan.evaluate:
        return {}, {}
    started = time.perf_counter()
    val_loss, val_bpb = evaluate(training.model, training.val_x, training.val_y, runtime, c.batch_size, training.dtype, training.val_bytes)
    return {"val_loss": val_loss, "val_bpb": val_bpb}, {"val": time.perf_counter() - started}


def in_loop_passes(c, training, runtime, plan, step, measured, seconds):
    """This step's in-loop passes, as plan says, after its checkpoint: the similarity bias (similarity/...) and the
    downstream accuracies (downstream/...) into measured, the seconds each took into seconds. Returns None, or
    the InLoopFailure that ends the run (exit 3: a relaunch would fail the same way) where a pass raised. Every process runs the same passes (their exceptions are raised on every
    one: InLoopDownstream shares the main process's failure to read lm-eval's results)."""
    passes = [("similarity", plan.similarity,  # on the eager model: its hooks read each block's attention input
               lambda: similarity_record(training.raw_model, training.val_x[:c.batch_size], runtime, training.dtype)),
              ("downstream", plan.downstream, lambda: training.downstream(training.raw_model, runtime, training.dtype, c.batch_size))]
    for name, due, measure in passes:
        if not due:
            continue
        started = time.perf_counter()
        try:
            measured.update(measure())
        except Exception as e:
            return InLoopFailure(name, step, e)
        seconds[name] = time.perf_counter() - started
    return None


class InLoopFailure(TrainingStopped):
    """An in-loop pass (similarity, downstream, sample) that raised at a step: the run ends with exit status 3, in
    one line naming the pass and the step, after the step's checkpoint."""

    def __init__(self, name, step, e):
        super().__init__(f"the in-loop {name} pass failed at step {step} ({exits.one_line(e)})")
        self.name, self.step = name, step

    def after(self, checkpoint):
        """The line to end with, once checkpoint (a path, or None: none was written) is."""
        kept = f"step {self.step} is checkpointed ({checkpoint})" if checkpoint else "no checkpoint of this step"
        return TrainingStopped(f"{self.args[0]}; {kept}; fix its cause, or turn the pass off "
                               f"({self.name}_interval=0), and continue with --init_from=resume")


def log_step(log, c, step, lr, result, pace, measured, seconds):
    """One record in metrics.jsonl (and wandb) and a line in the log, with one more for the similarity bias
    and one for the downstream tasks where this step measured them."""
    tokens_per_sec, mfu = pace.meter.read()
    record = {"step": step, "train_loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
              "tokens_per_sec": tokens_per_sec, "mfu": mfu, "peak_mem_gb": peak_memory_gb(pace.meter.device_type),
              "tokens": step * c.total_batch_size, "elapsed_s": pace.elapsed(), "time": time.time()}
    record.update((k, v) for k, v in measured.items() if v is not None)
    val_loss, val_bpb = measured.get("val_loss"), measured.get("val_bpb")
    log.log(record)
    log.print(f"step {step}/{c.max_iters} | loss {result.loss:.4f} | lr {lr:.3e} | grad norm {result.grad_norm:.3f} | "
              f"{'n/a' if tokens_per_sec is None else f'{tokens_per_sec:,.0f}'} tok/s | "
              f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | peak mem {record['peak_mem_gb']:.2f} GB | "
              f"tokens {format_count(record['tokens'])} | elapsed {format_duration(record['elapsed_s'])} | "
              f"eta {format_duration(pace.eta(step, c.max_iters))}"
              + (f" | val loss {val_loss:.4f}" if val_loss is not None else "")
              + (f" | val bpb {val_bpb:.4f}" if val_bpb is not None else ""))
    if "similarity" in seconds:
        layers = " ".join(f"{measured[f'similarity/layer{i}/cos_yv']:.3f}" for i in range(c.n_layer))
        log.print(f"step {step} similarity | mean cos(y, v) {measured['similarity/mean_cos_yv']:.4f} | by layer "
                  f"{layers} | {seconds['similarity']:.1f}s")
    if "downstream" in seconds:
        tasks = " | ".join(f"{k.removeprefix('downstream/')} {v:.4f}" for k, v in measured.items()
                           if k.startswith("downstream/") and k != "downstream/avg")
        log.print(f"step {step} downstream | avg {measured['downstream/avg']:.4f} | {tasks} | "
                  f"{seconds['downstream']:.1f}s")


def write_step_checkpoint(training, state, loader_position, result, val_loss, c, log):
    """The checkpoint of this step (its path), unless its loss spiked (None); a failed write or a non-finite state
    stops the run."""
    if result.spike:
        if state.step == c.max_iters:  # done, but without a final state worth keeping: not a finished run
            raise TrainingStopped(f"the last step's train loss spiked ({result.loss:.4g}): no final checkpoint "
                                  f"was written; resume from the newest checkpoint in {c.out_dir}, with a lower "
                                  f"learning_rate if it spikes again")
        log.print(f"step {state.step}: no checkpoint of this state (a spike)")
        return None
    state.guards = training.guards.state_dict()
    try:
        path = training.checkpointer.save(state, loader_position, val_loss=val_loss)
    except NonFiniteState as e:
        raise TrainingStopped(f"{e}; lower learning_rate or raise warmup_iters") from e
    except OSError as e:
        raise TrainingStopped(f"checkpoint write failed at step {state.step}: {e}") from e
    log.print(f"saved checkpoint {path}")
    return path


def train_loop(c, training, runtime, log, state):
    """Optimizer steps from the one after state.step to max_iters, with evaluation, logging, samples and
    checkpoints where StepPlan says; after a stop signal, the current step's checkpoint ends it.
    Returns the exit status: 0, or the stop signal's."""
    if c.compile:
        log.print("compiling the model: the first evaluation and the first step take longer")
    if state.step == 0:  # the loss of the initialisation: about ln(vocab_size), a check of the setup
        val_loss, _ = evaluate(training.model, training.val_x, training.val_y, runtime, c.batch_size, training.dtype)
        log.log({"step": 0, "val_loss": val_loss, "tokens": 0}, jsonl=False)  # metrics.jsonl: from step 1
        log.print(f"step 0/{c.max_iters} | val loss {val_loss:.4f}")
    pace = Pace(training, c, runtime, state.elapsed_s)
    reset_peak_memory(runtime.device_type)  # the first record's peak: training steps, not the evaluation
    pin = runtime.device_type == "cuda"
    batches = collections.deque()  # the next batch, read while the device works through the current step

    def read_batch():
        x, y = training.loader.next_batch()
        batches.append((x.pin_memory(), y.pin_memory(), training.loader.state_dict()) if pin else
                       (x, y, training.loader.state_dict()))  # with the loader's position after it

    read_batch()
    if c.attn_mask == "document" and not (batches[0][0] == c.eot_token).any():
        log.print(f'attn_mask="document" found no eot_token ({c.eot_token}) in the first batch: its mask is the '
                  f'causal one; check eot_token against the tokenizer of {c.data_dir}')
    for step in range(state.step + 1, c.max_iters + 1):
        x, y, loader_position = batches.popleft()
        lr = lr_at(step, c)
        result = training.train_step(step, x, y, lr, meanwhile=read_batch if step < c.max_iters else None)
        plan = StepPlan.at(step, c, stop_requested=result.stop_signal is not None)
        state.step = step
        if spiked := training.checkpointer.judge(state, step, result.blew_up):
            log.print(f"step {step}: set aside {spiked}, the checkpoint whose weights gave this step's loss")
        if result.failure:
            raise TrainingStopped(result.failure)
        pace.step_done(c.total_batch_size, timed=not (plan.log or plan.checkpoint or plan.sample))
        measured, seconds = validate(c, training, runtime, plan)
        val_loss = measured.get("val_loss")
        if val_loss is not None:
            state.best_val_loss = min(state.best_val_loss, val_loss)
        checkpoint = None
        in_loop = plan.similarity or plan.downstream
        if plan.log and not in_loop:  # the record before the checkpoint: a kill between the two loses no record
            log_step(log, c, step, lr, result, pace, measured, seconds)
        if plan.checkpoint:  # before the in-loop passes: a failure in one of them never costs the step's training
            state.elapsed_s = pace.elapsed()
            checkpoint = write_step_checkpoint(training, state, loader_position, result, val_loss, c, log)
        failure = in_loop_passes(c, training, runtime, plan, step, measured, seconds)
        if (plan.log and in_loop) or (failure and not plan.log):  # the record with what the passes measured
            log_step(log, c, step, lr, result, pace, measured, seconds)
        if plan.sample and not failure:
            try:
                text = sample_text(training.raw_model, runtime, training.dtype, seed=c.seed + step)
                log.print(f"step {step} sample: {text!r}")
            except Exception as e:
                failure = InLoopFailure("sample", step, e)
        if failure:  # the training so far is kept: this step is checkpointed if it was not yet
            if not plan.checkpoint:
                state.elapsed_s = pace.elapsed()
                checkpoint = write_step_checkpoint(training, state, loader_position, result, val_loss, c, log)
            raise failure.after(checkpoint)
        if plan.stop:
            training.checkpointer.finish(state)
            log.print(f"stopped by {signal.Signals(result.stop_signal).name} after step {step}; "
                      f"continue with --init_from=resume")
            return exits.SIGNALLED[result.stop_signal]
        if plan.log:  # each record's peak memory is that of the training steps since the previous one
            reset_peak_memory(runtime.device_type)
        if pace.first_timed is None and c.compile:
            log.print(compile_summary())
        pace.restart_clock(step)
    training.checkpointer.finish(state)
    log.print(f"finished {c.max_iters} steps in {format_duration(pace.elapsed())}; "
              f"best val loss {state.best_val_loss:.4f}")
    return exits.SIGNALLED[result.stop_signal] if result.stop_signal else 0  # a signal at the last step


def describe_run(c, training, runtime, log, run_provenance):
    """The run's description in the log: provenance, config, model, batch and parallelism."""
    log.print(f"provenance: {json.dumps(run_provenance)}")
    log.print(f"config: {json.dumps(c.to_dict())}")
    log.print(f"model: {training.raw_model.num_params() / 1e6:.2f}M non-embedding parameters, attn_type={c.attn_type}; "
              f"{c.total_batch_size:,} tokens per step = {runtime.world_size} processes x {training.grad_accum} "
              f"micro-steps x {c.batch_size} x {c.block_size}; dtype {training.dtype}")
    strategy = ("fsdp" if training.checkpointer.sharded else "ddp" if runtime.distributed
                else "none: one process, nothing to shard")
    log.print(f"parallelism {strategy}; activation checkpointing {c.activation_checkpointing}")


def train(c, runtime, log, stop_signals):
    """The training run described by the resolved config c: setup, starting state, loop. Returns the exit status."""
    run_provenance = provenance(runtime)  # git and device queries: once per run, not per checkpoint
    training = setup(c, runtime, log, stop_signals, run_provenance)
    lock = lock_run_dir(c.out_dir, runtime)
    try:
        if runtime.is_main:
            clean_run_dir(c.out_dir)  # left by a process killed mid-write
        if runtime.distributed:
            dist.barrier()
        state = starting_state(c, training, runtime, log)
        if runtime.distributed:
            dist.barrier()  # an overwritten run's files are moved aside before anyone writes
        if runtime.is_main:
            record_run(c.out_dir, c.to_dict(), run_provenance)
        describe_run(c, training, runtime, log, run_provenance)
        log.keep_steps_up_to(state.step)
        if c.wandb_log:
            log.start_wandb(c.wandb_project, c.wandb_group, c.wandb_run_name, state.wandb_run_id, c.to_dict())
        if state.step >= c.max_iters:
            log.print(f"run already finished: checkpoint step {state.step} >= max_iters {c.max_iters}")
            return 0
        return train_loop(c, training, runtime, log, state)
    finally:
        if lock:
            lock.release()


def run(argv):
    """The whole run; returns its exit status (exits.py). An error that a relaunch cannot fix ends in one line."""
    try:
        c, _ = train_config.resolve(argv)
        if c.wandb_log and (problem := wandb_problem()):
            raise ConfigError(problem)
        runtime = setup_runtime(c.device, c.backend, c.dist_timeout_s)
    except (ConfigError, DeviceError) as e:
        return exits.error(f"config error: {e}", exits.CONFIG_ERROR)
    # under torchrun the launcher forwards a signal it got to the ranks as well: one stop, not two
    stop_signals = StopSignals(ignore_repeats=runtime.distributed)
    log = MetricsLogger(c.out_dir, enabled=runtime.is_main)
    status = None  # stays None when an exception escapes: no barrier then, the other ranks may never reach it
    try:
        status = train(c, runtime, log, stop_signals)
    except exits.Reported as e:  # its line is already on stderr
        status = e.status
    except ConfigError as e:  # found only once the world size or out_dir is known
        status = exits.error(f"[rank {runtime.rank}] config error: {e}", exits.CONFIG_ERROR)
    except (TrainingStopped, ValueError, FileNotFoundError, PermissionError, NotADirectoryError) as e:
        status = exits.error(f"[rank {runtime.rank}] error: {e}", exits.STOPPED)
    except KeyboardInterrupt:  # a second Ctrl-C: at once, without the checkpoint the first one asked for
        status = exits.error(f"[rank {runtime.rank}] interrupted; the checkpoints in {c.out_dir} are intact",
                             stop_signals.exit_status or exits.SIGNALLED[signal.SIGINT])
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):  # a full or read-only disk
            raise  # possibly passing (a network filesystem): a relaunch may get past it
        status = exits.error(f"[rank {runtime.rank}] error: {e} (in {c.out_dir})", exits.STOPPED)
    except RuntimeError as e:  # gloo's and NCCL's errors in a collective are RuntimeErrors
        if not runtime.distributed or not (failure := collective_failure(e, c)):
            raise
        status = exits.error(f"[rank {runtime.rank}] error: {failure[0]}", failure[1])
        if failure[1] == exits.RETRY:  # another process failed first: its status is the launch's
            status = FollowedAnother(status)
    finally:
        log.finish()
        if status == 0:
            teardown_runtime(runtime)
        elif runtime.distributed and dist.is_initialized():
            dist.destroy_process_group()
    return status


def collective_failure(e, c):
    """(one line, exit status) for an error of a collective: a wait past dist_timeout_s (the others spent longer
    than that on something, or hang), or the end of another process, whose own error says why; else None."""
    message = str(e)
    if re.search(r"timed out|timeout", message, re.IGNORECASE):
        return (f"a collective waited longer than dist_timeout_s = {c.dist_timeout_s} s for another process "
                f"({exits.one_line(e)}); if one process's own work can take that long (rank 0 writing DDP's "
                f"checkpoint, docs/training.md), raise dist_timeout_s", exits.STOPPED)
    if re.search(r"connection closed by peer|connection reset|broken pipe", message, re.IGNORECASE):
        return (f"another process of this run ended, so this one cannot go on ({exits.one_line(e)}); that "
                f"process's error says why", exits.RETRY)
    return None


class FollowedAnother(int):
    """The exit status of a process that stopped because another one of the run ended first: the launch's status
    is that one's, so this one is not written to TRAIN_EXIT_STATUS_FILE."""


def main():
    status = run(sys.argv[1:])
    # torchrun and srun exit 1 whatever their processes chose: a launching script reads the status here
    if status and os.environ.get("TRAIN_EXIT_STATUS_FILE") and not isinstance(status, FollowedAnother):
        write_atomically(os.environ["TRAIN_EXIT_STATUS_FILE"], lambda f: f.write(f"{status}\n".encode()))
    sys.exit(status)


if __name__ == "__main__":
    main()
