"""scripts/sweep_*.sh and small_study.sh: the commands they run (DRY_RUN=1), and a real two-run
sweep interrupted, rerun and extended: the finished run skipped untouched, the other resumed."""

import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from helpers import SWEEP_PYTHON, config_value, dry_run, run_sweep, sweep_env
from micro import micro_args
from pretrain.metrics import read_metrics
from running import HANG_GUARD_S, REPO, run_script

# every test starts a sweep script (scripts/*.sh), some train: the slow tier
pytestmark = pytest.mark.slow

SCRIPTS = ["sweep_lr.sh", "sweep_seqlen.sh", "sweep_sinks.sh", "sweep_sizes.sh", "sweep_optimizer.sh",
           "small_study.sh"]
PAPER_TOKENS_PER_STEP = 524_288


def check_names(cmd, out_root, sweep, name, group):
    o = cmd["overrides"]
    assert o["out_dir"] == f"{out_root}/{sweep}/{name}"
    assert o["wandb_run_name"] == name
    assert o["wandb_group"] == group


def test_scripts_are_executable_and_document_themselves():
    for script in SCRIPTS:
        path = os.path.join(REPO, "scripts", script)
        assert os.access(path, os.X_OK), f"{script} is not executable"
        proc = run_sweep(script, "--help")
        assert "scripts/" + script in proc.stdout


def test_lr_sweep_runs_sa_and_xsa_at_the_paper_learning_rates(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_lr.sh", OUT_ROOT=out_root)
    assert len(commands) == 8
    seen = set()
    for cmd in commands:
        assert cmd["launcher"] == [SWEEP_PYTHON, "train.py"] and cmd["env"] == {}
        attn = os.path.basename(cmd["config"]).split("_")[0]
        lr = cmd["overrides"]["learning_rate"]
        assert cmd["config"] == f"config/{attn}_1p4b.py"
        check_names(cmd, out_root, "sweep_lr", f"{attn}_1p4b_lr{lr}", "sweep_lr_1p4b")
        assert "init_from" not in cmd["overrides"]  # nothing to resume yet
        seen.add((attn, float(lr)))
    assert seen == {(a, lr) for a in ("sa", "xsa") for lr in (1e-4, 2e-4, 4e-4, 6e-4)}


def test_lr_sweep_takes_size_and_rates_from_the_environment(tmp_path):
    commands = dry_run("sweep_lr.sh", OUT_ROOT=str(tmp_path), SIZE="0p7b", LRS="3e-4 5e-4")
    assert [(c["config"], c["overrides"]["learning_rate"]) for c in commands] == [
        ("config/sa_0p7b.py", "3e-4"), ("config/xsa_0p7b.py", "3e-4"),
        ("config/sa_0p7b.py", "5e-4"), ("config/xsa_0p7b.py", "5e-4")]
    assert {c["overrides"]["wandb_group"] for c in commands} == {"sweep_lr_0p7b"}


@pytest.mark.parametrize("nproc", [1, 8])
def test_seqlen_sweep_keeps_524288_tokens_per_step_and_the_micro_batch_in_memory(tmp_path, nproc):
    out_root = str(tmp_path)
    commands = dry_run("sweep_seqlen.sh", OUT_ROOT=out_root, NPROC=str(nproc))
    # the 1.4B config's micro-step (batch_size x 2048 tokens per GPU) is the memory the sweep must stay within
    tokens_per_micro = config_value("config/sa_1p4b.py", "batch_size") * config_value("config/sa_1p4b.py",
                                                                                      "block_size")
    lengths = set()
    for cmd in commands:
        o = cmd["overrides"]
        length, batch_size, total = int(o["block_size"]), int(o["batch_size"]), int(o["total_batch_size"])
        world = 1 if nproc == 1 else int(cmd["launcher"][cmd["launcher"].index("--standalone") + 1].split("=")[1])
        assert world == nproc
        assert total == PAPER_TOKENS_PER_STEP
        assert batch_size >= 1 and batch_size * length <= max(tokens_per_micro, length)
        assert batch_size * length == max(tokens_per_micro, length)  # whole sequences, no memory wasted
        # a micro-step of more tokens than the config's recomputes activations to fit the same memory
        expected = ("block" if length > 2 * tokens_per_micro else "selective" if length > tokens_per_micro
                    else None)
        assert o.get("activation_checkpointing") == expected
        grad_accum, remainder = divmod(PAPER_TOKENS_PER_STEP, batch_size * length * world)
        assert remainder == 0 and grad_accum >= 1
        assert batch_size * length * grad_accum * world == PAPER_TOKENS_PER_STEP
        attn = os.path.basename(cmd["config"]).split("_")[0]
        assert cmd["config"] == f"config/{attn}_1p4b.py"
        check_names(cmd, out_root, "sweep_seqlen", f"{attn}_1p4b_seqlen{length}", "sweep_seqlen_1p4b")
        assert o["attn_mask"] == "causal"  # MASKS' default
        lengths.add((attn, length))
    assert lengths == {(a, n) for a in ("sa", "xsa") for n in (512, 1024, 2048, 4096, 8192, 16384)}


def test_seqlen_sweep_with_both_masks_runs_each_length_under_each_named_and_grouped_by_mask(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_seqlen.sh", OUT_ROOT=out_root, MASKS="causal document", LENGTHS="512 4096")
    seen = set()
    for cmd in commands:
        o = cmd["overrides"]
        attn, length, mask = os.path.basename(cmd["config"]).split("_")[0], int(o["block_size"]), o["attn_mask"]
        suffix, group = ("", "sweep_seqlen_1p4b") if mask == "causal" else ("_document", "sweep_seqlen_1p4b_document")
        check_names(cmd, out_root, "sweep_seqlen", f"{attn}_1p4b_seqlen{length}{suffix}", group)
        assert int(o["total_batch_size"]) == PAPER_TOKENS_PER_STEP
        seen.add((attn, length, mask))
    assert len(commands) == len(seen) == 8
    assert seen == {(a, n, m) for a in ("sa", "xsa") for n in (512, 4096) for m in ("causal", "document")}


def test_seqlen_sweep_refuses_an_unknown_mask_and_sets_the_mask_itself(tmp_path):
    proc = run_sweep("sweep_seqlen.sh", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path), MASKS="causal doc")
    assert proc.returncode == 2 and "MASKS: unknown attention mask 'doc' (causal, document)" in proc.stderr
    proc = run_sweep("sweep_seqlen.sh", "--attn_mask=document", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path))
    assert proc.returncode == 2 and "sets --attn_mask itself" in proc.stderr


def test_seqlen_sweep_lets_an_explicit_activation_checkpointing_win(tmp_path):
    commands = dry_run("sweep_seqlen.sh", "--activation_checkpointing=none", OUT_ROOT=str(tmp_path), LENGTHS="16384")
    assert [c["overrides"]["activation_checkpointing"] for c in commands] == ["none", "none"]


@pytest.mark.parametrize("script", ["sweep_lr.sh", "sweep_seqlen.sh"])
def test_dry_run_checks_override_keys_and_values_before_printing_any_run(tmp_path, script):
    proc = run_sweep(script, "--learnig_rate=1e-3", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path))
    assert proc.returncode == 2 and "did you mean learning_rate" in proc.stderr
    assert "train.py" not in proc.stdout
    proc = run_sweep(script, "--max_iters=1.5", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path))
    assert proc.returncode == 2 and "max_iters expects int" in proc.stderr


def test_seqlen_sweep_refuses_a_process_count_that_cannot_make_whole_micro_steps(tmp_path):
    proc = run_sweep("sweep_seqlen.sh", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path), NPROC="3")
    assert proc.returncode == 2 and "not a multiple" in proc.stderr


def test_optimizer_sweep_runs_sa_and_xsa_with_adamw_and_muon(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_optimizer.sh", "--muon_adjust_lr=original", "--muon_learning_rate=0.02",
                       OUT_ROOT=out_root)
    seen = set()
    for cmd in commands:
        attn, optimizer = os.path.basename(cmd["config"]).split("_")[0], cmd["overrides"]["optimizer"]
        assert cmd["config"] == f"config/{attn}_1p4b.py"
        check_names(cmd, out_root, "sweep_optimizer", f"{attn}_1p4b_{optimizer}", "sweep_optimizer_1p4b")
        assert cmd["overrides"]["muon_learning_rate"] == "0.02"  # passed through to every run
        seen.add((attn, optimizer))
    assert seen == {(a, o) for a in ("sa", "xsa") for o in ("adamw", "muon")} and len(commands) == 4
    proc = run_sweep("sweep_optimizer.sh", "--optimizer=muon", check=False, DRY_RUN="1", OUT_ROOT=out_root)
    assert proc.returncode == 2 and "sets --optimizer itself" in proc.stderr


def test_a_sweep_refuses_two_runs_of_one_name(tmp_path):
    """Run names spell each run's attention variant (train_config.variant_name): an override that makes
    the SA config an XSA one would give both runs of a pair one name, one out_dir."""
    proc = run_sweep("sweep_lr.sh", "--attn_type=xsa", check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path), LRS="4e-4")
    assert proc.returncode == 2 and "two runs of this sweep are both xsa_1p4b_lr4e-4" in proc.stderr
    assert "train.py" not in proc.stdout


def test_sinks_sweep_runs_0_1_and_4_sinks_at_1p4b(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_sinks.sh", OUT_ROOT=out_root)
    seen = set()
    for cmd in commands:
        attn = os.path.basename(cmd["config"]).split("_")[0]
        n = cmd["overrides"]["n_sinks"]
        assert cmd["config"] == f"config/{attn}_1p4b.py"
        check_names(cmd, out_root, "sweep_sinks", f"{attn}_1p4b_sinks{n}", "sweep_sinks_1p4b")
        seen.add((attn, int(n)))
    assert seen == {(a, n) for a in ("sa", "xsa") for n in (0, 1, 4)} and len(commands) == 6


def test_sizes_sweep_runs_the_three_paper_configs_unchanged(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_sizes.sh", OUT_ROOT=out_root)
    assert [c["config"] for c in commands] == [f"config/{a}_{s}.py" for s in ("0p7b", "1p4b", "2p7b")
                                               for a in ("sa", "xsa")]
    for cmd in commands:
        name = os.path.basename(cmd["config"])[:-3]
        check_names(cmd, out_root, "sweep_sizes", name, "sweep_sizes")
        assert set(cmd["overrides"]) == {"out_dir", "wandb_run_name", "wandb_group"}  # each size's own LR


@pytest.mark.parametrize("script", SCRIPTS[:4])
def test_extra_arguments_reach_every_run_and_win(tmp_path, script):
    extra = ["--max_iters=2000", "--wandb_log=False"]
    commands = dry_run(script, *extra, OUT_ROOT=str(tmp_path))
    assert commands
    for cmd in commands:
        assert cmd["args"][-2:] == extra  # last, so they override the config file
        assert cmd["overrides"]["max_iters"] == "2000"


def test_seeds_repeat_every_run_in_its_own_directory(tmp_path):
    out_root = str(tmp_path)
    commands = dry_run("sweep_lr.sh", OUT_ROOT=out_root, LRS="4e-4", SEEDS="1 2")
    assert [(c["config"], c["overrides"]["seed"]) for c in commands] == [
        ("config/sa_1p4b.py", "1"), ("config/xsa_1p4b.py", "1"), ("config/sa_1p4b.py", "2"),
        ("config/xsa_1p4b.py", "2")]
    for cmd in commands:
        attn = os.path.basename(cmd["config"]).split("_")[0]
        check_names(cmd, out_root, "sweep_lr", f"{attn}_1p4b_lr4e-4_seed{cmd['overrides']['seed']}", "sweep_lr_1p4b")
    # --seed on the command line is a seed list of one, so it too gets its own directory
    commands = dry_run("sweep_sinks.sh", "--seed=7", OUT_ROOT=out_root, SINKS="4")
    assert [c["overrides"]["out_dir"] for c in commands] == [f"{out_root}/sweep_sinks/{a}_1p4b_sinks4_seed7"
                                                             for a in ("sa", "xsa")]


def test_launchers_for_gpus_and_processes(tmp_path):
    # one single-GPU run per GPU, in parallel (the dry run shows them round-robin)
    commands = dry_run("sweep_lr.sh", OUT_ROOT=str(tmp_path), GPUS="0 1 2 3", NPROC="")
    assert [c["env"] for c in commands] == [{"CUDA_VISIBLE_DEVICES": g} for g in "01230123"]
    assert all(c["launcher"] == [SWEEP_PYTHON, "train.py"] for c in commands)
    # two GPUs per run: torchrun with two processes, on disjoint GPUs
    commands = dry_run("sweep_sinks.sh", OUT_ROOT=str(tmp_path), GPUS="0,1 2,3", NPROC="")
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in commands] == ["0,1", "2,3"] * 3
    assert all(c["launcher"] == ["torchrun", "--standalone", "--nproc_per_node=2", "train.py"] for c in commands)
    # all GPUs for every run, one run after the other
    commands = dry_run("sweep_sizes.sh", OUT_ROOT=str(tmp_path), NPROC="8")
    assert all(c["launcher"] == ["torchrun", "--standalone", "--nproc_per_node=8", "train.py"] and not c["env"]
               for c in commands)


@pytest.mark.parametrize("args", [["--learning_rate=1e-3"], ["--out_dir=elsewhere"], ["--init_from=resume"],
                                  ["max_iters=10"], ["config/sa_tiny.py"]])
def test_sweep_refuses_arguments_it_cannot_pass_through(tmp_path, args):
    proc = run_sweep("sweep_lr.sh", *args, check=False, DRY_RUN="1", OUT_ROOT=str(tmp_path))
    assert proc.returncode == 2 and "error:" in proc.stderr
    assert "train.py" not in proc.stdout


def test_dry_run_skips_finished_runs_and_resumes_unfinished_ones(tmp_path):
    """Judged from the checkpoint names against the max_iters each run would train to."""
    out_root = str(tmp_path)
    finished = tmp_path / "sweep_lr" / "sa_1p4b_lr4e-4"
    unfinished = tmp_path / "sweep_lr" / "xsa_1p4b_lr4e-4"
    for path, steps in ((finished, (198000, 200000)), (unfinished, (4000, 6000))):
        path.mkdir(parents=True)
        for step in steps:
            (path / f"ckpt_{step:07d}.pt").write_bytes(b"")
    (unfinished / "ckpt_0300000.pt.tmp123").write_bytes(b"")  # a write cut short is no checkpoint
    proc = run_sweep("sweep_lr.sh", DRY_RUN="1", OUT_ROOT=out_root, LRS="4e-4")
    assert "sa_1p4b_lr4e-4: skip (finished: checkpoint step 200000 >= max_iters 200000)" in proc.stdout
    commands = dry_run("sweep_lr.sh", OUT_ROOT=out_root, LRS="4e-4")
    assert len(commands) == 1 and commands[0]["config"] == "config/xsa_1p4b.py"
    assert commands[0]["args"][-1] == "--init_from=resume"
    # a larger max_iters extends the finished run too
    commands = dry_run("sweep_lr.sh", "--max_iters=250000", OUT_ROOT=out_root, LRS="4e-4")
    assert [c["args"][-1] for c in commands] == ["--init_from=resume"] * 2
    # FSDP runs save sharded checkpoints as ckpt_<step>/ directories
    (unfinished / "ckpt_0200000").mkdir()
    proc = run_sweep("sweep_lr.sh", DRY_RUN="1", OUT_ROOT=out_root, LRS="4e-4")
    assert "xsa_1p4b_lr4e-4: skip (finished: checkpoint step 200000 >= max_iters 200000)" in proc.stdout


def test_small_study_prepares_data_trains_seeds_and_compares(tmp_path):
    data_dir = str(tmp_path / "shards")
    proc = run_sweep("small_study.sh", DRY_RUN="1", OUT_ROOT=str(tmp_path), DATA_DIR=data_dir,
                     INPUT="/some/corpus/*.txt")
    lines = [shlex.split(line) for line in proc.stdout.splitlines() if not line.startswith("#")]
    prepare = lines[0]
    assert prepare[1:4] == ["-m", "data.fineweb.prepare", "--input"]
    assert prepare[4] == "/some/corpus/*.txt"  # the glob goes to prepare.py unexpanded
    assert prepare[prepare.index("--out_dir") + 1] == data_dir
    commands = dry_run("small_study.sh", OUT_ROOT=str(tmp_path), DATA_DIR=data_dir, INPUT="/some/corpus/*.txt")
    runs = [f"{tmp_path}/small_study/{a}_tiny_seed{s}" for s in (1, 2, 3) for a in ("sa", "xsa")]
    assert [c["overrides"]["out_dir"] for c in commands] == runs
    assert all(c["overrides"]["data_dir"] == data_dir for c in commands)
    compare = lines[-1]
    assert compare[1:3] == ["-m", "eval.compare"] and compare[3:9] == runs


def test_small_study_with_the_document_mask_names_its_runs_group_and_table_apart(tmp_path):
    data_dir = str(tmp_path / "shards")
    commands, proc = dry_run("small_study.sh", "--attn_mask=document", OUT_ROOT=str(tmp_path), DATA_DIR=data_dir,
                             INPUT="/some/corpus/*.txt", with_output=True)
    runs = [f"{a}_tiny_document_seed{s}" for s in (1, 2, 3) for a in ("sa", "xsa")]
    for cmd, name in zip(commands, runs, strict=True):
        check_names(cmd, str(tmp_path), "small_study", name, "small_study_document")
        assert cmd["overrides"]["attn_mask"] == "document"
    compare = shlex.split(proc.stdout.splitlines()[-1])
    assert compare[1:3] == ["-m", "eval.compare"] and compare[-2:] == ["--out", f"{tmp_path}/small_study/document"]


# -----------------------------------------------------------------------------
# a real sweep: two micro runs, interrupted, rerun, extended


def files_of(directory):
    """{name: (size, mtime_ns, sha1)} of every file in a directory."""
    result = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            result[name] = (os.path.getsize(path), os.stat(path).st_mtime_ns, hashlib.sha1(f.read()).hexdigest())
    return result


def newest_step(directory):
    steps = [int(n[5:12]) for n in os.listdir(directory) if n.startswith("ckpt_") and n.endswith(".pt")] \
        if os.path.isdir(directory) else []
    return max(steps, default=None)


def test_interrupted_sweep_resumes_unfinished_runs_and_skips_finished_ones(tmp_path, data_dir):
    out_root = str(tmp_path / "out")
    max_iters = 20  # room for the stop to land before XSA finishes, even on a fast or starved machine
    micro = [a for a in micro_args(data_dir, "unused", max_iters=max_iters, checkpoint_interval=2,
                                   eval_interval=4, val_tokens=1024)
             if not a.startswith(("--out_dir=", "--learning_rate="))]  # the sweep sets these
    env = sweep_env(OUT_ROOT=out_root, SIZE="tiny", LRS="1e-3")
    sa_dir, xsa_dir = (os.path.join(out_root, "sweep_lr", f"{a}_tiny_lr1e-3") for a in ("sa", "xsa"))

    # 1. SA finishes; XSA is stopped (SIGTERM to the sweep, as from a scheduler) after its first checkpoint
    sweep = subprocess.Popen([os.path.join(REPO, "scripts", "sweep_lr.sh"), *micro], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + HANG_GUARD_S
        while newest_step(xsa_dir) is None:
            assert sweep.poll() is None, f"sweep ended early:\n{sweep.stdout.read()}"
            assert time.time() < deadline, "no XSA checkpoint in time"
            time.sleep(0.05)
        sweep.send_signal(signal.SIGTERM)
        output = sweep.communicate(timeout=HANG_GUARD_S)[0]
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, output
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the sweep stopped its run: nothing of it is left running
        os.killpg(sweep.pid, 0)
    assert newest_step(sa_dir) == max_iters
    stopped_at = newest_step(xsa_dir)
    assert stopped_at < max_iters, "XSA finished before it could be interrupted; the test needs a slower run"
    sa_files = files_of(sa_dir)

    # 2. the same command again, with a second LR added and two runs at a time: SA is skipped and left
    #    untouched, XSA resumes from its checkpoint, the new LR's runs start from scratch
    proc = run_sweep("sweep_lr.sh", *micro, OUT_ROOT=out_root, SIZE="tiny", LRS="1e-3 2e-3", GPUS="0 1",
                     OMP_NUM_THREADS="1")
    assert f"sa_tiny_lr1e-3: skip (finished: checkpoint step {max_iters} >= max_iters {max_iters})" in proc.stdout
    assert f"xsa_tiny_lr1e-3: resume from step {stopped_at} of {max_iters}" in proc.stdout
    assert "3 started, 1 skipped as finished, 0 failed" in proc.stdout
    assert files_of(sa_dir) == sa_files
    with open(os.path.join(xsa_dir, "train.log")) as f:
        assert f"resuming from {xsa_dir}/ckpt_{stopped_at:07d}.pt at step {stopped_at}" in f.read()
    with open(os.path.join(xsa_dir, "console.log")) as f:  # parallel runs write their output there
        assert "resuming from" in f.read()
    for name in ("sa_tiny_lr1e-3", "xsa_tiny_lr1e-3", "sa_tiny_lr2e-3", "xsa_tiny_lr2e-3"):
        run_dir = os.path.join(out_root, "sweep_lr", name)
        assert newest_step(run_dir) == max_iters
        assert [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))] == \
            list(range(1, max_iters + 1))

    # 3. once more: everything is finished, nothing runs
    proc = run_sweep("sweep_lr.sh", *micro, OUT_ROOT=out_root, SIZE="tiny", LRS="1e-3 2e-3")
    assert "0 started, 4 skipped as finished, 0 failed" in proc.stdout
    assert files_of(sa_dir) == sa_files


# train.py's stand-in: it records the signals it gets, and ends (130) a second after the first
RECORD_SIGNALS = r"""
import os, signal, sys, time
got = []
for signum in (signal.SIGINT, signal.SIGTERM):  # Python may handle a signal its shell started it ignoring
    signal.signal(signum, lambda s, frame: got.append(signal.Signals(s).name))
open(os.environ["RUN_READY"], "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1.0)  # time for a second signal to come
open(os.environ["RUN_SIGNALS"], "w").write(" ".join(got))
sys.exit(130)
"""


def test_ctrl_c_at_the_terminal_reaches_the_sweeps_run_once(tmp_path):
    """Ctrl-C signals the terminal's whole foreground process group: the sweep and, unless the sweep starts them in
    a session of their own, its runs. Before, a run got it from the terminal and then once more from the sweep's
    trap, and a run takes a second signal as "stop at once", without the checkpoint of its step."""
    recorder = tmp_path / "record_signals.py"
    recorder.write_text(RECORD_SIGNALS)
    python = tmp_path / "python"  # the sweep's PYTHON: train.py's stand-in for runs, the real one for the rest
    python.write_text(f'#!/bin/bash\n[[ $1 == train.py ]] && exec {shlex.quote(sys.executable)} {recorder} "$@"\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    ready, signals = tmp_path / "ready", tmp_path / "signals"
    env = sweep_env(OUT_ROOT=str(tmp_path / "out"), SIZE="tiny", LRS="1e-3", PYTHON=str(python),
                    RUN_READY=str(ready), RUN_SIGNALS=str(signals))
    sweep = subprocess.Popen([os.path.join(REPO, "scripts", "sweep_lr.sh")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + HANG_GUARD_S
        while not ready.exists():
            assert sweep.poll() is None, f"sweep ended early:\n{sweep.stdout.read()}"
            assert time.time() < deadline, "the run did not start in time"
            time.sleep(0.05)
        os.killpg(sweep.pid, signal.SIGINT)  # the terminal's Ctrl-C: to the sweep's process group
        output = sweep.communicate(timeout=HANG_GUARD_S)[0]
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, output
    assert signals.read_text() == "SIGINT", output  # once, and the signal the sweep got
    assert "xsa_tiny_lr1e-3" not in output.split("interrupted")[-1]  # the sweep stopped: XSA never started


def test_sweeps_resolve_a_runs_config_as_train_py_does():
    """The skip decision needs a run's max_iters, and a run's name its variant: the scripts resolve a
    config with train_config.resolve, as train.py does, and name the variant with variant_name."""
    from pretrain.train_config import resolve, variant_name
    argv = ["config/xsa_1p4b.py", "--max_iters=1234", "--learning_rate=2e-4", "--xsa_gate=True"]
    keys = ["max_iters", "learning_rate", "batch_size", "block_size", "eval_interval", "lr_decay_iters", "min_lr"]
    proc = run_script(["bash", "-c", 'source scripts/sweep_common.sh && resolve_config "$@"', "resolve",
                       " ".join(keys + ["variant"]), *argv], env=sweep_env(), preloaded=True)
    assert proc.returncode == 0, proc.stderr
    config, _ = resolve([os.path.join(REPO, a) if a.startswith("config/") else a for a in argv])
    assert proc.stdout.split() == [str(getattr(config, k)) for k in keys] + [variant_name(config)]
    assert proc.stdout.split()[-1] == "xsa_gate" and float(proc.stdout.split()[-2]) == 2e-5  # min_lr derived


def test_a_run_that_fails_for_good_is_reported_and_skipped_by_the_rerun(tmp_path):
    """Exit 3 (here: no data) would fail again as it is: the sweep says so per run and goes on with the
    others; its rerun skips them rather than spend a launch on each, until their exit_status is removed."""
    out_root = str(tmp_path / "out")
    micro = [a for a in micro_args(str(tmp_path / "no_data"), "unused", max_iters=2)
             if not a.startswith(("--out_dir=", "--learning_rate="))]
    proc = run_sweep("sweep_lr.sh", *micro, check=False, OUT_ROOT=out_root, SIZE="tiny", LRS="1e-3")
    assert proc.returncode == 1
    for name in ("sa_tiny_lr1e-3", "xsa_tiny_lr1e-3"):  # the second ran although the first failed
        assert f"# {name}: FAILED (exit status 3: a bad config, or a stop that a relaunch cannot fix" in proc.stdout
    assert "2 started, 0 skipped as finished, 2 failed" in proc.stdout
    again = run_sweep("sweep_lr.sh", *micro, check=False, OUT_ROOT=out_root, SIZE="tiny", LRS="1e-3")
    assert again.returncode == 1 and "0 started" in again.stdout and not re.search(r"^\+ ", again.stdout, re.M)
    status_file = os.path.join(out_root, "sweep_lr", "sa_tiny_lr1e-3", "exit_status")
    assert "# sa_tiny_lr1e-3: skip (its last launch stopped with exit status 3" in again.stdout
    assert f"delete {status_file} to run it again" in again.stdout
