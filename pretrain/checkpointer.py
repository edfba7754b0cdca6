"""
A run's directory and its checkpoints over its life: the one-writer lock on out_dir, the run's record
(config.json, git.diff), writing the whole training state at a step, keeping the newest few and the best,
cleaning up after a killed writer, and resuming from the newest one that loads, refusing one of another
architecture; and a model loaded from a checkpoint in one process, for evaluation and the export. The
format of one checkpoint is checkpoint_format.py's.
"""

import glob
import json
import math
import os
import shutil
import sys
import time
import uuid
import warnings
import zipfile
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from configurator import ConfigError
from model import GPT
from pretrain.checkpoint_format import (CHECKPOINT_PATTERN, checkpoint_path, checkpoint_step, dcp_errors,
                                        is_sharded_checkpoint, load_checkpoint_file, load_training_state, rng_state,
                                        save_checkpoint, save_sharded_checkpoint, set_rng_state,
                                        single_process_quietly)
from pretrain import exits
from pretrain.files import DirectoryLock, DirectoryLocked, fsync_dir, remove_temp_files, write_atomically
from pretrain.parallelize import local_shard
from pretrain.runtime import git_diff
from pretrain.train_config import ARCHITECTURE_KEYS, MODEL_DEFAULTS, model_config

RUN_FILES = ("metrics.jsonl", "train.log", "config.json", "git.diff")  # a run's logs, beside its checkpoints


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, files and sharded directories alike, oldest first."""
    paths = []
    for path in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*")):
        match = CHECKPOINT_PATTERN.fullmatch(os.path.basename(path))
        if match and (os.path.isfile(path) if match.group(2) else os.path.isdir(path)):
            paths.append(path)
    return sorted(paths, key=lambda p: (checkpoint_step(p), os.path.getmtime(p)))


def remove_checkpoint(path):
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def prune_checkpoints(out_dir, keep, known_good, protected=None):
    """Delete the checkpoints older than the newest `keep` of those known to be readable (written by
    this run, or loaded by it): an unreadable checkpoint never counts as kept, so a readable one is
    never deleted in its favour. `protected` (the checkpoint of the best validation loss) is never
    deleted: after a blow-up, the newest checkpoints may all be of the diverged run."""
    good = [p for p in list_checkpoints(out_dir) if p in known_good]
    if keep <= 0 or len(good) < keep:
        return
    oldest_kept = checkpoint_step(good[-keep])
    for path in list_checkpoints(out_dir):
        if checkpoint_step(path) < oldest_kept and path != protected:
            remove_checkpoint(path)


def lock_run_dir(out_dir, runtime):
    """One run per out_dir: rank 0 takes out_dir's lock (creating out_dir), and every rank stops alike
    (exits.TrainingStopped) if another live process holds it, or if out_dir cannot be written (read-only,
    under a file). Returns the lock (None on the other ranks)."""
    lock, error = None, None
    if runtime.is_main:
        try:
            os.makedirs(out_dir, exist_ok=True)
            lock = DirectoryLock(out_dir, ".train.lock").acquire()
        except DirectoryLocked as e:
            error = f"{e}; two runs in one out_dir would interleave their checkpoints and logs"
        except OSError as e:
            error = f"cannot write in out_dir {out_dir} ({exits.one_line(e)}); give a writable out_dir"
    if runtime.distributed:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise exits.TrainingStopped(error)
    return lock


def record_run(out_dir, config, run_provenance):
    """config.json (the resolved config, a dict, and the provenance), and git.diff for uncommitted code, in
    out_dir; by the main process."""
    info = json.dumps({"config": config, "provenance": run_provenance}, indent=2)
    write_atomically(os.path.join(out_dir, "config.json"), lambda f: f.write(info.encode()))
    if run_provenance["git_dirty"]:  # the commit alone would not reproduce this run
        diff = git_diff() or ""
        write_atomically(os.path.join(out_dir, "git.diff"), lambda f: f.write(diff.encode()))


def clean_run_dir(out_dir):
    """Clean up after a process killed mid-write: remove checkpoint temp files and directories
    (ckpt_*.pt.tmp<pid>, ckpt_*.tmp/) and metrics/config temp files. A sharded checkpoint moved aside
    to be replaced by a new one of the same step (ckpt_*.old/) is put back if the new one never
    arrived. Complete checkpoints are never touched."""
    for old in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*.old")):
        if os.path.exists(old[:-len(".old")]):
            shutil.rmtree(old)
        else:
            os.replace(old, old[:-len(".old")])
    remove_temp_files(out_dir, ("ckpt_*.tmp*", "metrics.jsonl.tmp*", "config.json.tmp*"))


def set_aside_run(out_dir):
    """Move an earlier run's checkpoints and logs into out_dir/replaced_<time>/ (a run started from
    scratch with overwrite): nothing is deleted, and nothing of it is resumed or appended to."""
    aside = os.path.join(out_dir, time.strftime("replaced_%Y%m%d-%H%M%S"))
    os.makedirs(aside)
    for path in list_checkpoints(out_dir) + [os.path.join(out_dir, name) for name in RUN_FILES]:
        if os.path.exists(path):
            os.replace(path, os.path.join(aside, os.path.basename(path)))
    fsync_dir(out_dir)
    return aside


def load_latest_checkpoint(out_dir, map_location="cpu"):
    """The newest checkpoint in out_dir that loads, skipping (with a warning naming it) any that
    is truncated or corrupt. Returns (path, state), or (None, None) if there is none. Under torchrun
    every process calls it, and all take the same checkpoint: one that every process could read."""
    for path in reversed(list_checkpoints(out_dir)):
        state, error = None, None
        try:
            state = load_checkpoint_file(path, map_location)
        except (Exception, CheckpointException) as e:  # truncated zip, bad pickle, missing shard, ...: the previous one
            error = f"{type(e).__name__}: {e}"
        if dist.is_initialized():
            failed = [None] * dist.get_world_size()
            dist.all_gather_object(failed, error)
            error = error or next((f"on rank {r}: {e}" for r, e in enumerate(failed) if e), None)
        if error is None:
            return path, state
        warnings.warn(f"skipping unreadable checkpoint {path}: {error}")
    return None, None


def architecture_mismatch(saved_config, config):
    """Names and values of the architecture keys that differ between two configs. A key the saved config
    lacks (written before the key existed) has its default, which is what that run computed."""
    saved = {k: saved_config.get(k, MODEL_DEFAULTS[k]) for k in ARCHITECTURE_KEYS}
    return {k: (saved[k], config.get(k)) for k in ARCHITECTURE_KEYS if saved[k] != config.get(k)}


def check_architecture(saved_config, config, path):
    diff = architecture_mismatch(saved_config, config)
    if diff:
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"checkpoint {path} has a different architecture ({details})")


class NonFiniteState(ValueError):
    """Model or optimizer state holding NaN or inf: never written as a checkpoint."""


@dataclass
class RunState:
    """A run's own state, beyond its model, optimizer, data position and RNG: saved whole in every
    checkpoint (Checkpointer.save) and restored whole from it (Checkpointer.resume), nowhere else."""
    step: int = 0  # optimizer steps taken
    wandb_run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # a resumed run continues it
    elapsed_s: float = 0.0  # training time, summed over the processes that continued the run
    best_val_loss: float = math.inf  # the lowest validation loss of any evaluation
    best_checkpoint: dict | None = None  # {"path": file name, "val_loss"} of the best checkpoint: never pruned
    guards: dict | None = None  # the guards' state (guards.Guards.state_dict), so a resumed run judges alike

    @classmethod
    def from_checkpoint(cls, state):
        """The run state of a checkpoint's contents; a field an older checkpoint lacks keeps its default."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


class Checkpointer:
    """Saves and restores a run's whole training state: model, optimizer, the data loader's position,
    every rank's RNG states, the run's own state (RunState), and its config and provenance. Every rank
    calls save() and load_newest(); a model sharded by FSDP gets a DCP directory, any other a single file
    written by rank 0. Keeps the newest `keep` readable checkpoints, and the best validation loss's."""

    def __init__(self, out_dir, keep, model, optimizer, loader, runtime, sharded, config=None, provenance=None):
        self.out_dir, self.keep = out_dir, keep
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.runtime, self.sharded = runtime, sharded
        self.config, self.provenance = config or {}, provenance or {}  # recorded in every checkpoint
        self.known_good = set()  # checkpoints of this run whose weights gave a healthy next loss: pruning counts these
        # (step, path, best checkpoint before it) of the newest checkpoint written or resumed from, until the loss
        # of the step after it, computed with its weights, is known (judge)
        self.unjudged = None

    def gather_rng_states(self):
        """Every rank's RNG state, in rank order."""
        state = rng_state(self.runtime.device_type)
        if not self.runtime.distributed:
            return [state]
        states = [None] * self.runtime.world_size
        dist.all_gather_object(states, state)
        return states

    def state_is_finite(self):
        """True on every rank if no parameter or optimizer state of any rank holds NaN or inf."""
        tensors = [p for p in self.model.parameters()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        flags = [torch.isfinite(local_shard(t)).all() for t in tensors]
        bad = (~torch.stack(flags).all()).float().reshape(1) if flags else torch.zeros(1)
        if self.runtime.distributed:
            bad = bad.to(self.runtime.device)
            dist.all_reduce(bad)
        return bad.item() == 0

    def save(self, run_state, loader_state, val_loss=None):
        """Write the checkpoint of run_state.step (val_loss: the validation loss of this step, if evaluated),
        then prune, keeping the checkpoint of the best validation loss whatever its age; run_state's
        best_checkpoint follows. Refuses (NonFiniteState) a state that holds NaN or inf; a failed write raises
        OSError on every rank and leaves the previous checkpoints and run_state as they were."""
        step = run_state.step
        if not self.state_is_finite():
            raise NonFiniteState(f"the model or optimizer state is not finite at step {step}; "
                                 f"it was not saved, the last checkpoint in {self.out_dir} is intact")
        best = previous_best = run_state.best_checkpoint
        if val_loss is not None and (best is None or val_loss < best["val_loss"]):
            best = {"path": os.path.basename(checkpoint_path(self.out_dir, step, self.sharded)), "val_loss": val_loss}
        state = {**asdict(run_state), "best_checkpoint": best, "loader": loader_state,
                 "rng": self.gather_rng_states(), "config": self.config, "provenance": self.provenance}
        path, error = None, None
        try:
            if self.sharded:  # every rank writes its shards
                path = save_sharded_checkpoint(self.model, self.optimizer, state, self.out_dir, step)
            elif self.runtime.is_main:
                state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
                path = save_checkpoint(state, self.out_dir, step)
        except OSError as e:
            error = e
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.runtime.device)
        if self.runtime.distributed:
            dist.all_reduce(failed)
        if failed.item():
            raise error or OSError(f"could not write checkpoint of step {step} on another rank")
        run_state.best_checkpoint = best
        self.unjudged = (step, path, previous_best)
        self.prune(run_state)  # keeps `keep` judged ones besides this one
        return path

    def prune(self, run_state):
        if self.runtime.is_main:
            best = run_state.best_checkpoint
            prune_checkpoints(self.out_dir, self.keep, self.known_good,
                              os.path.join(self.out_dir, best["path"]) if best else None)

    def judge(self, run_state, step, spike):
        """After the loss of `step` is known: the newest checkpoint, if it holds the weights that loss was
        computed with (written or resumed from at step - 1), is kept if the loss is healthy, and set aside
        as <name>.spiked if it spiked, so that no resume takes the weights that blew up (the loss of a step
        shows the update of the step before it). Returns the path set aside, or None."""
        if self.unjudged is None or self.unjudged[0] != step - 1:
            self.finish(run_state)
            return None
        _, path, previous_best = self.unjudged
        self.unjudged = None
        if not spike:
            self.known_good.add(path)
            self.prune(run_state)
            return None
        best = run_state.best_checkpoint
        if best and best["path"] == os.path.basename(path):
            run_state.best_checkpoint = previous_best
        if self.runtime.is_main:
            os.replace(path, path + ".spiked")
            fsync_dir(self.out_dir)
        return path + ".spiked"

    def finish(self, run_state):
        """At the end of a run (or when no step judges it): the newest checkpoint counts as kept, and
        pruning goes back to `keep`."""
        if self.unjudged is not None:
            self.known_good.add(self.unjudged[1])
            self.unjudged = None
            self.prune(run_state)

    def load_newest(self, config):
        """Load the newest readable checkpoint into the model, optimizer, loader and RNGs. Returns
        (path, its RunState, the rest of what it holds but model and optimizer: config, rng, ...), or
        (None, None, None) if out_dir holds none. config: this run's, as a dict."""
        path, state = load_latest_checkpoint(self.out_dir)
        if path is None:
            return None, None, None
        check_architecture(state["config"], config, path)
        saved_optimizer = state["config"].get("optimizer", "adamw")
        if saved_optimizer != config["optimizer"]:  # its state would not fit this optimizer's
            raise ConfigError(f"checkpoint {path} was trained with optimizer={saved_optimizer!r}, not "
                             f"{config['optimizer']!r}: resume it with --optimizer={saved_optimizer}")
        built = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        load_training_state(path, state, self.model, self.optimizer)  # either format, any parallelism
        for group, fresh in zip(self.optimizer.param_groups, built):  # keys an older train.py did not save
            for k, v in fresh.items():  # ("decay", "algorithm", ...): the groups keep their order
                group.setdefault(k, v)
        self.loader.load_state_dict(state["loader"])
        states = state["rng"]
        set_rng_state(states[self.runtime.rank % len(states)], self.runtime.device_type)
        run_state = RunState.from_checkpoint(state)
        self.unjudged = (run_state.step, path, None)
        state.pop("model", None)
        state.pop("optimizer", None)
        return path, run_state, state


# -----------------------------------------------------------------------------
# A model from a checkpoint, in one process: evaluation (eval/) and the export (scripts/export_hf.py)


def load_model(path, device="cpu"):
    """A GPT in eval mode from a checkpoint (a file or a sharded directory), or from the newest
    checkpoint in a run directory, in this process alone. Returns (model, resolved run config)."""
    if os.path.isdir(path) and not is_sharded_checkpoint(path):  # a run directory
        found, state = load_latest_checkpoint(path, map_location=device)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        path = found
    else:
        state = load_checkpoint_file(path, map_location=device)
    model = GPT(model_config(state["config"]))
    if os.path.isdir(path):
        model_state = model.state_dict()
        with single_process_quietly(), dcp_errors(path):
            dcp.load({"model": model_state}, checkpoint_id=path, no_dist=True)  # reads the model only
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(state["model"])
    return model.to(device).eval(), state["config"]


def cannot_load(path, reason):
    exits.fail(f"cannot load checkpoint {path}: {reason}")


def check_checkpoint_path(path):
    """Exit (status 3), naming path, if it neither exists nor holds a checkpoint: the cheap checks, before
    any loading."""
    if not os.path.exists(path):
        cannot_load(path, "no such file or directory")
    if os.path.isdir(path) and not (is_sharded_checkpoint(path) or list_checkpoints(path)):
        cannot_load(path, "no checkpoint (ckpt_<step>.pt or ckpt_<step>/) in this directory")


def load_model_or_exit(path, device):
    """load_model(path, device): (model, resolved training config). If the checkpoint cannot
    be loaded, exit with one line naming it and why (status 3). The newer checkpoints of a run directory
    that load_model skips as unreadable are named in one warning line each."""
    check_checkpoint_path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded, error = load_model(path, device), None
        except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException only
            loaded, error = None, e  # truncated zip, bad pickle, failed checksum, missing shard, ...
    skipped = []
    for w in caught:
        if os.path.abspath(w.filename) == os.path.abspath(__file__):  # load_latest_checkpoint's
            skipped.append(exits.one_line(str(w.message), sentence=True))
        else:  # not ours to reword
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if error is None:
        for note in skipped:
            print(f"warning: {note}", file=sys.stderr)
        return loaded
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch's own message would be about mmap
        cannot_load(path, "truncated, or not a checkpoint (not a complete torch zip archive)")
    if skipped and os.path.isdir(path) and not is_sharded_checkpoint(path):  # skipped every one
        cannot_load(path, "none of its checkpoints loads: " + "; ".join(skipped))
    if isinstance(error, CheckpointException) and error.failures:  # its message: a list of ranks, then tracebacks
        error = next(iter(error.failures.values()))[0]
    reason = exits.one_line(str(error), sentence=True).removeprefix(f"{path}: ")
    cannot_load(path, f"{type(error).__name__}: {reason}" if reason else type(error).__name__)
