"""
How the entry points end, and why in one line. Launchers (scripts/train_forever.sh, slurm_train.sh, the
sweeps) tell by the exit status a stop that relaunching cannot fix from a crash worth relaunching; a
failure that a user must fix is one line on stderr, not a traceback. train.py, eval/, data/fineweb/ and
scripts/ all take their statuses, and the one way to end with an error, from here.

The Hugging Face Hub out of reach is one of those stops: prepare (streaming FineWeb), download (fetching
shards) and eval.downstream (task data) check the Hub before starting, with one metadata request, and
report a failure with the way out that works without it, instead of retrying for half a minute and
ending in a 40-line traceback.
"""

import signal
import sys

RETRY = 1  # what running again may get past (a lost connection): the status of any crash
CONFIG_ERROR = 2  # a bad config, flag or command line: nothing was started or written
STOPPED = 3  # what running again unchanged cannot fix: missing or corrupt data or checkpoint, a diverged run,
# a full disk, an out_dir in use or unwritable, the Hugging Face Hub out of reach
SIGNALLED = {signal.SIGINT: 130, signal.SIGTERM: 143}  # stopped by a signal after checkpointing its step:
# 128 + the signal, as a shell reports it


class TrainingStopped(RuntimeError):
    """A condition under which continuing a run would waste compute or corrupt it: train.py ends with STOPPED."""


class Reported(Exception):
    """An error whose one line is already on stderr (exits.fail inside a check that train.py runs): the run ends
    with status, saying nothing more."""

    def __init__(self, status):
        super().__init__(f"exit status {status}")
        self.status = status


def one_line(e, sentence=False):
    """An exception as 'Type: first line' (a warning or a message: its first line alone), the libraries'
    own messages running to paragraphs; with sentence, cut to the first sentence (torch appends advice)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if sentence:
        text = text.split(". ")[0]
    if not isinstance(e, BaseException):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def error(message, status=STOPPED):
    """An error, message in one line on stderr (flushed); returns the exit status it ends with, for an entry
    point that returns its status (train.py) rather than exit at once (fail)."""
    print(message, file=sys.stderr, flush=True)
    return status


def fail(message, status=STOPPED):
    """End the program: message, one line on stderr, and exit status `status`."""
    sys.exit(error(message, status))


def hub_problem(repo_id):
    """Why the dataset repo cannot be read from the Hub, in one line, or None. One metadata request,
    which fails fast offline and honours the proxy settings as the real requests would."""
    from huggingface_hub import HfApi  # slow to import, and not needed for local files
    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except Exception as e:
        return one_line(e)
    return None


def exit_unreachable(repo_id, reason, instead):
    """One line naming the repo, the reason and what to do without the Hub (`instead`); exit status 3."""
    fail(f"cannot read {repo_id} from the Hugging Face Hub ({reason}); without Hub access, {instead}")


def check_hub(repo_id, instead):
    """Exit at once when the dataset repo cannot be read: load_dataset and hf_hub_download retry first."""
    problem = hub_problem(repo_id)
    if problem:
        exit_unreachable(repo_id, problem, instead)
