"""
Checkpoints: atomic writes, keeping the last few, finding the newest good one, refusing a
checkpoint of another architecture, and loading a model for evaluation.

Two formats, each readable by any run whatever its parallelism or number of processes:
- `ckpt_<step>.pt` (DDP and single-process runs): one torch file of plain containers and tensors,
  written by rank 0; it loads with torch.load(weights_only=True), so no pickled code is executed.
- `ckpt_<step>/` (FSDP runs): a torch.distributed.checkpoint (DCP) directory in which every
  process writes its own shards of the model and optimizer in parallel (`__<rank>_0.distcp`,
  `.metadata`), plus `run_state.pt` from rank 0 with everything else (step, loader position, the
  RNG state of every rank, config, wandb id, best val loss, provenance).
Model and optimizer states are exchanged keyed by parameter name (torch.distributed.checkpoint's
state_dict API), so a sharded checkpoint loads into an unsharded model and back, on any world size.

Every checkpoint carries CRC32 checksums (of each tensor in a file, of each shard file in a
directory): a corrupted checkpoint, not only a truncated one, is found when it is loaded and skipped
for the previous one. `Checkpointer` saves and restores a run's whole training state.
"""

import contextlib
import glob
import os
import random
import re
import shutil
import time
import warnings
import zlib

import numpy as np

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from model import GPT
from train_config import ARCHITECTURE_KEYS, model_config
from files import fsync_dir, remove_temp_files, write_atomically

CHECKPOINT_PATTERN = re.compile(r"ckpt_(\d+)(\.pt)?")
RUN_STATE = "run_state.pt"  # in a sharded checkpoint: everything but the model and optimizer
RUN_FILES = ("metrics.jsonl", "train.log", "config.json", "git.diff")  # a run's logs, beside its checkpoints


def checkpoint_path(out_dir, step, sharded=False):
    return os.path.join(out_dir, f"ckpt_{step:07d}" + ("" if sharded else ".pt"))


def is_sharded_checkpoint(path):
    """A DCP checkpoint directory, as opposed to a run directory holding checkpoints."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, name)) for name in (RUN_STATE, ".metadata"))


def checkpoint_step(path):
    return int(CHECKPOINT_PATTERN.fullmatch(os.path.basename(os.path.normpath(path))).group(1))


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, files and sharded directories alike, oldest first."""
    paths = []
    for path in glob.glob(os.path.join(out_dir, "ckpt_*")):
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


def clean_run_dir(out_dir):
    """Clean up after a process killed mid-write: remove checkpoint temp files and directories
    (ckpt_*.pt.tmp<pid>, ckpt_*.tmp/) and metrics/config temp files. A sharded checkpoint moved aside
    to be replaced by a new one of the same step (ckpt_*.old/) is put back if the new one never
    arrived. Complete checkpoints are never touched."""
    for old in glob.glob(os.path.join(out_dir, "ckpt_*.old")):
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


class CorruptCheckpoint(ValueError):
    """A checkpoint whose contents do not match the checksums written with it."""


def crc32(data, chunk=1 << 26):
    value = 0
    view = memoryview(data).cast("B")
    for start in range(0, len(view), chunk):  # zlib releases the GIL on each chunk
        value = zlib.crc32(view[start:start + chunk], value)
    return value


def tensor_crc32(tensor):
    """CRC32 of a tensor's bytes (any dtype and device)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return crc32(raw.numpy())


def tensor_checksums(state, prefix=""):
    """{path: CRC32} of every tensor in a nested state (dicts, lists, tuples), e.g.
    "model/lm_head.weight" or "optimizer/state/3/exp_avg"."""
    if isinstance(state, torch.Tensor):
        return {prefix: tensor_crc32(state)}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    sums = {}
    for key, value in items:
        sums.update(tensor_checksums(value, f"{prefix}/{key}" if prefix else str(key)))
    return sums


def state_checksum(state):
    """CRC32 of everything in a state but the tensors' bytes: its structure and every other value (step,
    loader position, config, RNG states, checksums, ...), written out by repr, which is exact for floats.
    A tensor counts here by dtype and shape; its bytes are tensor_checksums'."""
    def skeleton(x):
        if isinstance(x, torch.Tensor):
            return "tensor", str(x.dtype), tuple(x.shape)
        if isinstance(x, dict):
            return [(repr(key), skeleton(value)) for key, value in x.items()]
        if isinstance(x, (list, tuple)):
            return type(x).__name__, [skeleton(value) for value in x]
        return x
    return zlib.crc32(repr(skeleton(state)).encode())


def with_checksums(state):
    """state plus the checksums load_checkpoint_file verifies: of every tensor, then of all the rest."""
    state = {**state, "checksums": tensor_checksums(state)}
    return {**state, "state_checksum": state_checksum(state)}


def verify_state(path, state):
    """Check and remove the checksums with_checksums added; raise CorruptCheckpoint on a mismatch."""
    expected = state.pop("state_checksum", None)
    if expected is None:
        raise CorruptCheckpoint(f"{path}: no checksum (damaged, or written by an older version of train.py)")
    if state_checksum(state) != expected:
        raise CorruptCheckpoint(f"{path}: the run state (step, loader position, config, RNG, ...) does not match "
                                f"its checksum (corrupted on disk)")
    verify_checksums(path, state, state.pop("checksums"))


def verify_checksums(path, state, expected):
    actual = tensor_checksums(state)
    for name in sorted(set(expected) | set(actual)):
        if expected.get(name) != actual.get(name):
            raise CorruptCheckpoint(f"{path}: tensor {name} does not match its checksum (corrupted on disk)")


def save_checkpoint(state, out_dir, step):
    """Write state, with the checksums of its tensors, atomically (temp file, fsync, rename).
    A failure mid-write (a full disk: OSError, or RuntimeError from torch.save's writer) removes the
    temp file, leaves older checkpoints intact and raises OSError naming the checkpoint."""
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(out_dir, step)
    state = with_checksums(state)
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise OSError(getattr(e, "errno", None), f"could not write checkpoint {path} ({reason}); "
                                                 f"the previous checkpoints are untouched") from e
    return path


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns each time it saves or loads without a process group, which is what we mean there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def file_crc32(path):
    with open(path, "rb") as f:
        value = 0
        while chunk := f.read(1 << 26):
            value = zlib.crc32(chunk, value)
    return value


def save_sharded_checkpoint(model, optimizer, state, out_dir, step):
    """Collective: every process writes its shards of model and optimizer into ckpt_<step>.tmp/
    (fsynced by DCP) and the checksums of its shard files, rank 0 adds run_state.pt (the rest of
    `state`, with every shard file's checksum) and renames the directory to ckpt_<step>/. out_dir must
    be one directory seen by all processes (a shared filesystem on several nodes). A failure on any
    process removes the temp directory and leaves older checkpoints intact."""
    distributed = dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    path = checkpoint_path(out_dir, step, sharded=True)
    tmp = path + ".tmp"
    if main:
        os.makedirs(out_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-write
    if distributed:
        dist.barrier()
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this process's shards, keyed by name
        with single_process_quietly():
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp, no_dist=not distributed)
        rank = dist.get_rank() if distributed else 0
        mine = {os.path.basename(p): file_crc32(p) for p in glob.glob(os.path.join(tmp, f"__{rank}_*.distcp"))}
        everyone = [None] * dist.get_world_size() if distributed else [mine]
        if distributed:
            dist.all_gather_object(everyone, mine)
        if main:
            shard_checksums = {name: crc for sums in everyone for name, crc in sums.items()}
            for p in glob.glob(os.path.join(tmp, "*.distcp")):  # any file DCP named otherwise
                shard_checksums.setdefault(os.path.basename(p), file_crc32(p))
            with open(os.path.join(tmp, RUN_STATE), "wb") as f:
                torch.save(with_checksums({**state, "shard_checksums": shard_checksums}), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if os.path.exists(path):  # the same step written before (a resumed run that went back)
                shutil.rmtree(path + ".old", ignore_errors=True)
                os.replace(path, path + ".old")
                os.replace(tmp, path)
                shutil.rmtree(path + ".old")
            else:
                os.replace(tmp, path)
            fsync_dir(out_dir)
    except (OSError, RuntimeError, CheckpointException) as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        # DCP reports every failed rank, with its traceback: name each rank and its error
        reason = "; ".join(f"rank {rank}: {error[0]}" for rank, error in sorted(e.failures.items())) \
            if isinstance(e, CheckpointException) else str(e)
        raise OSError(f"could not write checkpoint {path} ({reason}); the previous checkpoints are untouched") from e
    return path


@contextlib.contextmanager
def dcp_errors(path):
    """torch.distributed.checkpoint's failures as CorruptCheckpoint: its CheckpointException derives from
    BaseException, which `except Exception` (the fallback to an older checkpoint, the eval scripts'
    one-line errors) would let through as a traceback."""
    try:
        yield
    except CheckpointException as e:
        reasons = "; ".join(f"rank {rank}: {type(error[0]).__name__}: {error[0]}"
                            for rank, error in sorted(e.failures.items()))
        raise CorruptCheckpoint(f"{path}: unreadable sharded checkpoint ({reasons or e})") from None


def check_shards(path, shard_checksums=None):
    """Raise if a sharded checkpoint's metadata is unreadable, one of its shard files is missing or
    shorter than the metadata says (a truncated write), or does not match its checksum. Under
    torchrun each process reads every world_size-th shard file for its checksum, not all of them
    (load_latest_checkpoint makes the processes agree)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a pickle: a corrupt one fails in many ways
        raise CorruptCheckpoint(f"{path}: unreadable .metadata ({type(e).__name__}: {e})") from None
    sizes = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sizes.items():
        have = os.path.getsize(os.path.join(path, name))  # FileNotFoundError if missing
        if have < size:
            raise ValueError(f"shard {name} holds {have} bytes, the metadata expects at least {size}")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for name, crc in sorted((shard_checksums or {}).items())[rank::world_size]:
        if file_crc32(os.path.join(path, name)) != crc:
            raise CorruptCheckpoint(f"{path}: shard file {name} does not match its checksum (corrupted on disk)")


def load_checkpoint_file(path, map_location="cpu"):
    """A checkpoint's contents: everything for a file; for a sharded directory, its run state
    (all but model and optimizer, which load_training_state reads), after checking its shards."""
    if os.path.isdir(path):
        state = torch.load(os.path.join(path, RUN_STATE), map_location="cpu", weights_only=True)
        verify_state(os.path.join(path, RUN_STATE), state)
        with dcp_errors(path):
            check_shards(path, state.pop("shard_checksums"))
        return state
    # memory-mapped on the CPU: the processes of a node share one copy of a large file
    state = torch.load(path, map_location=map_location, weights_only=True, mmap=map_location == "cpu")
    verify_state(path, state)
    return state


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


def optimizer_state_by_name(model, optimizer, state):
    """An optimizer.state_dict() (parameters numbered in param_groups order) keyed by parameter
    name instead, the form torch.distributed.checkpoint's set_state_dict takes."""
    names = {id(p): name for name, p in model.named_parameters()}
    index_to_name = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {index_to_name[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [index_to_name[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def load_training_state(path, state, model, optimizer):
    """Load a checkpoint's model and optimizer states into `model` (unwrapped: neither DDP nor
    compiled; sharded by FSDP or not) and its `optimizer`. `state` is what load_checkpoint_file
    returned. Works across formats, parallelisms and world sizes."""
    if os.path.isdir(path):
        # this process's share of every tensor, in this run's layout: DCP reads just those bytes
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with single_process_quietly(), dcp_errors(path):
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path,
                     no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:  # full tensors on every process; a sharded model keeps its part of each
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=optimizer_state_by_name(model, optimizer, state["optimizer"]),
                       options=StateDictOptions(full_state_dict=True))


def architecture_mismatch(saved_config, config):
    """Names and values of the architecture keys that differ between two configs."""
    return {k: (saved_config.get(k), config.get(k)) for k in ARCHITECTURE_KEYS
            if saved_config.get(k) != config.get(k)}


def check_architecture(saved_config, config, path):
    diff = architecture_mismatch(saved_config, config)
    if diff:
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {path} has a different architecture ({details})")


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


# -----------------------------------------------------------------------------
# A run's whole training state

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


def local_tensor(t):
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this process


class NonFiniteState(ValueError):
    """Model or optimizer state holding NaN or inf: never written as a checkpoint."""


class Checkpointer:
    """Saves and restores a run's whole training state: model, optimizer, the data loader's position,
    every rank's RNG states, and the run's bookkeeping (config, wandb run id, best val loss,
    provenance). Every rank calls save() and resume(); a model sharded by FSDP gets a DCP directory,
    any other a single file written by rank 0. Keeps the newest `keep` readable checkpoints."""

    def __init__(self, out_dir, keep, model, optimizer, loader, runtime, sharded):
        self.out_dir, self.keep = out_dir, keep
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.runtime, self.sharded = runtime, sharded
        self.known_good = set()  # checkpoints this run wrote or loaded: the only ones pruning counts
        self.best = None  # {"path", "val_loss"} of the checkpoint written at the best validation loss

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
        flags = [torch.isfinite(local_tensor(t)).all() for t in tensors]
        bad = (~torch.stack(flags).all()).float().reshape(1) if flags else torch.zeros(1)
        if self.runtime.distributed:
            bad = bad.to(self.runtime.device)
            dist.all_reduce(bad)
        return bad.item() == 0

    def save(self, step, loader_state, run_info, val_loss=None):
        """Write the checkpoint of `step` (run_info: config, wandb_run_id, best_val_loss, provenance, ...;
        val_loss: the validation loss of this step, if evaluated), then prune, keeping the checkpoint of
        the best validation loss whatever its age. Refuses (NonFiniteState) a state that holds NaN or
        inf; a failed write raises OSError on every rank and leaves the previous checkpoints intact."""
        if not self.state_is_finite():
            raise NonFiniteState(f"the model or optimizer state is not finite at step {step}; "
                                 f"it was not saved, the last checkpoint in {self.out_dir} is intact")
        best = self.best
        if val_loss is not None and (best is None or val_loss < best["val_loss"]):
            best = {"path": os.path.basename(checkpoint_path(self.out_dir, step, self.sharded)), "val_loss": val_loss}
        state = {"step": step, "loader": loader_state, "rng": self.gather_rng_states(), **run_info,
                 "best_checkpoint": best}
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
        self.best = best
        if self.runtime.is_main:
            self.known_good.add(path)
            prune_checkpoints(self.out_dir, self.keep, self.known_good, self.best_path())
        return path

    def best_path(self):
        return os.path.join(self.out_dir, self.best["path"]) if self.best else None

    def resume(self, config):
        """Load the newest readable checkpoint into the model, optimizer, loader and RNGs. Returns
        (path, its state without model and optimizer), or (None, None) if out_dir holds none."""
        path, state = load_latest_checkpoint(self.out_dir)
        if path is None:
            return None, None
        check_architecture(state["config"], config, path)
        saved_optimizer = state["config"].get("optimizer", "adamw")
        if saved_optimizer != config["optimizer"]:  # its state would not fit this optimizer's
            raise ValueError(f"checkpoint {path} was trained with optimizer={saved_optimizer!r}, not "
                             f"{config['optimizer']!r}: resume it with --optimizer={saved_optimizer}")
        load_training_state(path, state, self.model, self.optimizer)  # either format, any parallelism
        self.loader.load_state_dict(state["loader"])
        states = state["rng"]
        set_rng_state(states[self.runtime.rank % len(states)], self.runtime.device_type)
        self.known_good.add(path)
        self.best = state.get("best_checkpoint")
        state.pop("model", None)
        state.pop("optimizer", None)
        return path, state
