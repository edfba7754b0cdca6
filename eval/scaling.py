"""
Does XSA's gain grow with scale? Scaling laws fitted to a ladder of SA and XSA runs of several sizes
(scripts/sweep_ladder.sh): XSA's loss gap to SA and its compute multiplier, with bootstrap intervals.

    python -m eval.scaling out/sweep_ladder --out out/sweep_ladder/tiny        # a directory of runs
    python -m eval.scaling 'out/sweep_ladder/*_paper_*' --out out/ladder_paper --draws 2000

From each run directory (config.json and metrics.jsonl, as train.py writes them):
  N  the non-embedding parameters, as model.py counts them (GPT.num_params)
  D  the tokens trained: the last step x total_batch_size
  C  the training FLOPs: D x GPT.flops_per_token(block_size), the count the MFU meter uses
  L  the validation loss at the last step
A run whose records are unfinished (its last step below its max_iters, or no validation loss at that
step, where train.py always evaluates) is named and left out.

Per attention type, least squares (scipy) fits L(N) = E + A N^-alpha, and the same law in C. From them:
  the gap dL(N) = L_XSA(N) - L_SA(N), negative where XSA is better;
  XSA's compute multiplier k at compute C: SA needs k x C to reach the loss XSA reaches with C,
      L_SA(k C) = L_XSA(C), so k = ((L_XSA(C) - E_SA) / A_SA)^(-1/alpha_SA) / C with the laws in C;
      k > 1: XSA saves compute. Where L_XSA(C) <= E_SA no SA compute reaches XSA's loss: k is infinite.
each at every size of the ladder and extrapolated to the paper's three sizes (N of config/sa_0p7b.py,
sa_1p4b.py, sa_2p7b.py; C at the ladder's tokens per parameter). The law has three parameters: runs at
fewer than 3 sizes do not identify it (exit 3).
95% intervals by a percentile bootstrap over seeds: a draw picks as many seeds as there are, with
replacement, and refits on their runs (SA and XSA of a seed together). Where every size has one seed, over
runs instead (a draw picks sizes, SA and XSA together), and the output says so.
The paper publishes no loss values (docs/paper.md: curves only), so its sizes are marked, not plotted.

scaling.json holds, for "sa" and "xsa", "E", "A" and "alpha" of L(N) ("compute": of L(C)), each as
{"value", "ci": [low, high]}; "gap" and "multiplier", each "per_rung" (a list by N) and "extrapolated" (by
paper size); the runs fitted, those left out, and "notes": what the intervals say, in words. JSON has no
infinity: an infinite k is null with "infinite": true, an infinite end of its interval is null.
"""

import sys

if __name__ == "__main__" and not __package__:  # `python eval/scaling.py`: the repo's modules are out of reach
    print("run from the repo root as a module: python -m eval.scaling RUN_DIR... --out DIR", file=sys.stderr)
    sys.exit(2)  # exits.CONFIG_ERROR, which cannot be imported from here

import json
import math
import os
import statistics
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import least_squares

from configurator import ConfigError
from eval import common
from eval.compare import find_runs, fmt
from model import GPT
from pretrain import exits
from pretrain.files import write_atomically
from pretrain.metrics import format_count
from pretrain.train_config import MODEL_KEYS, model_config, resolve

TYPES = ("sa", "xsa")
PAPER_SIZES = (("0.7B", "config/sa_0p7b.py"), ("1.4B", "config/sa_1p4b.py"), ("2.7B", "config/sa_2p7b.py"))
CONFIDENCE = 0.95
# language-model exponents are 0.05 to 0.5 (Kaplan et al., Chinchilla): the bounds only keep the search finite
ALPHA_BOUNDS = (1e-3, 4.0)
ALPHA_GRID = np.linspace(0.02, 2.0, 50)  # where the least squares may start


class NotIdentified(ValueError):
    """Points at fewer than 3 sizes: the law's three parameters are not identified."""


# -----------------------------------------------------------------------------
# the law, its fit and the compute multiplier


@dataclass
class Law:
    """L(x) = E + A x^-alpha: E the loss no size reaches, alpha how fast the rest falls."""
    E: float
    A: float
    alpha: float

    def __call__(self, x):
        return self.E + self.A * np.power(x, -self.alpha)


def fit_law(x, y):
    """The Law nearest the points (x, y) in squared error, with E in [0, min y] (the floor lies below every
    loss seen), A >= 0 and alpha in ALPHA_BOUNDS. x is divided by its geometric mean, so that the fitted
    coefficient stays near the losses whether x is 1e4 parameters or 1e21 FLOPs. For each alpha of a grid,
    E and A are a linear least squares; the best of them starts scipy's, which from a fixed guess can stall
    on a flat ladder of a few noisy points."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    sizes = len(np.unique(x))
    if sizes < 3:
        raise NotIdentified(f"points at {sizes} size(s); the law's 3 parameters need at least 3")
    scale = math.exp(np.mean(np.log(x)))
    u = np.log(x / scale)
    z = np.exp(-np.outer(ALPHA_GRID, u))  # one row per alpha
    zc = z - z.mean(axis=1, keepdims=True)
    a = np.maximum(zc @ (y - y.mean()) / (zc ** 2).sum(axis=1), 0.0)
    E = np.clip(y.mean() - a * z.mean(axis=1), 0.0, y.min())
    best = np.argmin(((E[:, None] + a[:, None] * z - y) ** 2).sum(axis=1))
    lower, upper = [0.0, 0.0, ALPHA_BOUNDS[0]], [y.min(), np.inf, ALPHA_BOUNDS[1]]
    start = np.clip([E[best], a[best], ALPHA_GRID[best]], lower, upper)

    def residuals(p):
        return p[0] + p[1] * np.exp(-p[2] * u) - y

    def jacobian(p):
        e = np.exp(-p[2] * u)
        return np.stack([np.ones_like(u), e, -p[1] * u * e], axis=1)

    E, a, alpha = least_squares(residuals, start, jac=jacobian, bounds=(lower, upper)).x
    return Law(float(E), float(a * scale ** alpha), float(alpha))


def log_multiplier(C, xsa, sa):
    """log k, XSA's compute multiplier at compute C, from the laws in C: L_SA(k C) = L_XSA(C), so
    k = ((L_XSA(C) - E_SA) / A_SA)^(-1/alpha_SA) / C. +inf where L_XSA(C) <= E_SA: XSA's loss is at or
    below all that SA reaches with any compute, so no finite k matches it. In logs, because k's bootstrap
    values span orders of magnitude."""
    excess = xsa(C) - sa.E
    if excess <= 0:
        return math.inf
    if sa.A <= 0:  # SA's loss is E_SA at every compute, above XSA's: the least compute matches it
        return -math.inf
    return -(math.log(excess) - math.log(sa.A)) / sa.alpha - math.log(C)


def exp(x):
    """e^x, inf where it overflows."""
    return math.exp(x) if x < 709 else math.inf


def multiplier(C, xsa, sa):
    """k itself (see log_multiplier)."""
    return exp(log_multiplier(C, xsa, sa))


# -----------------------------------------------------------------------------
# runs


@lru_cache(maxsize=None)
def _counts(model_keys, block_size):
    with torch.device("meta"):  # no memory: only the shapes are needed
        model = GPT(model_config(json.loads(model_keys)))
    return model.num_params(), model.flops_per_token(block_size)


def counts(config):
    """(N, training FLOPs per token) of a run's model (a config dict), as model.py counts them for the
    paper's sizes and for the MFU meter."""
    return _counts(json.dumps({k: config[k] for k in MODEL_KEYS if k in config}, sort_keys=True),
                   config["block_size"])


def ladder_point(run):
    """One run (eval.compare.Run) as a point of the ladder, {path, attn_type, seed, N, D, C, loss}, or
    (None, why it is left out)."""
    if run.label not in TYPES:
        return None, f"attention variant {run.label}: the ladder compares SA with plain XSA"
    if not run.records:
        return None, "unfinished: no records in metrics.jsonl"
    last, max_iters = run.records[-1], run.config["max_iters"]
    if last["step"] < max_iters:
        return None, f"unfinished: its last step is {last['step']} of max_iters {max_iters}"
    if last.get("val_loss") is None or not math.isfinite(last["val_loss"]):
        return None, f"unfinished: no validation loss at its last step ({last['step']})"
    n, flops_per_token = counts(run.config)
    tokens = last["step"] * run.config["total_batch_size"]
    return {"path": run.path, "attn_type": run.label, "seed": run.seed, "N": n, "D": tokens,
            "C": flops_per_token * tokens, "loss": last["val_loss"]}, None


def ladder_points(runs):
    """(points, [(path, reason)] of the runs left out), each left-out run named in a warning line."""
    points, left_out = [], []
    for run in runs:
        point, reason = ladder_point(run)
        if point is None:
            print(f"warning: {run.path}: {reason}; left out", file=sys.stderr)
            left_out.append({"path": run.path, "reason": reason})
        else:
            points.append(point)
    return points, left_out


def check_identified(points):
    """Exit in one line unless each attention type has finished runs at 3 sizes or more."""
    for attn in TYPES:
        sizes = sorted({p["N"] for p in points if p["attn_type"] == attn})
        if len(sizes) < 3:
            at = f" (N = {', '.join(format_count(n) for n in sizes)})" if sizes else ""
            exits.fail(f"the fit is not identified: {attn.upper()} has finished runs at {len(sizes)} size(s){at}; "
                       f"L(N) = E + A N^-alpha has 3 parameters and needs runs at 3 sizes or more")


def ladder_sizes(points):
    """The ladder's sizes as targets, smallest first: N, and the mean D and C of its runs."""
    targets = []
    for n in sorted({p["N"] for p in points}):
        at = [p for p in points if p["N"] == n]
        targets.append({"key": f"rung {n}", "label": format_count(n), "kind": "rung", "N": n,
                        "D": statistics.fmean(p["D"] for p in at), "C": statistics.fmean(p["C"] for p in at)})
    return targets


def paper_sizes(tokens_per_param):
    """The paper's three sizes as targets: N of its SA configs, trained at the ladder's tokens per parameter."""
    targets = []
    for label, path in PAPER_SIZES:
        try:
            config, _ = resolve([path])
        except (ConfigError, OSError) as e:
            exits.fail(f"cannot read {path} ({exits.one_line(e)}); run from the repo root")
        n, flops_per_token = counts(config.to_dict())
        tokens = tokens_per_param * n
        targets.append({"key": f"paper {label}", "label": label, "kind": "paper", "N": n, "D": tokens,
                        "C": flops_per_token * tokens})
    return targets


# -----------------------------------------------------------------------------
# the statistics and their bootstrap


def fit_laws(points):
    """{attn: {"N": Law, "C": Law}} for each attention type; NotIdentified below 3 sizes."""
    laws = {}
    for attn in TYPES:
        own = [p for p in points if p["attn_type"] == attn]
        laws[attn] = {axis: fit_law([p[axis] for p in own], [p["loss"] for p in own]) for axis in ("N", "C")}
    return laws


def ladder_statistics(points, targets):
    """What the report gives, from the laws fitted to the points, as one flat dict (so that bootstrap draws
    line up): each law's E, A and alpha ("sa.N.alpha"), and at each target the gap and log k."""
    laws = fit_laws(points)
    values = {f"{attn}.{axis}.{name}": getattr(law, name)
              for attn in TYPES for axis, law in laws[attn].items() for name in ("E", "A", "alpha")}
    for t in targets:
        values[f"gap.{t['key']}"] = float(laws["xsa"]["N"](t["N"]) - laws["sa"]["N"](t["N"]))
        values[f"log_k.{t['key']}"] = log_multiplier(t["C"], laws["xsa"]["C"], laws["sa"]["C"])
    return values


def resampling_unit(points):
    """"seeds" where some size has runs of two seeds or more, else "runs"."""
    seeds = {}
    for p in points:
        seeds.setdefault((p["attn_type"], p["N"]), set()).add(p["seed"])
    return "seeds" if any(len(s) > 1 for s in seeds.values()) else "runs"


def bootstrap(points, statistic, draws, seed=0):
    """statistic(sample) for `draws` resamples of the points. Over seeds: a draw picks as many seeds as
    there are, with replacement, and takes every run of each pick, so that a seed's SA and XSA runs (same
    initialisation, same batches) stay together. Over runs, where every size has one seed: a draw picks
    (size, seed) pairs the same way. A draw left with fewer than 3 sizes cannot be fitted: it is dropped.
    Returns (the statistics, the unit, the number of draws dropped)."""
    unit = resampling_unit(points)
    groups = {}
    for p in points:
        groups.setdefault(p["seed"] if unit == "seeds" else (p["N"], p["seed"]), []).append(p)
    keys = list(groups)
    rng = np.random.default_rng(seed)
    results, dropped = [], 0
    for _ in range(draws):
        sample = [p for i in rng.integers(len(keys), size=len(keys)) for p in groups[keys[i]]]
        try:
            results.append(statistic(sample))
        except NotIdentified:
            dropped += 1
    return results, unit, dropped


def interval(values):
    """The central CONFIDENCE interval of bootstrap values, read off the sorted values without
    interpolating (so an infinite k stays infinite), or None without values."""
    values = np.array([v for v in values if not math.isnan(v)])
    if not values.size:
        return None
    tail = (1 - CONFIDENCE) / 2
    return float(np.quantile(values, tail, method="lower")), float(np.quantile(values, 1 - tail, method="higher"))


def spans_zero(ci):
    return ci is not None and ci[0] <= 0 <= ci[1]


def reaches(ci, floor):
    """Whether an interval's lower end is at or below floor."""
    return ci is not None and ci[0] is not None and ci[0] <= floor


def finite(x):
    """x for JSON: None where it is not a finite number."""
    return float(x) if x is not None and math.isfinite(x) else None


# -----------------------------------------------------------------------------
# the report


def estimate(point, draws, key):
    ci = interval([d[key] for d in draws])
    return {"value": finite(point[key]), "ci": None if ci is None else [finite(x) for x in ci]}


def gap_entry(t, point, draws):
    entry = {"N": t["N"], "D": t["D"], "C": t["C"], **estimate(point, draws, f"gap.{t['key']}")}
    return {**entry, "ci_spans_zero": spans_zero(entry["ci"])}


def multiplier_entry(t, point, draws):
    log_k, ci = point[f"log_k.{t['key']}"], interval([d[f"log_k.{t['key']}"] for d in draws])
    return {"N": t["N"], "C": t["C"], "value": finite(exp(log_k)), "infinite": log_k == math.inf,
            "ci": None if ci is None else [finite(exp(x)) for x in ci],
            "ci_unbounded": ci is not None and ci[1] == math.inf, "log_ci_spans_zero": spans_zero(ci)}


def law_entry(point, draws, attn, axis):
    return {name: estimate(point, draws, f"{attn}.{axis}.{name}") for name in ("E", "A", "alpha")}


def build_report(points, targets, point, draws, unit, dropped, left_out, tokens_per_param):
    rungs = [t for t in targets if t["kind"] == "rung"]
    paper = [t for t in targets if t["kind"] == "paper"]
    report = {
        "law": "L(x) = E + A * x^-alpha; x = N (non-embedding parameters) or, under compute, C (training FLOPs)",
        "confidence": CONFIDENCE,
        "bootstrap": {"over": unit, "draws": len(draws) + dropped, "fitted": len(draws), "dropped": dropped,
                      "seeds": sorted({p["seed"] for p in points})},
        "tokens_per_param": tokens_per_param,
        **{attn: {**law_entry(point, draws, attn, "N"), "compute": law_entry(point, draws, attn, "C")}
           for attn in TYPES},
        "gap": {"per_rung": [gap_entry(t, point, draws) for t in rungs],
                "extrapolated": {t["label"]: gap_entry(t, point, draws) for t in paper}},
        "multiplier": {"per_rung": [multiplier_entry(t, point, draws) for t in rungs],
                       "extrapolated": {t["label"]: multiplier_entry(t, point, draws) for t in paper}},
        "runs": [{"path": p["path"], "attn_type": p["attn_type"], "seed": p["seed"], "N": p["N"], "D": p["D"],
                  "C": p["C"], "val_loss": p["loss"]} for p in points],
        "left_out": left_out,
    }
    report["notes"] = notes(report, rungs, paper)
    return report


def notes(report, rungs, paper):
    """What the intervals say, in words: how they were drawn, and every one that reaches or spans zero."""
    return resampling_notes(report["bootstrap"]) + law_notes(report) + size_notes(report, rungs, paper)


def resampling_notes(b):
    said = []
    if b["over"] == "runs":
        said.append("One seed per size: the intervals are a bootstrap over runs (sizes), so they say how well "
                    "the law fits these points, not how much a seed moves them; more seeds (SEEDS=...) give "
                    "intervals over seeds.")
    elif len(b["seeds"]) < 5:  # n seeds drawn with replacement: comb(2n - 1, n) different draws, 10 for 3
        said.append(f"{len(b['seeds'])} seeds give {math.comb(2 * len(b['seeds']) - 1, len(b['seeds']))} different "
                    f"bootstrap draws: the intervals are coarse and likely too narrow; more seeds make them "
                    f"trustworthy.")
    if b["dropped"]:
        said.append(f"{b['dropped']} of {b['draws']} bootstrap draws left fewer than 3 sizes and were dropped.")
    return said


def law_notes(report):
    said = []
    for attn in TYPES:
        for law, entry in (("L(N)", report[attn]), ("L(C)", report[attn]["compute"])):
            # at the bounds of the fit, up to the solver's steps inside them: alpha's floor is next to 0
            if reaches(entry["alpha"]["ci"], ALPHA_BOUNDS[0] + 1e-6):
                said.append(f"{attn.upper()} {law}: alpha's interval reaches 0: on this evidence the loss "
                            f"need not fall with size at all.")
            if reaches(entry["E"]["ci"], 1e-6):
                said.append(f"{attn.upper()} {law}: E's interval reaches 0: the loss floor is not pinned down.")
    return said


def size_notes(report, rungs, paper):
    where = [(f"N = {format_count(t['N'])}", g, k) for t, g, k in
             zip(rungs, report["gap"]["per_rung"], report["multiplier"]["per_rung"])]
    where += [(f"the paper's {t['label']} (extrapolated)", report["gap"]["extrapolated"][t["label"]],
               report["multiplier"]["extrapolated"][t["label"]]) for t in paper]
    said = []
    for at, gap, k in where:
        if gap["ci_spans_zero"]:
            said.append(f"At {at}, ΔL's interval spans zero: no clear difference between XSA and SA.")
        if k["infinite"]:
            said.append(f"At {at}, k is infinite (not defined): XSA's fitted loss is at or below SA's fitted "
                        f"floor E, which no SA compute reaches.")
        elif k["log_ci_spans_zero"]:
            said.append(f"At {at}, k's interval includes 1 (log k spans zero): XSA's compute saving is not "
                        f"distinguishable from none.")
        if k["ci_unbounded"] and not k["infinite"]:
            said.append(f"At {at}, k's interval is unbounded above: in some draws XSA's loss is below SA's floor.")
    return said


def with_ci(entry, show):
    """'value [low, high]', each shown by show(x)."""
    ci = entry["ci"]
    return f"{show(entry['value'])} [{show(ci[0])}, {show(ci[1])}]" if ci else show(entry["value"])


def fmt_k(entry):
    """k [low, high], infinity spelled out (null in scaling.json)."""
    def one(x, infinite=False):
        return "∞" if infinite or x is None else f"{x:.3g}"
    ci = entry["ci"]
    text = one(entry["value"], entry["infinite"])
    return f"{text} [{one(ci[0])}, {one(ci[1])}]" if ci else text


def gap_and_k(gap, k):
    return f"{with_ci(gap, lambda x: fmt(x, signed=True))} | {fmt_k(k)}"


def laws_table(report):
    lines = ["| attention | law | E | A | α |", "|---|---|---|---|---|"]
    for attn in TYPES:
        for law, entry in (("L(N)", report[attn]), ("L(C)", report[attn]["compute"])):
            lines.append(f"| {attn.upper()} | {law} | {with_ci(entry['E'], fmt)} | "
                         f"{with_ci(entry['A'], lambda x: fmt(x) if x is None else f'{x:.3g}')} | "
                         f"{with_ci(entry['alpha'], lambda x: fmt(x) if x is None else f'{x:.3f}')} |")
    return lines


def sizes_table(report, points, rungs):
    """Each size: its runs' tokens and FLOPs, their seeds and final losses, the fitted gap and k."""
    lines = ["| N | tokens | FLOPs | seeds | SA val loss | XSA val loss | ΔL = XSA − SA, fitted | k, XSA's compute "
             "multiplier |", "|---|---|---|---|---|---|---|---|"]
    for t, gap, k in zip(rungs, report["gap"]["per_rung"], report["multiplier"]["per_rung"]):
        at = sorted((p for p in points if p["N"] == t["N"]), key=lambda p: p["seed"])
        seeds = ", ".join(str(s) for s in sorted({p["seed"] for p in at}))
        losses = [", ".join(f"{p['loss']:.4f}" for p in at if p["attn_type"] == attn) or "–" for attn in TYPES]
        lines.append(f"| {format_count(t['N'])} | {format_count(t['D'])} | {t['C']:.3g} | {seeds} | "
                     f"{' | '.join(losses)} | {gap_and_k(gap, k)} |")
    return lines


def paper_table(report, paper):
    lines = ["| size | N (model.py) | FLOPs | ΔL = XSA − SA | k | the paper's losses |", "|---|---|---|---|---|---|"]
    for t in paper:
        gap, k = report["gap"]["extrapolated"][t["label"]], report["multiplier"]["extrapolated"][t["label"]]
        lines.append(f"| {t['label']} | {format_count(t['N'])} | {t['C']:.3g} | {gap_and_k(gap, k)} | "
                     f"none published (curves only) |")
    return lines


def markdown(report, points, rungs, paper):
    b, sizes = report["bootstrap"], sorted({p["N"] for p in points})
    per_param = f"{report['tokens_per_param']:.3g} tokens per parameter"
    seeds = ("seed " if len(b["seeds"]) == 1 else "seeds ") + ", ".join(map(str, b["seeds"]))
    lines = ["# Scaling ladder: SA vs XSA", "",
             f"{len(points)} runs at {len(sizes)} sizes (N = {format_count(sizes[0])} to {format_count(sizes[-1])} "
             f"non-embedding parameters), {seeds}; {per_param}. Per attention "
             f"type, least squares fits of L(N) = E + A·N^−α and of the same law in training FLOPs C. "
             f"{100 * CONFIDENCE:g}% intervals: percentile bootstrap over {b['over']}, {b['fitted']} draws fitted.",
             "", "## Fitted laws", "", *laws_table(report),
             "", "## Per size", "", *sizes_table(report, points, rungs),
             "", f"## At the paper's sizes (extrapolated, at {per_param})", "", *paper_table(report, paper)]
    if report["notes"]:
        lines += ["", "## What the intervals say", ""] + [f"- {note}" for note in report["notes"]]
    if report["left_out"]:
        lines += ["", "## Left out", ""] + [f"- {r['path']}: {r['reason']}" for r in report["left_out"]]
    return "\n".join(lines) + "\n"


COLOURS, STYLES = {"sa": "tab:blue", "xsa": "tab:orange"}, {"sa": "--", "xsa": "-"}


def drawn_law(values, attn, axis):
    """The Law of one attention type and axis from a dict of statistics (the fit, or a bootstrap draw)."""
    return Law(*(values[f"{attn}.{axis}.{name}"] for name in ("E", "A", "alpha")))


def axis_span(points, paper, axis):
    xs = [p[axis] for p in points] + [t[axis] for t in paper]
    return np.geomspace(min(xs) / 1.5, max(xs) * 1.5, 200)


def mark_paper(ax, paper, axis):
    for t in paper:
        ax.axvline(t[axis], color="grey", ls=":", lw=0.8)
        ax.annotate(f"paper {t['label']}", (t[axis], 0.98), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize="small", color="grey")


def plot_losses(ax, axis, points, paper, point, markers):
    """Both fits of the loss against N or C, every run as a point marked by its seed."""
    xs = axis_span(points, paper, axis)
    for attn in TYPES:
        ax.plot(xs, drawn_law(point, attn, axis)(xs), STYLES[attn], color=COLOURS[attn], label=f"{attn.upper()} fit")
        for p in points:
            if p["attn_type"] == attn:
                ax.scatter(p[axis], p["loss"], marker=markers[p["seed"]], color=COLOURS[attn], s=22, zorder=3)
    mark_paper(ax, paper, axis)
    ax.set(xscale="log", xlabel="non-embedding parameters N" if axis == "N" else "training FLOPs C",
           ylabel="validation loss", title=f"loss against {axis}")
    ax.grid(alpha=0.3)


def plot_gap(ax, points, paper, point, draws, markers):
    """The fitted XSA - SA gap against N with its bootstrap band, and each seed's pair of runs."""
    xs = axis_span(points, paper, "N")
    if draws:
        gaps = np.array([drawn_law(d, "xsa", "N")(xs) - drawn_law(d, "sa", "N")(xs) for d in draws])
        tail = (1 - CONFIDENCE) / 2
        ax.fill_between(xs, *np.quantile(gaps, [tail, 1 - tail], axis=0), color=COLOURS["xsa"], alpha=0.2,
                        label=f"{100 * CONFIDENCE:g}% bootstrap band")
    ax.plot(xs, drawn_law(point, "xsa", "N")(xs) - drawn_law(point, "sa", "N")(xs), color=COLOURS["xsa"],
            label="fitted")
    pairs = {}
    for p in points:
        pairs.setdefault((p["N"], p["seed"]), {})[p["attn_type"]] = p["loss"]
    for (n, seed), losses in pairs.items():
        if len(losses) == 2:
            ax.scatter(n, losses["xsa"] - losses["sa"], marker=markers[seed], color="black", s=18, zorder=3)
    ax.axhline(0.0, color="black", lw=0.8)
    mark_paper(ax, paper, "N")
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="XSA − SA validation loss",
           title="the gap: fitted, and each seed's pair")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot(points, targets, draws, point, out):
    """Loss against N and against C with both fits (points marked by seed, the paper's sizes by dotted
    lines), and the fitted gap against N with its bootstrap band: out/scaling.png."""
    plt = common.pyplot()
    fig, (ax_n, ax_c, ax_gap) = plt.subplots(1, 3, figsize=(17, 4.8))
    seeds = sorted({p["seed"] for p in points})
    markers = {s: "osD^v<>ph*"[i % 10] for i, s in enumerate(seeds)}
    paper = [t for t in targets if t["kind"] == "paper"]
    plot_losses(ax_n, "N", points, paper, point, markers)
    plot_losses(ax_c, "C", points, paper, point, markers)
    for s in seeds:
        ax_n.scatter([], [], marker=markers[s], color="grey", label=f"seed {s}")
    ax_n.legend(fontsize="small")
    plot_gap(ax_gap, points, paper, point, draws, markers)
    fig.tight_layout()
    try:
        write_to(out, "scaling.png", lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def write_to(out, name, write):
    """write(f) into out/name atomically; a failure ends the script in one line."""
    path = os.path.join(out, name)
    try:
        write_atomically(path, write)
    except OSError as e:
        exits.fail(f"cannot write {path} ({exits.one_line(e)}); give a writable directory with --out")
    return path


def main(argv=None):
    parser = common.make_parser(__doc__.split("\n\n")[0], checkpoints=None, device=False,
                                out="scaling.json, scaling.md and scaling.png")
    parser.add_argument("runs", nargs="+", help="run directories or globs (quoted), or directories of runs")
    parser.add_argument("--draws", type=common.positive_int, default=1000, help="bootstrap draws (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap's resampling (default 0)")
    args = parser.parse_args(argv)
    out = common.output_dir(args.out)

    runs = find_runs(args.runs)
    if not runs:
        exits.fail(f"no run directories (with metrics.jsonl and config.json) in {' '.join(args.runs)}")
    points, left_out = ladder_points(runs)
    check_identified(points)
    tokens_per_param = statistics.median(p["D"] / p["N"] for p in points)
    rungs, paper = ladder_sizes(points), paper_sizes(tokens_per_param)
    targets = rungs + paper

    point = ladder_statistics(points, targets)
    draws, unit, dropped = bootstrap(points, lambda sample: ladder_statistics(sample, targets), args.draws, args.seed)
    report = build_report(points, targets, point, draws, unit, dropped, left_out, tokens_per_param)
    table = markdown(report, points, rungs, paper)
    info = json.dumps(report, indent=2, allow_nan=False) + "\n"
    write_to(out, "scaling.json", lambda f: f.write(info.encode("utf-8")))
    write_to(out, "scaling.md", lambda f: f.write(table.encode("utf-8")))
    plot(points, targets, draws, point, out)
    print(table)
    print(f"wrote {os.path.join(out, 'scaling.json')}, scaling.md and scaling.png")


if __name__ == "__main__":
    main()
