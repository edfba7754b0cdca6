"""The process group's timeout (dist_timeout_s): ranks that wait in a collective while rank 0 writes DDP's
single-file checkpoint alone. Rank 0's write is slowed by tests/fakes/slow_checkpoint_train.py, train.py on a
slow filesystem stand-in."""

import os

import pytest

from micro import micro_args
from running import REPO, run_train


def slow_run(data_dir, out_dir, timeout_s, slow_s, status_file):
    """A two-process DDP run of 2 steps, a checkpoint each, rank 0's writes slowed by slow_s seconds."""
    args = micro_args(data_dir, out_dir, max_iters=2, checkpoint_interval=1, eval_interval=2,
                      dist_timeout_s=timeout_s)
    env = {"SLOW_CHECKPOINT_S": str(slow_s), "TRAIN_EXIT_STATUS_FILE": str(status_file), "PYTHONPATH": REPO}
    return run_train(args, nproc=2, check=False, env=env, script="tests/fakes/slow_checkpoint_train.py",
                     torchrun=True)


@pytest.mark.slow
def test_a_slow_checkpoint_write_within_the_timeout_finishes(data_dir, tmp_path):
    result = slow_run(data_dir, tmp_path / "run", 60, 4, tmp_path / "status")
    assert result.status == 0, result.output[-3000:]
    assert sorted(os.listdir(tmp_path / "run")).count("ckpt_0000002.pt") == 1


@pytest.mark.slow
def test_a_timeout_shorter_than_the_write_ends_in_one_line_naming_the_key(data_dir, tmp_path):
    """The waiting rank stops with a line that names dist_timeout_s and exit status 3 (raising it, not
    relaunching, is the fix); rank 0, whose peer is gone, says so and leaves the status file to rank 1."""
    result = slow_run(data_dir, tmp_path / "run", 3, 10, tmp_path / "status")
    assert result.status != 0
    lines = [line for line in result.stderr.splitlines() if "dist_timeout_s = 3 s" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 1] error: a collective waited longer than")
    assert "[rank 0] error: another process of this run ended" in result.stderr
    assert (tmp_path / "status").read_text().strip() == "3"
