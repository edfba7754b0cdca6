"""
SA against the other attention variants (XSA, gated XSA, ...) from the run directories alone
(metrics.jsonl and config.json; no wandb account): a PNG of the train and validation loss curves and
a markdown table of the final validation losses and each variant's difference from SA.

    python -m eval.compare out/sweep_lr/*                          # writes out/eval/compare.png, compare.md
    python -m eval.compare 'out/small_study/*' --out out/small_study --smooth 0.9
    python -m eval.compare out/sweep_seqlen --out out/sweep_seqlen  # a directory of run directories

pretrain/train_config.py declares the key groups used here. A run's *variant* is its VARIANT_KEYS (attn_type,
xsa_gate, xsa_layers), named by train_config.variant_name ("sa", "xsa", "xsa_gate", "xsa_last4",
"xsa_blocks0-5"); a run whose config predates a variant key has that key's default (no xsa_gate:
plain XSA).
A *setting* is a run's resolved config without the variant keys, the PAIRING_KEYS (seed, data_seed)
and the BOOKKEEPING_KEYS (where and how a run was logged: out_dir, wandb names, init_from, ...).
Within a setting SA is the baseline, and every other variant is compared with it: a run of that
variant and an SA run with the same seeds form a pair (same initialisation, same batches). Each pair
is compared at the last step both evaluated. With several pairs the table gives the mean, the
standard deviation and a 95% confidence interval (Student t) of the paired difference, and a note of what
that interval's coverage, measured by simulation (T_COVERAGE), is worth: it falls short for skewed differences.

find_runs checks what it reads (eval/scaling.py reads its runs through it too): a non-finite value in
metrics.jsonl (a skipped step: NaN, Infinity) is left out and named in a warning line; a run whose config.json
or metrics.jsonl cannot be read is left out with a warning line naming the file; a path that does not exist is
an error in one line (exit status 3), and so is nothing usable left.

In the plot a setting has one colour and a variant one line style (SA dashed, XSA solid, gated XSA
dotted); several seeds are drawn thin with their mean bold. A third panel shows each variant's
paired validation-loss difference from SA over training. --val_metric=val_bpb compares bits per byte instead.

Runs that evaluated in the loop (train.py's downstream_interval, similarity_interval) also get in_loop.png:
the downstream average and each task's accuracy against tokens, the mean cos(y_i, v_i) against tokens and
cos(y_i, v_i) by layer at the last step (the paper's Figure 1), several seeds as their mean with a 95%
interval; and a table of each run's last values in compare.md. Averages over different task sets (other
downstream_tasks, or a resume that changed them) are drawn and tabulated apart, each named by its tasks.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.compare", file=sys.stderr)
    sys.exit(2)

import collections
import glob
import json
import math
import os
import re
import statistics

from eval import common
from eval.common import fmt, t_quantile
from pretrain import exits
from pretrain.train_config import BOOKKEEPING_KEYS, PAIRING_KEYS, TRAIN_KEYS, VARIANT_KEYS, variant_name

BASELINE = tuple(TRAIN_KEYS[k].default for k in VARIANT_KEYS)  # train.py's default attention: SA
# the validation metrics compared (--val_metric): their names in titles and sentences, and in table headers
AVG = "downstream/avg"  # the mean of a record's downstream/<task> accuracies
VAL_METRICS = {"val_loss": ("validation loss", "loss"), "val_bpb": ("validation bits per byte", "bpb")}


# -----------------------------------------------------------------------------
# statistics


def paired_stats(diffs, confidence=0.95):
    """Mean, sample standard deviation and confidence interval (Student t) of the differences (None where
    n < 2). Its coverage, measured by simulation, is in T_COVERAGE."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "ci": None}
    std = statistics.stdev(diffs)
    half = t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci": (mean - half, mean + half)}


# Coverage of paired_stats' 95% interval, measured by simulation from a known mean (200,000 draws each, numpy
# seed 0; tests/test_interval_coverage.py re-measures them on the function itself): the differences drawn
# from a normal, a heavy-tailed symmetric (Student t, 3 df), a skewed (exponential) and a strongly skewed
# (lognormal, sigma 1) distribution, by the number of pairs.
T_COVERAGE = {3: {"normal": 0.950, "t3": 0.962, "exponential": 0.884, "lognormal": 0.837},
              5: {"normal": 0.950, "t3": 0.962, "exponential": 0.883, "lognormal": 0.820}}
# Coverage of band's pointwise 95% interval for seeds' accuracies on a task of `examples` examples (each
# seed's accuracy binomial, p = 0.3; 200,000 draws each, numpy seed 0): with few examples the seeds often
# tie, and the band has no width.
BAND_COVERAGE = {(4, 3): 0.893, (4, 5): 0.941, (20, 3): 0.956, (100, 3): 0.952}


def percent(x):
    return f"{100 * x:.0f}%"


def coverage_note(pairs):
    """What the 95% intervals of the comparison table are worth, in words, for the numbers of pairs they
    are over: the measured coverage (T_COVERAGE), and where it falls short."""
    c3, c5 = T_COVERAGE[3], T_COVERAGE[5]
    note = ("How well the 95% intervals cover: the Student t interval assumes roughly normal differences between "
            "the seed pairs. Measured by simulation from a known mean, it covers "
            f"{percent(c3['normal'])} for normal and {percent(c3['t3'])} for heavy-tailed symmetric (t, 3 df) "
            f"differences, but only {percent(c3['exponential'])} for skewed (exponential) and "
            f"{percent(c3['lognormal'])} for strongly skewed (lognormal) differences at 3 pairs "
            f"({percent(c5['exponential'])} and {percent(c5['lognormal'])} at 5 pairs).")
    if min(pairs) < 5:
        note += (f" With fewer than 5 pairs ({'/'.join(map(str, sorted(set(p for p in pairs if p < 5))))} here) "
                 "the differences cannot show whether they are skewed: the interval assumes they are roughly "
                 "normal, and under-covers if they are not.")
    return note


def band_note(seeds):
    """What the shaded band of in_loop.png is worth, for the numbers of seeds it is over."""
    return (f"The shaded band in in_loop.png is, at each point, the 95% Student t interval over the seeds' values "
            f"({'/'.join(map(str, sorted(seeds)))} seeds): pointwise, not for the whole curve. Measured by "
            f"simulation, it covers {percent(T_COVERAGE[3]['normal'])} for normal values, less for skewed ones "
            f"({percent(T_COVERAGE[3]['exponential'])} for exponential at 3 seeds), and for accuracies on 100 "
            f"examples or more {percent(BAND_COVERAGE[100, 3])} at 3 seeds; on a handful of examples "
            f"(downstream_limit 4) the seeds' accuracies often tie and the band has no width: "
            f"{percent(BAND_COVERAGE[4, 3])} at 3 seeds, {percent(BAND_COVERAGE[4, 5])} at 5.")


# -----------------------------------------------------------------------------
# runs


class RunError(ValueError):
    """A run directory that cannot be read: the message names the file and what is wrong with it."""


def read_config(path):
    """The resolved config (a dict) of config.json at path; RunError naming the file where it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: cannot read the run's config ({exits.one_line(e)})") from None
    config = info.get("config", info) if isinstance(info, dict) else info
    if not isinstance(config, dict):
        raise RunError(f"{path}: not a run's config (a JSON object of config keys, as train.py writes it), "
                       f"a JSON {type(config).__name__}")
    return config


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_records(path):
    """The records of metrics.jsonl at path, and the values left out because they are not finite, as
    [(key, step)]. A torn last line (a killed run) is skipped; any other line that is not a JSON object
    with an integer step and numbers for values is a RunError naming the file and the line. train.py
    logs a skipped non-finite step as it is (NaN, Infinity in the JSON): those values are left out, the
    rest of their record kept."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise RunError(f"{path}: cannot read the run's metrics ({exits.one_line(e)})") from None
    records, non_finite = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        torn = number == len(lines)  # the last line has no newline: a run killed while writing it
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if torn:
                continue
            raise RunError(f"{path}, line {number}: not valid JSON ({exits.one_line(e)}); a metrics.jsonl "
                           "holds one JSON object per line") from None
        if not isinstance(record, dict):
            raise RunError(f"{path}, line {number}: a JSON {type(record).__name__}, not a record (a JSON object)")
        bad = [k for k, v in record.items() if not (v is None or is_number(v))]
        if "step" in record and not isinstance(record["step"], int) or bad:
            key = "step" if "step" in record and not isinstance(record["step"], int) else bad[0]
            raise RunError(f"{path}, line {number}: {key} is {json.dumps(record[key])[:40]}, not a number"
                           + (" (an integer step)" if key == "step" else ""))
        for key, value in list(record.items()):
            if isinstance(value, float) and not math.isfinite(value):
                non_finite.append((key, record.get("step")))
                del record[key]
        records.append(record)
    return records, non_finite


def describe_non_finite(path, non_finite):
    """One line naming the non-finite values left out of a metrics.jsonl: the key and its steps."""
    steps = {}
    for key, step in non_finite:
        steps.setdefault(key, []).append(step)
    return (f"{path}: non-finite values left out: "
            + "; ".join(f"{key} at step{'s' * (len(s) > 1)} {', '.join(map(str, s[:5]))}"
                        + (f" and {len(s) - 5} more" if len(s) > 5 else "") for key, s in steps.items()))


class Run:
    """One run directory: its resolved config and its metrics, one record per step. A file that cannot be read
    is a RunError naming it; non-finite values are left out of the records, named in self.warnings."""

    def __init__(self, path):
        self.path = path
        self.config = read_config(os.path.join(path, "config.json"))
        self.name = str(self.config.get("wandb_run_name") or os.path.basename(os.path.normpath(path)))
        # a key that the run's train.py did not have yet has its default (no xsa_gate: plain XSA)
        self.variant = tuple(self.config.get(k, TRAIN_KEYS[k].default) for k in VARIANT_KEYS)
        self.seed = self.config.get("seed")
        metrics = os.path.join(path, "metrics.jsonl")
        records, non_finite = read_records(metrics)
        self.warnings = [describe_non_finite(metrics, non_finite)] if non_finite else []
        by_step = {r["step"]: r for r in records if "step" in r}
        self.records = [by_step[s] for s in sorted(by_step)]  # a resumed run's last record per step wins
        for record in self.records:  # each average also under a key naming its tasks (see in_loop_keys)
            if record.get(AVG) is not None:
                record[average_key(record)] = record[AVG]
        try:
            hash(self.variant)
        except TypeError:
            raise RunError(f"{os.path.join(path, 'config.json')}: the attention keys "
                           f"{', '.join(VARIANT_KEYS)} are {self.variant}, not plain values") from None

    def curve(self, key, x="step"):
        """(steps, values) of a metric, where logged; x="tokens": (tokens seen, values)."""
        points = [(r[x], r[key]) for r in self.records if r.get(key) is not None and r.get(x) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def final_val(self, metric="val_loss"):
        """(step, value) of the validation metric (val_loss or val_bpb) at the last evaluation, or (None, None)."""
        steps, values = self.curve(metric)
        return (steps[-1], values[-1]) if steps else (None, None)

    def setting_key(self, keys):
        """The run's values of the given config keys, hashable."""
        return tuple((k, repr(self.config[k])) for k in sorted(keys))

    @property
    def label(self):
        return variant_label(self.variant)


def average_key(record):
    """The key of a record's downstream average that names the tasks it averages, from the record's
    downstream/<task> keys: 'downstream/avg(arc_easy+piqa)'. A run evaluates the tasks of its
    downstream_tasks, which a resume may change mid-run."""
    tasks = sorted(k.removeprefix("downstream/") for k in record
                   if k.startswith("downstream/") and not k.startswith(AVG))
    return f"{AVG}({'+'.join(tasks) or 'tasks not logged'})"


def variant_label(variant):
    """The variant's name (train_config.variant_name): 'sa', 'xsa', 'xsa_gate', 'xsa_last4'."""
    return variant_name(dict(zip(VARIANT_KEYS, variant)))


def variant_title(variant):
    """The variant as headings and legends name it, the attention type in capitals: 'SA', 'XSA',
    'XSA+gate', 'XSA+last4'."""
    attn_type, _, extras = variant_label(variant).partition("_")
    return attn_type.upper() + ("+" + extras.replace("_", "+") if extras else "")


def find_runs(patterns):
    """Run directories (with metrics.jsonl and config.json) from paths or globs; a directory that is
    not a run itself stands for the runs directly inside it. A path that does not exist, or is a file, or
    a glob that matches nothing ends the program in one line naming it (exit status 3); a run whose files
    cannot be read is left out with a warning line on stderr naming the file."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                exits.fail(f"{pattern} matches nothing; give run directories, directories of runs or globs of them")
            matches = [m for m in matches if os.path.isdir(m)]  # a glob also matches the reports beside the runs
        elif not os.path.exists(pattern):
            exits.fail(f"{pattern}: no such directory; give run directories, directories of runs or globs of them")
        elif not os.path.isdir(pattern):
            exits.fail(f"{pattern} is a file; give run directories (with metrics.jsonl and config.json), "
                       "directories of runs or globs of them")
        else:
            matches = [pattern]
        for path in matches:
            if os.path.exists(os.path.join(path, "metrics.jsonl")):
                paths.append(path)
            else:
                paths += sorted(os.path.join(path, d) for d in os.listdir(path)
                                if os.path.exists(os.path.join(path, d, "metrics.jsonl")))
    runs, seen = [], set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"warning: {path} has metrics.jsonl but no config.json; left out", file=sys.stderr)
            continue
        try:
            run = Run(path)
        except RunError as e:
            print(f"warning: {e}; run left out", file=sys.stderr)
            continue
        for w in run.warnings:
            print(f"warning: {w}", file=sys.stderr)
        runs.append(run)
    return runs


def short_name(run):
    """The run name without its variant prefix (sa_, xsa_, xsa_gate_) and _seed<N> suffix:
    'sa_1p4b_lr1e-4_seed2' -> '1p4b_lr1e-4'."""
    return re.sub(r"_seed\d+$", "", re.sub(r"^x?sa_(gated?_)?", "", run.name))


def setting_keys(runs):
    """The config keys that tell settings apart: all but the variant, pairing and bookkeeping keys,
    and only those every run has (runs made by different versions of train.py may lack newer keys).
    Returns (keys, keys left out because some runs lack them)."""
    shared = set.intersection(*(set(r.config) for r in runs))
    every = set.union(*(set(r.config) for r in runs))
    ignored = set(VARIANT_KEYS) | set(PAIRING_KEYS) | set(BOOKKEEPING_KEYS)
    return shared - ignored, sorted(every - shared - ignored)


def group_settings(runs):
    """[(label, [runs])] in the order settings first appear. A label is the runs' common short name
    where that names each setting uniquely, else the config keys in which the settings differ."""
    keys, _ = setting_keys(runs)
    settings = {}
    for run in runs:
        settings.setdefault(run.setting_key(keys), []).append(run)
    keys = list(settings)
    names = [{short_name(r) for r in settings[k]} for k in keys]
    if all(len(n) == 1 for n in names) and len({next(iter(n)) for n in names}) == len(keys):
        labels = [next(iter(n)) for n in names]
    else:
        varying = sorted({k for key in keys for k, v in key if len({dict(o).get(k) for o in keys}) > 1})
        labels = [", ".join(f"{k}={dict(key).get(k, 'None')}" for k in varying) or "all" for key in keys]
    return [(label, settings[key]) for label, key in zip(labels, keys)]


def runs_by_variant(runs):
    """{variant: {pairing values: run}} and a list of warnings. The pairing values are those of the
    PAIRING_KEYS that every run has (runs made by an older train.py may lack data_seed)."""
    keys = [k for k in PAIRING_KEYS if all(k in r.config for r in runs)]
    by_variant, warnings = {}, []
    for run in runs:
        pairing = tuple(run.config[k] for k in keys)
        same = by_variant.setdefault(run.variant, {})
        if pairing in same:
            warnings.append(f"{run.path}: a second {run.label} run with seed {run.seed}; using {same[pairing].path}")
            continue
        same[pairing] = run
    return by_variant, warnings


def paired_final_val(sa, other, metric="val_loss"):
    """(step, sa_val, other_val) of the validation metric at the last step both runs evaluated, or None."""
    sa_vals = dict(zip(*sa.curve(metric)))
    other_vals = dict(zip(*other.curve(metric)))
    both = sorted(set(sa_vals) & set(other_vals))
    return (both[-1], sa_vals[both[-1]], other_vals[both[-1]]) if both else None


# -----------------------------------------------------------------------------
# table


def comparison(settings, metric="val_loss"):
    """One row per setting and variant other than SA: that variant's pairs with SA and the numbers and
    statistics of the second table (a setting with SA runs alone gets one row, variant None). Also
    returns the runs in no pair, and warnings."""
    rows, unpaired, warnings = [], [], []
    for label, runs in settings:
        by_variant, w = runs_by_variant(runs)
        warnings += w
        baseline = by_variant.get(BASELINE, {})
        others = sorted((v for v in by_variant if v != BASELINE), key=variant_label)
        paired = set()
        for variant in others:
            pairs = {key: (baseline[key], run) for key, run in by_variant[variant].items() if key in baseline}
            paired.update(id(r) for pair in pairs.values() for r in pair)
            compared = [v for v in (paired_final_val(sa, other, metric) for sa, other in pairs.values())
                        if v is not None]
            row = {"setting": label, "variant": variant, "pairs": pairs, "n": len(compared),
                   "steps": sorted({step for step, _, _ in compared})}
            if compared:
                diffs = [other - sa for _, sa, other in compared]
                row.update(sa=statistics.fmean(sa for _, sa, _ in compared),
                           other=statistics.fmean(other for _, _, other in compared),
                           stats=paired_stats(diffs), lower=sum(d < 0 for d in diffs))
            rows.append(row)
        if not others:
            rows.append({"setting": label, "variant": None, "pairs": {}, "n": 0, "steps": []})
        unpaired += [r.name for r in runs if id(r) not in paired]
    return rows, unpaired, warnings


def markdown(runs, settings, rows, unpaired, warnings, metric="val_loss"):
    others = sorted({r.variant for r in runs if r.variant != BASELINE}, key=variant_label)
    baseline = variant_title(BASELINE)
    title = f"{baseline} vs {', '.join(map(variant_title, others))}" if others else f"{baseline} only"
    name, short = VAL_METRICS[metric]
    lines = [f"## {title}: {len(runs)} runs, {len(settings)} setting{'s' * (len(settings) != 1)}", "",
             f"Final {name} of each run (its last evaluation):", "",
             f"| run | setting | variant | seed | step | val {short} |", "|---|---|---|---|---|---|"]
    for label, setting_runs in settings:
        for run in setting_runs:
            step, val = run.final_val(metric)
            lines.append(f"| {run.name} | {label} | {run.label} | {run.seed} | {step if step else '–'} "
                         f"| {fmt(val)} |")
    lines += ["", f"Each variant − SA in {name} per setting (negative: the variant is better), pairs "
              "matched by seed and compared at the last step both evaluated; std and the 95% confidence "
              "interval (Student t) are over the pairs:", "",
              f"| setting | variant | pairs | step | SA {short} | variant {short} | variant − SA | std | 95% CI "
              "| variant lower |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        variant = "–" if row["variant"] is None else variant_label(row["variant"])
        if not row["n"]:
            why = "SA runs only" if row["variant"] is None else "no pair with SA"
            lines.append(f"| {row['setting']} | {variant} | 0 | – | – | – | – | – | – | {why} |")
            continue
        st = row["stats"]
        steps = "/".join(str(s) for s in row["steps"])
        ci = "–" if st["ci"] is None else f"[{st['ci'][0]:+.4f}, {st['ci'][1]:+.4f}]"
        lines.append(f"| {row['setting']} | {variant} | {st['n']} | {steps} | {fmt(row['sa'])} "
                     f"| {fmt(row['other'])} | {fmt(st['mean'], signed=True)} | {fmt(st['std'])} | {ci} "
                     f"| {row['lower']}/{st['n']} |")
    pairs = [row["stats"]["n"] for row in rows if row["n"] and row["stats"]["ci"] is not None]
    if pairs:
        lines += ["", coverage_note(pairs)]
    if unpaired:
        lines += ["", f"Runs without a partner of the same setting and seed (SA for a variant, a variant for SA): "
                      f"{', '.join(unpaired)}."]
    _, partial = setting_keys(runs)
    if partial:
        lines += ["", f"Not compared because only some runs' configs have them (other train.py versions): "
                      f"{', '.join(partial)}."]
    warnings = [w for r in runs for w in r.warnings] + warnings
    if warnings:
        lines += [""] + [f"Warning: {w}" for w in warnings]
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# plot


def ema(values, smooth):
    if not smooth:
        return values
    out, s = [], values[0]
    for v in values:
        s = smooth * s + (1.0 - smooth) * v
        out.append(s)
    return out


def mean_curve(curves):
    """The mean of several (steps, values) curves at the steps they all have."""
    common = sorted(set.intersection(*(set(s) for s, _ in curves)))
    lookups = [dict(zip(s, v)) for s, v in curves]
    return common, [statistics.fmean(lk[step] for lk in lookups) for step in common]


def loss_range(curves, skip=0.05):
    """A y-axis range that leaves out the first few percent of training (the loss starts near
    ln 50304 = 10.8 and would flatten the differences that matter), or None."""
    last = max((s[-1] for s, _ in curves if s), default=0)
    late = [v for s, vs in curves for step, v in zip(s, vs) if step >= skip * last]
    if not late:
        return None
    pad = 0.05 * (max(late) - min(late)) or 0.01
    return min(late) - pad, max(late) + pad


def line_styles(runs):
    """{variant: matplotlib line style}: SA dashed, then solid, dotted, dash-dotted in label order."""
    others = sorted({r.variant for r in runs if r.variant != BASELINE}, key=variant_label)
    styles = {BASELINE: "--"}
    styles.update((v, ("-", ":", "-.")[i % 3]) for i, v in enumerate(others))
    return styles


def plot(settings, rows, out, smooth=0.0, ylim=None, metric="val_loss"):
    """compare.png in out: train loss, the validation metric and its paired difference from SA, one colour
    per setting and one line style per variant."""
    plt = common.pyplot()
    from matplotlib.lines import Line2D

    fig, (ax_train, ax_val, ax_diff) = plt.subplots(1, 3, figsize=(17, 5))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {label: palette[i % len(palette)] for i, (label, _) in enumerate(settings)}
    styles = line_styles([r for _, runs in settings for r in runs])
    for ax, key, title in ((ax_train, "train_loss", "train loss" + (f" (EMA {smooth})" if smooth else "")),
                           (ax_val, metric, VAL_METRICS[metric][0])):
        drawn = []
        for label, runs in settings:
            for variant, style in styles.items():
                curves = [r.curve(key) for r in runs if r.variant == variant]
                curves = [(s, ema(v, smooth) if key == "train_loss" else v) for s, v in curves if s]
                for s, v in curves:
                    ax.plot(s, v, style, color=colours[label], lw=0.8 if len(curves) > 1 else 1.5,
                            alpha=0.35 if len(curves) > 1 else 1.0)
                if len(curves) > 1:
                    ax.plot(*mean_curve(curves), style, color=colours[label], lw=1.8)
                drawn += curves
        ax.set(title=title, xlabel="step", ylabel="loss" if key != "val_bpb" else "bits per byte")
        ylim_here = ylim or loss_range(drawn)
        if ylim_here:
            ax.set_ylim(*ylim_here)
        ax.grid(alpha=0.3)

    for row in rows:
        diffs = []
        for sa, other in row["pairs"].values():
            sa_vals, other_vals = dict(zip(*sa.curve(metric))), dict(zip(*other.curve(metric)))
            steps = sorted(set(sa_vals) & set(other_vals))
            if steps:
                diffs.append((steps, [other_vals[s] - sa_vals[s] for s in steps]))
        colour, style = colours[row["setting"]], styles.get(row["variant"], "-")
        for s, d in diffs:
            ax_diff.plot(s, d, style, marker="o", color=colour, ms=2, lw=0.8 if len(diffs) > 1 else 1.5,
                         alpha=0.35 if len(diffs) > 1 else 1.0)
        if len(diffs) > 1:
            ax_diff.plot(*mean_curve(diffs), style, color=colour, lw=1.8)
    ax_diff.axhline(0.0, color="black", lw=0.8)
    ax_diff.set(title=f"{VAL_METRICS[metric][0]}, variant − SA (paired by seed)", xlabel="step",
                ylabel="difference")
    ax_diff.grid(alpha=0.3)

    handles = [Line2D([], [], color=colour, lw=2, label=label) for label, colour in colours.items()]
    handles += [Line2D([], [], color="grey", ls=style, label=variant_title(v)) for v, style in styles.items()]
    for ax in (ax_train, ax_val, ax_diff):  # each panel readable on its own
        ax.legend(handles=handles, fontsize="small")
    return common.save_figure(fig, out, "compare.png")


# -----------------------------------------------------------------------------
# in-loop evaluation (train.py's downstream_interval and similarity_interval): accuracy and similarity bias


def in_loop_keys(runs):
    """(downstream keys, the average first; whether any run logged the similarity bias), from the records.
    Averages over different task sets (runs with other downstream_tasks, or a resume that changed them) are
    never one curve: where the runs' records average more than one set, each set has its own key,
    'downstream/avg(arc_easy+piqa)' (average_key), in place of downstream/avg."""
    keys = {k for r in runs for record in r.records for k in record}
    tasks = sorted(k for k in keys if k.startswith("downstream/") and not k.startswith(AVG))
    averages = sorted(k for k in keys if k.startswith(AVG + "("))
    averages = [AVG] if len(averages) == 1 else averages
    return (averages + tasks if tasks or averages else []), "similarity/mean_cos_yv" in keys


def average_title(key):
    """A panel's title for a downstream average key: 'downstream average', or 'downstream average of arc_easy,
    piqa' where the runs averaged different task sets."""
    tasks = key.removeprefix(AVG)
    return "downstream average" + (f" of {tasks.strip('()').replace('+', ', ')}" if tasks else "")


def band(curves, confidence=0.95):
    """(tokens, mean, low, high) of several runs' (tokens, values) curves at the tokens they all have: the mean
    and its Student t interval over the runs (low = high = mean for one run)."""
    tokens, mean = mean_curve(curves)
    lookups = [dict(zip(t, v)) for t, v in curves]
    low, high = list(mean), list(mean)
    if len(curves) > 1:
        for i, at in enumerate(tokens):
            ci = paired_stats([lk[at] for lk in lookups], confidence)["ci"]
            low[i], high[i] = ci
    return tokens, mean, low, high


def last_layers(run):
    """cos(y_i, v_i) by layer at the run's last similarity step: (step, [value per layer]) or None."""
    steps, _ = run.curve("similarity/mean_cos_yv")
    if not steps:
        return None
    record = next(r for r in run.records if r["step"] == steps[-1])
    values, i = [], 0
    while f"similarity/layer{i}/cos_yv" in record:
        values.append(record[f"similarity/layer{i}/cos_yv"])
        i += 1
    return steps[-1], values


def plot_in_loop(settings, out):
    """in_loop.png in out: the downstream average and each task's accuracy against tokens, the mean cos(y_i, v_i)
    against tokens, and cos(y_i, v_i) by layer at the last step (the paper's Figure 1), one colour per setting,
    one line style per variant; several seeds are drawn as their mean with the 95% interval shaded. Returns
    the path and what each panel drew, {panel title: {line label: (x, y)}}, read back from the figure."""
    plt = common.pyplot()
    runs = [r for _, rs in settings for r in rs]
    accuracy, similarity = in_loop_keys(runs)
    panels = [(key, average_title(key) if key.startswith(AVG) else key.removeprefix("downstream/"))
              for key in accuracy]
    if similarity:
        panels += [("similarity/mean_cos_yv", "mean cos(y_i, v_i) over layers"),
                   ("layers", "cos(y_i, v_i) by layer, last step")]
    columns = min(3, len(panels))
    n_rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(5.5 * columns, 4 * n_rows), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {label: palette[i % len(palette)] for i, (label, _) in enumerate(settings)}
    styles = line_styles(runs)
    drawn, legends = {}, {}
    for ax, (key, title) in zip(axes.flat, panels):
        shaded = False
        for label, setting_runs in settings:
            for variant, style in styles.items():
                chosen = [r for r in setting_runs if r.variant == variant]
                name = f"{label} {variant_title(variant)}"
                if key == "layers":
                    found = [v for v in map(last_layers, chosen) if v]
                    if found:
                        depth = min(len(v) for _, v in found)
                        values = [statistics.fmean(v[i] for _, v in found) for i in range(depth)]
                        ax.plot(range(depth), values, style, marker="o", color=colours[label], label=name)
                    continue
                curves = [c for c in (r.curve(key, x="tokens") for r in chosen) if c[0]]
                if not curves:
                    continue
                tokens, mean, low, high = band(curves)
                ax.plot(tokens, mean, style, marker="o", ms=3, color=colours[label], label=name)
                if len(curves) > 1:
                    ax.fill_between(tokens, low, high, color=colours[label], alpha=0.15, lw=0)
                    shaded = True
        if key == "layers":
            from matplotlib.ticker import MaxNLocator
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=title, xlabel="layer" if key == "layers" else "tokens",
               ylabel="accuracy" if key.startswith("downstream/") else "cosine")
        ax.grid(alpha=0.3)
        drawn[title] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        if ax.lines:  # each panel its own legend: a panel may draw only some settings or variants
            ax.legend(fontsize="small", title="mean, 95% band over seeds" if shaded else None,
                      title_fontsize="small")
            legends[title] = [t.get_text() for t in ax.get_legend().get_texts()]
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    return common.save_figure(fig, out, "in_loop.png"), drawn, legends


def in_loop_markdown(settings):
    """A markdown table of each run's last in-loop values: downstream accuracies (percent), mean cos(y_i, v_i)
    and val_bpb, each at the last step that logged it; "" when no run logged any."""
    runs = [r for _, rs in settings for r in rs]
    accuracy, similarity = in_loop_keys(runs)
    if not accuracy and not similarity:
        return ""
    keys = accuracy + (["similarity/mean_cos_yv"] if similarity else []) + ["val_bpb"]
    names = [k.removeprefix("downstream/").removeprefix("similarity/") for k in keys]
    lines = ["", "In-loop evaluation, each run's last logged value (accuracy in percent; step in brackets):", "",
             "| run | setting | variant | seed | " + " | ".join(names) + " |", "|---" * (4 + len(keys)) + "|"]
    for label, setting_runs in settings:
        for run in setting_runs:
            cells = []
            for key in keys:
                steps, values = run.curve(key)
                scale = 100 if key.startswith("downstream/") else 1
                cells.append(f"{scale * values[-1]:.{2 if scale == 100 else 4}f} ({steps[-1]})" if steps else "–")
            lines.append(f"| {run.name} | {label} | {run.label} | {run.seed} | " + " | ".join(cells) + " |")
    averages = [k for k in accuracy if k.startswith(AVG + "(")]
    if averages:
        lines += ["", f"These runs averaged {len(averages)} different sets of downstream tasks (their "
                      "downstream_tasks, or a resume that changed them): each set's average is a column and a panel of its own, "
                      + ", ".join(name for key, name in zip(keys, names) if key in averages) + "."]
    seeds = {n for _, setting_runs in settings for n in collections.Counter(r.variant for r in setting_runs).values()
             if n > 1}
    if seeds:
        lines += ["", band_note(seeds)]
    return "\n".join(lines) + "\n"


def main():
    parser = common.make_parser(__doc__.split("\n\n")[0], checkpoints=None, device=False,
                                out="compare.png, compare.md and, for runs with in-loop evaluation, in_loop.png")
    parser.add_argument("runs", nargs="+", help="run directories or globs (quoted), or directories of runs")
    parser.add_argument("--smooth", type=float, default=0.0,
                        help="EMA factor for the train-loss curves, 0 (none) to <1, e.g. 0.9")
    parser.add_argument("--ylim", type=float, nargs=2, metavar=("LOW", "HIGH"), help="loss axis range")
    parser.add_argument("--val_metric", choices=list(VAL_METRICS), default="val_loss",
                        help="what the validation panels and tables compare: the loss in nats per token, or bits "
                             "per byte of the text (independent of the tokenizer)")
    args = parser.parse_args()
    if not 0.0 <= args.smooth < 1.0:
        parser.error("--smooth must be in [0, 1)")
    out = common.output_dir(args.out)

    runs = find_runs(args.runs)
    if not any(r.records for r in runs):
        exits.fail(f"no usable runs (run directories with metrics.jsonl records and config.json) in "
                   f"{' '.join(args.runs)}")
    settings = group_settings(runs)
    rows, unpaired, warnings = comparison(settings, args.val_metric)
    table = markdown(runs, settings, rows, unpaired, warnings, args.val_metric) + in_loop_markdown(settings)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    path = common.write_text(out, "compare.md", table)
    plot(settings, rows, out, args.smooth, args.ylim, args.val_metric)
    written = "compare.png"
    if any(in_loop_keys(runs)):
        plot_in_loop(settings, out)
        written += " and in_loop.png"
    print(table)
    print(f"wrote {path}, {written}")


if __name__ == "__main__":
    main()
