"""eval/compare.py on synthetic run directories with known losses: the table's numbers against
statistics computed here independently, pairing by seed, SA against each other variant (XSA, gated
XSA) separately, settings told apart by train.py's key groups, and the PNG."""

import importlib
import json
import math
import os
import statistics

import pytest

from pretrain.train_config import BOOKKEEPING_KEYS, TRAIN_KEYS, VARIANT_KEYS
from running import run_in_process

# Student t quantiles from a printed table, by degrees of freedom: 0.975 (95% intervals), 0.95 (90%)
T_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 10: 2.228139, 30: 2.042272}
T_95 = {5: 2.015048}


def load_compare():
    return importlib.import_module("eval.compare")


def write_run(root, name, attn_type, seed, val_losses, learning_rate=1e-3, init_from="scratch", extra=None,
              drop=()):
    """A run directory as train.py leaves it: config.json and metrics.jsonl, a train loss every
    step and val_losses = {step: loss} on eval steps. `drop`: config keys an older train.py lacked."""
    path = os.path.join(root, name)
    os.makedirs(path)
    config = {"out_dir": path, "wandb_run_name": name, "wandb_group": "g", "init_from": init_from,
              "attn_type": attn_type, "xsa_gate": False, "seed": seed, "data_seed": seed,
              "learning_rate": learning_rate, "n_layer": 2, "block_size": 32, "max_iters": max(val_losses),
              **(extra or {})}
    config = {k: v for k, v in config.items() if k not in drop}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"config": config, "provenance": {}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(1, max(val_losses) + 1):
            record = {"step": step, "train_loss": 10.0 - 0.05 * step, "lr": 1e-3}
            if step in val_losses:
                record["val_loss"] = val_losses[step]
            f.write(json.dumps(record) + "\n")
    return path


def run_compare(*args):
    proc = run_in_process(["-m", "eval.compare", *args])
    assert proc.returncode == 0, proc.output
    return proc


def compare_markdown(out, *args):
    """Run compare.py with --out out (a directory) and return its compare.md."""
    run_compare(*args, "--out", out)
    with open(os.path.join(out, "compare.md")) as f:
        return f.read()


def comparison_rows(markdown):
    """The second table's rows, {(setting, variant): row}."""
    return {(r["setting"], r["variant"]): r for r in table_rows(markdown, "| setting |")}


def table_rows(markdown, header_start):
    """The rows of the markdown table whose header starts with header_start, as dicts."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, [c.strip() for c in line.strip("|").split("|")])))
    return rows


# final (step 100) val losses per seed; setting "lr1e-3" has 3 seeds, "lr2e-3" has 5
FINAL = {
    "lr1e-3": {"sa": {1: 3.51, 2: 3.49, 3: 3.55}, "xsa": {1: 3.47, 2: 3.48, 3: 3.50}},
    "lr2e-3": {"sa": {1: 3.40, 2: 3.42, 3: 3.45, 4: 3.39, 5: 3.44},
               "xsa": {1: 3.41, 2: 3.38, 3: 3.40, 4: 3.37, 5: 3.43}},
}


@pytest.fixture
def runs(tmp_path):
    """Synthetic runs: two settings with several seeds, an SA run without an XSA partner, and a
    resumed XSA run (init_from=resume, a duplicated step, a torn last line)."""
    root = str(tmp_path / "runs")
    for setting, lr in (("lr1e-3", 1e-3), ("lr2e-3", 2e-3)):
        for attn, by_seed in FINAL[setting].items():
            for seed, final in by_seed.items():
                write_run(root, f"{attn}_micro_{setting}_seed{seed}", attn, seed, {50: final + 0.3, 100: final},
                          learning_rate=lr, init_from="resume" if (attn, seed) == ("xsa", 2) else "scratch")
    write_run(root, "sa_micro_lr1e-3_seed9", "sa", 9, {50: 3.8, 100: 3.6})
    resumed = os.path.join(root, "xsa_micro_lr2e-3_seed1", "metrics.jsonl")
    with open(resumed, "a") as f:  # a step logged again after a resume replaces the first record
        f.write(json.dumps({"step": 100, "train_loss": 5.0, "val_loss": FINAL["lr2e-3"]["xsa"][1]}) + "\n")
        f.write('{"step": 101, "train_lo')
    return root


def test_confidence_intervals_match_the_printed_t_table():
    """paired_stats at 95% for several sample sizes, and at 90%, against t quantiles from a printed table."""
    compare = load_compare()
    cases = [(0.95, df, t) for df, t in T_975.items()] + [(0.90, df, t) for df, t in T_95.items()]
    for confidence, df, t in cases:
        diffs = [0.01 * ((i * 7) % 5) - 0.02 + 0.003 * i for i in range(df + 1)]
        stats = compare.paired_stats(diffs, confidence)
        mean, std = statistics.mean(diffs), statistics.stdev(diffs)
        half = t * std / math.sqrt(df + 1)
        assert stats["n"] == df + 1 and stats["mean"] == pytest.approx(mean) and stats["std"] == pytest.approx(std)
        assert stats["ci"] == (pytest.approx(mean - half, abs=1e-6), pytest.approx(mean + half, abs=1e-6))
    assert compare.paired_stats([0.1])["ci"] is None  # one pair: no spread to estimate


@pytest.mark.slow
def test_table_has_final_val_loss_and_paired_difference_statistics(runs, tmp_path):
    out = str(tmp_path / "report")  # a directory, made if missing, like every eval script's --out
    proc = run_compare(os.path.join(runs, "*"), "--out", out)
    assert sorted(os.listdir(out)) == ["compare.md", "compare.png"]
    with open(os.path.join(out, "compare.md")) as f:
        markdown = f.read()
    assert markdown in proc.stdout

    assert markdown.startswith("## SA vs XSA: 17 runs, 2 settings\n")
    per_run = {r["run"]: r for r in table_rows(markdown, "| run |")}
    assert len(per_run) == 17
    for setting, by_attn in FINAL.items():
        for attn, by_seed in by_attn.items():
            for seed, final in by_seed.items():
                row = per_run[f"{attn}_micro_{setting}_seed{seed}"]
                assert (row["setting"], row["variant"], row["seed"], row["step"]) == (f"micro_{setting}", attn,
                                                                                      str(seed), "100")
                assert float(row["val loss"]) == pytest.approx(final, abs=5e-5)

    per_setting = comparison_rows(markdown)
    # init_from and names do not split a setting
    assert set(per_setting) == {("micro_lr1e-3", "xsa"), ("micro_lr2e-3", "xsa")}
    for setting, df in (("lr1e-3", 2), ("lr2e-3", 4)):
        sa, xsa = FINAL[setting]["sa"], FINAL[setting]["xsa"]
        diffs = [xsa[s] - sa[s] for s in sorted(xsa)]  # seed 9 has no XSA partner: not a pair
        n, mean, std = len(diffs), statistics.mean(diffs), statistics.stdev(diffs)
        half = T_975[df] * std / math.sqrt(n)
        row = per_setting[(f"micro_{setting}", "xsa")]
        assert row["pairs"] == str(n) and row["step"] == "100"
        assert float(row["SA loss"]) == pytest.approx(statistics.mean(sa[s] for s in xsa), abs=5e-5)
        assert float(row["variant loss"]) == pytest.approx(statistics.mean(xsa.values()), abs=5e-5)
        assert float(row["variant − SA"]) == pytest.approx(mean, abs=5e-5)
        assert float(row["std"]) == pytest.approx(std, abs=5e-5)
        low, high = (float(x) for x in row["95% CI"].strip("[]").split(","))
        assert (low, high) == (pytest.approx(mean - half, abs=5e-5), pytest.approx(mean + half, abs=5e-5))
        assert row["variant lower"] == f"{sum(d < 0 for d in diffs)}/{n}"
    assert "without a partner" in markdown and "sa_micro_lr1e-3_seed9" in markdown

    with open(os.path.join(out, "compare.png"), "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow
def test_a_pair_is_compared_at_the_last_step_both_evaluated(tmp_path):
    """An XSA run stopped at step 50 is compared with SA at step 50, not with SA's final loss."""
    root = str(tmp_path / "runs")
    write_run(root, "sa_a", "sa", 1, {50: 4.0, 100: 3.5}, extra={"max_iters": 100})
    write_run(root, "xsa_a", "xsa", 1, {50: 3.9}, extra={"max_iters": 100})  # interrupted at step 50
    markdown = compare_markdown(str(tmp_path / "cmp"), root, "--smooth", "0.9")  # a directory of runs, as well as globs
    row = table_rows(markdown, "| setting |")[0]
    assert (row["setting"], row["variant"], row["pairs"], row["step"]) == ("a", "xsa", "1", "50")
    assert float(row["variant − SA"]) == pytest.approx(-0.1, abs=5e-5)
    assert row["std"] == "–" and row["95% CI"] == "–"  # one pair: no spread to estimate


@pytest.mark.slow
def test_settings_that_differ_in_config_get_labelled_by_the_differing_keys(tmp_path):
    """Runs without sweep names: the setting label is the key that differs."""
    root = str(tmp_path / "runs")
    for i, block_size in enumerate((32, 64)):
        for attn in ("sa", "xsa"):
            write_run(root, f"run{i}_{attn}", attn, 1, {10: 5.0 if attn == "sa" else 4.9},
                      extra={"block_size": block_size})
    per_setting = comparison_rows(compare_markdown(str(tmp_path / "cmp"), os.path.join(root, "run*")))
    assert set(per_setting) == {("block_size=32", "xsa"), ("block_size=64", "xsa")}
    assert all(float(r["variant − SA"]) == pytest.approx(-0.1, abs=5e-5) for r in per_setting.values())


@pytest.mark.slow
def test_runs_from_different_train_py_versions_still_pair(tmp_path):
    """A key only newer runs have (a newer train.py) does not split a setting; the table says so."""
    root = str(tmp_path / "runs")
    write_run(root, "sa_a_seed1", "sa", 1, {10: 5.0})
    write_run(root, "xsa_a_seed1", "xsa", 1, {10: 4.8}, extra={"new_key": 1, "parallelism": "fsdp"})
    markdown = compare_markdown(str(tmp_path / "cmp"), root)
    row = table_rows(markdown, "| setting |")[0]
    assert (row["setting"], row["pairs"]) == ("a", "1")
    assert float(row["variant − SA"]) == pytest.approx(-0.2, abs=5e-5)
    assert "only some runs' configs have them" in markdown and "new_key" in markdown


@pytest.mark.slow
def test_gated_xsa_is_compared_with_sa_separately_from_plain_xsa(tmp_path):
    """SA, XSA and gated XSA runs of one setting: one row XSA − SA and one row gated − SA, each paired
    by seed. A run from before xsa_gate existed counts as plain XSA."""
    final = {"sa": {1: 3.50, 2: 3.52, 3: 3.47},
             "xsa": {1: 3.46, 2: 3.50, 3: 3.45},
             "xsa_gate": {1: 3.44, 2: 3.49, 3: 3.47, 4: 3.40}}  # seed 4 has no SA partner
    root = str(tmp_path / "runs")
    for variant, by_seed in final.items():
        for seed, loss in by_seed.items():
            name = f"{variant.replace('+', '_')}_a_seed{seed}"
            gate = variant == "xsa_gate"
            write_run(root, name, "sa" if variant == "sa" else "xsa", seed, {50: loss + 0.2, 100: loss},
                      extra={"xsa_gate": gate}, drop=("xsa_gate",) if (variant, seed) == ("xsa", 3) else ())
    markdown = compare_markdown(str(tmp_path / "cmp"), root)

    per_run = {r["run"]: r for r in table_rows(markdown, "| run |")}
    assert per_run["xsa_gate_a_seed1"]["variant"] == "xsa_gate" and per_run["xsa_a_seed3"]["variant"] == "xsa"
    rows = comparison_rows(markdown)
    assert set(rows) == {("a", "xsa"), ("a", "xsa_gate")}  # one setting; neither variant mistaken for the other
    for variant in ("xsa", "xsa_gate"):
        seeds = sorted(set(final[variant]) & set(final["sa"]))
        diffs = [final[variant][s] - final["sa"][s] for s in seeds]
        row = rows[("a", variant)]
        assert row["pairs"] == "3" and row["step"] == "100"
        assert float(row["SA loss"]) == pytest.approx(statistics.mean(final["sa"].values()), abs=5e-5)
        assert float(row["variant loss"]) == pytest.approx(statistics.mean(final[variant][s] for s in seeds), abs=5e-5)
        assert float(row["variant − SA"]) == pytest.approx(statistics.mean(diffs), abs=5e-5)
        assert float(row["std"]) == pytest.approx(statistics.stdev(diffs), abs=5e-5)
        half = T_975[2] * statistics.stdev(diffs) / math.sqrt(3)
        low, high = (float(x) for x in row["95% CI"].strip("[]").split(","))
        assert low == pytest.approx(statistics.mean(diffs) - half, abs=5e-5)
        assert high == pytest.approx(statistics.mean(diffs) + half, abs=5e-5)
        assert row["variant lower"] == f"{sum(d < 0 for d in diffs)}/3"
    assert "without a partner" in markdown and "xsa_gate_a_seed4" in markdown
    assert markdown.startswith("## SA vs XSA, XSA+gate: 10 runs, 1 setting\n")
    assert "Not compared" not in markdown  # a variant key missing from old runs is no setting key left out


@pytest.mark.slow
def test_settings_ignore_the_bookkeeping_keys_train_py_declares(tmp_path):
    """Runs that differ only in keys train.py's BOOKKEEPING_KEYS names (how often a run evaluated or
    printed samples) are one setting; a key outside the groups (the learning rate) splits settings."""
    assert {"eval_interval", "sample_interval"} <= set(BOOKKEEPING_KEYS)
    root = str(tmp_path / "runs")
    write_run(root, "sa_a_seed1", "sa", 1, {10: 5.0}, extra={"eval_interval": 10, "sample_interval": 0})
    write_run(root, "xsa_a_seed1", "xsa", 1, {10: 4.7}, extra={"eval_interval": 5, "sample_interval": 10})
    write_run(root, "sa_b_seed1", "sa", 1, {10: 5.0}, learning_rate=2e-3, extra={"eval_interval": 10,
                                                                                 "sample_interval": 0})
    write_run(root, "xsa_b_seed1", "xsa", 1, {10: 4.9}, learning_rate=2e-3, extra={"eval_interval": 10,
                                                                                   "sample_interval": 0})
    rows = comparison_rows(compare_markdown(str(tmp_path / "cmp"), root))
    assert set(rows) == {("a", "xsa"), ("b", "xsa")}
    assert float(rows[("a", "xsa")]["variant − SA"]) == pytest.approx(-0.3, abs=5e-5)
    assert float(rows[("b", "xsa")]["variant − SA"]) == pytest.approx(-0.1, abs=5e-5)


def test_variant_labels_name_the_keys_that_differ_from_sa():
    """One spelling per variant (train_config.variant_name): the last 11 blocks and block 11 alone differ."""
    compare = load_compare()
    assert compare.VARIANT_KEYS == VARIANT_KEYS and "xsa_gate" in compare.VARIANT_KEYS

    def variant(**values):
        return tuple(values.get(k, TRAIN_KEYS[k].default) for k in VARIANT_KEYS)

    assert compare.variant_label(variant()) == "sa"
    assert compare.variant_label(variant(attn_type="xsa")) == "xsa"
    assert compare.variant_label(variant(attn_type="xsa", xsa_gate=True)) == "xsa_gate"
    assert compare.variant_label(variant(attn_type="xsa", xsa_layers=11)) == "xsa_last11"
    assert compare.variant_label(variant(attn_type="xsa", xsa_layers="11")) == "xsa_blocks11"
    assert compare.variant_label(variant(attn_type="xsa", xsa_gate=True, xsa_layers="0,5")) == "xsa_gate_blocks0-5"
    assert compare.variant_title(variant(attn_type="xsa", xsa_gate=True, xsa_layers=4)) == "XSA+gate+last4"


# -----------------------------------------------------------------------------
# in-loop evaluation: in_loop.png and the last values' table, drawn from the rows of metrics.jsonl

IN_LOOP_TASKS = ("arc_easy", "piqa")
IN_LOOP_STEPS = (10, 20, 30)


def write_in_loop_run(root, name, attn_type, seed):
    """A run whose metrics.jsonl, written by train.py's MetricsLogger, holds downstream and similarity rows of
    values drawn from the seed at steps 10, 20 and 30 (2 layers), and 1,000 tokens per step."""
    import random
    from pretrain.metrics import MetricsLogger
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"config": {"out_dir": path, "wandb_run_name": name, "attn_type": attn_type, "xsa_gate": False,
                              "seed": seed, "data_seed": seed, "n_layer": 2, "max_iters": 30}}, f)
    draw = random.Random(f"{attn_type}{seed}")
    log = MetricsLogger(path)
    for step in range(1, 31):
        record = {"step": step, "tokens": 1000 * step, "train_loss": 5.0 - 0.01 * step}
        if step in IN_LOOP_STEPS:
            scores = {f"downstream/{task}": draw.random() for task in IN_LOOP_TASKS}
            layers = {f"similarity/layer{i}/cos_yv": draw.random() for i in range(2)}
            record.update(scores, **layers, val_loss=4.0 - 0.01 * step + draw.random() / 10, val_bpb=draw.random())
            record["downstream/avg"] = statistics.fmean(scores.values())
            record["similarity/mean_cos_yv"] = statistics.fmean(layers.values())
        log.log(record)
    return path


@pytest.fixture
def in_loop_runs(tmp_path):
    root = tmp_path / "runs"
    return {(attn_type, seed): write_in_loop_run(str(root), f"{attn_type}_tiny_seed{seed}", attn_type, seed)
            for attn_type in ("sa", "xsa") for seed in (1, 2, 3)}


def rows_of(path):
    from pretrain.metrics import read_metrics
    return {r["step"]: r for r in read_metrics(os.path.join(path, "metrics.jsonl"))}


def test_the_in_loop_figure_draws_the_seeds_mean_of_the_rows_against_tokens(in_loop_runs, tmp_path):
    compare = load_compare()
    settings = compare.group_settings(compare.find_runs([str(tmp_path / "runs")]))
    path, drawn, legends = compare.plot_in_loop(settings, str(tmp_path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for title, lines in drawn.items():  # every panel has a legend naming each of its lines
        assert legends[title] == list(lines) and set(lines) == {"tiny SA", "tiny XSA"}
    panels = {"downstream average": "downstream/avg", **{task: f"downstream/{task}" for task in IN_LOOP_TASKS},
              "mean cos(y_i, v_i) over layers": "similarity/mean_cos_yv"}
    assert set(drawn) == set(panels) | {"cos(y_i, v_i) by layer, last step"}
    for title, key in panels.items():
        for attn_type in ("sa", "xsa"):
            x, y = drawn[title][f"tiny {attn_type.upper()}"]
            assert x == [1000 * step for step in IN_LOOP_STEPS]
            want = [statistics.fmean(rows_of(in_loop_runs[attn_type, seed])[step][key] for seed in (1, 2, 3))
                    for step in IN_LOOP_STEPS]
            assert y == pytest.approx(want, rel=1e-12)
    for attn_type in ("sa", "xsa"):  # Figure 1's shape: by layer, at the last step
        x, y = drawn["cos(y_i, v_i) by layer, last step"][f"tiny {attn_type.upper()}"]
        assert x == [0, 1]
        last = [rows_of(in_loop_runs[attn_type, seed])[30] for seed in (1, 2, 3)]
        assert y == pytest.approx([statistics.fmean(r[f"similarity/layer{i}/cos_yv"] for r in last) for i in range(2)],
                                  rel=1e-12)


def test_the_seeds_interval_is_the_student_t_one():
    compare = load_compare()
    curves = [([100, 200], [0.40, 0.50]), ([100, 200], [0.44, 0.56]), ([100, 200, 300], [0.45, 0.51, 0.9])]
    tokens, mean, low, high = compare.band(curves)
    assert tokens == [100, 200]  # where every seed has a value
    for i in range(2):
        values = [c[1][i] for c in curves]
        half = T_975[2] * statistics.stdev(values) / math.sqrt(3)
        assert mean[i] == pytest.approx(statistics.fmean(values))
        assert (low[i], high[i]) == pytest.approx((mean[i] - half, mean[i] + half), rel=1e-5)


def test_compare_md_lists_each_runs_last_in_loop_values_and_the_png_is_written(in_loop_runs, tmp_path):
    markdown = compare_markdown(str(tmp_path / "out"), str(tmp_path / "runs"))
    assert open(tmp_path / "out" / "in_loop.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    table = {r["run"]: r for r in table_rows(markdown, "| run | setting | variant | seed | avg")}
    assert len(table) == 6
    for (attn_type, seed), path in in_loop_runs.items():
        last = rows_of(path)[30]
        row = table[f"{attn_type}_tiny_seed{seed}"]
        for task in ("avg",) + IN_LOOP_TASKS:
            assert row[task] == f"{100 * last[f'downstream/{task}']:.2f} (30)"
        assert row["mean_cos_yv"] == f"{last['similarity/mean_cos_yv']:.4f} (30)"
        assert row["val_bpb"] == f"{last['val_bpb']:.4f} (30)"


def test_val_metric_compares_bits_per_byte(in_loop_runs, tmp_path):
    markdown = compare_markdown(str(tmp_path / "out"), str(tmp_path / "runs"), "--val_metric", "val_bpb")
    finals = {r["run"]: r for r in table_rows(markdown, "| run | setting | variant | seed | step | val bpb |")}
    for (attn_type, seed), path in in_loop_runs.items():
        assert finals[f"{attn_type}_tiny_seed{seed}"]["val bpb"] == f"{rows_of(path)[30]['val_bpb']:.4f}"
    [row] = table_rows(markdown, "| setting | variant | pairs | step | SA bpb |")
    diffs = [rows_of(in_loop_runs["xsa", s])[30]["val_bpb"] - rows_of(in_loop_runs["sa", s])[30]["val_bpb"]
             for s in (1, 2, 3)]
    assert float(row["variant − SA"]) == pytest.approx(statistics.fmean(diffs), abs=1e-4)


# -----------------------------------------------------------------------------
# what a user's run directories may hold: non-finite values, corrupt files, missing paths


def test_non_finite_values_are_named_in_one_warning_and_left_out(tmp_path):
    """train.py logs a skipped non-finite step as it is (NaN, Infinity in the JSON). A NaN final val_loss in
    two seed pairs and an infinite train_loss: one warning line per run names them, the pairs are compared at
    the last step both have a finite value, and the plots are drawn."""
    root = str(tmp_path / "runs")
    sa = {1: 3.50, 2: 3.52, 3: 3.47}
    xsa = {1: 3.46, 2: 3.50, 3: 3.45}
    for seed in (1, 2, 3):
        final = float("nan") if seed < 3 else sa[seed]
        write_run(root, f"sa_a_seed{seed}", "sa", seed, {50: sa[seed] + 0.2, 100: final})
        write_run(root, f"xsa_a_seed{seed}", "xsa", seed, {50: xsa[seed] + 0.1, 100: xsa[seed]})
    path = os.path.join(root, "xsa_a_seed3", "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    lines[6] = json.dumps({**json.loads(lines[6]), "train_loss": float("inf")}) + "\n"  # step 7
    with open(path, "w") as f:
        f.writelines(lines)
    assert "NaN" in open(os.path.join(root, "sa_a_seed1", "metrics.jsonl")).read()

    proc = run_compare(root, "--out", str(tmp_path / "cmp"))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3
    for seed in (1, 2):
        [line] = [w for w in warnings if f"sa_a_seed{seed}" in w]
        assert "metrics.jsonl" in line and "val_loss at step 100" in line and "non-finite" in line
    [line] = [w for w in warnings if "xsa_a_seed3" in w]
    assert "train_loss at step 7" in line
    markdown = open(tmp_path / "cmp" / "compare.md").read()
    row = table_rows(markdown, "| setting |")[0]
    assert row["step"] == "50/100"  # seeds 1 and 2 at step 50, seed 3 at 100
    diffs = [xsa[1] + 0.1 - (sa[1] + 0.2), xsa[2] + 0.1 - (sa[2] + 0.2), xsa[3] - sa[3]]
    assert float(row["variant − SA"]) == pytest.approx(statistics.mean(diffs), abs=5e-5)
    assert float(row["std"]) == pytest.approx(statistics.stdev(diffs), abs=5e-5)
    assert "nan" not in markdown.lower().replace("non-finite", "")
    assert open(tmp_path / "cmp" / "compare.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def corrupt(path, how):
    """Damage a run directory the ways a user's disk does."""
    config, metrics = os.path.join(path, "config.json"), os.path.join(path, "metrics.jsonl")
    if how.startswith("config"):
        os.remove(config)
        if how == "config folder":
            os.makedirs(config)
            return config
        text = {"config truncated": '{"config": {"attn_type": "sa", "se', "config empty": "",
                "config list": '[1, 2, 3]'}[how]
        with open(config, "w") as f:
            f.write(text)
        return config
    with open(metrics, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    lines[3] = {"metrics number": b"5\n", "metrics bytes": b"\xff\xfe\x00\x9c garbage \x01\n",
                "metrics string step": b'{"step": "20", "train_loss": 4.0}\n'}[how]
    with open(metrics, "wb") as f:
        f.writelines(lines)
    return metrics


CORRUPTIONS = ["config truncated", "config empty", "config list", "config folder", "metrics number",
               "metrics bytes", "metrics string step"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupt_run_is_left_out_with_one_line_naming_its_file(tmp_path, capsys, how):
    compare = load_compare()
    root = str(tmp_path / "runs")
    for attn in ("sa", "xsa"):
        for seed in (1, 2):
            write_run(root, f"{attn}_a_seed{seed}", attn, seed, {5: 4.0, 10: 3.5})
    bad = corrupt(os.path.join(root, "xsa_a_seed2"), how)
    runs = compare.find_runs([root])  # scaling reads its runs through find_runs too
    assert sorted(r.name for r in runs) == ["sa_a_seed1", "sa_a_seed2", "xsa_a_seed1"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {bad}") and "left out" in err[0]
    if how.startswith("metrics"):
        assert "line 4" in err[0]


def test_nothing_usable_left_exits_3_in_one_line(tmp_path):
    root = str(tmp_path / "runs")
    bad = corrupt(write_run(root, "sa_a_seed1", "sa", 1, {5: 4.0, 10: 3.5}), "config list")
    proc = run_in_process(["-m", "eval.compare", root, "--out", str(tmp_path / "cmp")])
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and bad in lines[0] and "no usable runs" in lines[1] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("which", ["missing", "file", "empty glob"])
def test_a_path_that_is_not_a_directory_of_runs_is_an_error_naming_it(tmp_path, which):
    root = str(tmp_path / "runs")
    good = write_run(root, "sa_a_seed1", "sa", 1, {5: 4.0, 10: 3.5})
    bad = {"missing": str(tmp_path / "typo"), "file": os.path.join(good, "metrics.jsonl"),
           "empty glob": str(tmp_path / "nothing_*")}[which]
    proc = run_in_process(["-m", "eval.compare", good, bad, "--out", str(tmp_path / "cmp")])
    assert proc.returncode == 3
    [line] = proc.stderr.strip().splitlines()
    assert bad in line and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "cmp" / "compare.md")


# -----------------------------------------------------------------------------
# downstream averages over different task sets are never one curve or one column


def write_task_run(root, name, attn_type, seed, tasks_by_step):
    """A run whose records at steps 10, 20, 30 hold downstream/<task> for the tasks tasks_by_step gives at
    that step, and their average downstream/avg, as train.py logs them."""
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"config": {"wandb_run_name": name, "attn_type": attn_type, "seed": seed, "data_seed": seed,
                              "n_layer": 2, "downstream_tasks": ",".join(tasks_by_step[10])}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(1, 31):
            record = {"step": step, "tokens": 100 * step, "train_loss": 5.0 - 0.01 * step}
            if step in tasks_by_step:
                scores = {f"downstream/{t}": 0.1 * len(t) / 10 + 0.01 * seed + 0.001 * step
                          for t in tasks_by_step[step]}
                record.update(scores, **{"downstream/avg": statistics.fmean(scores.values())})
            f.write(json.dumps(record) + "\n")
    return path


def test_averages_over_different_task_sets_are_drawn_and_tabulated_apart(tmp_path):
    """SA evaluated arc_easy and piqa; XSA arc_easy and boolq, and one XSA run was resumed at step 20 with
    piqa added. Each task set's average is a panel and a column of its own, holding only the steps that
    averaged that set."""
    compare = load_compare()
    root = str(tmp_path / "runs")
    two, other, three = ("arc_easy", "piqa"), ("arc_easy", "boolq"), ("arc_easy", "boolq", "piqa")
    paths = {("sa", 1): write_task_run(root, "sa_t_seed1", "sa", 1, {10: two, 20: two, 30: two}),
             ("xsa", 1): write_task_run(root, "xsa_t_seed1", "xsa", 1, {10: other, 20: other, 30: other}),
             ("xsa", 2): write_task_run(root, "xsa_t_seed2", "xsa", 2, {10: other, 20: three, 30: three})}
    runs = compare.find_runs([root])
    accuracy, _ = compare.in_loop_keys(runs)
    averages = [k for k in accuracy if "avg" in k]
    assert averages == ["downstream/avg(arc_easy+boolq)", "downstream/avg(arc_easy+boolq+piqa)",
                        "downstream/avg(arc_easy+piqa)"]
    settings = [("t", runs)]
    _, drawn, legends = compare.plot_in_loop(settings, str(tmp_path))
    assert "downstream average" not in drawn
    for tasks in (two, other, three):
        title = "downstream average of " + ", ".join(tasks)
        for label, (x, y) in drawn[title].items():
            attn = label.split()[1].lower()
            chosen = [path for (a, _), path in paths.items() if a == attn]
            # each seed's average at the steps that averaged exactly these tasks, and only where all seeds have it
            per_seed = [{r["step"]: r["downstream/avg"] for r in rows_of(p).values()
                         if r.get("downstream/avg") is not None
                         and sorted(k[11:] for k in r if k.startswith("downstream/") and k != "downstream/avg")
                         == list(tasks)} for p in chosen]
            per_seed = [d for d in per_seed if d]
            steps = sorted(set.intersection(*(set(d) for d in per_seed)))
            assert x == [100 * s for s in steps]
            assert y == pytest.approx([statistics.fmean(d[s] for d in per_seed) for s in steps])
        assert legends[title] == list(drawn[title])
    markdown = compare.in_loop_markdown(settings)
    table = {r["run"]: r for r in table_rows(markdown, "| run | setting | variant | seed |")}
    assert "avg" not in table["sa_t_seed1"]
    assert table["xsa_t_seed2"]["avg(arc_easy+boolq+piqa)"].endswith("(30)")
    assert table["xsa_t_seed2"]["avg(arc_easy+boolq)"].endswith("(10)")
    assert table["sa_t_seed1"]["avg(arc_easy+boolq)"] == "–"
    assert "3 different sets of downstream tasks" in markdown


def test_compare_md_states_the_measured_coverage_of_its_intervals(runs, tmp_path):
    """Below the table of differences: the t interval's coverage measured by simulation, skewed differences'
    shortfall included, and the warning that fewer than 5 pairs cannot show skew."""
    compare = load_compare()
    markdown = compare_markdown(str(tmp_path / "cmp"), os.path.join(runs, "*"))
    note = next(line for line in markdown.splitlines() if line.startswith("How well the 95% intervals cover"))
    for kind in ("exponential", "lognormal"):
        assert f"{100 * compare.T_COVERAGE[3][kind]:.0f}%" in note
    assert "fewer than 5 pairs (3 here)" in note  # lr1e-3 has 3 pairs, lr2e-3 has 5
