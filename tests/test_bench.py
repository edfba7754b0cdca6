"""bench.py: its figures are consistent with each other and its profile shows the XSA kernels."""

import json
import subprocess
import sys

import pytest

from conftest import MICRO, REPO


def test_bench_reports_consistent_figures_and_profiles_both_variants(tmp_path):
    args = [f"--{k}={v}" for k, v in MICRO.items()] + [
        "--batch_size=2", "--compile=False", "--device=cpu", "--dtype=float32", "--bench_rounds=2",
        "--bench_steps=1", "--bench_warmup=1", "--profile=True", f"--bench_json={tmp_path / 'bench.json'}"]
    proc = subprocess.run([sys.executable, f"{REPO}/bench.py", *args], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    results = report["results"]
    assert set(results) == {"sa", "xsa"}
    tokens_per_step = 2 * MICRO["block_size"]
    for r in results.values():
        assert r["tokens_per_sec"] == pytest.approx(tokens_per_step / (r["ms_per_step"] / 1000), rel=1e-9)
        assert r["mfu"] is None and r["peak_mem_gb"] is None  # no peak FLOP/s or allocator stats on CPU
    assert results["sa"]["params_M"] == results["xsa"]["params_M"]  # XSA adds no parameters
    assert results["xsa"]["throughput_ratio"] == pytest.approx(
        results["xsa"]["tokens_per_sec"] / results["sa"]["tokens_per_sec"], rel=1e-9)
    assert f"tok/s vs sa {results['xsa']['throughput_ratio']:.4f}" in proc.stdout
    # the traces are valid Chrome traces, and only the XSA one runs the exclusion's backward
    traces = {v: (tmp_path / f"bench_trace_{v}.json").read_text() for v in ("sa", "xsa")}
    for trace in traces.values():
        assert json.loads(trace)["traceEvents"]
    assert "ExcludeSelfBackward" in traces["xsa"] and "ExcludeSelfBackward" not in traces["sa"]


def test_peak_memory_counts_only_the_variant_measured(monkeypatch):
    """With the first variant's model still alive, the second variant's peak is its own footprint,
    not the sum of both (a fake CUDA allocator, so that this runs on any machine)."""
    import torch
    from bench import PeakMemory
    allocator = {"allocated": 0, "peak": 0}

    def allocate(n):
        allocator["allocated"] += n
        allocator["peak"] = max(allocator["peak"], allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: allocator.update(peak=allocator["allocated"]))
    with PeakMemory("cuda") as sa:
        allocate(4e9)  # model and optimizer, kept
        allocate(2e9)  # activations of a step, then freed
        allocate(-2e9)
    with PeakMemory("cuda") as xsa:
        allocate(4e9)
        allocate(2.5e9)
        allocate(-2.5e9)
    assert sa.gb == pytest.approx(6.0) and xsa.gb == pytest.approx(6.5)
    with PeakMemory("cpu") as cpu:
        allocate(1e9)
    assert cpu.gb is None


def test_bench_variants_take_overrides_and_reject_unknown_keys(tmp_path):
    base = [f"--{k}={v}" for k, v in MICRO.items()] + [
        "--batch_size=1", "--compile=False", "--device=cpu", "--dtype=float32", "--bench_rounds=1",
        "--bench_steps=1", "--bench_warmup=0", f"--bench_json={tmp_path / 'bench.json'}"]
    run = lambda *extra: subprocess.run([sys.executable, f"{REPO}/bench.py", *base, *extra], cwd=tmp_path,
                                        capture_output=True, text=True)
    proc = run("--bench_variants=sa,xsa:xsa_gate=True,sa:n_layer=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert list(results) == ["sa", "xsa:xsa_gate=True", "sa:n_layer=1"]
    # the gate adds one parameter per head and layer; one layer fewer has about half the block parameters
    gate = MICRO["n_layer"] * MICRO["n_head"] / 1e6
    assert results["xsa:xsa_gate=True"]["params_M"] == pytest.approx(results["sa"]["params_M"] + gate)
    assert results["sa:n_layer=1"]["params_M"] < 0.6 * results["sa"]["params_M"]
    proc = run("--bench_variants=sa,xsa:xsa_gat=True")
    assert proc.returncode != 0 and "did you mean xsa_gate" in proc.stderr
