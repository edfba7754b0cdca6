"""scripts/quickstart.sh end to end on the plays that ship with the tests, in a copy of the repository
(it writes out/ beside its scripts): a val split of what the tiny config scores, one checkpoint per
run, final lines that say how much text the runs saw and that one seed is not a result, and shards
that scripts/small_study.sh takes as its own."""

import glob
import os
import shlex
import shutil
import subprocess

import pytest

from helpers import config_value, sweep_env
from pretrain.shards import list_shards, read_header
from running import HANG_GUARD_S, REPO, run_script

# quickstart.sh prepares data and trains in subprocesses: the slow tier
pytestmark = pytest.mark.slow

STEPS = 4
# steps of one micro-batch of 4 sequences, a quarter of the config's 16: the script and its summary are what is
# checked, and the override shows that the summary counts the tokens the runs were given
TOKENS_PER_STEP = 4 * 128


def copy_repo(dest):
    """The working tree's files (tracked, or untracked and not ignored), without out/ or data."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = os.path.join(REPO, name)
        if os.path.isfile(source):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))
    return str(dest)


def quickstart(repo, cwd, env, steps):
    proc = run_script(["bash", os.path.join(repo, "scripts", "quickstart.sh"), f"--max_iters={steps}",
                       "--checkpoint_interval=2", f"--eval_interval={steps}", "--val_tokens=2048", "--batch_size=4",
                       f"--total_batch_size={TOKENS_PER_STEP}"], cwd=cwd, env=env,
                      timeout=HANG_GUARD_S, preloaded=True)  # prepare.py's worker processes
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_quickstart_scores_a_small_val_split_and_says_what_its_result_rests_on(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    shards = str(tmp_path / "shards")
    plays = os.path.join(repo, "tests", "fixtures", "corpus", "*.txt")
    env = dict(os.environ, DATA_DIR=shards, INPUT=plays)
    proc = quickstart(repo, tmp_path, env, STEPS)

    # the val split is what the config scores (val_tokens, and the token after the last one scored)
    scored = config_value("config/sa_tiny.py", "val_tokens")
    val = sum(read_header(path) for path in list_shards(shards, "val"))
    train = sum(read_header(path) for path in list_shards(shards, "train"))
    assert val == scored + 1 and val < 0.1 * (val + train)

    assert f"{train:,} train tokens and {val:,} val tokens" in proc.stdout
    assert config_value("config/sa_tiny.py", "total_batch_size") != TOKENS_PER_STEP
    seen = STEPS * TOKENS_PER_STEP
    assert f"{STEPS} x {TOKENS_PER_STEP:,} = {seen:,} tokens, {seen / train:.2f} epochs" in proc.stdout
    assert "one seed" in proc.stdout and "scripts/small_study.sh" in proc.stdout

    # one checkpoint kept per run, and the summary says which and how big
    for run in ("sa_tiny", "xsa_tiny"):
        kept = sorted(glob.glob(os.path.join(repo, "out", run, "ckpt_*")))
        assert [os.path.basename(p) for p in kept] == [f"ckpt_{STEPS:07d}.pt"]
        megabytes = os.path.getsize(kept[0]) / 1e6
        assert f"out/{run}: 1 checkpoint(s), {megabytes:.0f} MB (ckpt_{STEPS:07d}.pt)" in proc.stdout

    # run again, it starts over, and the earlier runs' files are kept aside, not deleted
    first = {run: os.path.getsize(os.path.join(repo, "out", run, f"ckpt_{STEPS:07d}.pt"))
             for run in ("sa_tiny", "xsa_tiny")}
    again = quickstart(repo, tmp_path, env, 2)
    assert again.stdout.count("earlier run's files are moved to") == 2
    for run in ("sa_tiny", "xsa_tiny"):
        kept = glob.glob(os.path.join(repo, "out", run, "ckpt_*"))
        assert [os.path.basename(p) for p in kept] == ["ckpt_0000002.pt"]
        aside = glob.glob(os.path.join(repo, "out", run, "*", f"ckpt_{STEPS:07d}.pt"))
        assert len(aside) == 1 and os.path.getsize(aside[0]) == first[run]
        in_all = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(repo, "out", run))
                     for f in files)
        assert f"MB (ckpt_0000002.pt); {in_all / 1e6:.0f} MB in all" in again.stdout

    # the small study, given the same data, takes these shards as they are (one setting for both)
    study = run_script([os.path.join(repo, "scripts", "small_study.sh")],
                       env=sweep_env(DRY_RUN="1", DATA_DIR=shards, INPUT=plays, OUT_ROOT=str(tmp_path / "out")))
    assert study.returncode == 0, study.stderr
    prepare = next(shlex.split(line) for line in study.stdout.splitlines() if "data.fineweb.prepare" in line)
    again = run_script(prepare, cwd=repo, timeout=HANG_GUARD_S, preloaded=True)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
