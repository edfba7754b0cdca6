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
"""

import contextlib
import glob
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from model import GPT, GPTConfig
from shards import fsync_dir, write_atomically

CHECKPOINT_PATTERN = re.compile(r"ckpt_(\d+)(\.pt)?")
RUN_STATE = "run_state.pt"  # in a sharded checkpoint: everything but the model and optimizer
# GPTConfig fields that decide the parameters or what they compute; the others (block_size,
# dropout) are training choices a resumed run may change
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "head_dim", "vocab_size", "attn_type",
                     "xsa_gate", "n_sinks", "rope_theta", "bias")


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


def prune_checkpoints(out_dir, keep):
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        remove_checkpoint(old)


def save_checkpoint(state, out_dir, step, keep=2):
    """Write state atomically (temp file, fsync, rename), then delete all but the newest `keep`.
    A failure mid-write (a full disk) removes the temp file and leaves older checkpoints intact."""
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(out_dir, step)
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except OSError as e:
        raise OSError(e.errno, f"could not write checkpoint {path} ({e.strerror}); "
                               f"the previous checkpoints are untouched") from e
    prune_checkpoints(out_dir, keep)
    return path


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns each time it saves or loads without a process group, which is what we mean there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded_checkpoint(model, optimizer, state, out_dir, step, keep=2):
    """Collective: every process writes its shards of model and optimizer into ckpt_<step>.tmp/
    (fsynced by DCP), rank 0 adds run_state.pt (the rest of `state`), renames the directory to
    ckpt_<step>/ and deletes all but the newest `keep` checkpoints. out_dir must be one directory
    seen by all processes (a shared filesystem on several nodes). A failure on any process removes
    the temp directory and leaves older checkpoints intact."""
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
        if main:
            with open(os.path.join(tmp, RUN_STATE), "wb") as f:
                torch.save(state, f)
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
    except (OSError, CheckpointException) as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        # DCP reports every failed rank, with its traceback: name each rank and its error
        reason = "; ".join(f"rank {rank}: {error[0]}" for rank, error in sorted(e.failures.items())) \
            if isinstance(e, CheckpointException) else str(e)
        raise OSError(f"could not write checkpoint {path} ({reason}); the previous checkpoints are untouched") from e
    if main:
        prune_checkpoints(out_dir, keep)
    return path


def check_shards(path):
    """Raise if a sharded checkpoint's metadata is unreadable or one of its shard files is
    missing or shorter than the metadata says (a truncated write)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    sizes = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sizes.items():
        have = os.path.getsize(os.path.join(path, name))  # FileNotFoundError if missing
        if have < size:
            raise ValueError(f"shard {name} holds {have} bytes, the metadata expects at least {size}")


def load_checkpoint_file(path, map_location="cpu"):
    """A checkpoint's contents: everything for a file; for a sharded directory, its run state
    (all but model and optimizer, which load_training_state reads), after checking its shards."""
    if os.path.isdir(path):
        state = torch.load(os.path.join(path, RUN_STATE), map_location="cpu", weights_only=True)
        check_shards(path)
        return state
    # memory-mapped on the CPU: the processes of a node share one copy of a large file
    return torch.load(path, map_location=map_location, weights_only=True, mmap=map_location == "cpu")


def load_latest_checkpoint(out_dir, map_location="cpu"):
    """The newest checkpoint in out_dir that loads, skipping (with a warning naming it) any that
    is truncated or corrupt. Returns (path, state), or (None, None) if there is none."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            return path, load_checkpoint_file(path, map_location)
        except Exception as e:  # truncated zip, bad pickle, missing shard, ...: fall back to the previous one
            warnings.warn(f"skipping unreadable checkpoint {path}: {type(e).__name__}: {e}")
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
        with single_process_quietly():
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


def model_config(config):
    """The GPTConfig for a resolved run config (a dict with at least the GPTConfig fields)."""
    fields = GPTConfig.__dataclass_fields__
    return GPTConfig(**{k: v for k, v in config.items() if k in fields})


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
        with single_process_quietly():
            dcp.load({"model": model_state}, checkpoint_id=path, no_dist=True)  # reads the model only
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(state["model"])
    return model.to(device).eval(), state["config"]
