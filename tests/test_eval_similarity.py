"""eval/similarity.py: the Figure 1 quantities agree with a naive float64 re-implementation of
attention written here from the weights, sinks are not counted as tokens, and XSA's output is
orthogonal to the own value vector."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from checkpoint import load_model
from conftest import MICRO, REPO
from dataloader import val_sequences
from eval.similarity import similarity_stats
from model import GPT, GPTConfig


def rotate(x, theta):
    """RoPE, rotate-half pairing (i, i + D/2), position = row index; x: (T, D) float64."""
    T, D = x.shape
    out = torch.empty_like(x)
    for i in range(D // 2):
        angle = torch.arange(T, dtype=torch.float64) * theta ** (-2 * i / D)
        a, b = x[:, i], x[:, i + D // 2]
        out[:, i] = a * angle.cos() - b * angle.sin()
        out[:, i + D // 2] = a * angle.sin() + b * angle.cos()
    return out


@torch.no_grad()
def naive_stats(model, x):
    """Per layer: mean cos(v_i, v_j) (i != j), a_ii and cos(y_i, v_i) over heads, tokens and
    sequences, from q, k, v sliced out of c_attn's weight and a masked softmax, in float64.
    The residual stream is advanced block by block here, not captured with hooks."""
    c = model.config
    S, H, D = c.n_sinks, c.n_head, c.head_dim
    h = model.transformer.wte(x)
    if S:
        h = torch.cat((model.sinks.expand(len(x), -1, -1), h), dim=1)
    h = model.transformer.ln_emb(h)
    L = h.size(1)
    out = {"cos_vv": [], "a_ii": [], "cos_yv": []}
    for block in model.transformer.h:
        a = block.ln_1(h).double()
        W = block.attn.c_attn.weight.double()  # rows: all q heads, then all k heads, then all v heads
        sums = {name: 0.0 for name in out}
        for b in range(len(x)):
            for head in range(H):
                rows = [slice(part * H * D + head * D, part * H * D + (head + 1) * D) for part in range(3)]
                q, k, v = (a[b] @ W[r].T for r in rows)
                q, k = rotate(q, c.rope_theta), rotate(k, c.rope_theta)
                scores = q @ k.T / math.sqrt(D)
                scores[torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)] = float("-inf")
                att = torch.softmax(scores, dim=-1)
                y = att @ v
                v, y, att = v[S:], y[S:], att[S:, S:]
                T = len(v)
                cos_pairs = [torch.dot(v[i], v[j]) / (v[i].norm() * v[j].norm())
                             for i in range(T) for j in range(T) if i != j]
                sums["cos_vv"] += torch.stack(cos_pairs).mean().item()
                sums["a_ii"] += att.diagonal().mean().item()
                sums["cos_yv"] += ((y * v).sum(-1) / (y.norm(dim=-1) * v.norm(dim=-1))).mean().item()
        for name in out:
            out[name].append(sums[name] / (len(x) * H))
        h = block(h, model.rope_cos[:L], model.rope_sin[:L])
    return out


@pytest.fixture(scope="module")
def val_x(data_dir):
    x, _ = val_sequences(data_dir, MICRO["block_size"], 3 * MICRO["block_size"])
    return x


def test_sa_statistics_match_naive_attention(trained_runs, val_x):
    model, _ = load_model(trained_runs["sa"], "cpu")
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    assert got["cos_zv"] is None  # no XSA, nothing after it
    for name in ("cos_vv", "a_ii", "cos_yv"):
        assert len(got[name]) == model.config.n_layer
        assert got[name] == pytest.approx(want[name], abs=2e-5), name
    # a trained layer is not trivially uniform: the check above compares non-degenerate numbers
    assert max(abs(v) for v in got["cos_yv"]) > 1e-2


def test_sink_positions_are_not_counted(val_x):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(MICRO, n_sinks=2))).eval()
    with torch.no_grad():
        model.sinks.normal_(0, 1.0)  # sinks that differ from the tokens, so counting them would show
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    for name in ("cos_vv", "a_ii", "cos_yv"):
        assert got[name] == pytest.approx(want[name], abs=2e-5), name


def test_xsa_output_is_orthogonal_to_own_value(trained_runs, val_x):
    model, _ = load_model(trained_runs["xsa"], "cpu")
    got = similarity_stats(model, val_x)
    assert len(got["cos_zv"]) == model.config.n_layer
    assert all(0 <= c < 1e-4 for c in got["cos_zv"])
    # before XSA the same outputs do lean on their own values: the after-XSA number is not vacuous
    assert max(abs(c) for c in got["cos_yv"]) > 1e-2


def test_cli_writes_every_layer_and_a_plot(trained_runs, data_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "eval/similarity.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
         "--data_dir", data_dir, "--num_sequences", "6", "--batch_size", "4", "--device", "cpu",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "similarity.json") as f:
        report = json.load(f)
    n_layer = MICRO["n_layer"]
    for label in ("SA", "XSA"):
        stats = report["models"][label]
        assert stats["num_sequences"] == 6
        for name in ("cos_vv", "a_ii", "cos_yv"):
            assert len(stats[name]) == n_layer and all(math.isfinite(v) for v in stats[name])
    assert report["models"]["SA"]["cos_zv"] is None and len(report["models"]["XSA"]["cos_zv"]) == n_layer
    png = tmp_path / "similarity.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| {n_layer - 1} |" in proc.stdout  # the table has a row for the last layer
