"""data/fineweb/prepare.py's progress bar: with an ETA on a terminal, none in a log or with --quiet."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from helpers import ETA, last_bar
from prepare_helpers import PREPARE, prepare_args, run_prepare
from running import REPO


def run_on_a_terminal(cmd):
    """Run cmd with its stderr on a pseudo-terminal (100 columns); returns (exit status, stderr text)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    output = b""
    while True:  # read as it comes, so that a full terminal buffer never blocks the process
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    return proc.wait(), output.decode()


def test_progress_bar_counts_documents_to_the_total_of_the_input(parquet_file, docs, tmp_path):
    status, stderr = run_on_a_terminal([sys.executable, "-m", PREPARE,
                                        *map(str, prepare_args([parquet_file], tmp_path / "a"))])
    assert status == 0
    bar = last_bar(stderr)
    assert bar.startswith("100%") and f" {len(docs)}/{len(docs)} " in bar and ETA.search(bar), bar


def test_progress_bar_counts_tokens_to_max_tokens(parquet_file, tmp_path):
    cmd = [sys.executable, "-m", PREPARE,
           *map(str, prepare_args([parquet_file], tmp_path / "a", "--max_tokens", 55_555))]
    status, stderr = run_on_a_terminal(cmd)
    assert status == 0
    bar = last_bar(stderr)
    assert bar.startswith("100%") and " 55.6k/55.6k " in bar and ETA.search(bar), bar


def test_no_progress_bar_with_quiet_or_in_a_log(parquet_file, tmp_path):
    status, stderr = run_on_a_terminal([sys.executable, "-m", PREPARE,
                                        *map(str, prepare_args([parquet_file], tmp_path / "a", "--quiet"))])
    assert status == 0 and stderr.strip() == ""
    logged = run_prepare(*prepare_args([parquet_file], tmp_path / "b"))  # stderr is a pipe
    assert logged.stderr.strip() == "" and "done:" in logged.stdout
