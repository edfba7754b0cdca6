"""scripts/train_forever.sh and scripts/slurm_train.sh: which exit statuses end a run and which
relaunch it, signals reaching the training, no training process left behind, and a Slurm job that
outlives its time limit by requeueing itself.

Fake torchrun, nvidia-smi, sbatch, srun, scontrol and scancel (first on PATH) and a fake training
program, the programs in tests/fakes/, stand in for the real ones and record what happens to them;
the tests at the end run the real torchrun and train.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import SWEEP_PYTHON, dry_run
from micro import micro_args
from pretrain.metrics import read_metrics
from running import HANG_GUARD_S, REPO, run_script

FOREVER = os.path.join(REPO, "scripts", "train_forever.sh")
SLURM = os.path.join(REPO, "scripts", "slurm_train.sh")
LAUNCH_ENV = ("NPROC", "MAX_RESTARTS", "RESTART_DELAY", "CUDA_VISIBLE_DEVICES", "PYTHON", "TMPDIR",
              "TRAIN_EXIT_STATUS_FILE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")

# the fake programs, one file each in tests/fakes/
FAKES_DIR = os.path.join(REPO, "tests", "fakes")
FAKES = ["fake_train", "torchrun", "nvidia-smi", "sbatch", "srun", "scontrol", "scancel"]


def install_fake(name, path):
    """tests/fakes/<name> as an executable at path that runs under the interpreter running pytest."""
    with open(os.path.join(FAKES_DIR, name)) as f:
        shebang, source = f.read().split("\n", 1)
    assert shebang.startswith("#!"), f"tests/fakes/{name} has no shebang"
    path.write_text(f"#!{sys.executable} -S\n" + source)  # -S: the fakes use the standard library alone
    path.chmod(0o755)


@pytest.fixture
def fakes(tmp_path):
    """A bin directory of fake programs; gives the environment that puts them first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in FAKES:
        install_fake(name, bin_dir / name)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "slurm").mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env = {**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "events.jsonl"),
           "FAKE_TRAIN": str(bin_dir / "fake_train"), "PYTHON": str(bin_dir / "fake_train"),
           "FAKE_SLURM_DIR": str(tmp_path / "slurm"), "TMPDIR": str(tmp_path / "tmp"), "RESTART_DELAY": "0"}
    yield env
    for e in events(env):  # a failed test may leave fakes running in sessions of their own: end them
        if "pid" in e and alive(e["pid"]):
            os.kill(e["pid"], signal.SIGKILL)


def events(env, kind=None):
    path = env["FAKE_LOG"]
    if not os.path.exists(path):
        return []
    with open(path) as f:
        found = [json.loads(line) for line in f]
    return [e for e in found if kind is None or e["event"] == kind]


def wait_until(condition, what, timeout=HANG_GUARD_S):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def alive(pid):
    """Running, not a zombie (an init that does not reap orphans leaves those behind)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes():
    """[(pid, ppid, pgid)] of the live processes on this machine."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            found.append((int(name), int(fields[1]), int(fields[2])))
    return found


def descendants(pid):
    """pid and the live processes it started, and theirs."""
    found, children = [pid], {}
    for child, parent, _ in processes():
        children.setdefault(parent, []).append(child)
    for parent in found:
        found.extend(children.get(parent, []))
    return found


def forever(env, *args, **extra):
    """Start train_forever.sh detached (setsid), so that a failing test can kill what it left."""
    return subprocess.Popen(["bash", FOREVER, *args], env={**env, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, timeout=HANG_GUARD_S):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_nothing_left(env):
    for e in events(env):
        if "pid" in e:
            assert not alive(e["pid"]), f"{e['event']} process {e['pid']} outlived train_forever"
    assert not os.listdir(env["TMPDIR"]), "train_forever left its exit-status files behind"


# -----------------------------------------------------------------------------
# train_forever.sh


@pytest.mark.slow
def test_help_shows_its_own_settings_then_train_py_keys():
    proc = run_script(["bash", FOREVER, "config/sa_tiny.py", "--help"])
    assert proc.returncode == 0, proc.stderr
    for setting in ("NPROC", "MAX_RESTARTS", "RESTART_DELAY", "TRAIN_EXIT_STATUS_FILE"):
        assert setting in proc.stdout
    assert "learning_rate" in proc.stdout.split("NPROC", 1)[1]  # then train.py's keys
    assert "run finished" not in proc.stdout and "restarting" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("status", [2, 3])
def test_an_error_no_restart_fixes_ends_the_loop_after_one_launch(fakes, nproc, status):
    proc = forever(fakes, "config/sa_tiny.py", NPROC=str(nproc), FAKE_MODE=f"exit:{status}", MAX_RESTARTS="3")
    output = finish(proc)
    assert proc.returncode == status, output  # also under torchrun, which itself exits 1
    assert len(events(fakes, "start")) == nproc and "restarting" not in output
    assert len(events(fakes, "torchrun")) == (nproc > 1)
    assert_nothing_left(fakes)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_crash_is_relaunched_from_the_newest_checkpoint(fakes, nproc):
    proc = forever(fakes, "config/sa_tiny.py", "--max_iters=50", NPROC=str(nproc), FAKE_MODE="exit:1")
    output = finish(proc)
    assert proc.returncode == 0 and "run finished" in output, output
    starts = events(fakes, "start")
    assert len(starts) == 2 * nproc
    assert all("--init_from=resume" not in s["argv"] for s in starts[:nproc])
    assert all(s["argv"][-1] == "--init_from=resume" and "--max_iters=50" in s["argv"] for s in starts[nproc:])
    assert_nothing_left(fakes)


@pytest.mark.slow
def test_crashes_are_relaunched_max_restarts_times_then_it_gives_up(fakes):
    proc = forever(fakes, "config/sa_tiny.py", NPROC="1", FAKE_MODE="exit:7", FAKE_RESUMED="same",
                   MAX_RESTARTS="2")
    output = finish(proc)
    assert proc.returncode == 7 and "giving up after 2 restarts" in output
    assert len(events(fakes, "start")) == 3


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 143)])
def test_a_signal_stops_the_training_at_a_checkpoint_and_ends_the_loop(fakes, nproc, sig, status):
    """Ctrl-C at the terminal reaches only train_forever (each launch is started with setsid); it
    passes the signal on (SIGHUP as SIGTERM), waits for the checkpoint, and does not relaunch."""
    proc = forever(fakes, "config/sa_tiny.py", NPROC=str(nproc))
    wait_until(lambda: len(events(fakes, "start")) == nproc, "the training to start")
    proc.send_signal(sig)
    output = finish(proc)
    assert proc.returncode == status, output
    assert "restarting" not in output
    expected = signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM
    received = events(fakes, "signal")
    assert sorted(e["rank"] or "0" for e in received) == [str(r) for r in range(nproc)]  # each rank once
    assert {e["signal"] for e in received} == {expected.name}
    assert len(events(fakes, "checkpoint")) == nproc
    assert len(events(fakes, "start")) == nproc
    assert_nothing_left(fakes)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_training_starts_up_ends_the_loop(fakes, nproc, sig, status):
    """A Ctrl-C that comes before train.py has installed its handler (it is importing torch) stops that
    launch and the loop: the launch is not left running with the signal ignored, as a `&` child of a
    non-interactive shell would be, and nothing is relaunched. There is no checkpoint to write yet."""
    proc = forever(fakes, "config/sa_tiny.py", NPROC=str(nproc), FAKE_START_S="36000")
    wait_until(lambda: len(events(fakes, "starting")) == nproc, "the training to be starting")
    proc.send_signal(sig)
    output = finish(proc)  # not the ten hours of the start-up: the signal ended it
    assert proc.returncode == status, output
    assert "restarting" not in output and f"stopped by a signal (status {status})" in output
    assert events(fakes, "start") == [] and len(events(fakes, "torchrun")) == (nproc > 1)
    assert_nothing_left(fakes)


@pytest.mark.slow
@pytest.mark.parametrize("status", [130, 143])
def test_a_training_stopped_by_a_signal_of_its_own_is_not_relaunched(fakes, status):
    proc = forever(fakes, "config/sa_tiny.py", NPROC="2", FAKE_MODE=f"exit:{status}")
    output = finish(proc)
    assert proc.returncode == status and "--init_from=resume" in output
    assert len(events(fakes, "torchrun")) == 1


@pytest.mark.slow
def test_a_signal_during_the_restart_delay_ends_the_loop_at_once(fakes):
    proc = forever(fakes, "config/sa_tiny.py", NPROC="1", FAKE_MODE="exit:1", RESTART_DELAY="36000")
    for line in proc.stdout:
        if "restarting" in line:  # the crashed launch is over
            break
    proc.send_signal(signal.SIGTERM)
    output = finish(proc)  # not the ten hours of the delay
    assert proc.returncode == 143, output
    assert len(events(fakes, "start")) == 1


@pytest.mark.slow
def test_ranks_of_a_killed_torchrun_are_stopped_before_the_relaunch(fakes):
    """kill -9 on torchrun orphans its ranks; they must not outlive it and hold out_dir against the
    relaunch. Their SIGTERM statuses (143) come after torchrun's death and do not stop the loop."""
    proc = forever(fakes, "config/sa_tiny.py", NPROC="2")
    wait_until(lambda: len(events(fakes, "start")) == 2, "the ranks to start")
    torchrun = events(fakes, "torchrun")[0]
    os.kill(torchrun["pid"], signal.SIGKILL)
    output = finish(proc)
    assert proc.returncode == 0 and "restarting (1/10)" in output, output
    launches = events(fakes, "torchrun")
    assert len(launches) == 2
    orphans_ended = [e for e in events(fakes, "exit") if e["launch"] == torchrun["launch"]]
    assert len(orphans_ended) == 2 and all(e["status"] == 143 for e in orphans_ended)  # asked, and checkpointed
    assert max(e["time"] for e in orphans_ended) < launches[1]["time"]
    assert_nothing_left(fakes)


@pytest.mark.slow
@pytest.mark.parametrize("visible, nproc", [(None, 4), ("0,1", 2), ("3", 1), ("", 1)])
def test_processes_follow_cuda_visible_devices_as_in_the_sweeps(fakes, tmp_path, visible, nproc):
    """One GPU count for train_forever.sh and the sweeps: CUDA_VISIBLE_DEVICES when set (empty
    hides every GPU), else what nvidia-smi lists (4 GPUs here)."""
    env = {**fakes, "FAKE_GPUS": "4", "FAKE_MODE": "exit:0"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = forever(env, "config/sa_tiny.py")
    finish(proc)
    assert proc.returncode == 0
    launches = events(fakes, "torchrun")
    assert [e["nproc"] for e in launches] == ([nproc] if nproc > 1 else [])
    assert len(events(fakes, "start")) == nproc
    sweep = dry_run("sweep_sizes.sh", OUT_ROOT=str(tmp_path / "out"), SIZES="tiny", NPROC="", PATH=env["PATH"],
                    FAKE_GPUS="4", **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    expected = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "train.py"] if nproc > 1 else \
        [SWEEP_PYTHON, "train.py"]
    assert [c["launcher"] for c in sweep] == [expected] * 2


@pytest.mark.slow
def test_a_bad_process_count_is_a_config_error(fakes):
    proc = forever(fakes, "config/sa_tiny.py", NPROC="two")
    output = finish(proc)
    assert proc.returncode == 2 and "NPROC=two" in output
    assert not events(fakes)


# -----------------------------------------------------------------------------
# slurm_train.sh under a fake Slurm


def submit(env, *args, **extra):
    result = run_script(["sbatch", SLURM, *args], env={**env, **extra}, timeout=HANG_GUARD_S)
    return result, result.output


def directives():
    with open(SLURM) as f:
        return [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH")]


def test_slurm_job_asks_for_a_warning_before_its_time_limit_and_may_be_requeued():
    found = directives()
    assert "--requeue" in found
    assert "--open-mode=append" in found  # a requeued job keeps its log, under the same job id
    spec = next(d.split("=", 1)[1] for d in found if d.startswith("--signal="))
    assert spec.startswith("B:USR1@")  # to the batch script only: it stops the training itself
    assert int(spec.split("@")[1]) >= 300  # time to finish a step and write a checkpoint


@pytest.mark.slow
def test_slurm_job_at_its_time_limit_checkpoints_requeues_and_resumes(fakes):
    proc, output = submit(fakes, "config/xsa_2p7b.py", "--parallelism=fsdp", FAKE_TIME_LIMITS="1")
    assert proc.returncode == 0, output
    runs = events(fakes, "srun")
    assert len(runs) == 2
    for run in runs:
        argv = run["argv"]
        assert argv[:2] == ["--kill-on-bad-exit=1", "torchrun"]
        assert "--nnodes=2" in argv and "--nproc_per_node=8" in argv and "--rdzv_endpoint=node001:29500" in argv
        assert argv[argv.index("train.py"):][:3] == ["train.py", "config/xsa_2p7b.py", "--parallelism=fsdp"]
    assert "--init_from=resume" not in runs[0]["argv"] and runs[1]["argv"][-1] == "--init_from=resume"
    # the training, not srun, gets SIGTERM (srun would SIGKILL it); the requeue waits for the checkpoint
    assert not events(fakes, "srun_signal")
    assert [e["argv"] for e in events(fakes, "scancel")] == [["--signal=TERM", "4242"]]
    order = [e["event"] for e in events(fakes) if e["event"] in
             ("time_limit_warning", "signal", "checkpoint", "exit", "requeue", "job_end", "job_start")]
    assert order == ["job_start", "time_limit_warning", "signal", "checkpoint", "exit", "requeue", "job_end",
                     "job_start", "exit", "job_end"]
    assert [e["status"] for e in events(fakes, "exit")] == [143, 0]


@pytest.mark.slow
@pytest.mark.parametrize("mode, status", [("exit:0", 0), ("exit:2", 2), ("exit:3", 3), ("exit:1", 1)])
def test_slurm_job_that_ends_by_itself_is_not_requeued(fakes, mode, status):
    """srun exits 1 for train.py's 2 and 3 as for a crash; the job ends with train.py's status."""
    proc, output = submit(fakes, "config/xsa_2p7b.py", FAKE_MODE=mode)
    assert proc.returncode == status, output
    assert len(events(fakes, "srun")) == 1 and not events(fakes, "requeue")


@pytest.mark.slow
@pytest.mark.parametrize("mode, status", [("exit:2", 2), ("exit:0", 0)])
def test_slurm_job_that_fails_or_finishes_at_its_time_limit_is_not_requeued(fakes, mode, status):
    """The warning comes while the run is already stopping: an error no restart fixes, or the end."""
    env = {**fakes, "FAKE_MODE": "run"}
    with open(fakes["FAKE_TRAIN"]) as f:
        source = f.read()
    assert "    stop(128 + signum)" in source
    with open(fakes["FAKE_TRAIN"], "w") as f:  # the fake's signal handler stops with mode's status instead
        f.write(source.replace("    stop(128 + signum)", f"    stop({mode[5:]})"))
    proc, output = submit(env, "config/xsa_2p7b.py", FAKE_TIME_LIMITS="1")
    assert proc.returncode == status, output
    assert len(events(fakes, "srun")) == 1 and not events(fakes, "requeue")


@pytest.mark.slow
def test_slurm_job_waits_for_the_checkpoint_when_preempted(fakes):
    """Preemption (or scancel) sends SIGTERM to the batch script and the training at once: the
    script must outlive the training's checkpoint; Slurm requeues the job, which resumes."""
    proc, output = submit(fakes, "config/xsa_2p7b.py", FAKE_PREEMPTIONS="1")
    assert proc.returncode == 0, output
    checkpoint, first_end = events(fakes, "checkpoint")[0], events(fakes, "job_end")[0]
    assert checkpoint["time"] < first_end["time"]
    assert not events(fakes, "srun_signal") and not events(fakes, "requeue")  # Slurm requeues it itself
    assert events(fakes, "srun")[1]["argv"][-1] == "--init_from=resume"


# -----------------------------------------------------------------------------
# the real torchrun and train.py


def launch_leader(forever_pid):
    """The running launch of train_forever: its child that leads a process group of its own."""
    for pid, ppid, pgid in processes():
        if ppid == forever_pid and pgid == pid:
            return pid
    return None


def newest_checkpoint_step(out_dir):
    from pretrain.checkpoint_format import checkpoint_step
    from pretrain.checkpointer import list_checkpoints
    paths = list_checkpoints(out_dir) if os.path.isdir(out_dir) else []
    return checkpoint_step(paths[-1]) if paths else None


def real_env(**extra):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**clean, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "RESTART_DELAY": "0", **extra}


@pytest.mark.slow
def test_real_config_error_under_torchrun_stops_after_one_launch():
    proc = run_script(["bash", FOREVER, "config/sa_tiny.py", "--batch_size=0"],
                      env=real_env(NPROC="2", MAX_RESTARTS="2"), timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting" not in proc.stdout


@pytest.mark.slow
def test_real_ctrl_c_under_torchrun_checkpoints_and_stops(tmp_path, data_dir):
    out_dir = str(tmp_path / "run")
    args = micro_args(data_dir, out_dir, max_iters=5000, checkpoint_interval=2500, eval_interval=2500)
    proc = forever(real_env(NPROC="2"), *args)
    try:
        metrics = os.path.join(out_dir, "metrics.jsonl")
        wait_until(lambda: os.path.exists(metrics) and len(read_metrics(metrics)) >= 3, "training steps")
        leader = launch_leader(proc.pid)
        ranks = descendants(leader)
        proc.send_signal(signal.SIGINT)
        output = finish(proc, timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    assert "restarting" not in output
    assert newest_checkpoint_step(out_dir) == read_metrics(metrics)[-1]["step"]  # saved where it stopped
    assert len(ranks) >= 3 and not any(alive(pid) for pid in ranks)  # torchrun and its two ranks


@pytest.mark.slow
def test_real_ranks_of_a_killed_torchrun_are_gone_before_the_relaunch(tmp_path, data_dir):
    out_dir = str(tmp_path / "run")
    max_iters = 40
    args = micro_args(data_dir, out_dir, max_iters=max_iters, checkpoint_interval=5, eval_interval=1000)
    proc = forever(real_env(NPROC="2"), *args)
    try:
        wait_until(lambda: newest_checkpoint_step(out_dir), "the first checkpoint")
        first = launch_leader(proc.pid)
        ranks = descendants(first)[1:]
        assert len(ranks) >= 2
        os.kill(first, signal.SIGKILL)
        log = os.path.join(out_dir, "train.log")
        wait_until(lambda: open(log).read().count("resuming from") == 1, "the relaunched run to resume")
        assert not any(alive(pid) for pid in ranks), "the killed torchrun's ranks outlived it"
        output = finish(proc, timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    assert "restarting (1/10)" in output and "restarting (2/10)" not in output
    assert [r["step"] for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))] == list(range(1, max_iters + 1))
