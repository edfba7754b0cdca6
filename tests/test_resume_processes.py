"""Runs stopped from outside and resumed: a killed process, a signal (to the launcher or to one rank), a
crash under scripts/train_forever.sh, a second run in the same out_dir, an unwritable out_dir, and a run
of two processes resumed on one. Each resumed run continues exactly as the uninterrupted one."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest


from helpers import RESUME, losses
from micro import BYTE_TOKENS, micro_args
from pretrain.checkpointer import list_checkpoints
from pretrain.metrics import read_metrics
from running import HANG_GUARD_S, REPO, TORCHRUN_GRACE, communicate, cpu_threads, preloaded_python, run_train


# 30 steps, a checkpoint every 3: a kill lands between two checkpoints. These runs, killed from outside (and one under
# scripts/train_forever.sh, which starts train.py itself), train over GPT-2's tokens, not bytes (BYTE_TOKENS): the
# seconds a step takes are the room the kill has to land in
THIRTY = dict(RESUME, max_iters=30, lr_decay_iters=30, checkpoint_interval=3, eval_interval=100)


@pytest.fixture(scope="module")
def thirty_steps(data_dir, tmp_path_factory):
    """THIRTY uninterrupted: the losses every killed and resumed run must reproduce."""
    out = str(tmp_path_factory.mktemp("thirty"))
    run_train(micro_args(data_dir, out, **THIRTY))
    return out


@pytest.mark.slow
def test_sigkill_after_first_checkpoint_then_resume(data_dir, thirty_steps, tmp_path):
    settings, full = THIRTY, thirty_steps
    out = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "train.py", *micro_args(data_dir, out, **settings)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + HANG_GUARD_S
    while not list_checkpoints(out) and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = int(os.path.basename(list_checkpoints(out)[-1])[5:12])
    assert killed_at < 30
    resumed = run_train(micro_args(data_dir, out, init_from="resume", **settings))
    assert f"at step {killed_at}" in resumed.stdout
    assert losses(out) == losses(full)


@pytest.mark.slow
def test_two_process_run_resumes_on_one_process(byte_data_dir, tmp_path):
    settings = dict(max_iters=6, lr_decay_iters=6, eval_interval=100, checkpoint_interval=3,
                    batch_size=2, total_batch_size=2 * 2 * 32 * 2, **BYTE_TOKENS)
    full = str(tmp_path / "full")
    run_train(micro_args(byte_data_dir, full, **settings), nproc=2)
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**settings, "max_iters": 3}), nproc=2)
    run_train(micro_args(byte_data_dir, out, init_from="resume", **settings), nproc=1)
    for (step_a, a), (step_b, b) in zip(losses(out), losses(full), strict=True):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-5)


def training_processes(out_dir):
    """PIDs of train.py processes writing to out_dir (not the wrapper script)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"train.py") for arg in cmdline) and f"--out_dir={out_dir}".encode() in cmdline:
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_train_forever_relaunches_after_a_crash(data_dir, thirty_steps, tmp_path):
    out = str(tmp_path / "run")
    settings, full = THIRTY, thirty_steps
    env = dict(os.environ, MAX_RESTARTS="3", NPROC="1", RESTART_DELAY="0")
    wrapper = subprocess.Popen(["bash", "scripts/train_forever.sh", *micro_args(data_dir, out, **settings)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    deadline = time.time() + HANG_GUARD_S
    while not list_checkpoints(out) and time.time() < deadline:
        time.sleep(0.05)
    victims = training_processes(out)
    assert victims, "no training process to crash"
    for pid in victims:  # a crash: the node dies under the training process
        os.kill(pid, signal.SIGKILL)
    output, _ = communicate(wrapper)
    assert wrapper.returncode == 0, output[-3000:]
    assert "restarting" in output and "resuming from" in output
    assert losses(out) == losses(full)


# signalled once 3 steps are logged: the 37 steps left (several seconds: SLOW_STEP_TRAIN) are room for the signal to
# arrive, and each resume trains what is left, so more steps cost every test here. Over bytes: the stop and the
# resume are the subject, not the tokens
LONG = dict(RESUME, max_iters=40, lr_decay_iters=40, checkpoint_interval=0, eval_interval=100, **BYTE_TOKENS)
# the runs stopped from outside: train.py, each step SLOW_STEP_S = 0.1 s longer (a bytes step alone is milliseconds)
SLOW_STEP_TRAIN = "tests/fakes/slow_step_train.py"


def wait_for_steps(out_dir, proc, steps):
    """Wait (for as long as the run lives) until `steps` steps are in out_dir's metrics.jsonl."""
    path = os.path.join(out_dir, "metrics.jsonl")
    while proc.poll() is None and not (os.path.exists(path) and len(read_metrics(path)) >= steps):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be signalled"


def start_train(args, nproc=1, env=None, preloaded=True):
    """train.py with slower steps (SLOW_STEP_TRAIN) started, in a process of its own or under torchrun: through
    the preloaded server (its signals are forwarded to the run), or (preloaded=False) the real interpreter, whose
    PID is the run's own."""
    python = preloaded_python(start=True) if preloaded else sys.executable
    cmd = [python, SLOW_STEP_TRAIN] if nproc == 1 else \
        [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SLOW_STEP_TRAIN]
    return subprocess.Popen(cmd + args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a hang is ended with the ranks (conftest.communicate)
                            env={**os.environ, **TORCHRUN_GRACE, "OMP_NUM_THREADS": str(max(1, cpu_threads() // nproc)),
                                 "SLOW_STEP_S": "0.1", "PYTHONPATH": REPO, **(env or {})})


@pytest.fixture(scope="module")
def long_run(byte_data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("long"))
    run_train(micro_args(byte_data_dir, out, **LONG))
    return out


@pytest.fixture(scope="module")
def long_run_on_two(byte_data_dir, tmp_path_factory):
    """LONG on two processes, which draw other dropout masks than one."""
    out = str(tmp_path_factory.mktemp("long_two"))
    run_train(micro_args(byte_data_dir, out, **LONG), nproc=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signum,status,nproc", [(signal.SIGTERM, 143, 1), (signal.SIGINT, 130, 1),
                                                 (signal.SIGTERM, 143, 2)])
def test_a_signal_ends_the_step_writes_a_checkpoint_and_the_resume_continues_exactly(
        byte_data_dir, tmp_path, long_run, long_run_on_two, signum, status, nproc):
    """SIGTERM (Slurm's preemption and time limit) and SIGINT (Ctrl-C): the run finishes its step,
    checkpoints it and exits 143 or 130. Under torchrun the signal goes to the launcher, which forwards it;
    torchrun's own status is 1, the run's is in TRAIN_EXIT_STATUS_FILE."""
    out, status_file = str(tmp_path / "run"), str(tmp_path / "exit_status")
    proc = start_train(micro_args(byte_data_dir, out, **LONG), nproc, env={"TRAIN_EXIT_STATUS_FILE": status_file})
    wait_for_steps(out, proc, 3)
    proc.send_signal(signum)
    stdout, stderr = communicate(proc)
    assert proc.returncode == (status if nproc == 1 else 1), stderr[-3000:]
    assert open(status_file).read() == f"{status}\n"
    # torchrun prints a traceback of its own SignalException; the ranks print none
    assert 'train.py", line' not in stderr and (nproc > 1 or "Traceback" not in stderr)
    stopped_at = int(re.search(rf"stopped by {signal.Signals(signum).name} after step (\d+)", stdout).group(1))
    assert 3 <= stopped_at < LONG["max_iters"]
    assert [os.path.basename(p) for p in list_checkpoints(out)] == [f"ckpt_{stopped_at:07d}.pt"]
    assert [s for s, _ in losses(out)][-1] == stopped_at
    resumed = run_train(micro_args(byte_data_dir, out, init_from="resume", **LONG), nproc=nproc)
    assert f"at step {stopped_at}" in resumed.stdout
    assert losses(out) == losses(long_run if nproc == 1 else long_run_on_two)


@pytest.mark.slow
def test_permanent_errors_reach_the_launcher_through_the_exit_status_file(data_dir, tmp_path):
    """torchrun exits 1 whatever its processes chose: train_forever.sh would relaunch a config error."""
    status_file = tmp_path / "exit_status"
    proc = run_train(micro_args(data_dir, str(tmp_path / "run"), batch_size=0), nproc=2, check=False, torchrun=True,
                     env={"TRAIN_EXIT_STATUS_FILE": str(status_file)})
    assert proc.returncode != 0 and "batch_size must be positive" in proc.stderr
    assert status_file.read_text() == "2\n"
    proc = run_train(micro_args(str(tmp_path / "no_data"), str(tmp_path / "run")), nproc=2, check=False, torchrun=True,
                     env={"TRAIN_EXIT_STATUS_FILE": str(status_file)})
    assert status_file.read_text() == "3\n"


@pytest.mark.slow
def test_a_second_run_in_the_same_out_dir_stops_naming_the_first(byte_data_dir, tmp_path):
    """One run per out_dir: the second exits 3 naming the holder's PID; the lock dies with its holder
    (kill -9 included), so a relaunch then resumes."""
    out = str(tmp_path / "run")
    first = start_train(micro_args(byte_data_dir, out, **{**LONG, "checkpoint_interval": 2}), preloaded=False)
    wait_for_steps(out, first, 3)
    second = run_train(micro_args(byte_data_dir, out, init_from="resume", **LONG), check=False)
    assert second.returncode == 3 and f"is in use by another process (PID {first.pid}" in second.stderr
    assert first.poll() is None  # untouched by the second
    first.send_signal(signal.SIGKILL)
    first.wait()
    resumed = run_train(micro_args(byte_data_dir, out, init_from="resume", **{**LONG, "max_iters": 8}))
    assert "resuming from" in resumed.stdout
    assert not os.path.exists(os.path.join(out, ".train.lock"))  # released at the end


def rank_processes(out_dir):
    """{rank: PID} of the torchrun workers training into out_dir (not torchrun itself)."""
    ranks = {}
    for pid in training_processes(out_dir):
        try:
            environ = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"LOCAL_RANK" in environ:
            ranks[int(environ[b"RANK"])] = pid
    return ranks


@pytest.mark.slow
def test_a_signal_that_reaches_one_rank_stops_every_rank_after_one_checkpoint_with_one_status(
        byte_data_dir, tmp_path, long_run_on_two):
    """SIGTERM to rank 1 alone (a node's agent, a kill by hand): both ranks stop after the same step, write
    one checkpoint, and exit 143 without a traceback (rank 0 got no signal, yet takes the agreed status);
    the resume equals the uninterrupted run."""
    out, status_file = str(tmp_path / "run"), str(tmp_path / "exit_status")
    proc = start_train(micro_args(byte_data_dir, out, **LONG), nproc=2, env={"TRAIN_EXIT_STATUS_FILE": status_file})
    wait_for_steps(out, proc, 3)
    ranks = rank_processes(out)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGTERM)
    stdout, stderr = communicate(proc)
    assert open(status_file).read() == "143\n", stderr[-3000:]
    ranks_stderr = stderr.split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]  # torchrun's own aside
    # rank 0, which got no signal, once exited 0 into a barrier rank 1 had left: "Connection closed by peer"
    assert 'train.py", line' not in ranks_stderr and "Connection closed" not in ranks_stderr, stderr[-5000:]
    stopped_at = int(re.search(r"stopped by SIGTERM after step (\d+)", stdout).group(1))
    assert [os.path.basename(p) for p in list_checkpoints(out)] == [f"ckpt_{stopped_at:07d}.pt"]
    run_train(micro_args(byte_data_dir, out, init_from="resume", **LONG), nproc=2)
    assert losses(out) == losses(long_run_on_two)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_out_dir_that_cannot_be_written_stops_every_rank_in_one_line(data_dir, tmp_path, nproc):
    """A path under a file (or a read-only mount) fails on rank 0, where the lock is taken; the other ranks
    must not wait for it in a collective: all stop with exit 3."""
    (tmp_path / "notes").write_text("a file")
    out, status_file = str(tmp_path / "notes" / "run"), tmp_path / "exit_status"
    proc = run_train(micro_args(data_dir, out), nproc=nproc, check=False, torchrun=nproc > 1,
                     env={"TRAIN_EXIT_STATUS_FILE": str(status_file)})
    message = f"cannot write in out_dir {out} (NotADirectoryError"
    assert message in proc.stderr and 'train.py", line' not in proc.stderr  # torchrun's own report aside
    if nproc == 1:
        assert proc.returncode == 3
    else:
        assert status_file.read_text() == "3\n" and proc.stderr.count(message) == 2  # every rank, alike
