"""bench.py: its figures are consistent with each other and its profile shows the XSA kernels."""

import json
import os
import sys

import pytest

from helpers import write_fixture_tasks
from micro import MICRO
from running import REPO, run_in_process, run_script

# gpu_check's checks.py, run from its OUT folder: the repo's modules found through PYTHONPATH
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
    proc = run_in_process(["-m", "scripts.bench", *args], cwd=tmp_path)  # its traces go to the working directory
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
        return run_in_process(["-m", "scripts.bench", *base, *extra], cwd=tmp_path)
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


def gpu_check(out, **env):
    """scripts/gpu_check.sh with DRY_RUN=1 (toy sizes on the CPU, compile off, gloo) into out, the Hub offline;
    returns (Result, gpu_check.json or None)."""
    env = dict(os.environ, DRY_RUN="1", OUT=str(out), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", **env)
    proc = run_script(["bash", "scripts/gpu_check.sh"], env=env, preloaded=True)
    report = out / "gpu_check.json"
    return proc, json.loads(report.read_text()) if report.exists() else None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every stage, read by the tests below: (Result, gpu_check.json, its OUT folder)."""
    out = tmp_path_factory.mktemp("gpu_check_all") / "gpu_check"
    proc, report = gpu_check(out)
    return proc, report, out


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_stage_offline_and_reports_their_figures(dry_run):
    """Every stage at toy size on the CPU, offline: the bench rows of both variants, the SDPA backend and XSA's
    orthogonality, DDP and FSDP runs of 2 micro-steps resumed to the uninterrupted run's losses, FSDP's peak
    memory against memory_plan's, Muon's losses under DDP and FSDP, the document mask's gradients under torchrun
    and its step time against the causal mask's at two lengths, and the in-loop passes at every step."""
    import re
    proc, report, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert report["dry_run"] and report["passed"] and report["tokenizer"]["available"]
    stages = report["stages"]
    assert {n: r["status"] for n, r in stages.items()} == {str(n): "pass" for n in range(1, 8)}
    assert all(r["seconds"] >= 0 and r["estimate_s"] > 0 for r in stages.values())
    assert re.search(r"stage 1: +\d+ s .*\n(.*\n){6}  total: +\d+ s", proc.stdout)  # the estimates, first
    # on 2 cores or more, stages 1-4 and 5-7 run side by side; their output still comes in the stages' order
    lanes = "stages 1 2 3 4 and 5 6 7 in two lanes side by side" in proc.stdout
    assert lanes == (len(os.sched_getaffinity(0)) >= 2)
    starts = [proc.stdout.index(f"== stage {n}\n") for n in range(1, 8)]
    assert starts == sorted(starts)
    table = (out / "table.md").read_text()
    assert table in proc.stdout

    # 1: bench rows; 2 sequences of 64 tokens per step. ms/step is printed rounded, so tokens/s lies between the
    # rates of the rounding interval's ends (and tokens/s itself is rounded to the token)
    bench = stages["1"]["figures"]
    assert bench["compile_on"] is None and set(bench["compile_off"]) == {"sa", "xsa"}
    rows = re.findall(r"^\| (sa|xsa) \| off \| ([\d.]+) \| ([\d,]+) \| n/a \| n/a \| ([\d.]+) \| n/a \| - \|$",
                      table, re.M)
    assert [r[0] for r in rows] == ["sa", "xsa"]
    for variant, ms, tokens_per_sec, ratio in rows:
        half_ulp = 0.5 * 10 ** -len(ms.split(".")[1])
        assert 128e3 / (float(ms) + half_ulp) - 1 <= float(tokens_per_sec.replace(",", "")) <= \
            128e3 / (float(ms) - half_ulp) + 1
        r = bench["compile_off"][variant]
        assert float(ratio) == pytest.approx(r["tokens_per_sec"] / bench["compile_off"]["sa"]["tokens_per_sec"],
                                             abs=1e-3)
    # 2
    ortho = stages["2"]["figures"]
    assert ortho["sdpa_backend"] == "flash (CPU)" and "- Stage 2: SDPA backend: flash (CPU)" in table
    assert 0 <= ortho["xsa_orthogonality_mean"] <= ortho["xsa_orthogonality_max"] < 1e-5
    # 3 and 4: one process, 2 micro-steps, the named parallelism; the resumed run logs steps 3 and 4 only,
    # with the uninterrupted run's losses (float32 on the CPU: exactly)
    for n, parallelism in (("3", "ddp"), ("4", "fsdp")):
        f = stages[n]["figures"]
        assert (f["processes"], f["micro_steps"], f["parallelism"]) == (1, 2, parallelism)
        assert f["activation_checkpointing"] == "block" and f["recompile_limit_lines"] == 0
        assert list(f["losses"]) == ["1", "2", "3", "4"] and list(f["resumed_losses"]) == ["3", "4"]
        assert all(f["resumed_losses"][s] == f["losses"][s] for s in ("3", "4"))
    memory = stages["4"]["figures"]
    assert memory["planned_peak_gb"] > 0 and memory["plan_device"] == "cpu"
    assert memory["measured_over_planned"] == pytest.approx(memory["peak_mem_gb"] / memory["planned_peak_gb"])
    assert not list((out / "stage3" / "full").glob("ckpt_*"))  # removed once judged
    # 5: Muon under both, 3 steps; 6: the document mask on the CPU is the dense mask on both sides
    muon = stages["5"]["figures"]
    assert list(muon["ddp_losses"]) == ["1", "2", "3"] and muon["max_rel_diff"] <= 1e-3
    assert "muon" in (out / "stage5" / "fsdp" / "config.json").read_text()
    document = stages["6"]["figures"]
    assert document["torchrun"]["world_size"] == 1 and document["torchrun"]["documents"] > 1
    assert document["torchrun"]["bf16"]["worst_grad_rel_flex"] == 0 and document["torchrun"]["float32"]["loss_rel"] == 0
    assert set(document["timing"]) == {"32", "64"}
    for t in document["timing"].values():
        assert t["xsa"]["document_over_causal"] == pytest.approx(t["xsa"]["document_ms"] / t["xsa"]["causal_ms"])
    # 7: every pass at both steps, each pass's seconds read off train.py's log
    in_loop = stages["7"]["figures"]
    assert list(in_loop["similarity_s"]) == list(in_loop["downstream_s"]) == ["1", "2"]
    assert in_loop["samples_at"] == [1, 2] and in_loop["recompile_limit_lines"] == 0
    assert all(0 <= avg <= 1 for avg in in_loop["downstream_avg"].values())


@pytest.mark.slow
def test_gpu_check_runs_the_stages_asked_records_a_failure_and_skips_the_tokenizer_stage_without_bpe_files(tmp_path):
    """STAGES=7,2,1 runs those alone, in order. Stage 1 fails (a config error in its bench) and is recorded; stage
    2 still runs, on a bench of its own, and passes; with TIKTOKEN_CACHE_DIR empty, stage 7 (downstream and
    samples need GPT-2's BPE files) is skipped saying why, and nothing is downloaded; the exit status is 1."""
    out, empty = tmp_path / "gpu_check", tmp_path / "no_tiktoken_files"
    empty.mkdir()
    proc, report = gpu_check(out, STAGES="7,2,1", BATCH_SIZE="0", TIKTOKEN_CACHE_DIR=str(empty))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert not report["passed"] and report["stages_run"] == [1, 2, 7] and set(report["stages"]) == {"1", "2", "7"}
    failed = report["stages"]["1"]
    assert failed["status"] == "fail" and "bench_compile_False exited 2: config error: batch_size" in failed["reason"]
    assert report["stages"]["2"]["status"] == "pass" and report["stages"]["2"]["figures"]["from"] == "stage2/bench.json"
    assert report["stages"]["7"]["status"] == "skipped" and report["stages"]["7"]["reason"].startswith("no tokenizer files")
    assert "stage 7: skipped: no tokenizer files" in proc.stdout
    assert not any((out / f"stage{n}").exists() for n in (3, 4, 5, 6)) and not list(empty.iterdir())  # offline


@pytest.mark.slow
def test_gpu_check_judges_a_stage_again_on_its_logs(dry_run, tmp_path):
    """Stage 3 judged again on its logs passes as it did; with a recompile-limit line added it fails, and so
    does a resumed loss moved past the tolerance."""
    import shutil
    out = dry_run[2]

    def judged_again(change):
        copy = tmp_path / "rejudged"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(out / "stage3", copy / "stage3")
        change(copy / "stage3")
        proc = run_script([sys.executable, out / "checks.py", "judge", "3", copy / "stage3"],
                          env=FROM_TMP_PATH)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads((copy / "stage3.json").read_text())

    assert judged_again(lambda d: None)["status"] == "pass"

    def storm(d):
        with open(d / "resumed.log", "a") as f:
            f.write("W0101 torch/_dynamo/convert_frame.py:1995] torch._dynamo hit config.recompile_limit (8)\n")
    verdict = judged_again(storm)
    assert verdict["status"] == "fail" and "resumed: torch._dynamo hit config.recompile_limit" in verdict["reason"]

    def moved(d):
        lines = (d / "resumed" / "metrics.jsonl").read_text().splitlines()
        record = json.loads(lines[-1])
        record["train_loss"] *= 1.002  # past the 1e-3 tolerance
        (d / "resumed" / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(record)]) + "\n")
    verdict = judged_again(moved)
    assert verdict["status"] == "fail" and "resumed losses differ" in verdict["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("stages", ["3,9", "0", "1,x", ","])
def test_gpu_check_refuses_unknown_stages_in_one_line(tmp_path, stages):
    proc, report = gpu_check(tmp_path / "gpu_check", STAGES=stages)
    assert proc.returncode == 2 and report is None and not (tmp_path / "gpu_check").exists()
    assert len(proc.stderr.strip().splitlines()) == 1 and "the stages are 1 to 7" in proc.stderr


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


@pytest.mark.slow
def test_bench_says_what_it_times_and_checks_in_loop_tasks_before_timing(tmp_path):
    """Without a config file it says so at once (train.py's defaults are a 124M model); with --bench_in_loop=True a
    task it cannot score ends it in one line before any variant is built or timed."""
    tasks = write_fixture_tasks(tmp_path / "tasks")
    result = run_in_process(["-m", "scripts.bench", "--device=cpu", "--compile=False", "--bench_in_loop=True",
                             f"--downstream_include_path={tasks}", "--downstream_tasks=arc_easy,hellaswg",
                             "--bench_rounds=1000000"])
    assert result.status == 2, result.output[-2000:]
    first = result.stdout.splitlines()[0]
    assert first.startswith("bench: sa, xsa at 12 x 768") and "no config file given: train.py's defaults" in first
    assert "ms/step" not in result.stdout  # nothing was timed
    assert result.stderr.strip().splitlines()[-1].startswith("config error: unknown task hellaswg")
