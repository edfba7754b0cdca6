"""eval/position_loss.py: per-position losses average to the plain validation loss, each position's
loss is what the model predicts there, and the buckets partition the positions."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpoint import load_model
from conftest import MICRO, REPO
from dataloader import val_sequences
from eval.position_loss import bucket_losses, position_losses


@pytest.fixture(scope="module")
def sa_model_and_data(trained_runs, data_dir):
    model, _ = load_model(trained_runs["sa"], "cpu")
    x, y = val_sequences(data_dir, MICRO["block_size"], 13 * MICRO["block_size"])
    return model, x, y


@torch.no_grad()
def test_mean_over_positions_is_the_validation_loss(sa_model_and_data):
    model, x, y = sa_model_and_data
    per_position = position_losses(model, x, y, batch_size=5)  # 13 sequences: a partial last batch
    assert per_position.shape == (x.size(1),)
    _, loss = model(x, y)
    # other batch shapes change fp32 matmul rounding; any real error (a dropped position) is ~1e-2
    assert per_position.mean().item() == pytest.approx(loss.item(), rel=1e-4)


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


def test_cli_writes_tables_and_plot(trained_runs, data_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "eval/position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
         "--data_dir", data_dir, "--num_sequences", "8", "--buckets", "4", "--device", "cpu",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "position_loss.json") as f:
        report = json.load(f)
    assert report["num_sequences"] == 8
    for label in ("SA", "XSA"):
        result = report["models"][label]
        assert len(result["buckets"]) == 4 and len(result["per_position"]) == MICRO["block_size"]
        assert result["mean"] == pytest.approx(sum(result["per_position"]) / MICRO["block_size"])
        assert f"mean validation loss {result['mean']:.4f}" in proc.stdout
    markdown = (tmp_path / "position_loss.md").read_text()
    assert "| positions | SA | XSA | XSA - SA |" in markdown and "| all (mean) |" in markdown
    png = tmp_path / "position_loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
