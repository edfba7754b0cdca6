"""
What the scripts in eval/ share: their common command-line flags (checkpoints and --labels,
--data_dir, --device, --dtype, --out, --quiet), progress bars, writing results and plots, and
loading a checkpoint or the validation sequences. Whatever cannot be read or written ends a script
with one line on stderr naming it, and exit status 3, instead of a traceback.
"""

import argparse
import os
import sys
import tempfile
import warnings
import zipfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from model import GPT
from pretrain import checkpoint_format, checkpointer, exits
from pretrain.dataloader import val_sequences
from pretrain.runtime import DTYPES, DeviceError, pick_device, resolve_dtype
from pretrain.shards import ShardError
from pretrain.train_config import model_config

OUT = "out/eval"  # every script's default --out
DTYPE_HELP = "autocast dtype of the forward pass; auto: bfloat16 on GPUs that support it, else float32"


def make_parser(doc, checkpoints="+", data_dir=False, device=True, out=None, progress=False,
                dtype_help=DTYPE_HELP):
    """An ArgumentParser with the flags the eval scripts share; each script adds its own after these.
    checkpoints: nargs of the positional checkpoints, with --labels ("+", "*"; None: neither)
    data_dir: add --data_dir, which defaults to the data each checkpoint was trained on
    device: add --device and --dtype
    out: what the --out directory receives, e.g. "similarity.json and similarity.png" (None: no --out)
    progress: add --quiet, which turns the progress bars off"""
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
        parser.add_argument("--dtype", default="auto", choices=DTYPES,
                            help=dtype_help)
    if out:
        parser.add_argument("--out", default=OUT, help=f"directory for {out} (default {OUT})")
    if progress:
        parser.add_argument("--quiet", action="store_true",
                            help="no progress bars (they are off anyway when stderr is not a terminal)")
    return parser


def positive_int(text):
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def label_checkpoints(parser, paths, labels=None):
    """{label: path}, one distinct label per checkpoint (default: its path). Every path is checked
    here, so that a mistyped one fails before the first model is evaluated, not after."""
    labels = labels or [os.path.normpath(p) for p in paths]
    if len(labels) != len(paths) or len(set(labels)) != len(labels):
        parser.error("--labels needs one distinct label per checkpoint")
    for path in paths:
        check_checkpoint_path(path)
    return dict(zip(labels, paths))


def device_and_dtype(parser, args):
    """(device, autocast dtype) from --device and --dtype, "auto" resolved for this machine."""
    try:
        device = pick_device(args.device)
    except DeviceError as e:
        parser.error(str(e))
    return device, resolve_dtype(args.dtype, device.split(":")[0])


def bars_shown(quiet):
    """Whether progress bars are drawn: not with --quiet, nor when stderr is not a terminal (a log
    file or a pipe would fill with bars)."""
    return not quiet and sys.stderr.isatty()


def progress(iterable, quiet=False, **tqdm_args):
    """iterable with a tqdm progress bar on stderr (count, rate, time left) where bars_shown(quiet),
    for the loops that take minutes."""
    from tqdm import tqdm
    return tqdm(iterable, disable=not bars_shown(quiet), **tqdm_args)


# -----------------------------------------------------------------------------
# one line on stderr and exit status 3 for whatever cannot be read or written


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(exits.STOPPED)


def output_dir(out):
    """Make the --out directory if needed and check that files can be written there, before any long
    work: a report lost after an hour of evaluation to a typo in --out is the worst kind of failure."""
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--out {out} is a file; --out names a directory (made if missing) for the results")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        fail(f"cannot write in --out {out} ({exits.one_line(e)}); give a writable directory with --out")
    return out


def write_text(out, name, text):
    """Write text to out/name; returns the path."""
    path = os.path.join(out, name)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        fail(f"cannot write {path} ({exits.one_line(e)}); give a writable directory with --out")
    return path


def pyplot():
    """matplotlib.pyplot drawing to files only: no display is needed on a cluster node."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, out, name):
    """Lay out fig, write it to out/name as a PNG and close it; returns the path."""
    plt = pyplot()
    path = os.path.join(out, name)
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except OSError as e:
        fail(f"cannot write {path} ({exits.one_line(e)}); give a writable directory with --out")
    finally:
        plt.close(fig)
    return path


# -----------------------------------------------------------------------------
# loading


def cannot_load(path, reason):
    fail(f"cannot load checkpoint {path}: {reason}")


def first_sentence(message):
    """An error message cut to its first line and sentence: torch appends paragraphs of advice."""
    lines = str(message).strip().splitlines()
    return lines[0].split(". ")[0] if lines else ""


def load_model(path, device="cpu"):
    """A GPT in eval mode from a checkpoint (a file or a sharded directory), or from the newest
    checkpoint in a run directory, in this process alone. Returns (model, resolved run config)."""
    if os.path.isdir(path) and not checkpoint_format.is_sharded_checkpoint(path):  # a run directory
        found, state = checkpointer.load_latest_checkpoint(path, map_location=device)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        path = found
    else:
        state = checkpoint_format.load_checkpoint_file(path, map_location=device)
    model = GPT(model_config(state["config"]))
    if os.path.isdir(path):
        model_state = model.state_dict()
        with checkpoint_format.single_process_quietly(), checkpoint_format.dcp_errors(path):
            dcp.load({"model": model_state}, checkpoint_id=path, no_dist=True)  # reads the model only
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(state["model"])
    return model.to(device).eval(), state["config"]


def check_checkpoint_path(path):
    """Exit, naming path, if it neither exists nor holds a checkpoint: the cheap checks, before any loading."""
    if not os.path.exists(path):
        cannot_load(path, "no such file or directory")
    if os.path.isdir(path) and not (checkpoint_format.is_sharded_checkpoint(path)
                                    or checkpointer.list_checkpoints(path)):
        cannot_load(path, "no checkpoint (ckpt_<step>.pt or ckpt_<step>/) in this directory")


def load(path, device):
    """load_model(path, device): (model, resolved training config). If the checkpoint cannot
    be loaded, exit with one line naming it and why. The newer checkpoints of a run directory that
    load_model skips as unreadable are named in one warning line each."""
    check_checkpoint_path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded, error = load_model(path, device), None
        except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException only
            loaded, error = None, e  # truncated zip, bad pickle, failed checksum, missing shard, ...
    skipped = []
    for w in caught:
        if os.path.abspath(w.filename) == os.path.abspath(checkpointer.__file__):
            skipped.append(first_sentence(w.message))
        else:  # not ours to reword
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if error is None:
        for note in skipped:
            print(f"warning: {note}", file=sys.stderr)
        return loaded
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch's own message would be about mmap
        cannot_load(path, "truncated, or not a checkpoint (not a complete torch zip archive)")
    if skipped and os.path.isdir(path) and not checkpoint_format.is_sharded_checkpoint(path):  # skipped every one
        cannot_load(path, "none of its checkpoints loads: " + "; ".join(skipped))
    if isinstance(error, CheckpointException) and error.failures:  # its message: a list of ranks, then tracebacks
        error = next(iter(error.failures.values()))[0]
    reason = first_sentence(error).removeprefix(f"{path}: ")
    cannot_load(path, f"{type(error).__name__}: {reason}" if reason else type(error).__name__)


def check_block_size(block_size, config, path, source="--block_size", extend=None):
    """Exit in one line if sequences of block_size tokens do not fit the model of checkpoint path; source:
    where block_size came from, to say what to change. extend: None where the script cannot score past the
    training length, else whether it was asked to (--extend_context)."""
    if block_size > config["block_size"] and not extend:
        fail(f"{source} {block_size} is longer than the context of {path} ({config['block_size']} tokens); "
             f"use --block_size {config['block_size']} or less" + (", or --extend_context to score past it"
                                                                     if extend is not None else ""))


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
