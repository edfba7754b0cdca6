"""
What the scripts in eval/ share: their common command-line flags (checkpoints and --labels,
--data_dir, --device, --dtype, --out, --quiet), progress bars, writing results and plots, GPT-2's
encoding (also train.py's, for its in-loop passes), the validation sequences and the Student t quantile of
their intervals (a checkpoint's model loads with pretrain/checkpointer.py's load_model_or_exit).
Whatever cannot be read or written ends a script with one line on stderr naming it, and exit status 3
(exits.fail), instead of a traceback.
"""

import argparse
import functools
import os
import sys
import tempfile

from pretrain import checkpointer, exits
from pretrain.dataloader import val_sequences
from pretrain.files import write_atomically
from pretrain.runtime import DTYPES, DeviceError, pick_device, resolve_dtype
from pretrain.shards import ShardError

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
        checkpointer.check_checkpoint_path(path)
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
# one line on stderr and exit status 3 (exits.fail) for whatever cannot be read or written


def output_dir(out):
    """Make the --out directory if needed and check that files can be written there, before any long
    work: a report lost after an hour of evaluation to a typo in --out is the worst kind of failure."""
    if os.path.exists(out) and not os.path.isdir(out):
        exits.fail(f"--out {out} is a file; --out names a directory (made if missing) for the results")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        exits.fail(f"cannot write in --out {out} ({exits.one_line(e)}); give a writable directory with --out")
    return out


def write_text(out, name, text):
    """Write text to out/name atomically (pretrain/files.py: a crash leaves the old file or the new one);
    returns the path. A failure ends the script in one line."""
    return write_file(out, name, lambda f: f.write(text.encode("utf-8")))


def write_file(out, name, write):
    """Call write(f) on a binary file that becomes out/name atomically; returns the path."""
    path = os.path.join(out, name)
    try:
        write_atomically(path, write)
    except OSError as e:
        exits.fail(f"cannot write {path} ({exits.one_line(e)}); give a writable directory with --out")
    return path


@functools.lru_cache(maxsize=None)
def t_quantile(confidence, df):
    """The Student t quantile of a two-sided interval at this confidence, with df degrees of freedom. Cached:
    scipy's ppf is slow, and a table and its band ask for the same few over and over. scipy is imported here,
    not at the top: its second of imports is for the scripts that print an interval."""
    import scipy.stats
    return float(scipy.stats.t.ppf((1 + confidence) / 2, df))


def fmt(x, signed=False):
    """A loss or a difference for the tables: 4 decimals, "–" where there is none."""
    return "–" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")


def pyplot():
    """matplotlib.pyplot drawing to files only: no display is needed on a cluster node."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, out, name, dpi=120):
    """Lay out fig, write it to out/name as a PNG (atomically) and close it; returns the path."""
    plt = pyplot()
    try:
        fig.tight_layout()
        return write_file(out, name, lambda f: fig.savefig(f, format="png", dpi=dpi))
    finally:
        plt.close(fig)


# -----------------------------------------------------------------------------
# GPT-2's encoding, which tiktoken downloads on first use


class TokenizerUnavailable(RuntimeError):
    """GPT-2's encoding cannot be loaded here (offline, with nothing in tiktoken's cache); the message is one line."""


def gpt2_encoding():
    """tiktoken's gpt2 encoding (the shards' tokenizer), or TokenizerUnavailable saying why and what to do."""
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests' errors offline, a missing package, a torn cache file
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or "tiktoken's default cache"
        raise TokenizerUnavailable(f"cannot load GPT-2's encoding (tiktoken's gpt2: {exits.one_line(e, sentence=True)}; "
                                   f"cache: {cache}); offline, point TIKTOKEN_CACHE_DIR at a folder holding "
                                   f"tiktoken's cached gpt2 files") from None


def gpt2_encoding_or_exit():
    """gpt2_encoding(), or the script ends in one line with exit status 3."""
    try:
        return gpt2_encoding()
    except TokenizerUnavailable as e:
        exits.fail(str(e))


# -----------------------------------------------------------------------------
# what a checkpoint's model is run on


def check_block_size(block_size, config, path, source="--block_size", extend=None):
    """Exit in one line if sequences of block_size tokens do not fit the model of checkpoint path; source:
    where block_size came from, to say what to change. extend: None where the script cannot score past the
    training length, else whether it was asked to (--extend_context)."""
    if block_size > config["block_size"] and not extend:
        exits.fail(f"{source} {block_size} is longer than the context of {path} ({config['block_size']} tokens); "
                   f"use --block_size {config['block_size']} or less"
                   + (", or --extend_context to score past it" if extend is not None else ""))


def validation_sequences(args, config, block_size, num_sequences):
    """(data_dir, x, y): up to num_sequences validation sequences of block_size tokens from --data_dir,
    or by default from the data_dir in the checkpoint's training config, so that a model is scored
    on held-out tokens of the data it was trained on."""
    data_dir = args.data_dir or config["data_dir"]
    try:
        x, y = val_sequences(data_dir, block_size, num_sequences * block_size)
    except (ShardError, OSError) as e:
        whose = "" if args.data_dir else " (the checkpoint's data_dir; --data_dir reads another)"
        exits.fail(f"cannot read validation data{whose}: {e}")
    return data_dir, x, y
