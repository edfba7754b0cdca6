"""Exact resume and fault tolerance: interrupted runs continue as if nothing happened. The runs stopped by a
signal, a killed process or a launcher are test_resume_processes.py's."""

import errno
import hashlib
import os
import re

import pytest
import torch

from helpers import RESUME, losses
from micro import BYTE_TOKENS, make_optimizer, micro_args
from pretrain.checkpoint_format import save_checkpoint
from pretrain.checkpointer import list_checkpoints, load_latest_checkpoint, prune_checkpoints
from pretrain.metrics import read_metrics
from running import run_python, run_train

# the runs here check resumes and checkpoints, not tokens: the micro model on the plays' bytes (micro.BYTE_TOKENS)
BYTE_RESUME = dict(RESUME, **BYTE_TOKENS)


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def uninterrupted(byte_data_dir, tmp_path_factory):
    """8-step runs with no interruption, SA and XSA: {attn_type: out_dir}."""
    runs = {}
    for attn_type in ("sa", "xsa"):
        out = str(tmp_path_factory.mktemp(f"full_{attn_type}"))
        run_train(micro_args(byte_data_dir, out, attn_type=attn_type, **BYTE_RESUME))
        runs[attn_type] = out
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("attn_type", ["sa", "xsa"])
def test_stop_and_resume_is_bitwise_identical(byte_data_dir, tmp_path, uninterrupted, attn_type):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, attn_type=attn_type, **{**BYTE_RESUME, "max_iters": 4}))
    proc = run_train(micro_args(byte_data_dir, out, attn_type=attn_type, init_from="resume", **BYTE_RESUME))
    assert "resuming from" in proc.stdout and "at step 4" in proc.stdout
    assert losses(out) == losses(uninterrupted[attn_type])  # exact float equality, steps 1..8 once each
    val = [r["val_loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "val_loss" in r]
    full = [r["val_loss"] for r in read_metrics(os.path.join(uninterrupted[attn_type], "metrics.jsonl"))
            if "val_loss" in r]
    assert val == full


@pytest.mark.slow
def test_evaluation_and_checkpoints_do_not_change_training(byte_data_dir, tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "eval_interval": 100, "checkpoint_interval": 0}))
    assert losses(out) == losses(uninterrupted["sa"])


@pytest.mark.slow
def test_truncated_checkpoint_falls_back_to_previous(byte_data_dir, tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **BYTE_RESUME))
    newest = list_checkpoints(out)[-1]
    assert newest.endswith("ckpt_0000008.pt")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME))
    assert "skipping unreadable checkpoint" in proc.stderr and "ckpt_0000008.pt" in proc.stderr
    assert "at step 4" in proc.stdout
    assert losses(out) == losses(uninterrupted["sa"])


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    good = list_checkpoints(out)
    before = {p: digest(p) for p in good}
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume",
                                **{**BYTE_RESUME, "max_iters": 30, "lr_decay_iters": 30, "learning_rate": 1e3,
                                   "grad_clip": 0.0, "loss_spike_factor": 0, "log_interval": 100}),
                     check=False)
    assert proc.returncode == 3
    assert "non-finite loss or gradient norm at step" in proc.stderr
    assert list_checkpoints(out) == good and {p: digest(p) for p in good} == before
    assert not [f for f in os.listdir(out) if ".tmp" in f]


@pytest.mark.slow
def test_nonfinite_steps_can_be_skipped(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "learning_rate": 1e3, "loss_spike_factor": 0,
                                                  "skip_nonfinite_steps": 1}), check=False)
    # one bad step is tolerated; with the learning rate still absurd, the next one ends the run
    assert "step skipped (1/1)" in proc.stdout
    assert proc.returncode == 3 and "non-finite" in proc.stderr


@pytest.mark.slow
def test_resume_with_other_architecture_is_refused(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", n_layer=3, attn_type="xsa", **BYTE_RESUME),
                     check=False)
    assert proc.returncode == 2  # a config at odds with the checkpoint: nothing written
    assert "different architecture" in proc.stderr
    assert "n_layer: checkpoint 2 vs now 3" in proc.stderr and "attn_type: checkpoint 'sa' vs now 'xsa'" in proc.stderr


@pytest.mark.slow
def test_checkpoint_holds_the_documented_state_and_loads_weights_only(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4, "keep_checkpoints": 1}))
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000004.pt"]
    state = torch.load(list_checkpoints(out)[0], weights_only=True)
    assert {"model", "optimizer", "step", "loader", "rng", "config", "wandb_run_id", "best_val_loss",
            "provenance"} <= set(state)
    assert state["step"] == 4 and not any(k.startswith("_orig_mod.") for k in state["model"])
    assert {"python", "numpy", "torch"} <= set(state["rng"][0])
    assert state["loader"]["offset"] > 0 and state["config"]["n_layer"] == 2


def pickled_modules(path):
    """The modules whose names a torch checkpoint file's pickle refers to (its GLOBAL opcodes)."""
    import pickletools
    import zipfile
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    modules, strings = set(), []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            modules.add(arg.split(" ")[0])
        elif opcode.name == "STACK_GLOBAL":
            modules.add(strings[-2])
        elif opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
    return modules


@pytest.mark.slow
def test_a_checkpoint_written_before_the_package_still_resumes(byte_data_dir, tmp_path, uninterrupted):
    """A checkpoint file is plain containers and tensors, with no path of the code that wrote it: the one the
    flat layout wrote (checkpoint.py, checkpointer.py at the root) is this same dict, saved by torch.save, and
    resumes as the uninterrupted run continues."""
    path = os.path.join(uninterrupted["sa"], "ckpt_0000004.pt")
    modules = pickled_modules(path)
    assert modules and all(m.split(".")[0] in ("torch", "collections", "builtins", "_codecs") for m in modules), \
        modules  # nothing of the repo: pretrain, checkpointer, checkpoint, train_config, model, ...
    out = tmp_path / "flat_layout_run"
    out.mkdir()
    torch.save(torch.load(path, weights_only=True), out / "ckpt_0000004.pt")  # as the flat layout's code saved it
    proc = run_train(micro_args(byte_data_dir, str(out), init_from="resume", **BYTE_RESUME))
    assert "at step 4" in proc.stdout
    assert losses(out) == [(step, loss) for step, loss in losses(uninterrupted["sa"]) if step > 4]


def test_failed_checkpoint_write_leaves_previous_intact(tmp_path, monkeypatch):
    save_checkpoint({"step": 1, "weights": torch.ones(3)}, str(tmp_path), 1)
    before = digest(list_checkpoints(str(tmp_path))[0])

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device.*previous checkpoints are untouched"):
        save_checkpoint({"step": 2}, str(tmp_path), 2)
    assert os.listdir(tmp_path) == ["ckpt_0000001.pt"]
    assert digest(list_checkpoints(str(tmp_path))[0]) == before
    path, state = load_latest_checkpoint(str(tmp_path))
    assert state["step"] == 1


@pytest.mark.slow
def test_scratch_run_over_old_checkpoints_is_refused_unless_they_are_moved_aside(byte_data_dir, tmp_path):
    """A later resume must not take the earlier run's newest checkpoint for this run's: starting from
    scratch over checkpoints is a config error (nothing touched); overwrite moves the earlier run aside."""
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 8}))
    before = {name: digest(os.path.join(out, name)) for name in os.listdir(out) if os.path.isfile(os.path.join(out, name))}
    proc = run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 2, "checkpoint_interval": 0}),
                     check=False)
    assert proc.returncode == 2 and "holds checkpoints of an earlier run (newest ckpt_0000008.pt)" in proc.stderr
    assert "--overwrite=True" in proc.stderr and "Traceback" not in proc.stderr
    assert {n: digest(os.path.join(out, n)) for n in before} == before
    # the new run is killed at step 2 (its checkpoint_interval); the resume must continue it, not the old run
    run_train(micro_args(byte_data_dir, out, overwrite=True, **{**BYTE_RESUME, "max_iters": 2,
                                                                "checkpoint_interval": 2}))
    aside = [name for name in os.listdir(out) if name.startswith("replaced_")]
    assert len(aside) == 1
    assert {n: digest(os.path.join(out, aside[0], n)) for n in before} == before  # moved whole, not rewritten
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **{**BYTE_RESUME, "max_iters": 3}))
    assert "at step 2" in proc.stdout
    assert [s for s, _ in losses(out)] == [1, 2, 3]


def flip_bytes_in_the_middle(path):
    """Corrupt a file without changing its size (bit rot, a bad disk), as a truncation test cannot."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(64)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


@pytest.mark.slow
def test_corrupted_checkpoint_is_detected_by_checksum_and_skipped(byte_data_dir, tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **BYTE_RESUME))
    newest = list_checkpoints(out)[-1]
    flip_bytes_in_the_middle(newest)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME))
    assert "skipping unreadable checkpoint" in proc.stderr and "does not match its checksum" in proc.stderr
    assert "at step 4" in proc.stdout
    assert losses(out) == losses(uninterrupted["sa"])


def test_pruning_never_deletes_a_readable_checkpoint_in_favour_of_an_unreadable_one(tmp_path):
    out = str(tmp_path)
    for step in (4, 8):
        save_checkpoint({"step": step, "weights": torch.full((1000,), float(step))}, out, step)
    flip_bytes_in_the_middle(os.path.join(out, "ckpt_0000008.pt"))
    with pytest.warns(UserWarning, match="ckpt_0000008.pt.*checksum"):
        path, state = load_latest_checkpoint(out)
    assert state["step"] == 4
    # the run continues from step 4 and saves step 12, keeping 2: step 4 (readable) must stay
    known_good = {path, save_checkpoint({"step": 12, "weights": torch.zeros(3)}, out, 12)}
    prune_checkpoints(out, 2, known_good)
    kept = [os.path.basename(p) for p in list_checkpoints(out)]
    assert "ckpt_0000004.pt" in kept and "ckpt_0000012.pt" in kept


@pytest.mark.slow
def test_temp_files_of_a_killed_save_are_removed_at_start(byte_data_dir, tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    debris = [os.path.join(out, "ckpt_0000008.pt.tmp4242"), os.path.join(out, "metrics.jsonl.tmp")]
    for path in debris:
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
    os.makedirs(os.path.join(out, "ckpt_0000008.tmp"))  # a sharded save cut off mid-way
    run_train(micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME))
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    assert losses(out) == losses(uninterrupted["sa"])


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter "
                                                "failed writing file data/3: file write failed")])
def test_full_disk_during_save_raises_oserror_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, error):
    save_checkpoint({"step": 1, "weights": torch.ones(3)}, str(tmp_path), 1)
    before = digest(list_checkpoints(str(tmp_path))[0])

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise error
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="could not write checkpoint .*ckpt_0000002.pt.*previous checkpoints are untouched"):
        save_checkpoint({"step": 2}, str(tmp_path), 2)
    assert os.listdir(tmp_path) == ["ckpt_0000001.pt"] and digest(list_checkpoints(str(tmp_path))[0]) == before


@pytest.mark.slow
def test_full_disk_during_training_exits_3_and_keeps_the_previous_checkpoint(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    before = {p: digest(p) for p in list_checkpoints(out)}
    # a file-size limit (RLIMIT_FSIZE) of half a checkpoint makes the next checkpoint write fail as a full disk
    # does; the logs stay far below it
    limit = os.path.getsize(list_checkpoints(out)[-1]) // 2
    script = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); sys.argv = sys.argv[1:]; "
              "runpy.run_path('train.py', run_name='__main__')")
    args = micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME)
    proc = run_python(["-c", script, "train.py", *args])  # a process of its own, for its file-size limit
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "checkpoint write failed at step 8" in proc.stderr and "previous checkpoints are untouched" in proc.stderr
    assert {p: digest(p) for p in list_checkpoints(out)} == before
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_checkpointer_refuses_to_save_a_non_finite_state(tmp_path):
    from pretrain.checkpointer import Checkpointer, NonFiniteState, RunState
    from model import GPT, GPTConfig
    from pretrain.runtime import Runtime
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
    optimizer = make_optimizer(model)
    checkpointer = Checkpointer(str(tmp_path), 2, model, optimizer, loader=None,
                                runtime=Runtime(0, 0, 1, "cpu", "cpu", False), sharded=False)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteState, match="not finite at step 3"):
        checkpointer.save(RunState(step=3), {})
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_skipped_non_finite_last_step_still_evaluates_and_checkpoints(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    # an absurd learning rate makes every step after the first non-finite; all of them may be skipped
    proc = run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "dropout": 0.0, "max_iters": 3,
                                                       "checkpoint_interval": 0,
                                                  "learning_rate": 1e3, "warmup_iters": 0, "loss_spike_factor": 0,
                                                  "skip_nonfinite_steps": 10}), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3: non-finite loss or gradient, step skipped" in proc.stdout
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000003.pt"]
    assert "val_loss" in read_metrics(os.path.join(out, "metrics.jsonl"))[-1]


@pytest.mark.slow
def test_resume_applies_the_weight_decay_given_now_even_after_zero(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4, "weight_decay": 0.0}))
    run_train(micro_args(byte_data_dir, out, init_from="resume", **{**BYTE_RESUME, "weight_decay": 0.05}))
    groups = torch.load(list_checkpoints(out)[-1], weights_only=True)["optimizer"]["param_groups"]
    # the matrices' group decays at the new rate; norms and biases never decay
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.05]


@pytest.mark.slow
def test_extending_a_finished_run_warns_that_the_cosine_is_stretched(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    settings = {**BYTE_RESUME, "lr_decay_iters": None, "max_iters": 6, "warmup_iters": 2}
    run_train(micro_args(byte_data_dir, out, **{**settings, "max_iters": 4}))
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **settings))
    assert "warning: the learning-rate schedule differs from the checkpoint's" in proc.stdout
    assert "--lr_decay_iters=4" in proc.stdout


@pytest.mark.slow
def test_samples_are_logged_and_do_not_change_training(data_dir, tmp_path):
    """In GPT-2's tokens, which samples are decoded from."""
    full, out = str(tmp_path / "full"), str(tmp_path / "run")
    run_train(micro_args(data_dir, full, **RESUME))
    proc = run_train(micro_args(data_dir, out, sample_interval=4, **RESUME))
    samples = re.findall(r"^step (\d+) sample: (.+)$", proc.stdout, re.M)
    assert [int(step) for step, _ in samples] == [4, 8] and all(len(text) > 2 for _, text in samples)
    assert losses(out) == losses(full)  # sampling draws from its own generator


@pytest.mark.slow
def test_muon_run_resumes_exactly_and_keeps_its_own_learning_rate(byte_data_dir, tmp_path):
    muon = dict(BYTE_RESUME, optimizer="muon", attn_type="xsa", muon_adjust_lr="original", muon_learning_rate=0.02)
    full, out = str(tmp_path / "full"), str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, full, **muon))
    run_train(micro_args(byte_data_dir, out, **{**muon, "max_iters": 4}))
    run_train(micro_args(byte_data_dir, out, init_from="resume", **muon))
    assert losses(out) == losses(full)
    state = torch.load(list_checkpoints(out)[-1], weights_only=True)
    lrs = {g["algorithm"]: g["lr"] for g in state["optimizer"]["param_groups"]}
    last_lr = read_metrics(os.path.join(out, "metrics.jsonl"))[-1]["lr"]  # the schedule's (AdamW's)
    assert lrs["adamw"] == pytest.approx(last_lr) and lrs["muon"] == pytest.approx(last_lr * 0.02 / 3e-3)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **{**muon, "optimizer": "adamw",
                                                                      "max_iters": 10}), check=False)
    assert proc.returncode == 2 and "was trained with optimizer='muon'" in proc.stderr


# -----------------------------------------------------------------------------
# checksummed run state, blow-ups


@pytest.mark.slow
def test_run_state_flips_are_all_detected(byte_data_dir, tmp_path):
    """Every bit that a resume reads is checksummed: flipping any one of 60 random bits of a checkpoint
    file either makes it unreadable or leaves what it loads unchanged, never a silently different state
    (a flip in the step once resumed at the wrong step)."""
    import random
    from pretrain.checkpoint_format import load_checkpoint_file
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    path = list_checkpoints(out)[-1]
    original = load_checkpoint_file(path)
    data = bytearray(open(path, "rb").read())
    rng = random.Random(0)
    # bit 82 is where the step once was; the rest at random over the run state and tensors alike
    positions = [82] + [rng.randrange(len(data)) for _ in range(59)]
    detected = 0
    for position in positions:
        flipped = bytearray(data)
        flipped[position] ^= 1 << rng.randrange(8)
        victim = str(tmp_path / "flipped.pt")
        open(victim, "wb").write(flipped)
        try:
            state = load_checkpoint_file(victim)
        except Exception:  # CorruptCheckpoint, or not even a zip or a pickle any more
            detected += 1
            continue
        assert repr(state) == repr(original), position  # the byte was one torch.load never reads
    assert detected > 0


def test_flipped_bits_in_a_sharded_run_state_are_detected(tmp_path):
    """FSDP's run_state.pt holds step, loader position, config and RNG: every flip that loads is caught."""
    import random
    from pretrain.checkpoint_format import load_checkpoint_file, save_sharded_checkpoint
    from pretrain.train_config import model_config
    from micro import MICRO
    from model import GPT
    model = GPT(model_config(MICRO))
    state = {"step": 7, "loader": {"shard": 1, "offset": 4096, "epoch": 0}, "config": {"learning_rate": 3e-3},
             "rng": [{"torch": torch.get_rng_state()}], "best_val_loss": 5.25}
    path = save_sharded_checkpoint(model, make_optimizer(model), state, str(tmp_path), 7)
    run_state = os.path.join(path, "run_state.pt")
    data = bytearray(open(run_state, "rb").read())
    original = repr(load_checkpoint_file(path))
    rng = random.Random(1)
    silent = []
    for _ in range(60):
        flipped = bytearray(data)
        position = rng.randrange(len(data))
        flipped[position] ^= 1 << rng.randrange(8)
        open(run_state, "wb").write(flipped)
        try:
            if repr(load_checkpoint_file(path)) != original:
                silent.append(position)
        except Exception:  # CorruptCheckpoint, or no longer a zip or a pickle: detected
            pass
    assert silent == []


@pytest.mark.slow
def test_a_finite_blow_up_stops_the_run_and_keeps_the_best_checkpoint(byte_data_dir, tmp_path):
    """A run resumed at a learning rate that makes it diverge (finite losses in the hundreds): the
    spiking states are never checkpointed, the run stops with exit 3, and the checkpoint of the best
    validation loss survives pruning even with keep_checkpoints=1."""
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 8, "dropout": 0.0}))
    blow_up = dict(BYTE_RESUME, max_iters=40, lr_decay_iters=40, dropout=0.0, learning_rate=10.0, grad_clip=0.0,
                   checkpoint_interval=1, eval_interval=100, keep_checkpoints=1)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **blow_up), check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "the run diverged" in proc.stderr and "Traceback" not in proc.stderr
    spikes = [int(s) for s in re.findall(r"step (\d+): train loss \S+ is a spike", proc.stdout)]
    assert spikes and all(not os.path.exists(os.path.join(out, f"ckpt_{s:07d}.pt")) for s in spikes)
    names = [os.path.basename(p) for p in list_checkpoints(out)]
    assert "ckpt_0000008.pt" in names  # the best validation loss: evaluated at step 8, kept
    assert len(names) <= 2  # keep_checkpoints=1, plus the best


@pytest.mark.slow
def test_the_checkpoint_whose_weights_blew_up_is_set_aside_and_the_resume_takes_a_healthy_one(byte_data_dir, tmp_path):
    """The loss of step N is computed with the weights of checkpoint N-1: when it spikes, that checkpoint is
    set aside (ckpt_N-1.pt.spiked) instead of being the newest, which a resume would take."""
    out = str(tmp_path / "run")
    settings = dict(BYTE_RESUME, dropout=0.0, checkpoint_interval=1, keep_checkpoints=2)
    run_train(micro_args(byte_data_dir, out, **settings))
    blow_up = dict(settings, max_iters=40, lr_decay_iters=40, learning_rate=10.0, grad_clip=0.0, eval_interval=100)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **blow_up), check=False)
    assert proc.returncode == 3 and "the run diverged" in proc.stderr
    first_spike = int(re.search(r"step (\d+): train loss \S+ is a spike", proc.stdout).group(1))
    assert first_spike == 10  # the update of step 9 (at a learning rate of 10) blew it up
    assert os.path.exists(os.path.join(out, "ckpt_0000009.pt.spiked"))
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000007.pt", "ckpt_0000008.pt"]
    resumed = run_train(micro_args(byte_data_dir, out, init_from="resume", **{**settings, "max_iters": 9}))
    assert "at step 8" in resumed.stdout
    assert read_metrics(os.path.join(out, "metrics.jsonl"))[-1]["train_loss"] < 11  # healthy weights


@pytest.mark.slow
def test_a_spike_on_the_last_step_is_not_a_finished_run(byte_data_dir, tmp_path):
    out = str(tmp_path / "run")
    settings = dict(BYTE_RESUME, dropout=0.0, checkpoint_interval=1)
    run_train(micro_args(byte_data_dir, out, **settings))
    # one step at a learning rate that blows up the weights, then the last step measures them
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **{**settings, "max_iters": 10,
                                                                           "lr_decay_iters": 10,
                                                                      "learning_rate": 10.0, "grad_clip": 0.0}),
                     check=False)
    assert proc.returncode == 3 and "the last step's train loss spiked" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [os.path.basename(p) for p in list_checkpoints(out)][-1] == "ckpt_0000008.pt"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lr[3e-3]", "run *?", "seed 1 [a-z]"])
def test_an_out_dir_with_glob_characters_and_spaces_resumes(byte_data_dir, tmp_path, uninterrupted, name):
    """Sweeps name runs after their settings; glob must not read the name as a pattern (it once made the
    resume find no checkpoint and train from scratch)."""
    out = str(tmp_path / name)
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4}))
    os.makedirs(os.path.join(out, "ckpt_0000008.tmp"))  # debris of a killed save, cleaned at the start
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME))
    assert "at step 4" in proc.stdout
    assert losses(out) == losses(uninterrupted["sa"])
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000004.pt", "ckpt_0000008.pt"]
    assert not os.path.exists(os.path.join(out, "ckpt_0000008.tmp"))


@pytest.mark.slow
def test_a_checkpoint_from_before_the_decay_key_resumes(byte_data_dir, tmp_path, uninterrupted):
    """Checkpoints written before param groups said whether they decay (and, before Muon, which algorithm
    and learning-rate scale they take): the groups are matched in order
    (decayed matrices first, as they always were), and the resume equals the uninterrupted run."""
    out = str(tmp_path / "run")
    run_train(micro_args(byte_data_dir, out, **{**BYTE_RESUME, "max_iters": 4, "checkpoint_interval": 4}))
    path = list_checkpoints(out)[-1]
    state = torch.load(path, weights_only=True)
    for name in ("checksums", "state_checksum"):
        state.pop(name)
    for group in state["optimizer"]["param_groups"]:
        for added_later in ("decay", "algorithm", "lr_scale"):
            group.pop(added_later)
    os.remove(path)
    save_checkpoint(state, out, 4)
    run_train(micro_args(byte_data_dir, out, init_from="resume", **BYTE_RESUME))
    assert losses(out) == losses(uninterrupted["sa"])
