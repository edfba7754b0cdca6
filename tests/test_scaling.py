"""eval/scaling.py and scripts/sweep_ladder.sh: the laws fitted to synthetic ladders drawn from known laws
(runs written as train.py writes them: config.json, and metrics.jsonl by metrics.MetricsLogger), the compute
multiplier against its defining equation, the bootstrap's coverage, the errors at the edges, and the
ladder's rungs (DRY_RUN) against model.py's counts."""

import functools
import json
import math
import os
import re
import runpy
import shlex
import sys

import numpy as np
import pytest
import torch

from eval import scaling
from model import GPT, GPTConfig
from pretrain.metrics import MetricsLogger
from pretrain.runtime import PEAK_BF16_FLOPS, provenance
from pretrain.train_config import make_config, model_config, resolve
from running import REPO, run_script

HEAD_DIM = 32
DEPTHS = (1, 2, 3, 4, 5)  # width 32 x depth, heads of 32: the tiny ladder's shapes and one more
TOKENS_PER_PARAM = 2
TOTAL_BATCH_SIZE = 1024
# laws in training FLOPs C (from about 2e9 to 3e13 FLOPs on this ladder), one floor for both types
SA_LAW = scaling.Law(E=2.0, A=60.0, alpha=0.15)
CONSTANT_K = 1.35  # XSA as SA at 1.35x the compute, at every C: gamma = 0
XSA_CONSTANT = scaling.Law(E=2.0, A=60.0 * CONSTANT_K ** -0.15, alpha=0.15)
C0 = 1e11  # the growing law's k is CONSTANT_K here, and grows as C^gamma, gamma = 0.18 / 0.15 - 1 = 0.2
XSA_GROWING = scaling.Law(E=2.0, A=60.0 * (CONSTANT_K * C0) ** -0.15 * C0 ** 0.18, alpha=0.18)


@pytest.fixture(scope="module")
def run_provenance():
    return provenance()


def shape(depth):
    return dict(n_layer=depth, n_embd=32 * depth, n_head=depth, head_dim=HEAD_DIM)


def model_counts(config):
    """(N, FLOPs per token) straight from model.py, as train.py's model and meter would have them."""
    return _model_counts(json.dumps(model_config(config).__dict__, sort_keys=True), config.block_size)


@functools.lru_cache(maxsize=None)
def _model_counts(model_keys, block_size):
    with torch.device("meta"):
        model = GPT(GPTConfig(**json.loads(model_keys)))
    return model.num_params(), model.flops_per_token(block_size)


def write_run(root, attn, seed, depth, loss, run_provenance, steps_done=None, last_val=True, **overrides):
    """A finished (or, with steps_done, an interrupted) run of the given shape in root/<name>, trained on
    TOKENS_PER_PARAM tokens per parameter at the ladder's learning-rate rule (1e-3 x 32 / width); loss(N, C)
    is its final validation loss. Returns (path, N, C)."""
    name = f"{attn}_d{depth}_seed{seed}"
    path = os.path.join(root, name)
    os.makedirs(path)
    keys = dict(**shape(depth), block_size=64, batch_size=16, total_batch_size=TOTAL_BATCH_SIZE,
                learning_rate=1e-3 * 32 / shape(depth)["n_embd"])
    keys.update(overrides)
    n, flops_per_token = model_counts(make_config(**keys))
    max_iters = math.ceil(TOKENS_PER_PARAM * n / keys["total_batch_size"])
    config = make_config(**keys, max_iters=max_iters, attn_type=attn, seed=seed, out_dir=path, wandb_run_name=name)
    with open(os.path.join(path, "config.json"), "w") as f:  # as train.py's record_run writes it
        json.dump({"config": config.to_dict(), "provenance": run_provenance}, f, indent=2)
    compute = flops_per_token * max_iters * keys["total_batch_size"]
    log = MetricsLogger(path)
    last = steps_done or max_iters
    middle = max(1, last // 2)
    for step in sorted({1, middle, last}):
        record = {"step": step, "train_loss": loss(n, compute) + 1.0 / step, "lr": 1e-3,
                  "tokens": step * keys["total_batch_size"]}
        if step == last:
            if last_val:
                record["val_loss"] = loss(n, compute)
        elif step == middle:  # an earlier evaluation, which the fit must not take for the final one
            record["val_loss"] = loss(n, compute) + 0.5
        log.log(record)
    return path, n, compute


def write_ladder(root, laws, seeds, run_provenance, depths=DEPTHS, noise=0.001, rng_seed=0, **overrides):
    """SA and XSA runs at every depth and seed, each final loss from its attention type's law in C plus
    Gaussian noise per run. Returns {(attn, depth, seed): (path, N, C)}."""
    rng = np.random.default_rng(rng_seed)
    runs = {}
    for seed in seeds:
        for depth in depths:
            for attn in ("sa", "xsa"):
                jitter = rng.normal(0.0, noise)
                law = laws[attn]
                runs[attn, depth, seed] = write_run(root, attn, seed, depth, lambda n, c: float(law(c)) + jitter,
                                                    run_provenance, **overrides)
    return runs


def run_main(capsys, *args):
    """eval.scaling's main in this process: (exit status, stdout, stderr)."""
    try:
        scaling.main([str(a) for a in args])
        status = 0
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def fit(tmp_path, capsys, laws, seeds, run_provenance, **kwargs):
    """Write a ladder and fit it: (scaling.json as a dict, scaling.md, stdout, the runs)."""
    runs = write_ladder(tmp_path / "runs", laws, seeds, run_provenance, **kwargs)
    status, out, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 0, err
    return (json.loads((tmp_path / "fit" / "scaling.json").read_text()), (tmp_path / "fit" / "scaling.md").read_text(),
            out, runs)


@functools.lru_cache(maxsize=None)
def paper_counts():
    """{label: (N, FLOPs per token)} of the paper's three SA configs."""
    counts = {}
    for label, size in (("0.7B", "0p7b"), ("1.4B", "1p4b"), ("2.7B", "2p7b")):
        config, _ = resolve([f"config/sa_{size}.py"])
        counts[label] = model_counts(config)
    return counts


# -----------------------------------------------------------------------------
# the fit


def test_the_shared_floor_fit_recovers_E_both_alphas_k_and_gamma_on_each_axis():
    """Points on two laws with one floor, in N and in C = 12 N^2 (so alpha in C is half alpha in N)."""
    sizes = np.geomspace(1e4, 3e6, 6)
    for sa, xsa in ((SA_LAW, XSA_CONSTANT), (SA_LAW, XSA_GROWING)):
        fitted_sa, fitted_xsa = scaling.fit_shared_floor(sizes, sa(sizes), sizes, xsa(sizes))
        for fitted, law in ((fitted_sa, sa), (fitted_xsa, xsa)):
            assert fitted.E == pytest.approx(law.E, abs=1e-4)
            assert fitted.alpha == pytest.approx(law.alpha, rel=1e-3)
            assert fitted.A == pytest.approx(law.A, rel=1e-2)
        assert scaling.growth(fitted_xsa, fitted_sa) == pytest.approx(scaling.growth(xsa, sa), abs=1e-3)
        for compute in (1e8, 1e12, 1e20):
            assert scaling.multiplier(compute, fitted_xsa, fitted_sa) == pytest.approx(
                scaling.multiplier(compute, xsa, sa), rel=1e-2)
    # the closed form: log k = (log A_SA - log A_XSA) / alpha_SA + gamma log C
    for compute in (1e9, 1e15, 1e21):
        closed = ((math.log(SA_LAW.A) - math.log(XSA_GROWING.A)) / SA_LAW.alpha
                  + scaling.growth(XSA_GROWING, SA_LAW) * math.log(compute))
        assert scaling.log_multiplier(compute, XSA_GROWING, SA_LAW) == pytest.approx(closed, rel=1e-9)


@pytest.mark.slow  # the whole command, plot included
def test_a_constant_multiplier_is_recovered_at_every_rung_and_at_the_paper_sizes(
        tmp_path, capsys, monkeypatch, run_provenance):
    monkeypatch.chdir(REPO)  # the paper's config files are read from the repo root, as with python -m
    report, table, out, runs = fit(tmp_path, capsys, {"sa": SA_LAW, "xsa": XSA_CONSTANT}, (1, 2, 3), run_provenance)
    entries = report["multiplier"]["per_rung"] + list(report["multiplier"]["extrapolated"].values())
    assert len(entries) == len(DEPTHS) + 3
    for k in entries:
        assert k["value"] == pytest.approx(CONSTANT_K, rel=0.10)
    g = report["growth"]
    assert g["ci"][0] <= 0 <= g["ci"][1] and g["spans_zero"]
    assert "includes 0: a compute multiplier that stays constant with scale" in table
    assert report["floor"]["shared"] and report["floor"]["compute"]["value"] == pytest.approx(SA_LAW.E, abs=0.02)
    for attn in ("sa", "xsa"):
        assert report[attn]["E"]["value"] == report["floor"]["value"]  # one floor, quoted for both
        assert report[attn]["compute"]["alpha"]["value"] == pytest.approx(0.15, abs=0.01)
    assert report["intervals"]["method"] == "t over seeds" and report["intervals"]["seeds"] == [1, 2, 3]
    assert report["intervals"]["left_out_seeds"] == []
    # the rungs are inside the ladder, the paper's sizes (1e18 FLOPs and more) beyond it, and marked so; at the
    # top rung SA needs 1.35x the ladder's largest compute for XSA's loss: that k is extrapolated too
    assert not any(e["beyond_ladder"] for e in report["gap"]["per_rung"])
    top_compute = max(c for _, _, c in runs.values())
    for k in report["multiplier"]["per_rung"]:
        assert k["beyond_ladder"] == (k["value"] * k["C"] > top_compute * (1 + 1e-9))
    assert report["multiplier"]["per_rung"][-1]["beyond_ladder"]
    for label in ("0.7B", "1.4B", "2.7B"):
        assert report["gap"]["extrapolated"][label]["beyond_ladder"]
        assert report["multiplier"]["extrapolated"][label]["beyond_ladder"]
        assert next(line for line in table.splitlines() if line.startswith(f"| {label} |")).count("†") == 2
    assert "lie beyond the ladder (marked †)" in table and "tokens per parameter" in table

    # each run counted as model.py counts it, every run's loss in the table, the paper's sizes as model.py has them
    by_path = {r["path"]: r for r in report["runs"]}
    for path, n, compute in runs.values():
        assert by_path[path]["N"] == n and by_path[path]["C"] == pytest.approx(compute, rel=1e-12)
        row = next(line for line in table.splitlines() if line.startswith(f"| {scaling.format_count(n)} |"))
        assert f"{by_path[path]['val_loss']:.4f}" in row and "| 1, 2, 3 |" in row
    for label, (n, flops_per_token) in paper_counts().items():
        entry = report["multiplier"]["extrapolated"][label]
        assert entry["N"] == n
        assert entry["C"] == pytest.approx(flops_per_token * n * report["tokens_per_param"], rel=1e-9)
    assert table in out
    assert (tmp_path / "fit" / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in os.listdir(tmp_path / "fit") if ".tmp" in f]  # written atomically


@pytest.mark.slow  # the whole command, plot included
def test_a_growing_multiplier_gives_a_growth_interval_above_zero_around_the_truth(tmp_path, capsys, run_provenance):
    report, table, _, _ = fit(tmp_path, capsys, {"sa": SA_LAW, "xsa": XSA_GROWING}, (1, 2, 3), run_provenance)
    true_gamma = scaling.growth(XSA_GROWING, SA_LAW)
    low, high = report["growth"]["ci"]
    assert 0 < low <= true_gamma <= high and not report["growth"]["spans_zero"]
    assert "excludes 0: XSA's compute multiplier grows with compute" in table
    for k in report["multiplier"]["per_rung"]:
        assert k["value"] == pytest.approx(scaling.multiplier(k["C"], XSA_GROWING, SA_LAW), rel=0.10)
        assert k["ci"][0] <= scaling.multiplier(k["C"], XSA_GROWING, SA_LAW) <= k["ci"][1]
    # the loss gap of these laws: XSA's lead widens with size along the ladder, and the slope says so
    slope = report["gap_trend"]
    assert slope["ci"][1] < 0 and "XSA's lead in loss widens with size" in table


@pytest.mark.slow  # the whole command, plot included
def test_the_loss_gap_and_the_multiplier_pointing_different_ways_is_said(tmp_path, capsys, run_provenance):
    """A multiplier that grows slowly (gamma = 0.02) beside a loss gap that narrows with size, as one floor
    makes it: both verdicts are printed and the disagreement is named."""
    sa = scaling.Law(E=2.0, A=60.0, alpha=0.15)
    xsa = scaling.Law(E=2.0, A=60.0 * (2.0 * C0) ** -0.15 * C0 ** 0.153, alpha=0.153)
    report, table, _, _ = fit(tmp_path, capsys, {"sa": sa, "xsa": xsa}, (1, 2, 3), run_provenance, noise=0.0002)
    assert report["growth"]["ci"][0] > 0 and report["gap_trend"]["ci"][0] > 0
    assert "The two point different ways" in table


@pytest.mark.slow  # the whole command, plot included
def test_one_seed_gives_no_interval_and_two_seeds_give_one(tmp_path, capsys, run_provenance):
    """3 sizes and one seed: no interval at all (a bootstrap over 3 points gave zero-width ones); 2 seeds:
    intervals of positive width, and the note on 1 degree of freedom."""
    laws = {"sa": SA_LAW, "xsa": XSA_CONSTANT}
    report, table, _, _ = fit(tmp_path / "one", capsys, laws, (1,), run_provenance, depths=(1, 2, 3), noise=0.01)
    assert report["intervals"]["method"] == "none: one seed" and report["intervals"]["coverage"] is None
    estimates = [report["floor"], report["growth"], report["gap_trend"], report["sa"]["alpha"], report["xsa"]["E"]]
    estimates += report["gap"]["per_rung"] + report["multiplier"]["per_rung"]
    estimates += list(report["gap"]["extrapolated"].values())
    assert all(e["ci"] is None for e in estimates)
    assert 'One seed: no interval; SEEDS="1 2 3" gives one' in table

    report, table, _, _ = fit(tmp_path / "two", capsys, laws, (1, 2), run_provenance, depths=(1, 2, 3), noise=0.01)
    assert report["intervals"]["method"] == "t over seeds" and report["intervals"]["seeds"] == [1, 2]
    for e in (report["growth"], report["floor"], *report["gap"]["per_rung"]):
        assert e["ci"][0] < e["ci"][1]
        assert e["ci"][0] <= e["value"] <= e["ci"][1] or e is report["floor"]
    assert "Two seeds: the t interval has 1 degree of freedom" in table
    assert report["intervals"]["coverage"] is not None and report["intervals"]["coverage"] >= 0.9


@pytest.mark.slow  # the whole command, plot included
def test_seeds_missing_a_size_are_left_out_of_the_fit_and_named(tmp_path, capsys, run_provenance):
    """Mid-sweep: seeds 1 and 2 have the whole ladder, seed 3 only its lower rungs."""
    laws = {"sa": SA_LAW, "xsa": XSA_CONSTANT}
    write_ladder(tmp_path / "runs", laws, (1, 2), run_provenance, depths=(1, 2, 3, 4))
    write_ladder(tmp_path / "runs", laws, (3,), run_provenance, depths=(1, 2), rng_seed=1)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 0, err
    report = json.loads((tmp_path / "fit" / "scaling.json").read_text())
    assert report["intervals"]["seeds"] == [1, 2] and report["intervals"]["left_out_seeds"] == [3]
    assert {r["seed"] for r in report["runs"]} == {1, 2}
    assert "seed 3 lacks finished SA and XSA runs at N = " in err
    assert "Seed 3 is left out" in (tmp_path / "fit" / "scaling.md").read_text()


@pytest.mark.parametrize("losses", ["flat", "rising"])
def test_a_ladder_whose_loss_does_not_fall_identifies_no_law(tmp_path, capsys, run_provenance, losses):
    flat = scaling.Law(E=3.0, A=0.0, alpha=0.2)
    rising = scaling.Law(E=0.0, A=3.0, alpha=-0.05)
    law = flat if losses == "flat" else rising
    noise = 0.0 if losses == "flat" else 0.001
    write_ladder(tmp_path / "runs", {"sa": law, "xsa": law}, (1, 2), run_provenance, noise=noise)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 3
    assert len(err.strip().splitlines()) == 1 and err.startswith("no law is identified")
    assert not os.path.exists(tmp_path / "fit" / "scaling.json")


@pytest.mark.slow  # the whole command, plot included
def test_separate_floors_say_that_k_beyond_the_ladder_is_not_identified(tmp_path, capsys, run_provenance):
    write_ladder(tmp_path / "runs", {"sa": SA_LAW, "xsa": XSA_CONSTANT}, (1, 2), run_provenance)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit", "--separate_floors")
    assert status == 0, err
    report = json.loads((tmp_path / "fit" / "scaling.json").read_text())
    assert not report["floor"]["shared"] and report["floor"]["value"] is None
    assert report["sa"]["E"]["value"] != report["xsa"]["E"]["value"]
    assert "k beyond the ladder is not identified" in (tmp_path / "fit" / "scaling.md").read_text()


def test_multiplier_solves_its_defining_equation_for_two_known_laws():
    # 1. same E and alpha, XSA's coefficient r times SA's: SA needs r^(-1/alpha) times the compute, at any C
    sa, xsa = scaling.Law(E=1.8, A=400.0, alpha=0.2), scaling.Law(E=1.8, A=0.8 * 400.0, alpha=0.2)
    for compute in (1e15, 1e18, 1e21):
        assert scaling.multiplier(compute, xsa, sa) == pytest.approx(0.8 ** (-1 / 0.2), rel=1e-9)
    # 2. unrelated laws (separate floors): k solves L_SA(k C) = L_XSA(C), found here by root finding in log k
    from scipy.optimize import brentq
    sa, xsa = scaling.Law(E=2.0, A=180.0, alpha=0.16), scaling.Law(E=1.9, A=150.0, alpha=0.14)
    for compute in (1e16, 1e19, 1e21):
        k = scaling.multiplier(compute, xsa, sa)
        root = brentq(lambda log_k: float(sa(compute * math.exp(log_k)) - xsa(compute)), -50.0, 50.0)
        assert k == pytest.approx(math.exp(root), rel=1e-8)
        assert float(sa(k * compute)) == pytest.approx(float(xsa(compute)), rel=1e-10)
    # 3. XSA below SA's floor: no SA compute matches it, k is infinite, not a number
    low = scaling.Law(E=1.0, A=1.0, alpha=0.5)
    assert float(low(1e12)) < sa.E
    assert scaling.log_multiplier(1e12, low, sa) == math.inf and scaling.multiplier(1e12, low, sa) == math.inf


# -----------------------------------------------------------------------------
# coverage


@pytest.mark.slow
def test_the_intervals_cover_the_truth_at_their_nominal_rate():
    """The calibration's own cells, smaller: 100 ladders of 3 seeds at 4 sizes, noise 0.02 half shared by a
    seed's SA and XSA runs; every interval the report prints covers the truth in 85% to 100% of them."""
    rng = np.random.default_rng(3)
    result = scaling.calibration_cell("growing k", 4, 3, 0.02, 0.5, 100, rng)
    for quantity, (coverage, width, fitted) in result.items():
        assert fitted == 100
        assert 0.85 <= coverage <= 1.0, (quantity, coverage)
        assert width > 0


def test_the_calibration_truths_have_the_gamma_and_k_they_are_named_for():
    for name, gamma in (("constant k", 0.0), ("growing k", 0.1)):
        sa, xsa = scaling.calibration_laws(name)
        assert scaling.growth(xsa, sa) == pytest.approx(gamma, abs=1e-12)
        assert scaling.multiplier(1e19, xsa, sa) == pytest.approx(1.35, rel=1e-9)


def test_the_shipped_coverage_table_holds_every_interval_within_the_bar():
    """eval/scaling_coverage.json, the calibration the report quotes: >= 200 ladders a cell, every measured
    coverage of a printed interval between 90% and 99%, and no interval claimed at one seed."""
    with open(scaling.COVERAGE_FILE) as f:
        table = json.load(f)
    assert table["ladders_per_cell"] >= 200
    assert {(c["seeds"], c["sizes"]) for c in table["cells"]} == {(s, n) for s in (1, 2, 3, 5) for n in (4, 7)}
    for cell in table["cells"]:
        for quantity, coverage in cell["coverage"].items():
            if cell["seeds"] == 1:
                assert coverage is None
            else:
                assert 0.90 <= coverage <= 0.99, (cell["truth"], cell["sigma"], cell["sizes"], cell["seeds"], quantity)


# -----------------------------------------------------------------------------
# the edges


def test_too_few_sizes_is_not_identified(tmp_path, capsys, run_provenance):
    write_ladder(tmp_path / "runs", {"sa": SA_LAW, "xsa": XSA_CONSTANT}, (1, 2), run_provenance, depths=(1, 2))
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 3
    assert len(err.strip().splitlines()) == 1 and "not identified" in err and "2 size(s)" in err
    assert not os.path.exists(tmp_path / "fit" / "scaling.json")


@pytest.mark.slow  # the whole command, plot included
def test_unfinished_runs_are_named_and_left_out(tmp_path, capsys, monkeypatch, run_provenance):
    """Two seeds, SA and XSA drawn from one law: the unfinished runs are named and not fitted (their seed
    then lacks sizes and is left out as a whole), and the output says where the gap's interval spans zero."""
    monkeypatch.chdir(REPO)
    same = {"sa": SA_LAW, "xsa": SA_LAW}
    runs = write_ladder(tmp_path / "runs", same, (1, 2), run_provenance, depths=(1, 2, 3, 4), noise=0.01)
    stopped, _, _ = write_run(tmp_path / "runs", "sa", 3, 3, lambda n, c: 9.0, run_provenance, steps_done=7)
    no_val, _, _ = write_run(tmp_path / "runs", "xsa", 3, 4, lambda n, c: 9.0, run_provenance, last_val=False)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 0, err
    assert f"{stopped}: unfinished: its last step is 7 of max_iters" in err
    assert f"{no_val}: unfinished: no finite validation loss at its last step" in err
    report = json.loads((tmp_path / "fit" / "scaling.json").read_text())
    assert {r["path"] for r in report["runs"]} == {path for path, _, _ in runs.values()}
    assert {stopped, no_val} <= {r["path"] for r in report["left_out"]}
    table = (tmp_path / "fit" / "scaling.md").read_text()
    assert stopped in table and no_val in table

    spanning = [g for g in report["gap"]["per_rung"] if g["ci_spans_zero"]]
    assert spanning  # one law for both: the gap's sign is not settled
    for gap in report["gap"]["per_rung"]:
        said = f"At N = {scaling.format_count(gap['N'])}, ΔL's interval spans zero" in table
        assert said == gap["ci_spans_zero"]
    for k in report["multiplier"]["per_rung"]:
        said = f"At N = {scaling.format_count(k['N'])}, k's interval includes 1" in table
        assert said == (k["log_ci_spans_zero"] and not k["infinite"])


@pytest.mark.parametrize("stray", [{"block_size": 128}, {"learning_rate": 5e-3}, {"total_batch_size": 2048},
                                   {"tokens": 20}])
def test_runs_of_another_setting_are_not_pooled_as_seeds(tmp_path, capsys, run_provenance, stray):
    """A 4-rung ladder plus runs at one of its sizes trained another way: refused in one line naming how."""
    laws = {"sa": SA_LAW, "xsa": XSA_CONSTANT}
    write_ladder(tmp_path / "runs", laws, (1, 2), run_provenance, depths=(1, 2, 3, 4))
    if "tokens" in stray:
        global TOKENS_PER_PARAM
        saved, TOKENS_PER_PARAM = TOKENS_PER_PARAM, stray["tokens"]
        try:
            write_ladder(tmp_path / "runs", laws, (3,), run_provenance, depths=(1, 2, 3, 4))
        finally:
            TOKENS_PER_PARAM = saved
    else:
        write_ladder(tmp_path / "runs", laws, (3,), run_provenance, depths=(1, 2, 3, 4), **stray)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 3
    assert len(err.strip().splitlines()) == 1 and err.startswith("these runs are not one ladder")
    key = next(iter(stray))
    assert {"learning_rate": "learning_rate x n_embd", "tokens": "tokens per parameter"}.get(key, key) in err
    assert not os.path.exists(tmp_path / "fit" / "scaling.json")


def test_a_missing_path_is_an_error(tmp_path, capsys, run_provenance):
    write_ladder(tmp_path / "runs", {"sa": SA_LAW, "xsa": XSA_CONSTANT}, (1, 2), run_provenance)
    status, _, err = run_main(capsys, tmp_path / "runs", tmp_path / "typo", "--out", tmp_path / "fit")
    assert status in (2, 3) and str(tmp_path / "typo") in err
    assert not os.path.exists(tmp_path / "fit" / "scaling.json")


def test_runs_as_a_module_from_the_repo_root_and_hints_at_it_when_run_as_a_file(tmp_path, capsys, monkeypatch):
    """`python -m eval.scaling` (as the ladder runs it), here in this process; `python eval/scaling.py` gives
    the -m form instead of an ImportError."""
    os.makedirs(tmp_path / "empty")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["eval/scaling.py", str(tmp_path / "empty"), "--out", str(tmp_path / "fit")])
    monkeypatch.delitem(sys.modules, "eval.scaling")  # run afresh as __main__, as python -m does
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("eval.scaling", run_name="__main__", alter_sys=True)
    assert stopped.value.code == 3  # its imports resolved: it got as far as looking for runs
    err = capsys.readouterr().err
    assert err.strip() == f"no run directories (with metrics.jsonl and config.json) in {tmp_path / 'empty'}"
    proc = run_script(["python", "eval/scaling.py", tmp_path / "empty"])
    assert proc.returncode == 2 and "python -m eval.scaling" in proc.stderr


# -----------------------------------------------------------------------------
# the ladder


def dry_run_ladder(tmp_path, **env):
    """The rungs sweep_ladder.sh lists ([{key: value}]) and the train.py commands it would run."""
    keep = {k: v for k, v in os.environ.items()
            if k not in ("SIZES", "DEPTHS", "TOKENS_PER_PARAM", "SEEDS", "GPUS", "NPROC", "INPUT", "DATA_DIR")}
    proc = run_script([os.path.join(REPO, "scripts", "sweep_ladder.sh")], cwd="/",
                      env={**keep, "DRY_RUN": "1", "NPROC": "1", "OUT_ROOT": str(tmp_path),
                           "DATA_DIR": str(tmp_path / "shards"), **env}, preloaded=True)
    assert proc.returncode == 0, proc.stderr
    rungs = [dict(word.split("=", 1) for word in line.split()[2:]) for line in proc.stdout.splitlines()
             if line.startswith("# rung ")]
    commands = []
    for line in proc.stdout.splitlines():
        words = shlex.split(line) if "train.py" in line and not line.startswith("#") else []
        if words:
            at = words.index("train.py")
            commands.append((words[at + 1], dict(w[2:].split("=", 1) for w in words[at + 2:])))
    return rungs, commands, proc.stdout


def resolved_value(config_file, key):
    """A key of a config file as train.py resolves it (helpers.config_value executes the file instead)."""
    config, _ = resolve([config_file])
    return getattr(config, key)


@pytest.mark.slow
@pytest.mark.parametrize("sizes,env,head_dim_from", [
    ("tiny", {"TOKENS_PER_PARAM": "3", "SEEDS": "1 2"}, "config/sa_tiny.py"),
    ("paper", {}, "config/sa_1p4b.py"),  # the paper's head_dim at 1.4B and 2.7B; its 0.7B has heads of 256
])
def test_ladder_rungs_grow_in_depth_and_width_with_model_py_counts(tmp_path, monkeypatch, sizes, env, head_dim_from):
    monkeypatch.chdir(REPO)
    rungs, commands, out = dry_run_ladder(tmp_path, SIZES=sizes, **env)
    tokens_per_param = float(env.get("TOKENS_PER_PARAM", 20))  # Chinchilla's, the paper ladder's default
    seeds = env.get("SEEDS", "1").split()
    assert len(rungs) >= 4
    head_dim = resolved_value(head_dim_from, "head_dim")
    for smaller, larger in zip(rungs, rungs[1:]):  # the paper's 0.7B and 1.4B share depth 24
        assert int(larger["n_layer"]) >= int(smaller["n_layer"]) and int(larger["n_embd"]) > int(smaller["n_embd"])
        assert int(larger["params"]) > int(smaller["params"])
    total_flops = total_hours = 0.0  # of every run: SA and XSA, each seed
    for rung in rungs:
        base = f"config/sa_{rung['config']}.py"
        if rung["name"].startswith("d"):  # a rung by the rule
            assert int(rung["head_dim"]) == head_dim and int(rung["n_layer"]) == int(rung["name"][1:])
            assert int(rung["n_head"]) == math.ceil(int(rung["n_embd"]) / head_dim)
        else:  # one of the paper's models, exactly as its config has it
            assert rung["name"] == rung["config"]
            for key in ("n_layer", "n_embd", "n_head", "head_dim", "learning_rate"):
                assert float(rung[key if key != "learning_rate" else "lr"]) == float(resolved_value(base, key))
        config, _ = resolve([base] + [f"--{k}={rung[k]}" for k in ("n_layer", "n_embd", "n_head", "head_dim")])
        n, flops_per_token = model_counts(config)
        assert int(rung["params"]) == n
        tokens = int(rung["tokens"])
        assert tokens == int(rung["steps"]) * config.total_batch_size
        assert tokens_per_param * n <= tokens < tokens_per_param * n + config.total_batch_size
        assert float(rung["flops"]) == pytest.approx(flops_per_token * tokens, rel=1e-3)
        assert float(rung["gpu_hours"]) == pytest.approx(float(rung["flops"]) / (0.4 * PEAK_BF16_FLOPS["H100"]) / 3600,
                                                         rel=1e-3)
        total_flops += 2 * len(seeds) * float(rung["flops"])
        total_hours += 2 * len(seeds) * float(rung["gpu_hours"])
        # one SA and one XSA run per seed, trained as listed, in a wandb group per attention type
        runs = [(c, o) for c, o in commands if o["out_dir"].rsplit("_seed", 1)[0].endswith(f"_{rung['name']}")]
        assert sorted((c, o["seed"]) for c, o in runs) == sorted(
            (f"config/{attn}_{rung['config']}.py", s) for attn in ("sa", "xsa") for s in seeds)
        for config_file, o in runs:
            attn = os.path.basename(config_file).split("_")[0]
            assert o["max_iters"] == rung["steps"] and float(o["learning_rate"]) == float(rung["lr"])
            assert all(o[k] == rung[k] for k in ("n_layer", "n_embd", "n_head", "head_dim"))
            assert o["wandb_group"] == f"sweep_ladder_{sizes}_{attn}"
            assert o["out_dir"] == f"{tmp_path}/sweep_ladder/{attn}_{sizes}_{rung['name']}_seed{o['seed']}"
    assert len(commands) == 2 * len(seeds) * len(rungs)
    in_all = re.search(rf"^# ladder {sizes} in all: (\S+) FLOPs, (\S+) GPU-hours", out, re.M)
    assert float(in_all[1]) == pytest.approx(total_flops, rel=1e-2)
    assert float(in_all[2]) == pytest.approx(total_hours, rel=1e-2)
    assert "-m eval.scaling" in out  # and the fit, once the runs are done
    if sizes == "paper":  # the paper's three models are rungs of the ladder, at its largest sizes
        assert [int(r["params"]) for r in rungs[-3:]] == [n for n, _ in paper_counts().values()]
        assert [r["name"] for r in rungs[-3:]] == ["0p7b", "1p4b", "2p7b"]
    anchor = {"tiny": "config/sa_tiny.py", "paper": "config/sa_0p7b.py"}[sizes]
    for rung in rungs:  # the learning rate falls as 1 / width, through the anchor config's, on the rule's rungs
        if rung["name"].startswith("d"):
            expected = resolved_value(anchor, "learning_rate") * resolved_value(anchor, "n_embd") / int(rung["n_embd"])
            assert float(rung["lr"]) == pytest.approx(expected, rel=5e-3)


@pytest.mark.slow
def test_ladder_settings_are_read_as_written(tmp_path):
    """TOKENS_PER_PARAM in scientific notation is a number; DEPTHS of blanks is no ladder, refused in one line
    before anything runs (it planned an empty rung and failed on config/sa_.py)."""
    rungs, _, _ = dry_run_ladder(tmp_path, SIZES="tiny", TOKENS_PER_PARAM="1e3", DEPTHS="1 2")
    assert [int(r["tokens"]) >= 1000 * int(r["params"]) for r in rungs] == [True, True]
    keep = {k: v for k, v in os.environ.items() if k not in ("DEPTHS", "SEEDS", "TOKENS_PER_PARAM")}
    proc = run_script([os.path.join(REPO, "scripts", "sweep_ladder.sh")], cwd="/",
                      env={**keep, "DRY_RUN": "1", "SIZES": "tiny", "DEPTHS": "   ", "OUT_ROOT": str(tmp_path),
                           "DATA_DIR": str(tmp_path / "shards")}, preloaded=True)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: DEPTHS='   ': the ladder has no rungs"
