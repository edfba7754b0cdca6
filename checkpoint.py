"""
Checkpoints: atomic writes, keeping the last few, finding the newest good one, refusing a
checkpoint of another architecture, and loading a model for evaluation.

A checkpoint is one torch file `ckpt_<step>.pt` holding plain containers and tensors only, so
it loads with torch.load(weights_only=True): no pickled code is ever executed.
"""

import glob
import os
import re
import warnings

import torch

from model import GPT, GPTConfig
from shards import fsync_dir

CHECKPOINT_PATTERN = re.compile(r"ckpt_(\d+)\.pt$")
# GPTConfig fields that decide the parameters or what they compute; the others (block_size,
# dropout) are training choices a resumed run may change
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "head_dim", "vocab_size", "attn_type",
                     "xsa_gate", "n_sinks", "rope_theta", "bias")


def checkpoint_path(out_dir, step):
    return os.path.join(out_dir, f"ckpt_{step:07d}.pt")


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, oldest first."""
    paths = [p for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt")) if CHECKPOINT_PATTERN.search(p)]
    return sorted(paths, key=lambda p: int(CHECKPOINT_PATTERN.search(p).group(1)))


def save_checkpoint(state, out_dir, step, keep=2):
    """Write state atomically (temp file, fsync, rename), then delete all but the newest `keep`.
    A failure mid-write (a full disk) removes the temp file and leaves older checkpoints intact."""
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(out_dir, step)
    tmp = path + f".tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"could not write checkpoint {path} ({e.strerror}); "
                                   f"the previous checkpoints are untouched") from e
        raise
    fsync_dir(out_dir)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        os.remove(old)
    return path


def load_checkpoint_file(path, map_location="cpu"):
    return torch.load(path, map_location=map_location, weights_only=True)


def load_latest_checkpoint(out_dir, map_location="cpu"):
    """The newest checkpoint in out_dir that loads, skipping (with a warning naming it) any that
    is truncated or corrupt. Returns (path, state), or (None, None) if there is none."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            return path, load_checkpoint_file(path, map_location)
        except Exception as e:  # truncated zip, bad pickle, ...: fall back to the previous one
            warnings.warn(f"skipping unreadable checkpoint {path}: {type(e).__name__}: {e}")
    return None, None


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
    """A GPT in eval mode from a checkpoint file, or from the newest checkpoint in a run directory.
    Returns (model, resolved run config)."""
    if os.path.isdir(path):
        found, state = load_latest_checkpoint(path, map_location=device)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
    else:
        state = load_checkpoint_file(path, map_location=device)
    model = GPT(model_config(state["config"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state["config"]
