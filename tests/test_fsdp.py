"""FSDP2 and activation checkpointing: the same training whatever the strategy (bf16's FSDP policy against DDP
under autocast included), checkpoints that move between strategies and world sizes. The memory planner's
estimates are test_memory_plan.py's."""

import os
import re
import shutil

import pytest
import torch

from helpers import PARALLEL_RUN, assert_same_training, records
from micro import BYTE_TOKENS, MICRO, make_optimizer, micro_args
from pretrain.checkpointer import list_checkpoints, load_latest_checkpoint, load_model
from pretrain.dataloader import val_sequences
from running import run_train

# one global batch of 4 x 2 sequences: 1 process x 4 micro-steps, or 2 processes x 2 micro-steps;
# 5 val sequences: on 2 processes 3 and 2, in batches of 2, so FSDP's collective forwards must line up
# the two-process FSDP runs: XSA also with every block's activations recomputed
# the plays' bytes: what is checked is the training across strategies, not the tokens (micro.BYTE_TOKENS)
PARALLEL_BYTES = dict(PARALLEL_RUN, **BYTE_TOKENS)
FSDP = {"sa": dict(parallelism="fsdp"), "xsa": dict(parallelism="fsdp", activation_checkpointing="block")}


@pytest.fixture(scope="module")
def one_process(byte_data_dir, tmp_path_factory):
    """Single-process runs, SA and XSA: {attn_type: out_dir}."""
    runs = {}
    for attn_type in ("sa", "xsa"):
        runs[attn_type] = str(tmp_path_factory.mktemp(f"one_{attn_type}"))
        run_train(micro_args(byte_data_dir, runs[attn_type], attn_type=attn_type, **PARALLEL_BYTES))
    return runs


@pytest.fixture(scope="module")
def fsdp_runs(byte_data_dir, tmp_path_factory):
    """Two-process FSDP runs, SA and XSA: {attn_type: out_dir}."""
    runs = {}
    for attn_type, settings in FSDP.items():
        runs[attn_type] = str(tmp_path_factory.mktemp(f"fsdp_{attn_type}"))
        run_train(micro_args(byte_data_dir, runs[attn_type], attn_type=attn_type, **PARALLEL_BYTES, **settings),
                  nproc=2)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("attn_type", ["sa", "xsa"])
def test_two_process_fsdp_matches_one_process(one_process, fsdp_runs, attn_type):
    assert_same_training(fsdp_runs[attn_type], one_process[attn_type], steps=range(1, 7))
    log = open(os.path.join(fsdp_runs[attn_type], "train.log")).read()
    assert "parallelism fsdp" in log and "2 processes x 2 micro-steps" in log


@pytest.mark.slow
def test_two_process_fsdp_muon_matches_ddp_muon_and_resumes(byte_data_dir, tmp_path):
    """Muon orthogonalises whole matrices under FSDP too (all-gathered, not shard by shard): the same
    losses as DDP, where every process holds whole matrices, and a sharded Muon checkpoint resumes."""
    muon = dict(PARALLEL_BYTES, optimizer="muon", attn_type="xsa", learning_rate=1e-2)
    ddp, fsdp = str(tmp_path / "ddp"), str(tmp_path / "fsdp")
    run_train(micro_args(byte_data_dir, ddp, **muon), nproc=2)
    run_train(micro_args(byte_data_dir, fsdp, parallelism="fsdp", **{**muon, "max_iters": 4}), nproc=2)
    run_train(micro_args(byte_data_dir, fsdp, parallelism="fsdp", init_from="resume", **muon), nproc=2)
    # Newton-Schulz runs in bf16, where the two reductions' last-bit differences can round apart
    assert_same_training(fsdp, ddp, steps=range(1, 7), rel=1e-3)
    assert [os.path.basename(p) for p in list_checkpoints(fsdp)] == ["ckpt_0000004", "ckpt_0000006"]


# compiled, on 2 processes, with recomputed blocks: under FSDP each block compiles on its own, so a
# checkpointed block that dynamo skipped (torch's checkpoint called as the forward) ran eagerly
COMPILED = {"ddp-block": dict(activation_checkpointing="block"),
            "ddp-selective": dict(activation_checkpointing="selective"),
            "fsdp-block": dict(parallelism="fsdp", activation_checkpointing="block"),
            "fsdp-selective": dict(parallelism="fsdp", activation_checkpointing="selective")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_two_process_training_with_recomputed_blocks_matches_eager(byte_data_dir, tmp_path, one_process, name):
    """torch.compile (inductor's C++ backend here, Triton on a GPU) with activation checkpointing, under
    DDP and FSDP: graphs compiled, no graph break, the eager single-process losses, and checkpoints of
    the uncompiled state dict (no _orig_mod. prefixes)."""
    out = str(tmp_path / "run")
    proc = run_train(micro_args(byte_data_dir, out, attn_type="xsa", compile=True, **PARALLEL_BYTES,
                                **COMPILED[name]), nproc=2)
    summary = re.search(r"^torch.compile: (\d+) graphs, (\d+) graph breaks", proc.stdout, re.M)
    assert summary, proc.stdout[-2000:]
    graphs, breaks = int(summary.group(1)), int(summary.group(2))
    assert graphs > 0 and breaks == 0, summary.group(0)
    assert_same_training(out, one_process["xsa"], steps=range(1, 7))
    saved = load_latest_checkpoint(out)[0]
    model, _ = load_model(saved)
    assert set(model.state_dict()) == set(load_model(one_process["xsa"])[0].state_dict())


@pytest.mark.slow
def test_a_recomputed_block_compiles_on_its_own():
    """FSDP compiles block by block: a block whose forward runs under activation checkpointing must still
    give dynamo a graph (it skips torch's checkpoint when that is the compiled frame itself)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    from pretrain.train_config import model_config
    from model import GPT
    from pretrain.parallelize import apply_activation_checkpointing
    dynamo.reset()
    counters.clear()
    model = GPT(model_config({**MICRO, "vocab_size": 512, "attn_type": "xsa"}))
    apply_activation_checkpointing(model, "block")
    for block in model.transformer.h:
        block.compile(backend="aot_eager")
    x = torch.randint(0, 512, (2, MICRO["block_size"]))
    model(x, x)[1].backward()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


@pytest.mark.slow
def test_fsdp_writes_sharded_checkpoints_and_keeps_the_newest(fsdp_runs):
    out = fsdp_runs["sa"]
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000004", "ckpt_0000006"]
    assert not [name for name in os.listdir(out) if ".tmp" in name]
    newest = os.path.join(out, "ckpt_0000006")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "run_state.pt"} <= set(os.listdir(newest))
    state = torch.load(os.path.join(newest, "run_state.pt"), weights_only=True)
    assert {"step", "loader", "rng", "config", "wandb_run_id", "best_val_loss", "provenance"} <= set(state)
    assert state["step"] == 6 and len(state["rng"]) == 2 and state["config"]["parallelism"] == "fsdp"


def copy_checkpoint(run, name, out_dir):
    os.makedirs(out_dir)
    copy = shutil.copytree if os.path.isdir(os.path.join(run, name)) else shutil.copy
    copy(os.path.join(run, name), os.path.join(out_dir, name))


@pytest.mark.slow
@pytest.mark.parametrize("attn_type,nproc", [("sa", 1), ("xsa", 2)])
def test_fsdp_checkpoint_resumes_in_ddp(byte_data_dir, tmp_path, one_process, fsdp_runs, attn_type, nproc):
    """On one process (no process group) and on two DDP processes (each reads every shard)."""
    out = str(tmp_path / "run")
    copy_checkpoint(fsdp_runs[attn_type], "ckpt_0000004", out)
    proc = run_train(micro_args(byte_data_dir, out, attn_type=attn_type, init_from="resume", **PARALLEL_BYTES),
                     nproc=nproc)
    assert "resuming from" in proc.stdout and "at step 4" in proc.stdout
    assert ("checkpoint has RNG states of 2 ranks, resuming on 1" in proc.stdout) == (nproc == 1)
    assert_same_training(out, one_process[attn_type], steps=[5, 6])
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000004", "ckpt_0000006.pt"]


@pytest.mark.slow
def test_single_file_checkpoint_resumes_in_two_process_fsdp(byte_data_dir, tmp_path, one_process):
    out = str(tmp_path / "run")
    copy_checkpoint(one_process["xsa"], "ckpt_0000004.pt", out)
    proc = run_train(micro_args(byte_data_dir, out, attn_type="xsa", init_from="resume", **PARALLEL_BYTES,
                                **FSDP["xsa"]), nproc=2)
    assert "at step 4" in proc.stdout
    assert_same_training(out, one_process["xsa"], steps=[5, 6])
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["ckpt_0000004.pt", "ckpt_0000006"]


@pytest.mark.slow
def test_an_fsdp_checkpoint_exports_as_its_single_file_equivalent(fsdp_runs, tmp_path):
    """scripts/export_hf.py reads a DCP directory in one process: the folder is byte for byte the one
    exported from the same weights in a single-file checkpoint."""
    from pretrain.checkpoint_format import save_checkpoint
    from running import run_in_process
    sharded = os.path.join(fsdp_runs["xsa"], "ckpt_0000006")
    model, config = load_model(sharded)
    single = save_checkpoint({"model": model.state_dict(), "config": config, "step": 6}, str(tmp_path / "single"), 6)
    folders = {}
    for name, path in (("sharded", sharded), ("single", single)):
        folders[name] = tmp_path / f"hf_{name}"
        result = run_in_process(["-m", "scripts.export_hf", path, folders[name]])
        assert result.status == 0, result.stderr[-3000:]
    contents = {name: {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder))} for name, folder in folders.items()}
    assert contents["sharded"] == contents["single"] and "model.safetensors" in contents["single"]


@pytest.mark.slow
def test_sharded_checkpoint_loads_for_evaluation(byte_data_dir, fsdp_runs):
    """eval/*.py's load_model, in one process without a process group: the run's last val loss."""
    model, config = load_model(fsdp_runs["sa"])
    assert config["parallelism"] == "fsdp" and not model.training
    x, y = val_sequences(byte_data_dir, MICRO["block_size"], PARALLEL_BYTES["val_tokens"])
    with torch.no_grad():
        val_loss = model(x, y)[1].item()
    assert val_loss == pytest.approx(records(fsdp_runs["sa"])[-1]["val_loss"], rel=1e-5)
    same, _ = load_model(os.path.join(fsdp_runs["sa"], "ckpt_0000006"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))


@pytest.mark.slow
def test_truncated_sharded_checkpoint_falls_back_to_previous(tmp_path, fsdp_runs):
    out = str(tmp_path / "run")
    shutil.copytree(fsdp_runs["sa"], out)
    shard = os.path.join(out, "ckpt_0000006", "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.warns(UserWarning, match=r"skipping unreadable checkpoint .*ckpt_0000006"):
        path, state = load_latest_checkpoint(out)
    assert os.path.basename(path) == "ckpt_0000004" and state["step"] == 4


@pytest.mark.slow
def test_corrupt_metadata_is_an_unreadable_checkpoint_not_a_base_exception(tmp_path, fsdp_runs):
    """DCP raises CheckpointException (a BaseException) for a corrupt .metadata: resume falls back to the
    previous checkpoint, and evaluation gets an ordinary error naming the checkpoint."""
    from pretrain.checkpoint_format import CorruptCheckpoint
    out = str(tmp_path / "run")
    shutil.copytree(fsdp_runs["sa"], out)
    metadata = os.path.join(out, "ckpt_0000006", ".metadata")
    with open(metadata, "r+b") as f:
        f.seek(os.path.getsize(metadata) // 2)
        f.write(b"\x00" * 32)
    with pytest.warns(UserWarning, match=r"skipping unreadable checkpoint .*ckpt_0000006"):
        path, state = load_latest_checkpoint(out)
    assert os.path.basename(path) == "ckpt_0000004" and state["step"] == 4
    with pytest.raises(CorruptCheckpoint, match="ckpt_0000006"):
        load_model(os.path.join(out, "ckpt_0000006"))


@pytest.mark.slow
def test_corrupted_shard_is_found_by_the_process_checking_it_and_all_fall_back(byte_data_dir, tmp_path, one_process,
                                                                               fsdp_runs):
    """Two processes share the checksum work (rank 1 reads __1_0.distcp); the one that finds the
    corruption makes both resume from the previous checkpoint."""
    out = str(tmp_path / "run")
    shutil.copytree(fsdp_runs["sa"], out)
    shard = os.path.join(out, "ckpt_0000006", "__1_0.distcp")
    with open(shard, "r+b") as f:  # same size, other bytes: only the checksum can tell
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 64)
    proc = run_train(micro_args(byte_data_dir, out, init_from="resume", **PARALLEL_BYTES, **FSDP["sa"]), nproc=2)
    assert "skipping unreadable checkpoint" in proc.stderr and "__1_0.distcp does not match its checksum" in proc.stderr
    assert "at step 4" in proc.stdout
    assert_same_training(out, one_process["sa"], steps=range(1, 7))


def test_failed_sharded_checkpoint_write_leaves_previous_intact(tmp_path, monkeypatch):
    """Also: a sharded checkpoint written and read by one process, without a process group."""
    import errno
    from pretrain.checkpoint_format import load_training_state, save_sharded_checkpoint
    from pretrain.train_config import model_config
    from model import GPT
    model = GPT(model_config(MICRO))
    optimizer = make_optimizer(model)
    save_sharded_checkpoint(model, optimizer, {"step": 1}, str(tmp_path), 1)

    def disk_full(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(torch, "save", disk_full)
        with pytest.raises(OSError, match="No space left on device.*previous checkpoints are untouched"):
            save_sharded_checkpoint(model, optimizer, {"step": 2}, str(tmp_path), 2)
    assert os.listdir(tmp_path) == ["ckpt_0000001"]
    path, state = load_latest_checkpoint(str(tmp_path))
    assert state == {"step": 1}
    fresh = GPT(model_config(MICRO))
    torch.nn.init.zeros_(fresh.lm_head.weight)  # differs from the saved model (tied: the embedding too)
    fresh_optimizer = make_optimizer(fresh)
    load_training_state(path, state, fresh, fresh_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_activation_checkpointing_gives_the_same_training():
    """Recomputed blocks give bit-identical losses, gradients and parameters, dropout included."""
    from pretrain.train_config import model_config
    from model import GPT
    from pretrain.parallelize import apply_activation_checkpointing
    x = torch.randint(0, 512, (4, MICRO["block_size"] + 1))
    results = {}
    for mode in ("none", "block", "selective"):
        torch.manual_seed(0)
        model = GPT(model_config({**MICRO, "n_layer": 3, "vocab_size": 512, "attn_type": "xsa", "dropout": 0.1}))
        apply_activation_checkpointing(model, mode)
        optimizer = make_optimizer(model, learning_rate=1e-2)
        losses = []
        for _ in range(3):
            loss = model(x[:, :-1], x[:, 1:])[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[mode] = (losses, [p.detach().clone() for p in model.parameters()])
    for mode in ("block", "selective"):
        assert results[mode][0] == results["none"][0]
        assert all(torch.equal(a, b) for a, b in zip(results[mode][1], results["none"][1]))


@pytest.mark.slow
def test_fsdp_with_the_bf16_policy_trains_as_ddp_under_bf16_autocast(byte_data_dir, tmp_path, fsdp_runs):
    """The GPU's FSDP path on its CPU stand-in: two gloo processes, dtype bfloat16, so FSDP all-gathers bf16
    parameters and reduces fp32 gradients (MixedPrecisionPolicy), against DDP under bf16 autocast on the same
    batches. Tolerance: bf16's unit roundoff is 2^-8 = 0.39%, and the two paths round different tensors (FSDP
    also LayerNorm's weights and the embedding, DDP only what autocast runs in bf16), so their losses may
    differ by a few roundoffs: 1% relative at each of 6 steps. That the policy is on at all shows against the
    fp32 FSDP run of the same settings (fsdp_runs: its recomputed blocks change no bit, as
    test_activation_checkpointing_gives_the_same_training shows), which differs from the bf16 one by more
    than float32 noise."""
    losses = {"fsdp_fp32": [r["train_loss"] for r in records(fsdp_runs["xsa"]) if "train_loss" in r]}
    for name, settings in (("fsdp_bf16", dict(parallelism="fsdp", dtype="bfloat16")),
                           ("ddp_bf16", dict(parallelism="ddp", dtype="bfloat16"))):
        out = str(tmp_path / name)
        run_train(micro_args(byte_data_dir, out, attn_type="xsa", **PARALLEL_BYTES, **settings), nproc=2)
        losses[name] = [r["train_loss"] for r in records(out) if "train_loss" in r]
    assert len(losses["fsdp_bf16"]) == len(losses["ddp_bf16"]) == len(losses["fsdp_fp32"]) == 6
    assert "dtype float32" in open(os.path.join(fsdp_runs["xsa"], "train.log")).read()
    for fsdp, ddp in zip(losses["fsdp_bf16"], losses["ddp_bf16"]):
        assert fsdp == pytest.approx(ddp, rel=1e-2)
    assert max(abs(a - b) for a, b in zip(losses["fsdp_bf16"], losses["fsdp_fp32"])) > 1e-5
