"""
SA against XSA from the run directories alone (metrics.jsonl and config.json; no wandb account):
a PNG of the train and validation loss curves and a markdown table of the final validation losses
and the XSA - SA differences.

    python eval/compare.py out/sweep_lr/*                          # writes compare.png, compare.md
    python eval/compare.py 'out/small_study/*' --out out/small_study/compare --smooth 0.9
    python eval/compare.py out/sweep_seqlen                        # a directory of run directories

A *setting* is a run's resolved config without attn_type, seed and the keys that only say where
and how a run was logged (out_dir, wandb names, init_from, ...): SA and XSA runs of one setting
are compared, and within a setting an SA and an XSA run with the same seed form a pair (same
initialisation seed, same batches). Each pair is compared at the last step both evaluated. With
several pairs the table gives the mean, the standard deviation and a 95% confidence interval
(Student t) of the paired difference.

In the plot a setting has one colour: SA dashed, XSA solid; several seeds are drawn thin with
their mean bold. A third panel shows the paired XSA - SA validation-loss difference over training.
"""

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrics import read_metrics  # noqa: E402

# keys that say where and how a run was logged, launched or parallelised, not what was trained
BOOKKEEPING_KEYS = {"out_dir", "wandb_log", "wandb_project", "wandb_group", "wandb_run_name", "init_from",
                    "log_interval", "checkpoint_interval", "keep_checkpoints", "skip_nonfinite_steps",
                    "device", "compile", "backend", "parallelism", "reshard_after_forward",
                    "activation_checkpointing"}
# what a comparison varies within a setting: the attention, and the seed that pairs SA with XSA
PAIRING_KEYS = {"attn_type", "seed", "data_seed"}


# -----------------------------------------------------------------------------
# Student t quantile without scipy: the CDF from the regularized incomplete beta function
# (continued fraction, as in Numerical Recipes), inverted by bisection


def _beta_continued_fraction(a, b, x):
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def regularized_beta(a, b, x):
    """I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # where the continued fraction converges fast
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p, df):
    """The p-quantile of Student's t with df degrees of freedom (p > 0.5)."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"t_quantile needs 0.5 < p < 1, got {p}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_stats(diffs, confidence=0.95):
    """Mean, sample standard deviation and confidence interval of the differences (None where n < 2)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "ci": None}
    std = statistics.stdev(diffs)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci": (mean - half, mean + half)}


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
        self.attn_type = self.config.get("attn_type", "sa")
        self.seed = self.config.get("seed")
        by_step = {r["step"]: r for r in read_metrics(os.path.join(path, "metrics.jsonl")) if "step" in r}
        self.records = [by_step[s] for s in sorted(by_step)]  # a resumed run's last record per step wins

    def curve(self, key):
        """(steps, values) of a metric, where logged."""
        points = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def final_val(self):
        """(step, val_loss) of the last evaluation, or (None, None)."""
        steps, values = self.curve("val_loss")
        return (steps[-1], values[-1]) if steps else (None, None)

    def setting_key(self, keys):
        """The run's values of the given config keys, hashable."""
        return tuple((k, repr(self.config[k])) for k in sorted(keys))


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
    """The run name without its sa_/xsa_ prefix and _seed<N> suffix: 'sa_1p4b_lr1e-4_seed2' -> '1p4b_lr1e-4'."""
    return re.sub(r"_seed\d+$", "", re.sub(r"^x?sa_", "", run.name))


def setting_keys(runs):
    """The config keys that tell settings apart: all but the pairing and bookkeeping keys, and only
    those every run has (runs made by different versions of train.py may lack newer keys).
    Returns (keys, keys left out because some runs lack them)."""
    common = set.intersection(*(set(r.config) for r in runs))
    every = set.union(*(set(r.config) for r in runs))
    ignored = BOOKKEEPING_KEYS | PAIRING_KEYS
    return common - ignored, sorted(every - common - ignored)


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


def pairs_by_seed(runs):
    """{seed: (sa_run, xsa_run)} for the seeds that have both, and a list of warnings."""
    by_attn, warnings = {"sa": {}, "xsa": {}}, []
    for run in runs:
        if run.attn_type not in by_attn:
            continue
        if run.seed in by_attn[run.attn_type]:
            warnings.append(f"{run.path}: a second {run.attn_type} run with seed {run.seed}; "
                            f"using {by_attn[run.attn_type][run.seed].path}")
            continue
        by_attn[run.attn_type][run.seed] = run
    seeds = sorted(set(by_attn["sa"]) & set(by_attn["xsa"]), key=repr)
    return {s: (by_attn["sa"][s], by_attn["xsa"][s]) for s in seeds}, warnings


def paired_final_val(sa, xsa):
    """(step, sa_val, xsa_val) at the last step both runs evaluated, or None."""
    sa_vals = dict(zip(*sa.curve("val_loss")))
    xsa_vals = dict(zip(*xsa.curve("val_loss")))
    common = sorted(set(sa_vals) & set(xsa_vals))
    return (common[-1], sa_vals[common[-1]], xsa_vals[common[-1]]) if common else None


# -----------------------------------------------------------------------------
# table


def fmt(x, signed=False):
    return "–" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")


def comparison(settings):
    """Per setting: the pairs' numbers and statistics (the content of the second table)."""
    rows, warnings = [], []
    for label, runs in settings:
        pairs, w = pairs_by_seed(runs)
        warnings += w
        compared = {s: paired_final_val(sa, xsa) for s, (sa, xsa) in pairs.items()}
        compared = {s: v for s, v in compared.items() if v is not None}
        paired = {id(r) for pair in pairs.values() for r in pair}
        row = {"setting": label, "pairs": pairs, "seeds": list(compared),
               "steps": sorted({v[0] for v in compared.values()}),
               "unpaired": [r.name for r in runs if id(r) not in paired]}
        if compared:
            diffs = [x - s for _, s, x in compared.values()]
            row.update(sa=statistics.fmean(v[1] for v in compared.values()),
                       xsa=statistics.fmean(v[2] for v in compared.values()),
                       stats=paired_stats(diffs), xsa_lower=sum(d < 0 for d in diffs))
        rows.append(row)
    return rows, warnings


def markdown(runs, settings, rows, warnings):
    lines = [f"## SA vs XSA: {len(runs)} runs, {len(settings)} setting{'s' * (len(settings) != 1)}", "",
             "Final validation loss of each run (its last evaluation):", "",
             "| run | setting | attn | seed | step | val loss |", "|---|---|---|---|---|---|"]
    for label, setting_runs in settings:
        for run in setting_runs:
            step, val = run.final_val()
            lines.append(f"| {run.name} | {label} | {run.attn_type} | {run.seed} | {step if step else '–'} "
                         f"| {fmt(val)} |")
    lines += ["", "XSA − SA in validation loss per setting (negative: XSA better), pairs matched by seed and "
              "compared at the last step both evaluated; std and the 95% confidence interval (Student t) "
              "are over the pairs:", "",
              "| setting | pairs | step | SA | XSA | XSA − SA | std | 95% CI | XSA lower |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["seeds"]:
            lines.append(f"| {row['setting']} | 0 | – | – | – | – | – | – | no SA/XSA pair |")
            continue
        st = row["stats"]
        steps = "/".join(str(s) for s in row["steps"])
        ci = "–" if st["ci"] is None else f"[{st['ci'][0]:+.4f}, {st['ci'][1]:+.4f}]"
        lines.append(f"| {row['setting']} | {st['n']} | {steps} | {fmt(row['sa'])} | {fmt(row['xsa'])} "
                     f"| {fmt(st['mean'], signed=True)} | {fmt(st['std'])} | {ci} "
                     f"| {row['xsa_lower']}/{st['n']} |")
    unpaired = [name for row in rows for name in row["unpaired"]]
    if unpaired:
        lines += ["", f"Runs without a partner of the other attention and the same seed: {', '.join(unpaired)}."]
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


def plot(settings, rows, path, smooth=0.0, ylim=None):
    """Train loss, validation loss and the paired validation difference, one colour per setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (ax_train, ax_val, ax_diff) = plt.subplots(1, 3, figsize=(17, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"sa": "--", "xsa": "-"}
    for ax, key, title in ((ax_train, "train_loss", "train loss" + (f" (EMA {smooth})" if smooth else "")),
                           (ax_val, "val_loss", "validation loss")):
        drawn = []
        for i, (label, runs) in enumerate(settings):
            colour = colours[i % len(colours)]
            for attn in ("sa", "xsa"):
                curves = [r.curve(key) for r in runs if r.attn_type == attn]
                curves = [(s, ema(v, smooth) if key == "train_loss" else v) for s, v in curves if s]
                for s, v in curves:
                    ax.plot(s, v, styles[attn], color=colour, lw=0.8 if len(curves) > 1 else 1.5,
                            alpha=0.35 if len(curves) > 1 else 1.0)
                if len(curves) > 1:
                    ax.plot(*mean_curve(curves), styles[attn], color=colour, lw=1.8)
                drawn += curves
        ax.set(title=title, xlabel="step", ylabel="loss")
        ylim_here = ylim or loss_range(drawn)
        if ylim_here:
            ax.set_ylim(*ylim_here)
        ax.grid(alpha=0.3)

    for i, row in enumerate(rows):
        diffs = []
        for sa, xsa in row["pairs"].values():
            sa_vals, xsa_vals = dict(zip(*sa.curve("val_loss"))), dict(zip(*xsa.curve("val_loss")))
            steps = sorted(set(sa_vals) & set(xsa_vals))
            if steps:
                diffs.append((steps, [xsa_vals[s] - sa_vals[s] for s in steps]))
        colour = colours[i % len(colours)]
        for s, d in diffs:
            ax_diff.plot(s, d, "-o", color=colour, ms=2, lw=0.8 if len(diffs) > 1 else 1.5,
                         alpha=0.35 if len(diffs) > 1 else 1.0)
        if len(diffs) > 1:
            ax_diff.plot(*mean_curve(diffs), "-", color=colour, lw=1.8)
    ax_diff.axhline(0.0, color="black", lw=0.8)
    ax_diff.set(title="validation loss, XSA − SA (paired by seed)", xlabel="step", ylabel="difference")
    ax_diff.grid(alpha=0.3)

    handles = [Line2D([], [], color=colours[i % len(colours)], lw=2, label=label)
               for i, (label, _) in enumerate(settings)]
    handles += [Line2D([], [], color="grey", ls="--", label="SA"), Line2D([], [], color="grey", ls="-", label="XSA")]
    ax_val.legend(handles=handles, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or globs (quoted), or directories of runs")
    parser.add_argument("--out", default="compare", help="output prefix: writes OUT.png and OUT.md")
    parser.add_argument("--smooth", type=float, default=0.0,
                        help="EMA factor for the train-loss curves, 0 (none) to <1, e.g. 0.9")
    parser.add_argument("--ylim", type=float, nargs=2, metavar=("LOW", "HIGH"), help="loss axis range")
    args = parser.parse_args()
    if not 0.0 <= args.smooth < 1.0:
        parser.error("--smooth must be in [0, 1)")

    runs = find_runs(args.runs)
    if not runs:
        sys.exit(f"no run directories (with metrics.jsonl and config.json) in {' '.join(args.runs)}")
    settings = group_settings(runs)
    rows, warnings = comparison(settings)
    table = markdown(runs, settings, rows, warnings)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    plot(settings, rows, args.out + ".png", args.smooth, args.ylim)
    print(table)
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    main()
