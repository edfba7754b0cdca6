"""
What the scripts in eval/ share: their common command-line flags (checkpoints and --labels,
--data_dir, --device, --dtype, --out), and loading a checkpoint or the validation sequences with a
one-line error naming what could not be read, instead of a traceback.
"""

import argparse
import os
import sys
import warnings
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
from dataloader import val_sequences  # noqa: E402
from runtime import pick_device, resolve_dtype  # noqa: E402
from shards import ShardError  # noqa: E402

OUT = "out/eval"  # every script's default --out
DTYPE_HELP = "autocast dtype of the forward pass; auto: bfloat16 on GPUs that support it, else float32"


def make_parser(doc, checkpoints="+", data_dir=False, device=True, out=None, dtype_help=DTYPE_HELP):
    """An ArgumentParser with the flags the eval scripts share; each script adds its own after these.
    checkpoints: nargs of the positional checkpoints, with --labels ("+", "*"; None: neither)
    data_dir: add --data_dir, which defaults to the data each checkpoint was trained on
    device: add --device and --dtype
    out: what the --out directory receives, e.g. "similarity.json and similarity.png" (None: no --out)"""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if checkpoints:
        parser.add_argument("checkpoints", nargs=checkpoints,
                            help="checkpoint files or run directories (a run directory: its newest checkpoint)")
        parser.add_argument("--labels", nargs="*", help="one label per checkpoint (default: its path)")
    if data_dir:
        parser.add_argument("--data_dir", default=None,
                            help="directory of llm.c shards, the val split is used; default: the data_dir "
                                 "the checkpoint was trained on")
    if device:
        parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, ...")
        parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                            help=dtype_help)
    if out:
        parser.add_argument("--out", default=OUT, help=f"directory for {out} (default {OUT})")
    return parser


def label_checkpoints(parser, paths, labels=None):
    """{label: path}, one distinct label per checkpoint (default: its path). Every path is checked
    here, so that a mistyped one fails before the first model is evaluated, not after."""
    labels = labels or [os.path.normpath(p) for p in paths]
    if len(labels) != len(paths) or len(set(labels)) != len(labels):
        parser.error("--labels needs one distinct label per checkpoint")
    for path in paths:
        check_checkpoint_path(path)
    return dict(zip(labels, paths))


def device_and_dtype(args):
    """(device, autocast dtype) from --device and --dtype, "auto" resolved for this machine."""
    device = pick_device(args.device)
    return device, resolve_dtype(args.dtype, device.split(":")[0])


def output_path(out, name):
    """out/name, creating out if needed."""
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, name)


# -----------------------------------------------------------------------------
# loading, with one line on stderr and exit status 1 for whatever cannot be read


def fail(message):
    sys.exit(message)  # printed to stderr, exit status 1


def cannot_load(path, reason):
    fail(f"cannot load checkpoint {path}: {reason}")


def first_sentence(message):
    """An error message cut to its first line and sentence: torch appends paragraphs of advice."""
    lines = str(message).strip().splitlines()
    return lines[0].split(". ")[0] if lines else ""


def check_checkpoint_path(path):
    """Exit, naming path, if it neither exists nor holds a checkpoint: the cheap checks, before any loading."""
    if not os.path.exists(path):
        cannot_load(path, "no such file or directory")
    if os.path.isdir(path) and not (checkpoint.is_sharded_checkpoint(path) or checkpoint.list_checkpoints(path)):
        cannot_load(path, "no checkpoint (ckpt_<step>.pt or ckpt_<step>/) in this directory")


def load(path, device):
    """checkpoint.load_model(path, device): (model, resolved training config). If the checkpoint cannot
    be loaded, exit with one line naming it and why. The newer checkpoints of a run directory that
    load_model skips as unreadable are named in one warning line each."""
    check_checkpoint_path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded, error = checkpoint.load_model(path, device), None
        except Exception as e:  # truncated zip, bad pickle, failed checksum, missing shard, not a checkpoint, ...
            loaded, error = None, e
    skipped = []
    for w in caught:
        if os.path.abspath(w.filename) == os.path.abspath(checkpoint.__file__):
            skipped.append(first_sentence(w.message))
        else:  # not ours to reword
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if error is None:
        for note in skipped:
            print(f"warning: {note}", file=sys.stderr)
        return loaded
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch's own message would be about mmap
        cannot_load(path, "truncated, or not a checkpoint (not a complete torch zip archive)")
    if skipped and os.path.isdir(path) and not checkpoint.is_sharded_checkpoint(path):  # skipped every one
        cannot_load(path, "none of its checkpoints loads: " + "; ".join(skipped))
    reason = first_sentence(error).removeprefix(f"{path}: ")
    cannot_load(path, f"{type(error).__name__}: {reason}" if reason else type(error).__name__)


def validation_sequences(args, config, block_size, num_sequences):
    """(data_dir, x, y): up to num_sequences validation sequences of block_size tokens from --data_dir,
    or by default from the data_dir in the checkpoint's training config, so that a model is scored
    on held-out tokens of the data it was trained on."""
    data_dir = args.data_dir or config["data_dir"]
    try:
        x, y = val_sequences(data_dir, block_size, num_sequences * block_size)
    except (ShardError, OSError) as e:
        whose = "" if args.data_dir else " (the checkpoint's data_dir; --data_dir reads another)"
        fail(f"cannot read validation data{whose}: {e}")
    return data_dir, x, y
