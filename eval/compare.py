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
standard deviation and a 95% confidence interval (Student t) of the paired difference.

In the plot a setting has one colour and a variant one line style (SA dashed, XSA solid, gated XSA
dotted); several seeds are drawn thin with their mean bold. A third panel shows each variant's
paired validation-loss difference from SA over training. --val_metric=val_bpb compares bits per byte instead.

Runs that evaluated in the loop (train.py's downstream_interval, similarity_interval) also get in_loop.png:
the downstream average and each task's accuracy against tokens, the mean cos(y_i, v_i) against tokens and
cos(y_i, v_i) by layer at the last step (the paper's Figure 1), several seeds as their mean with a 95%
interval; and a table of each run's last values in compare.md.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.compare", file=sys.stderr)
    sys.exit(2)

import glob
import json
import math
import os
import re
import statistics

import scipy.stats

from eval import common
from pretrain import exits
from pretrain.metrics import read_metrics
from pretrain.train_config import BOOKKEEPING_KEYS, PAIRING_KEYS, TRAIN_KEYS, VARIANT_KEYS, variant_name

BASELINE = tuple(TRAIN_KEYS[k].default for k in VARIANT_KEYS)  # train.py's default attention: SA
# the validation metrics compared (--val_metric): their names in titles and sentences, and in table headers
VAL_METRICS = {"val_loss": ("validation loss", "loss"), "val_bpb": ("validation bits per byte", "bpb")}


# -----------------------------------------------------------------------------
# statistics


def paired_stats(diffs, confidence=0.95):
    """Mean, sample standard deviation and confidence interval of the differences (None where n < 2)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "ci": None}
    std = statistics.stdev(diffs)
    ci = scipy.stats.t.interval(confidence, n - 1, loc=mean, scale=std / math.sqrt(n))
    return {"n": n, "mean": mean, "std": std, "ci": tuple(float(x) for x in ci)}


# -----------------------------------------------------------------------------
# runs


class Run:
    """One run directory: its resolved config and its metrics, one record per step."""

    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            info = json.load(f)
        self.config = info.get("config", info)
        self.name = self.config.get("wandb_run_name") or os.path.basename(os.path.normpath(path))
        # a key that the run's train.py did not have yet has its default (no xsa_gate: plain XSA)
        self.variant = tuple(self.config.get(k, TRAIN_KEYS[k].default) for k in VARIANT_KEYS)
        self.seed = self.config.get("seed")
        by_step = {r["step"]: r for r in read_metrics(os.path.join(path, "metrics.jsonl")) if "step" in r}
        self.records = [by_step[s] for s in sorted(by_step)]  # a resumed run's last record per step wins

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
    not a run itself stands for the runs directly inside it."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for path in matches:
            if not os.path.isdir(path):
                continue
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
        runs.append(Run(path))
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


def fmt(x, signed=False):
    return "–" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")


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
    if unpaired:
        lines += ["", f"Runs without a partner of the same setting and seed (SA for a variant, a variant for SA): "
                      f"{', '.join(unpaired)}."]
    _, partial = setting_keys(runs)
    if partial:
        lines += ["", f"Not compared because only some runs' configs have them (other train.py versions): "
                      f"{', '.join(partial)}."]
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
    ax_val.legend(handles=handles, fontsize="small")
    return common.save_figure(fig, out, "compare.png")


# -----------------------------------------------------------------------------
# in-loop evaluation (train.py's downstream_interval and similarity_interval): accuracy and similarity bias


def in_loop_keys(runs):
    """(downstream task keys, the avg first; whether any run logged the similarity bias), from the records."""
    keys = {k for r in runs for record in r.records for k in record}
    tasks = sorted(k for k in keys if k.startswith("downstream/") and k != "downstream/avg")
    return (["downstream/avg"] + tasks if tasks else []), "similarity/mean_cos_yv" in keys


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
    panels = [(key, key.removeprefix("downstream/").replace("avg", "downstream average")) for key in accuracy]
    if similarity:
        panels += [("similarity/mean_cos_yv", "mean cos(y_i, v_i) over layers"),
                   ("layers", "cos(y_i, v_i) by layer, last step")]
    columns = min(3, len(panels))
    n_rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(5.5 * columns, 4 * n_rows), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {label: palette[i % len(palette)] for i, (label, _) in enumerate(settings)}
    styles = line_styles(runs)
    drawn = {}
    for ax, (key, title) in zip(axes.flat, panels):
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
        if key == "layers":
            from matplotlib.ticker import MaxNLocator
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=title, xlabel="layer" if key == "layers" else "tokens",
               ylabel="accuracy" if key.startswith("downstream/") else "cosine")
        ax.grid(alpha=0.3)
        drawn[title] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    return common.save_figure(fig, out, "in_loop.png"), drawn


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
    if not runs:
        exits.fail(f"no run directories (with metrics.jsonl and config.json) in {' '.join(args.runs)}")
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
