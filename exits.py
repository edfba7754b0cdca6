"""
How the entry points end. Launchers (scripts/train_forever.sh, slurm_train.sh, the sweeps) tell by
the exit status a stop that relaunching cannot fix from a crash worth relaunching; a failure that a
user must fix is one line on stderr, not a traceback. train.py, bench.py, eval/, data/fineweb/ and
scripts/ all take their statuses from here.
"""

import signal

CONFIG_ERROR = 2  # a bad config, flag or command line: nothing was started or written
STOPPED = 3  # what running again unchanged cannot fix: missing or corrupt data or checkpoint, a diverged run,
# a full disk, an out_dir in use or unwritable, the Hugging Face Hub out of reach
SIGNALLED = {signal.SIGINT: 130, signal.SIGTERM: 143}  # stopped by a signal after checkpointing its step:
# 128 + the signal, as a shell reports it


def one_line(e):
    """An exception as 'Type: first line': the libraries' own messages run to paragraphs."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
