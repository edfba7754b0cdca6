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
from scipy.optimize import brentq

from conftest import REPO, run_script
from eval import scaling
from eval.compare import find_runs
from model import GPT
from pretrain.metrics import MetricsLogger
from pretrain.runtime import PEAK_BF16_FLOPS, provenance
from pretrain.train_config import make_config, model_config, resolve

HEAD_DIM = 32
DEPTHS = (1, 2, 3, 4, 5)  # width 32 x depth, heads of 32: the tiny ladder's shapes and one more
TOKENS_PER_PARAM = 2
TOTAL_BATCH_SIZE = 1024
SA_N_LAW = scaling.Law(E=2.0, A=60.0, alpha=0.3)
XSA_N_LAW = scaling.Law(E=1.9, A=58.0, alpha=0.32)


@pytest.fixture(scope="module")
def run_provenance():
    return provenance()


def shape(depth):
    return dict(n_layer=depth, n_embd=32 * depth, n_head=depth, head_dim=HEAD_DIM)


def model_counts(config):
    """(N, FLOPs per token) straight from model.py, as train.py's model and meter would have them."""
    with torch.device("meta"):
        model = GPT(model_config(config))
    return model.num_params(), model.flops_per_token(config.block_size)


def write_run(root, attn, seed, depth, loss, run_provenance, steps_done=None, last_val=True):
    """A finished (or, with steps_done, an interrupted) run of the given shape in root/<name>, trained on
    TOKENS_PER_PARAM tokens per parameter; loss(N, C) is its final validation loss. Returns (path, N, C)."""
    name = f"{attn}_d{depth}_seed{seed}"
    path = os.path.join(root, name)
    os.makedirs(path)
    probe = make_config(**shape(depth), block_size=64, batch_size=16, total_batch_size=TOTAL_BATCH_SIZE)
    n, flops_per_token = model_counts(probe)
    max_iters = math.ceil(TOKENS_PER_PARAM * n / TOTAL_BATCH_SIZE)
    config = make_config(**shape(depth), block_size=64, batch_size=16, total_batch_size=TOTAL_BATCH_SIZE,
                         max_iters=max_iters, attn_type=attn, seed=seed, out_dir=path, wandb_run_name=name)
    with open(os.path.join(path, "config.json"), "w") as f:  # as train.py's record_run writes it
        json.dump({"config": config.to_dict(), "provenance": run_provenance}, f, indent=2)
    compute = flops_per_token * max_iters * TOTAL_BATCH_SIZE
    log = MetricsLogger(path)
    last = steps_done or max_iters
    middle = max(1, last // 2)
    for step in sorted({1, middle, last}):
        record = {"step": step, "train_loss": loss(n, compute) + 1.0 / step, "lr": 1e-3,
                  "tokens": step * TOTAL_BATCH_SIZE}
        if step == last:
            if last_val:
                record["val_loss"] = loss(n, compute)
        elif step == middle:  # an earlier evaluation, which the fit must not take for the final one
            record["val_loss"] = loss(n, compute) + 0.5
        log.log(record)
    return path, n, compute


def write_ladder(root, laws, seeds, run_provenance, depths=DEPTHS, noise=0.003, on="N", rng_seed=0):
    """SA and XSA runs at every depth and seed, each final loss from its attention type's law (in N, or in
    C with on="C") plus Gaussian noise. Returns {(attn, depth, seed): (path, N, C)}."""
    rng = np.random.default_rng(rng_seed)
    runs = {}
    for seed in seeds:
        for depth in depths:
            for attn in ("sa", "xsa"):
                jitter = rng.normal(0.0, noise)
                law = laws[attn]
                runs[attn, depth, seed] = write_run(
                    root, attn, seed, depth, lambda n, c: float(law(n if on == "N" else c)) + jitter, run_provenance)
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


def test_fit_recovers_the_laws_and_reports_both_with_the_seeds_and_the_paper_sizes(tmp_path, capsys, monkeypatch,
                                                                                   run_provenance):
    monkeypatch.chdir(REPO)  # the paper's config files are read from the repo root, as with python -m
    runs = write_ladder(tmp_path / "runs", {"sa": SA_N_LAW, "xsa": XSA_N_LAW}, (1, 2, 3), run_provenance)
    status, out, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit", "--draws", 100)
    assert status == 0, err
    report = json.loads((tmp_path / "fit" / "scaling.json").read_text())

    for attn, law in (("sa", SA_N_LAW), ("xsa", XSA_N_LAW)):
        fitted = report[attn]
        assert fitted["alpha"]["value"] == pytest.approx(law.alpha, abs=0.03)
        assert fitted["E"]["value"] == pytest.approx(law.E, abs=0.05)
        for name in ("E", "A", "alpha"):
            low, high = fitted[name]["ci"]
            assert low <= fitted[name]["value"] <= high
        assert fitted["alpha"]["ci"][0] <= law.alpha <= fitted["alpha"]["ci"][1]
        assert set(fitted["compute"]) == {"E", "A", "alpha"}
    # the gap at each size: the difference of the two true laws there
    sizes = sorted({n for _, n, _ in runs.values()})
    assert [g["N"] for g in report["gap"]["per_rung"]] == sizes
    for gap in report["gap"]["per_rung"]:
        assert gap["value"] == pytest.approx(float(XSA_N_LAW(gap["N"]) - SA_N_LAW(gap["N"])), abs=0.01)
    assert [k["N"] for k in report["multiplier"]["per_rung"]] == sizes

    # each run counted as model.py counts it; three seeds: the bootstrap resamples seeds
    by_path = {r["path"]: r for r in report["runs"]}
    for path, n, compute in runs.values():
        assert by_path[path]["N"] == n and by_path[path]["C"] == pytest.approx(compute, rel=1e-12)
    assert report["bootstrap"]["over"] == "seeds" and report["bootstrap"]["seeds"] == [1, 2, 3]
    assert report["tokens_per_param"] == pytest.approx(TOKENS_PER_PARAM, rel=0.05)

    # the paper's sizes: N as model.py counts the paper configs, C at the ladder's tokens per parameter
    paper = paper_counts()
    for label, (n, flops_per_token) in paper.items():
        for entry in (report["gap"]["extrapolated"][label], report["multiplier"]["extrapolated"][label]):
            assert entry["N"] == n
            assert entry["C"] == pytest.approx(flops_per_token * n * report["tokens_per_param"], rel=1e-9)
        assert report["gap"]["extrapolated"][label]["value"] == pytest.approx(
            float(XSA_N_LAW(n) - SA_N_LAW(n)), abs=0.05)
    # at 2.7B XSA's true loss is below SA's true floor: no SA compute reaches it, and the report says so
    assert float(XSA_N_LAW(paper["2.7B"][0])) < SA_N_LAW.E
    top = report["multiplier"]["extrapolated"]["2.7B"]
    assert top["infinite"] and top["value"] is None

    # the table: every size with its seeds' losses, both laws, the paper's three sizes
    table = (tmp_path / "fit" / "scaling.md").read_text()
    assert table in out
    for path, n, _ in runs.values():
        row = next(line for line in table.splitlines() if line.startswith(f"| {scaling.format_count(n)} |"))
        assert f"{by_path[path]['val_loss']:.4f}" in row and "| 1, 2, 3 |" in row
    assert sum(line.startswith(("| SA |", "| XSA |")) for line in table.splitlines()) == 4
    assert all(f"| {label} |" in table for label in ("0.7B", "1.4B", "2.7B"))
    for label, k in report["multiplier"]["extrapolated"].items():
        assert (f"At the paper's {label} (extrapolated), k is infinite" in table) == k["infinite"]
    assert (tmp_path / "fit" / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in os.listdir(tmp_path / "fit") if ".tmp" in f]  # written atomically


def test_fit_recovers_the_compute_laws_and_the_multiplier(tmp_path, run_provenance):
    """Losses drawn from laws in C where XSA's coefficient is r times SA's: k = r^(-1/alpha) at every C."""
    r, alpha = 0.9, 0.15
    sa = scaling.Law(E=2.0, A=300.0, alpha=alpha)
    xsa = scaling.Law(E=2.0, A=r * 300.0, alpha=alpha)
    write_ladder(tmp_path, {"sa": sa, "xsa": xsa}, (1, 2), run_provenance, noise=0.001, on="C")
    points, left_out = scaling.ladder_points(find_runs([str(tmp_path)]))
    assert not left_out and len(points) == 2 * 2 * len(DEPTHS)
    targets = scaling.ladder_sizes(points)
    values = scaling.ladder_statistics(points, targets)
    for attn, law in (("sa", sa), ("xsa", xsa)):
        assert values[f"{attn}.C.alpha"] == pytest.approx(law.alpha, abs=0.02)
        assert values[f"{attn}.C.E"] == pytest.approx(law.E, abs=0.1)
    true_k = r ** (-1 / alpha)
    for t in targets:
        assert math.exp(values[f"log_k.{t['key']}"]) == pytest.approx(true_k, rel=0.15)


def test_multiplier_equals_its_closed_form_for_two_known_laws():
    # 1. same E and alpha, XSA's coefficient r times SA's: SA needs r^(-1/alpha) times the compute, at any C
    sa, xsa = scaling.Law(E=1.8, A=400.0, alpha=0.2), scaling.Law(E=1.8, A=0.8 * 400.0, alpha=0.2)
    for compute in (1e15, 1e18, 1e21):
        assert scaling.multiplier(compute, xsa, sa) == pytest.approx(0.8 ** (-1 / 0.2), rel=1e-9)
    # 2. unrelated laws: k solves L_SA(k C) = L_XSA(C), found here by root finding in log k
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


def test_bootstrap_over_seeds_covers_the_true_exponent_in_most_ladders():
    """Calibration: 25 ladders of 6 seeds drawn from one law with noise; the 95% interval of alpha should
    hold the true alpha in most of them, and a clearly wrong alpha in few."""
    rng = np.random.default_rng(1)
    law, sizes, seeds = SA_N_LAW, [1e4 * 3 ** i for i in range(5)], range(6)
    covered = wrong = 0
    ladders = 25
    for i in range(ladders):
        points = [{"attn_type": "sa", "N": n, "seed": s, "loss": float(law(n)) + rng.normal(0.0, 0.02)}
                  for s in seeds for n in sizes]
        draws, unit, dropped = scaling.bootstrap(
            points, lambda sample: {"alpha": scaling.fit_law([p["N"] for p in sample],
                                                             [p["loss"] for p in sample]).alpha}, 80, seed=i)
        assert unit == "seeds" and dropped == 0 and len(draws) == 80
        low, high = scaling.interval([d["alpha"] for d in draws])
        covered += low <= law.alpha <= high
        wrong += low <= 1.1 * law.alpha <= high
    assert covered >= 0.8 * ladders
    assert wrong <= 0.2 * ladders


# -----------------------------------------------------------------------------
# the edges


def test_too_few_sizes_is_not_identified(tmp_path, capsys, run_provenance):
    write_ladder(tmp_path / "runs", {"sa": SA_N_LAW, "xsa": XSA_N_LAW}, (1, 2), run_provenance, depths=(1, 2))
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 3
    assert len(err.strip().splitlines()) == 1 and "not identified" in err and "2 size(s)" in err
    assert not os.path.exists(tmp_path / "fit" / "scaling.json")


def test_unfinished_runs_are_named_and_left_out(tmp_path, capsys, monkeypatch, run_provenance):
    """One seed, SA and XSA drawn from one law: the intervals are over runs, and the output says so and says
    where the gap's interval spans zero; the two unfinished runs are named and not fitted."""
    monkeypatch.chdir(REPO)
    same = {"sa": SA_N_LAW, "xsa": SA_N_LAW}
    runs = write_ladder(tmp_path / "runs", same, (1,), run_provenance, depths=(1, 2, 3, 4), noise=0.01)
    stopped, _, _ = write_run(tmp_path / "runs", "sa", 2, 3, lambda n, c: 9.0, run_provenance, steps_done=7)
    no_val, _, _ = write_run(tmp_path / "runs", "xsa", 2, 4, lambda n, c: 9.0, run_provenance, last_val=False)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit", "--draws", 100)
    assert status == 0, err
    assert f"{stopped}: unfinished: its last step is 7 of max_iters" in err
    assert f"{no_val}: unfinished: no validation loss at its last step" in err
    report = json.loads((tmp_path / "fit" / "scaling.json").read_text())
    assert {r["path"] for r in report["runs"]} == {path for path, _, _ in runs.values()}
    assert {r["path"] for r in report["left_out"]} == {stopped, no_val}
    table = (tmp_path / "fit" / "scaling.md").read_text()
    assert stopped in table and no_val in table

    assert report["bootstrap"]["over"] == "runs" and "One seed per size" in table
    spanning = [g for g in report["gap"]["per_rung"] if g["ci_spans_zero"]]
    assert spanning  # one law for both: the gap's sign is not settled
    for gap in report["gap"]["per_rung"]:
        said = f"At N = {scaling.format_count(gap['N'])}, ΔL's interval spans zero" in table
        assert said == gap["ci_spans_zero"]
    for k in report["multiplier"]["per_rung"]:
        said = f"At N = {scaling.format_count(k['N'])}, k's interval includes 1" in table
        assert said == (k["log_ci_spans_zero"] and not k["infinite"])


def test_runs_left_out_down_to_two_sizes_are_not_identified(tmp_path, capsys, run_provenance):
    write_ladder(tmp_path / "runs", {"sa": SA_N_LAW, "xsa": XSA_N_LAW}, (1,), run_provenance, depths=(1, 2))
    stopped, _, _ = write_run(tmp_path / "runs", "xsa", 1, 3, lambda n, c: 3.0, run_provenance, steps_done=5)
    write_run(tmp_path / "runs", "sa", 1, 3, lambda n, c: 3.0, run_provenance)
    status, _, err = run_main(capsys, tmp_path / "runs", "--out", tmp_path / "fit")
    assert status == 3
    assert f"warning: {stopped}: unfinished" in err
    assert "not identified: XSA has finished runs at 2 size(s)" in err.splitlines()[-1]


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
                           "DATA_DIR": str(tmp_path / "shards"), **env})
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


def config_value(config_file, key):
    config, _ = resolve([config_file])
    return getattr(config, key)


@pytest.mark.slow
@pytest.mark.parametrize("sizes,env,head_dim_from", [
    ("tiny", {"TOKENS_PER_PARAM": "3", "SEEDS": "1 2"}, "config/sa_tiny.py"),
    ("paper", {}, "config/sa_1p4b.py"),  # the paper's head_dim (its 1.4B and 2.7B models)
])
def test_ladder_rungs_grow_in_depth_and_width_with_model_py_counts(tmp_path, monkeypatch, sizes, env, head_dim_from):
    monkeypatch.chdir(REPO)
    rungs, commands, out = dry_run_ladder(tmp_path, SIZES=sizes, **env)
    tokens_per_param = float(env.get("TOKENS_PER_PARAM", 20))  # Chinchilla's, the paper ladder's default
    seeds = env.get("SEEDS", "1").split()
    assert len(rungs) >= 4
    head_dim = config_value(head_dim_from, "head_dim")
    for smaller, larger in zip(rungs, rungs[1:]):
        assert int(larger["n_layer"]) > int(smaller["n_layer"]) and int(larger["n_embd"]) > int(smaller["n_embd"])
        assert int(larger["params"]) > int(smaller["params"])
    total_flops = total_hours = 0.0  # of every run: SA and XSA, each seed
    for rung in rungs:
        assert int(rung["head_dim"]) == head_dim
        assert int(rung["n_head"]) == math.ceil(int(rung["n_embd"]) / head_dim)
        base = f"config/sa_{rung['config']}.py"
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
        runs = [(c, o) for c, o in commands if o["n_layer"] == rung["n_layer"]]
        assert sorted((c, o["seed"]) for c, o in runs) == sorted(
            (f"config/{attn}_{rung['config']}.py", s) for attn in ("sa", "xsa") for s in seeds)
        for config_file, o in runs:
            attn = os.path.basename(config_file).split("_")[0]
            assert o["max_iters"] == rung["steps"] and float(o["learning_rate"]) == float(rung["lr"])
            assert all(o[k] == rung[k] for k in ("n_layer", "n_embd", "n_head", "head_dim"))
            assert o["wandb_group"] == f"sweep_ladder_{sizes}_{attn}"
            assert o["out_dir"] == f"{tmp_path}/sweep_ladder/{attn}_{sizes}_d{rung['n_layer']}_seed{o['seed']}"
    assert len(commands) == 2 * len(seeds) * len(rungs)
    in_all = re.search(rf"^# ladder {sizes} in all: (\S+) FLOPs, (\S+) GPU-hours", out, re.M)
    assert float(in_all[1]) == pytest.approx(total_flops, rel=1e-2)
    assert float(in_all[2]) == pytest.approx(total_hours, rel=1e-2)
    assert "-m eval.scaling" in out  # and the fit, once the runs are done
    if sizes == "paper":  # the paper's three sizes are on the ladder, within 6% of N
        listed = [int(r["params"]) for r in rungs]
        assert all(min(abs(m - n) / n for m in listed) < 0.06 for n, _ in paper_counts().values())
    anchor = {"tiny": "config/sa_tiny.py", "paper": "config/sa_0p7b.py"}[sizes]
    for rung in rungs:  # the learning rate falls as 1 / width, through the anchor config's
        expected = config_value(anchor, "learning_rate") * config_value(anchor, "n_embd") / int(rung["n_embd"])
        assert float(rung["lr"]) == pytest.approx(expected, rel=5e-3)
