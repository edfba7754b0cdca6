"""
One checkpoint: its name, its format, its checksums, and loading it back.

Two formats, each readable by any run whatever its parallelism or number of processes:
- `ckpt_<step>.pt` (DDP and single-process runs): one torch file of plain containers and tensors,
  written by rank 0; it loads with torch.load(weights_only=True), so no pickled code is executed.
- `ckpt_<step>/` (FSDP runs): a torch.distributed.checkpoint (DCP) directory in which every
  process writes its own shards of the model and optimizer in parallel (`__<rank>_0.distcp`,
  `.metadata`), plus `run_state.pt` from rank 0 with everything else (step, loader position, the
  RNG state of every rank, config, the run's own state, provenance).
Model and optimizer states are exchanged keyed by parameter name (torch.distributed.checkpoint's
state_dict API), so a sharded checkpoint loads into an unsharded model and back, on any world size.

Every checkpoint carries CRC32 checksums (of each tensor in a file, of each shard file in a
directory): a corrupted checkpoint, not only a truncated one, is found when it is loaded. Which
checkpoints a run writes, keeps and resumes from is checkpointer.py's.
"""

import contextlib
import glob
import os
import random
import re
import shutil
import warnings
import zlib

import numpy as np

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pretrain.files import fsync_dir, write_atomically

CHECKPOINT_PATTERN = re.compile(r"ckpt_(\d+)(\.pt)?")
RUN_STATE = "run_state.pt"  # in a sharded checkpoint: everything but the model and optimizer


def checkpoint_path(out_dir, step, sharded=False):
    return os.path.join(out_dir, f"ckpt_{step:07d}" + ("" if sharded else ".pt"))


def is_sharded_checkpoint(path):
    """A DCP checkpoint directory, as opposed to a run directory holding checkpoints."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, name)) for name in (RUN_STATE, ".metadata"))


def checkpoint_step(path):
    return int(CHECKPOINT_PATTERN.fullmatch(os.path.basename(os.path.normpath(path))).group(1))


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
        mine = {os.path.basename(p): file_crc32(p) for p in glob.glob(os.path.join(glob.escape(tmp), f"__{rank}_*.distcp"))}
        everyone = [None] * dist.get_world_size() if distributed else [mine]
        if distributed:
            dist.all_gather_object(everyone, mine)
        if main:
            shard_checksums = {name: crc for sums in everyone for name, crc in sums.items()}
            for p in glob.glob(os.path.join(glob.escape(tmp), "*.distcp")):  # any file DCP named otherwise
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


# -----------------------------------------------------------------------------
# RNG states

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
