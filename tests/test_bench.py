"""bench.py: its figures are consistent with each other and its profile shows the XSA kernels."""

import json
import os
import sys

import pytest

from conftest import HANG_GUARD_S, MICRO, REPO, run_script
from helpers import write_fixture_tasks

# scripts.bench run in a temporary directory (where its traces go): the repo's modules found through PYTHONPATH
FROM_TMP_PATH = {**os.environ, "PYTHONPATH": REPO}


@pytest.mark.slow
def test_bench_reports_consistent_figures_and_profiles_both_variants(tmp_path):
    """Also the in-loop evaluation's cost (--bench_in_loop): its shares of the training between two evaluations,
    measured and in FLOPs, against the formulas recomputed here, for this config and the paper's."""
    tasks = write_fixture_tasks(tmp_path / "tasks")
    in_loop = dict(bench_in_loop=True, downstream_include_path=tasks, downstream_interval=50, downstream_limit=3,
                   similarity_interval=20, total_batch_size=4 * MICRO["block_size"])
    args = [f"--{k}={v}" for k, v in {**MICRO, **in_loop}.items()] + [
        "--batch_size=2", "--compile=False", "--device=cpu", "--dtype=float32", "--bench_rounds=2",
        "--bench_steps=1", "--bench_warmup=1", "--profile=True", f"--bench_json={tmp_path / 'bench.json'}"]
    proc = run_script([sys.executable, "-m", "scripts.bench", *args], cwd=tmp_path,
                      env={**FROM_TMP_PATH, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    results = report["results"]
    cost = results.pop("in_loop")
    step_s = results["sa"]["ms_per_step"] / 1000 * 2  # train.py's step: total_batch_size = 2 bench steps' tokens
    assert cost["train_step_s"] == pytest.approx(step_s, rel=1e-9)
    for what, interval in (("similarity", 20), ("downstream", 50)):
        seconds = cost[f"{what}_s"]
        assert cost[f"{what}_share"] == pytest.approx(seconds / (interval * step_s + seconds), rel=1e-9)
    assert cost["downstream_examples"] == 8 * 3  # the first 3 examples of each of the 8 tasks
    tokens = cost["forward_tokens_per_example"] * cost["downstream_examples"]
    assert cost["downstream_flop_share"] == pytest.approx(tokens / 3 / (50 * 4 * MICRO["block_size"]), rel=1e-9)
    assert cost["similarity_flop_share"] == pytest.approx(2 * 2 / 3 / (20 * 4), rel=1e-9)
    for path, shares in cost["paper"].items():  # 8 tasks x 500 examples every 5000 steps of 524,288 tokens
        per_example = cost["forward_tokens_per_example"]
        assert shares["downstream_flop_share"] == pytest.approx(per_example * 4000 / 3 / (5000 * 524_288), rel=1e-9)
        assert f"{path}: downstream 4000 examples every 5000 steps: {100 * shares['downstream_flop_share']:.3f}%" \
            in proc.stdout
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
    from scripts.bench import PeakMemory
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


@pytest.mark.slow
def test_bench_variants_take_overrides_and_reject_unknown_keys(tmp_path):
    base = [f"--{k}={v}" for k, v in MICRO.items()] + [
        "--batch_size=1", "--compile=False", "--device=cpu", "--dtype=float32", "--bench_rounds=1",
        "--bench_steps=1", "--bench_warmup=0", f"--bench_json={tmp_path / 'bench.json'}"]

    def run(*extra):
        return run_script([sys.executable, "-m", "scripts.bench", *base, *extra], cwd=tmp_path, env=FROM_TMP_PATH)
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


@pytest.mark.slow
def test_gpu_check_dry_run_fills_its_table_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh with DRY_RUN=1 runs every stage at toy size on the CPU: the bench rows of
    both variants with compile off and on (compiled whole: graphs, no break), the SDPA backend, XSA's
    orthogonality, an FSDP run on 2 processes resumed to the uninterrupted run's loss, the document mask
    against the causal one at two lengths (bench.py --attn_mask=document: each variant and its causal twin),
    and the check of FlexAttention's gradients (on the CPU, the dense mask on both sides)."""
    import os
    import re
    out = tmp_path / "gpu_check"
    env = dict(os.environ, DRY_RUN="1", OUT=str(out), OMP_NUM_THREADS="1")
    proc = run_script(["bash", "scripts/gpu_check.sh"], env=env, timeout=HANG_GUARD_S)  # its FSDP runs are 2 processes
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert table in proc.stdout
    rows = re.findall(r"^\| (sa|xsa) \| (off|on) \| ([\d.]+) \| ([\d,]+) \| n/a \| n/a \| ([\d.]+) \| n/a \| (.+) \|$",
                      table, re.M)
    assert [(r[0], r[1]) for r in rows] == [("sa", "off"), ("xsa", "off"), ("sa", "on"), ("xsa", "on")]
    tokens_per_sec_of = {(r[0], r[1]): float(r[3].replace(",", "")) for r in rows}
    for variant, compile, ms, _, ratio, graphs in rows:
        tokens_per_sec = tokens_per_sec_of[variant, compile]
        # 2 sequences of 64 tokens per step; ms/step is printed rounded, so tokens/s lies between the
        # rates of the rounding interval's ends (and tokens/s itself is rounded to the token)
        half_ulp = 0.5 * 10 ** -len(ms.split(".")[1])
        slowest, fastest = 128e3 / (float(ms) + half_ulp), 128e3 / (float(ms) - half_ulp)
        assert slowest - 1 <= tokens_per_sec <= fastest + 1
        # SA is the baseline; XSA's ratio (printed to 3 decimals) is its tokens/s over SA's
        assert float(ratio) == pytest.approx(tokens_per_sec / tokens_per_sec_of["sa", compile], abs=1e-3)
        assert variant == "xsa" or ratio == "1.000"
        if compile == "on":
            compiled, breaks = map(int, graphs.split(" / "))
            assert compiled >= 1 and breaks == 0
    assert "- SDPA backend: flash (CPU)" in table
    ortho = re.search(r"XSA orthogonality in float32: mean ([\d.e+-]+), max ([\d.e+-]+)", table)
    assert ortho and 0 <= float(ortho.group(1)) <= float(ortho.group(2)) < 1e-5
    resume = re.search(r"step-3 loss ([\d.]+); resumed from the step-2 checkpoint ([\d.]+)", table)
    assert resume and resume.group(1) == resume.group(2)
    assert "parallelism fsdp" in (out / "fsdp_full" / "train.log").read_text()
    assert "2 processes" in (out / "fsdp_resumed" / "train.log").read_text()
    # the document mask against the causal one at two lengths: each ratio is its two step times'
    masks = re.findall(r"^\| (sa|xsa) \| (\d+) \| (document|causal) \| ([\d.]+) \| [\d,]+ \| ([\d.]+|-) \|$", table, re.M)
    assert [(r[0], r[1], r[2]) for r in masks] == [(v, t, m) for t in ("32", "64") for v in ("sa", "xsa")
                                                   for m in ("document", "causal")]
    for document, causal in zip(masks[::2], masks[1::2]):
        assert float(document[4]) == pytest.approx(float(document[3]) / float(causal[3]), abs=2e-3)
    assert "FlexAttention vs dense on cpu: loss rel 0.0e+00, worst gradient rel 0.0e+00" in table


def test_benchmark_documents_have_log_normal_lengths_around_the_median():
    import torch
    from scripts.bench import with_documents
    x = torch.randint(0, 50000, (256, 1024))
    starts = (with_documents(x, 400, 50256).view(-1) == 50256).nonzero().view(-1)
    lengths = starts.diff().double()
    assert starts[0] == 0 and len(lengths) > 300  # mean ~660 tokens: ~400 documents
    assert 320 < lengths.median() < 500  # the median asked for, within 3 sampling errors (~7% each)
    assert lengths.log().std() == pytest.approx(1.0, abs=0.2)  # sigma 1
    assert torch.equal(with_documents(x, 400, 50256), with_documents(x, 400, 50256))  # the same tokens every time
