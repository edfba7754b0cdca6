"""eval/position_loss.py: per-position losses average to the plain validation loss, each position's
loss is what the model predicts there, the buckets partition the positions, and the validation data
defaults to the first checkpoint's own."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import MICRO, micro_args, run_eval, run_in_process, run_train
from dataloader import val_sequences
from eval.common import load_model
from eval.position_loss import bucket_losses, position_losses


@pytest.fixture(scope="module")
def sa_model_and_data(trained_runs, data_dir):
    model, _ = load_model(trained_runs["sa"], "cpu")
    x, y = val_sequences(data_dir, MICRO["block_size"], 13 * MICRO["block_size"])
    return model, x, y


@pytest.mark.slow
@torch.no_grad()
def test_mean_over_positions_is_the_validation_loss(sa_model_and_data):
    model, x, y = sa_model_and_data
    per_position = position_losses(model, x, y, batch_size=5)  # 13 sequences: a partial last batch
    assert per_position.shape == (x.size(1),)
    _, loss = model(x, y)
    # other batch shapes change fp32 matmul rounding; any real error (a dropped position) is ~1e-2
    assert per_position.mean().item() == pytest.approx(loss.item(), rel=1e-4)


@pytest.mark.slow
@torch.no_grad()
def test_each_position_is_scored_from_its_own_prefix(sa_model_and_data):
    """Position t's loss equals the loss of a forward pass on the first t + 1 tokens alone."""
    model, x, y = sa_model_and_data
    per_position = position_losses(model, x, y, batch_size=16)
    for t in (0, 7, x.size(1) - 1):
        logits, _ = model(x[:, :t + 1])
        want = F.cross_entropy(logits[:, -1].double(), y[:, t])
        assert per_position[t].item() == pytest.approx(want.item(), rel=1e-4)  # batch-shape rounding only


def test_buckets_partition_the_positions():
    per_position = torch.arange(32, dtype=torch.float64) ** 2  # distinct values expose misplaced bounds
    for n_buckets in (1, 5, 8, 32, 50):
        buckets = bucket_losses(per_position, n_buckets)
        assert len(buckets) == min(n_buckets, 32)
        assert buckets[0]["start"] == 0 and buckets[-1]["end"] == 32
        assert all(a["end"] == b["start"] for a, b in zip(buckets, buckets[1:]))
        sizes = [b["end"] - b["start"] for b in buckets]
        assert max(sizes) - min(sizes) <= 1
        for b in buckets:
            assert b["loss"] == pytest.approx(per_position[b["start"]:b["end"]].mean().item())
        weighted = sum(b["loss"] * (b["end"] - b["start"]) for b in buckets) / 32
        assert weighted == pytest.approx(per_position.mean().item())


@pytest.mark.slow
def test_cli_writes_tables_and_plot(trained_runs, data_dir, tmp_path):
    """No --data_dir: the models are scored on the val shards of the data_dir they were trained on."""
    proc, report = run_eval("position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--num_sequences", "8", "--buckets", "4", "--device", "cpu", out=tmp_path)
    with open(os.path.join(trained_runs["sa"], "config.json")) as f:
        trained_on = json.load(f)["config"]["data_dir"]  # the session's shards (a parallel worker's copy of them)
    assert report["num_sequences"] == 8 and report["data_dir"] == trained_on
    x, y = val_sequences(data_dir, MICRO["block_size"], 8 * MICRO["block_size"])
    for label, attn_type in (("SA", "sa"), ("XSA", "xsa")):
        result = report["models"][label]
        assert len(result["buckets"]) == 4 and len(result["per_position"]) == MICRO["block_size"]
        assert result["mean"] == pytest.approx(sum(result["per_position"]) / MICRO["block_size"])
        assert f"mean validation loss {result['mean']:.4f}" in proc.stdout
        model, _ = load_model(trained_runs[attn_type], "cpu")
        with torch.no_grad():
            _, loss = model(x, y)  # the model's own loss on the training data's val tokens
        assert result["mean"] == pytest.approx(loss.item(), rel=1e-4)
    assert "%|" not in proc.stderr  # stderr is a pipe here: no progress bars
    markdown = (tmp_path / "position_loss.md").read_text()
    assert "| positions | SA | XSA | XSA - SA |" in markdown and "| all (mean) |" in markdown
    png = tmp_path / "position_loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_an_explicit_data_dir_wins_over_the_checkpoints(trained_runs, data_dir, tmp_path):
    other = tmp_path / "other_shards"  # a val split of other text: the training data's first train shard
    other.mkdir()
    shutil.copy(os.path.join(data_dir, "fineweb_train_000001.bin"), other / "fineweb_val_000000.bin")
    proc = run_in_process(
        ["eval/position_loss.py", trained_runs["sa"], "--labels", "SA", "--data_dir", other,
         "--num_sequences", "8", "--device", "cpu", "--out", tmp_path / "out"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "out" / "position_loss.json") as f:
        report = json.load(f)
    assert report["data_dir"] == str(other)
    model, _ = load_model(trained_runs["sa"], "cpu")
    with torch.no_grad():
        _, want = model(*val_sequences(str(other), MICRO["block_size"], 8 * MICRO["block_size"]))
        _, default = model(*val_sequences(data_dir, MICRO["block_size"], 8 * MICRO["block_size"]))
    assert report["models"]["SA"]["mean"] == pytest.approx(want.item(), rel=1e-4)
    assert abs(want.item() - default.item()) > 1e-2  # the two data sets tell apart


@pytest.mark.slow
@pytest.mark.parametrize("given", ["--block_size", "first checkpoint"])
def test_sequences_longer_than_a_models_context_are_refused_in_one_line(trained_runs, data_dir, tmp_path, given):
    """--block_size 64 on a 32-token model, or a second model with a shorter context than the first
    one's block_size that sets the sequence length: one line naming the checkpoint and the fix."""
    if given == "--block_size":
        args, source = [trained_runs["sa"], "--block_size", "64"], "--block_size 64"
    else:
        longer = str(tmp_path / "run_64")
        run_train(micro_args(data_dir, longer, block_size=64, max_iters=1, eval_interval=1, checkpoint_interval=1,
                             val_tokens=1024))
        args, source = [longer, trained_runs["sa"]], "the first checkpoint's block_size 64"
    proc = run_in_process(["eval/position_loss.py", *args, "--num_sequences", "2", "--device", "cpu",
                       "--out", tmp_path / "out"])
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [f"{source} is longer than the context of {trained_runs['sa']} "
                                                 f"({MICRO['block_size']} tokens); use --block_size "
                                                 f"{MICRO['block_size']} or less, or --extend_context to score "
                                                 f"past it"], proc.stderr
    assert not os.path.exists(tmp_path / "out" / "position_loss.json")


@pytest.mark.slow
def test_scoring_past_the_training_length_extends_the_context_and_splits_the_report_there(trained_runs, tmp_path):
    """--block_size 4x: sequences 4 times the 32 tokens trained on, the RoPE tables extended; per-position
    losses as the extended model computes them, buckets that never straddle position 32, and each model's
    mean inside and beyond it."""
    proc, report = run_eval("position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--block_size", "4x", "--num_sequences", "4", "--buckets", "8", "--device", "cpu",
                            out=tmp_path)
    T, trained = 4 * MICRO["block_size"], MICRO["block_size"]
    assert report["block_size"] == T
    model, config = load_model(trained_runs["xsa"], "cpu")
    model.extend_context(T)
    x, y = val_sequences(config["data_dir"], T, 4 * T)
    with torch.no_grad():
        want = F.cross_entropy(model(x)[0].transpose(1, 2), y, reduction="none").double().mean(dim=0)
    xsa = report["models"]["XSA"]
    assert xsa["per_position"] == pytest.approx(want.tolist(), rel=1e-5)
    for label in ("SA", "XSA"):
        per_position = torch.tensor(report["models"][label]["per_position"])
        assert report["models"][label]["inside"] == pytest.approx(per_position[:trained].mean().item())
        assert report["models"][label]["beyond"] == pytest.approx(per_position[trained:].mean().item())
        assert any(b["start"] == trained for b in report["models"][label]["buckets"])  # split at the training length
    inside_delta = xsa["inside"] - report["models"]["SA"]["inside"]
    assert f"| inside the training length ({trained}) |" in proc.stdout and f"{inside_delta:.4f} |" in proc.stdout
    assert (tmp_path / "position_loss.png").exists()
