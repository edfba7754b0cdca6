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
                          text=True, timeout=300)
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
