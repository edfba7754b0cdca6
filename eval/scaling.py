"""
Does XSA's gain grow with scale? Scaling laws fitted to a ladder of SA and XSA runs of several sizes
(scripts/sweep_ladder.sh): XSA's loss gap to SA, its compute multiplier and the multiplier's growth, with
intervals over seeds whose coverage is measured by simulation (--calibrate).

    python -m eval.scaling 'out/sweep_ladder/*_tiny_*' --out out/sweep_ladder/tiny   # runs, globs or folders
    python -m eval.scaling --calibrate --out out/scaling_calibration                   # the intervals' coverage

From each run directory (config.json and metrics.jsonl, as train.py writes them):
  N  the non-embedding parameters, as model.py counts them (GPT.num_params)
  D  the tokens trained: the last step x total_batch_size
  C  the training FLOPs: D x GPT.flops_per_token(block_size), the count the MFU meter uses
  L  the validation loss at the last step
A run whose records are unfinished (its last step below its max_iters, or no validation loss at that
step, where train.py always evaluates) is named and left out. The runs must be one ladder: the same
block_size, data, optimizer and recipe, the same tokens per parameter (up to the rounding of the steps) and
learning-rate rule (learning_rate x n_embd within 10%: the paper's own 1.4B sits 7% off the rule of its
0.7B and 2.7B); a folder that mixes ladders is refused in one line that says how they differ.

The law. SA and XSA train on the same tokens with the same tokenizer, so they share the loss no model
reaches: one floor E, and per attention type
    L_SA(x) = E + A_SA x^-alpha_SA,   L_XSA(x) = E + A_XSA x^-alpha_XSA,
fitted in x = N and in x = C (--separate_floors: an E per type, as an ablation). Least squares on L
(scipy): the noise of a final loss is additive and of about the same size at every rung, so squared error
on L weighs the rungs as the noise does; a fit on log L would only rescale it (L varies by 2x along a
ladder). For each pair of exponents of a grid the three linear parameters are one 3x3 solve; the best pair
starts one bounded least_squares refinement (about 3 ms a fit, which the calibration needs).
From the laws in C, XSA's compute multiplier k(C), SA needing k x C to reach the loss XSA reaches with C:
    L_SA(k C) = L_XSA(C)  =>  log k = (log A_SA - log A_XSA) / alpha_SA + gamma log C,
    gamma = alpha_XSA / alpha_SA - 1,
a power law in C: "XSA's gain grows with scale" is gamma > 0. The loss gap dL(N) = L_XSA(N) - L_SA(N) is
given at every rung, and its trend, the slope of the paired differences of each seed in log10 N. With a
shared floor the gap shrinks toward 0 at large N unless gamma is large: the report says when the two point
different ways. With separate floors k is set far from the ladder by the gap between two noisy floors, so
k beyond the ladder is not identified and the report says so. Every target outside the ladder's range (N
for the gap; C or k C for the multiplier) is marked "beyond_ladder". A ladder whose loss does not fall with
size (flat, rising, or an exponent at its lower bound) identifies no law: one line, exit 3.

The intervals (95%). The unit of replication is the seed: a seed's SA and XSA runs share the
initialisation and the batches. Each seed's ladder is fitted on its own, and the interval is the Student t
interval over the S fits (centred on their mean). Only the seeds with both runs at every size are used;
the others are named. With one seed there is no interval: no method we measured covers at one seed. With 2
seeds the t quantile is 12.7 (1 degree of freedom), so the intervals are wide; the output says so.
--calibrate simulates ladders from known laws (noise per run plus a part shared by a seed's SA and XSA
runs), fits them as a real ladder is fitted, and prints the coverage and median width of each interval;
scaling.json quotes the measured coverage of its own cell (seeds x sizes) from eval/scaling_coverage.json.

scaling.json: "floor", "growth", "gap_trend", "sa" and "xsa" ("E", "A", "alpha" of L(N), "compute": of L(C),
each {"value", "ci"}), "gap" and "multiplier" ("per_rung", a list by N, and "extrapolated", by paper size),
"intervals", the runs fitted, those left out, and "notes": what the numbers say, in words. An interval is
null where none is claimed. JSON has no infinity: an infinite value is null with "infinite": true.
"""

import sys

if __name__ == "__main__" and not __package__:  # `python eval/scaling.py`: the repo's modules are out of reach
    print("run from the repo root as a module: python -m eval.scaling RUN_DIR... --out DIR", file=sys.stderr)
    sys.exit(2)  # exits.CONFIG_ERROR, which cannot be imported from here

import json
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from configurator import ConfigError
from eval import common
from eval.common import fmt, t_quantile
from eval.compare import find_runs
from model import GPT
from pretrain import exits
from pretrain.metrics import format_count
from pretrain.train_config import MODEL_KEYS, VARIANT_KEYS, model_config, resolve

TYPES = ("sa", "xsa")
PAPER_SIZES = (("0.7B", "config/sa_0p7b.py"), ("1.4B", "config/sa_1p4b.py"), ("2.7B", "config/sa_2p7b.py"))
CONFIDENCE = 0.95
# language-model exponents are 0.05 to 0.5 (Kaplan et al., Chinchilla): the bounds only keep the search finite
ALPHA_BOUNDS = (1e-3, 4.0)
ALPHA_GRID = np.geomspace(0.01, 2.0, 40)  # where the refinement may start
LR_RULE_TOLERANCE = 0.10  # learning_rate x n_embd within 10% of the ladder's: the paper's 1.4B is 7% off
COVERAGE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_coverage.json")


class NotIdentified(ValueError):
    """Points at fewer than 3 sizes, or a loss that does not fall with size: no law is identified."""


# -----------------------------------------------------------------------------
# the laws, their fit and the compute multiplier


@dataclass
class Law:
    """L(x) = E + A x^-alpha: E the loss no size reaches, alpha how fast the rest falls."""
    E: float
    A: float
    alpha: float

    def __call__(self, x):
        return self.E + self.A * np.power(x, -self.alpha)


def _refine(residuals, jacobian, start, lower, upper):
    from scipy.optimize import least_squares  # here: scipy's second of imports, for the commands that fit
    start = np.clip(start, lower, upper)
    return least_squares(residuals, start, jac=jacobian, bounds=(lower, upper)).x


def fit_law(x, y):
    """One Law to the points (x, y) in squared error, with E in [0, min y] (the floor lies below every loss
    seen), A >= 0 and alpha in ALPHA_BOUNDS: the ablation's separate floor. x is divided by its geometric
    mean, so the fitted coefficient stays near the losses whether x is 1e4 parameters or 1e21 FLOPs."""
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

    def residuals(p):
        return p[0] + p[1] * np.exp(-p[2] * u) - y

    def jacobian(p):
        e = np.exp(-p[2] * u)
        return np.stack([np.ones_like(u), e, -p[1] * u * e], axis=1)

    E, a, alpha = _refine(residuals, jacobian, [E[best], a[best], ALPHA_GRID[best]],
                          [0.0, 0.0, ALPHA_BOUNDS[0]], [y.min(), np.inf, ALPHA_BOUNDS[1]])
    return Law(float(E), float(a * scale ** alpha), float(alpha))


def fit_shared_floor(x_sa, y_sa, x_xsa, y_xsa):
    """(SA's Law, XSA's Law) sharing one E, in squared error over both types' points, with E in [0, min y],
    A >= 0 and each alpha in ALPHA_BOUNDS. For each pair (alpha_SA, alpha_XSA) of ALPHA_GRID, E, A_SA and
    A_XSA are a 3x3 linear least squares (clipped to their bounds); the best pair starts the refinement."""
    xs, ys, xx, yx = (np.asarray(a, dtype=float) for a in (x_sa, y_sa, x_xsa, y_xsa))
    for name, x in (("SA", xs), ("XSA", xx)):
        if len(np.unique(x)) < 3:
            raise NotIdentified(f"{name} has points at {len(np.unique(x))} size(s); its law needs at least 3")
    scale = math.exp(np.mean(np.log(np.concatenate([xs, xx]))))
    us, ux = np.log(xs / scale), np.log(xx / scale)
    zs, zx = np.exp(-np.outer(ALPHA_GRID, us)), np.exp(-np.outer(ALPHA_GRID, ux))  # (grid, points)
    g, n = len(ALPHA_GRID), len(ys) + len(yx)
    normal = np.zeros((g, g, 3, 3))  # the normal equations of (E, a_SA, a_XSA) for every pair of exponents
    normal[..., 0, 0] = n
    normal[..., 0, 1] = normal[..., 1, 0] = zs.sum(axis=1)[:, None]
    normal[..., 0, 2] = normal[..., 2, 0] = zx.sum(axis=1)[None, :]
    normal[..., 1, 1] = (zs ** 2).sum(axis=1)[:, None]
    normal[..., 2, 2] = (zx ** 2).sum(axis=1)[None, :]
    rhs = np.zeros((g, g, 3))
    rhs[..., 0] = ys.sum() + yx.sum()
    rhs[..., 1] = (zs @ ys)[:, None]
    rhs[..., 2] = (zx @ yx)[None, :]
    solution = np.linalg.solve(normal + 1e-12 * np.eye(3), rhs[..., None])[..., 0]
    floor_max = min(ys.min(), yx.min())
    E = np.clip(solution[..., 0], 0.0, floor_max)
    a_sa, a_xsa = np.maximum(solution[..., 1], 0.0), np.maximum(solution[..., 2], 0.0)
    sse = (((E[..., None] + a_sa[..., None] * zs[:, None, :] - ys) ** 2).sum(-1)
           + ((E[..., None] + a_xsa[..., None] * zx[None, :, :] - yx) ** 2).sum(-1))
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    n_sa = len(ys)

    def residuals(p):
        return np.concatenate([p[0] + p[1] * np.exp(-p[3] * us) - ys, p[0] + p[2] * np.exp(-p[4] * ux) - yx])

    def jacobian(p):
        es, ex = np.exp(-p[3] * us), np.exp(-p[4] * ux)
        jac = np.zeros((n, 5))
        jac[:, 0] = 1.0
        jac[:n_sa, 1], jac[n_sa:, 2] = es, ex
        jac[:n_sa, 3], jac[n_sa:, 4] = -p[1] * us * es, -p[2] * ux * ex
        return jac

    E, a_sa, a_xsa, alpha_sa, alpha_xsa = _refine(
        residuals, jacobian, [E[i, j], a_sa[i, j], a_xsa[i, j], ALPHA_GRID[i], ALPHA_GRID[j]],
        [0.0, 0.0, 0.0, ALPHA_BOUNDS[0], ALPHA_BOUNDS[0]], [floor_max, np.inf, np.inf] + [ALPHA_BOUNDS[1]] * 2)
    return (Law(float(E), float(a_sa * scale ** alpha_sa), float(alpha_sa)),
            Law(float(E), float(a_xsa * scale ** alpha_xsa), float(alpha_xsa)))


def log_multiplier(C, xsa, sa):
    """log k, XSA's compute multiplier at compute C, from the laws in C: L_SA(k C) = L_XSA(C), so
    k = ((L_XSA(C) - E_SA) / A_SA)^(-1/alpha_SA) / C; with a shared floor this is the closed form
    (log A_SA - log A_XSA) / alpha_SA + gamma log C. +inf where L_XSA(C) <= E_SA (separate floors only):
    XSA's loss is at or below all that SA reaches with any compute. In logs, because k spans orders of
    magnitude."""
    excess = xsa(C) - sa.E
    if excess <= 0:
        return math.inf
    if sa.A <= 0:  # SA's loss is E_SA at every compute, above XSA's: the least compute matches it
        return -math.inf
    return -(math.log(excess) - math.log(sa.A)) / sa.alpha - math.log(C)


def growth(xsa, sa):
    """gamma = alpha_XSA / alpha_SA - 1: k(C) grows as C^gamma under a shared floor."""
    return xsa.alpha / sa.alpha - 1.0


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
    """One run (eval.compare.Run) as a point of the ladder, {path, attn_type, seed, N, D, C, loss, config},
    or (None, why it is left out)."""
    if run.label not in TYPES:
        return None, f"attention variant {run.label}: the ladder compares SA with plain XSA"
    if not run.records:
        return None, "unfinished: no records in metrics.jsonl"
    needed = ("max_iters", "total_batch_size", "block_size", "learning_rate", "n_embd")
    missing = [k for k in needed if k not in run.config]
    if missing:
        return None, f"its config.json lacks {', '.join(missing)}"
    last, max_iters = run.records[-1], run.config["max_iters"]
    if last["step"] < max_iters:
        return None, f"unfinished: its last step is {last['step']} of max_iters {max_iters}"
    if last.get("val_loss") is None or not math.isfinite(last["val_loss"]):
        return None, f"unfinished: no finite validation loss at its last step ({last['step']})"
    try:
        n, flops_per_token = counts(run.config)
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        return None, f"its config.json does not describe a model ({exits.one_line(e)})"
    tokens = last["step"] * run.config["total_batch_size"]
    return {"path": run.path, "attn_type": run.label, "seed": run.seed, "N": n, "D": tokens,
            "C": flops_per_token * tokens, "loss": last["val_loss"], "config": run.config}, None


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


# what a ladder holds fixed from rung to rung (its shape, learning rate, steps and warmup vary)
LADDER_FIXED_KEYS = ("block_size", "data_dir", "optimizer", "weight_decay", "beta1", "beta2", "grad_clip",
                     "total_batch_size", "dtype",
                     *(k for k in VARIANT_KEYS if k != "attn_type"))


def check_one_ladder(points):
    """Exit in one line unless the runs are one ladder: the same LADDER_FIXED_KEYS, tokens per parameter
    equal up to the rounding of the steps (D / N within one batch of tokens per parameter), and one
    learning-rate rule (learning_rate x n_embd within LR_RULE_TOLERANCE of the runs' median)."""
    for key in LADDER_FIXED_KEYS:
        values = Counter(repr(p["config"].get(key)) for p in points)
        if len(values) > 1:
            kinds = ", ".join(f"{key}={v} ({n} runs)" for v, n in values.most_common())
            exits.fail(f"these runs are not one ladder: {kinds}; fit one ladder at a time "
                       f"(give its runs, e.g. a glob such as 'out/sweep_ladder/*_tiny_*')")
    # a run of D tokens was asked for t tokens per parameter with D - batch < t N <= D (the steps round up)
    per_param = [p["D"] / p["N"] for p in points]
    asked = min(per_param)
    if any(x - p["config"]["total_batch_size"] / p["N"] >= asked * (1 + 1e-6) for x, p in zip(per_param, points)):
        middle = statistics.median(per_param)
        stray = max(zip(per_param, points), key=lambda xp: abs(math.log(xp[0] / middle)))[1]
        exits.fail(f"these runs are not one ladder: {stray['path']} trained {stray['D'] / stray['N']:.3g} tokens per "
                   f"parameter, the others {middle:.3g} (up to the rounding of the steps); fit one ladder at a time")
    rule = statistics.median(p["config"]["learning_rate"] * p["config"]["n_embd"] for p in points)
    for p in points:
        lr_rule = p["config"]["learning_rate"] * p["config"]["n_embd"]
        if abs(lr_rule / rule - 1) > LR_RULE_TOLERANCE:
            exits.fail(f"these runs are not one ladder: {p['path']} has learning_rate x n_embd = {lr_rule:.3g}, "
                       f"the others {rule:.3g} (the ladder's rule: learning rate inversely proportional to the "
                       f"width); fit one ladder at a time")


def complete_seeds(points):
    """(seeds with an SA and an XSA run at every size, [(seed, the sizes it lacks)] of the others)."""
    sizes = sorted({p["N"] for p in points})
    have = {}
    for p in points:
        have.setdefault(p["seed"], set()).add((p["attn_type"], p["N"]))
    complete, incomplete = [], []
    for seed in sorted(have, key=str):
        missing = sorted({n for n in sizes for attn in TYPES if (attn, n) not in have[seed]})
        (incomplete.append((seed, missing)) if missing else complete.append(seed))
    return complete, incomplete


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
# the statistics of one fit, and their intervals over seeds


def fit_laws(points, shared_floor=True):
    """{attn: {"N": Law, "C": Law}}; NotIdentified below 3 sizes."""
    by_type = {attn: [p for p in points if p["attn_type"] == attn] for attn in TYPES}
    laws = {attn: {} for attn in TYPES}
    for axis in ("N", "C"):
        xy = {attn: ([p[axis] for p in own], [p["loss"] for p in own]) for attn, own in by_type.items()}
        if shared_floor:
            laws["sa"][axis], laws["xsa"][axis] = fit_shared_floor(*xy["sa"], *xy["xsa"])
        else:
            for attn in TYPES:
                laws[attn][axis] = fit_law(*xy[attn])
    return laws


def ladder_statistics(points, targets, shared_floor=True):
    """What the report gives, from the laws fitted to the points, as one flat dict (so that the seeds' fits
    line up): each law's E, A and alpha ("sa.N.alpha"), the floor, gamma, and at each target the gap and log k."""
    laws = fit_laws(points, shared_floor)
    values = {f"{attn}.{axis}.{name}": getattr(law, name)
              for attn in TYPES for axis, law in laws[attn].items() for name in ("E", "A", "alpha")}
    for axis in ("N", "C"):
        values[f"floor.{axis}"] = laws["sa"][axis].E if shared_floor else math.nan
    values["growth"] = growth(laws["xsa"]["C"], laws["sa"]["C"])
    for t in targets:
        values[f"gap.{t['key']}"] = float(laws["xsa"]["N"](t["N"]) - laws["sa"]["N"](t["N"]))
        values[f"log_k.{t['key']}"] = log_multiplier(t["C"], laws["xsa"]["C"], laws["sa"]["C"])
    return values


def gap_slope(points):
    """The trend of the paired differences L_XSA - L_SA of one seed's ladder: their least-squares slope in
    log10 N (per decade of N; negative: XSA's lead widens with size)."""
    pairs = {}
    for p in points:
        pairs.setdefault(p["N"], {})[p["attn_type"]] = p["loss"]
    both = sorted((n, d["xsa"] - d["sa"]) for n, d in pairs.items() if len(d) == 2)
    x, y = np.log10([n for n, _ in both]), np.array([d for _, d in both])
    return float(np.polyfit(x, y, 1)[0])


def t_interval(values):
    """The Student t CONFIDENCE interval of the mean of per-seed values, or None with fewer than 2. An
    infinite value makes that end unbounded (inf)."""
    values = [v for v in values if not math.isnan(v)]
    if len(values) < 2:
        return None
    if any(math.isinf(v) for v in values):
        finite_values = [v for v in values if math.isfinite(v)]
        low = -math.inf if -math.inf in values else min(finite_values, default=math.inf)
        return low, (math.inf if math.inf in values else max(finite_values))
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = t_quantile(CONFIDENCE, len(values) - 1) * sd / math.sqrt(len(values))
    return float(mean - half), float(mean + half)


def seed_statistics(points, seeds, targets, shared_floor=True):
    """{name: [the value from each seed's own fit]}, the gap's slope included."""
    per_seed = []
    for seed in seeds:
        own = [p for p in points if p["seed"] == seed]
        values = ladder_statistics(own, targets, shared_floor)
        values["gap_slope"] = gap_slope(own)
        per_seed.append(values)
    return {name: [v[name] for v in per_seed] for name in per_seed[0]} if per_seed else {}


def spans_zero(ci):
    return bool(ci is not None and ci[0] <= 0 <= ci[1])


def finite(x):
    """x for JSON: None where it is not a finite number."""
    return float(x) if x is not None and math.isfinite(x) else None


# -----------------------------------------------------------------------------
# the calibration: how often the intervals cover the truth, on ladders drawn from known laws

CALIBRATION_LAWS = {
    # Chinchilla's law in N (E 1.69, A 406.4, alpha 0.34) as SA's, in C at 20 tokens per parameter and C = 6 N D
    # = 120 N^2 (so alpha in C is half of alpha in N); XSA: SA at 1.35x the compute (gamma = 0), or an XSA
    # exponent 10% larger (gamma = 0.1) that meets SA's coefficient at 1e19 FLOPs
    "constant k": {"E": 1.69, "alpha_sa": 0.17, "alpha_xsa": 0.17, "k": 1.35},
    "growing k": {"E": 1.69, "alpha_sa": 0.17, "alpha_xsa": 0.187, "k": 1.35},
}
CALIBRATION_N = {4: np.geomspace(2.5e7, 2.5e8, 4), 7: np.geomspace(2.5e7, 2.7e9, 7)}
CALIBRATION_PAPER_N = 6.8e8  # the paper's 0.7B, beyond the 4-size ladder and inside the 7-size one
CALIBRATION_SIGMAS = (0.002, 0.02)
CALIBRATION_QUANTITIES = ("alpha SA", "alpha XSA", "E", "dL top", "dL 0.7B", "k top", "k 0.7B", "gamma",
                          "dL slope")


def calibration_laws(name):
    """(SA's Law in C, XSA's Law in C) of a calibration truth: C = 120 N^2, SA's A in C from Chinchilla's
    406.4 in N; XSA's A from k at C0 = 1e19 (L_SA(k C0) = L_XSA(C0))."""
    truth = CALIBRATION_LAWS[name]
    a_sa = 406.4 * 120 ** truth["alpha_sa"]
    sa = Law(truth["E"], a_sa, truth["alpha_sa"])
    c0 = 1e19
    a_xsa = a_sa * (truth["k"] * c0) ** -truth["alpha_sa"] * c0 ** truth["alpha_xsa"]
    return sa, Law(truth["E"], a_xsa, truth["alpha_xsa"])


def true_quantities(name, sizes):
    sa, xsa = calibration_laws(name)
    top, paper = 120 * sizes[-1] ** 2, 120 * CALIBRATION_PAPER_N ** 2
    gaps = [float(xsa(120 * n ** 2) - sa(120 * n ** 2)) for n in sizes]
    return {"alpha SA": 2 * sa.alpha, "alpha XSA": 2 * xsa.alpha, "E": sa.E,  # alphas of the laws in N
            "dL top": gaps[-1], "dL 0.7B": float(xsa(paper) - sa(paper)),
            "k top": log_multiplier(top, xsa, sa), "k 0.7B": log_multiplier(paper, xsa, sa),
            "gamma": growth(xsa, sa), "dL slope": float(np.polyfit(np.log10(sizes), gaps, 1)[0])}


def simulate_ladder(name, sizes, seeds, sigma, shared, rng):
    """Points of a ladder drawn from a calibration truth: each run's loss is the law's plus noise of
    standard deviation sigma, of which a share `shared` of the variance is common to a seed's SA and XSA run
    at one size (the same initialisation and batches)."""
    laws = dict(zip(TYPES, calibration_laws(name)))
    points = []
    for seed in range(1, seeds + 1):
        for n in sizes:
            common_part = rng.normal(0.0, sigma * math.sqrt(shared))
            for attn in TYPES:
                C = 120 * n ** 2
                loss = float(laws[attn](C)) + common_part + rng.normal(0.0, sigma * math.sqrt(1 - shared))
                points.append({"attn_type": attn, "seed": seed, "N": float(n), "D": 20 * n, "C": C, "loss": loss})
    return points


def calibration_cell(name, n_sizes, seeds, sigma, shared, ladders, rng):
    """{quantity: (coverage, median width, ladders)} over `ladders` simulated ladders, of the report's own
    intervals; None entries with one seed (no interval is claimed)."""
    sizes = CALIBRATION_N[n_sizes]
    truth = true_quantities(name, sizes)
    targets = [{"key": "top", "N": sizes[-1], "C": 120 * sizes[-1] ** 2},
               {"key": "paper", "N": CALIBRATION_PAPER_N, "C": 120 * CALIBRATION_PAPER_N ** 2}]
    names = {"alpha SA": "sa.N.alpha", "alpha XSA": "xsa.N.alpha", "E": "floor.N", "dL top": "gap.top",
             "dL 0.7B": "gap.paper", "k top": "log_k.top", "k 0.7B": "log_k.paper", "gamma": "growth",
             "dL slope": "gap_slope"}
    hits, widths, fitted = {q: 0 for q in names}, {q: [] for q in names}, 0
    for _ in range(ladders):
        points = simulate_ladder(name, sizes, seeds, sigma, shared, rng)
        try:
            values = seed_statistics(points, list(range(1, seeds + 1)), targets)
        except NotIdentified:
            continue
        fitted += 1
        for q, key in names.items():
            ci = t_interval(values[key])
            if ci is not None:
                hits[q] += ci[0] <= truth[q] <= ci[1]
                widths[q].append(ci[1] - ci[0])
    return {q: (hits[q] / fitted if widths[q] else None, float(np.median(widths[q])) if widths[q] else None, fitted)
            for q in names}


def calibrate(out, ladders, seed, sigmas, shared):
    """Every cell (truth x noise x sizes x seeds): the measured coverage and median width of each interval,
    as a table (calibration.md) and JSON (calibration.json, the form eval/scaling_coverage.json keeps)."""
    rng = np.random.default_rng(seed)
    cells, started = [], time.time()
    for name in CALIBRATION_LAWS:
        for sigma in sigmas:
            for n_sizes in sorted(CALIBRATION_N):
                for seeds in (1, 2, 3, 5):
                    result = calibration_cell(name, n_sizes, seeds, sigma, shared, ladders, rng)
                    cells.append({"truth": name, "sigma": sigma, "shared": shared, "sizes": n_sizes, "seeds": seeds,
                                  "ladders": ladders, "coverage": {q: r[0] for q, r in result.items()},
                                  "median_width": {q: r[1] for q, r in result.items()}})
                    print(f"# {name}, sigma {sigma:g}, {n_sizes} sizes, {seeds} seed(s): {time.time() - started:.0f} s",
                          file=sys.stderr, flush=True)
    report = {"confidence": CONFIDENCE, "method": "t over seeds", "ladders_per_cell": ladders, "seed": seed,
              "laws": CALIBRATION_LAWS, "cells": cells}
    table = calibration_markdown(report)
    common.write_text(out, "calibration.json", json.dumps(report, indent=2) + "\n")
    common.write_text(out, "calibration.md", table)
    print(table)
    print(f"wrote {os.path.join(out, 'calibration.json')} and calibration.md")
    return report


def calibration_markdown(report):
    lines = [f"# Coverage of eval.scaling's {100 * CONFIDENCE:g}% intervals (Student t over seeds)", "",
             f"{report['ladders_per_cell']} simulated ladders per cell (--seed {report['seed']}); each entry: "
             f"measured coverage, and in brackets the median width (log k for k). One seed: no interval is "
             f"claimed. k and dL at 0.7B lie beyond the 4-size ladder and inside the 7-size one.", "",
             "| truth | σ | sizes | seeds | " + " | ".join(CALIBRATION_QUANTITIES) + " |",
             "|---|---|---|---|" + "---|" * len(CALIBRATION_QUANTITIES)]
    for cell in report["cells"]:
        entries = []
        for q in CALIBRATION_QUANTITIES:
            coverage, width = cell["coverage"][q], cell["median_width"][q]
            entries.append("–" if coverage is None else f"{100 * coverage:.0f}% ({width:.2g})")
        lines.append(f"| {cell['truth']} | {cell['sigma']:g} | {cell['sizes']} | {cell['seeds']} | "
                     + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def measured_coverage(seeds, sizes):
    """The lowest coverage the calibration measured (eval/scaling_coverage.json) over the quantities and noise
    levels of the cell nearest this ladder (its number of seeds, at most; its sizes, nearest), with the
    cell; (None, None) without a calibration or an interval."""
    try:
        with open(COVERAGE_FILE, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
    except (OSError, ValueError, KeyError):
        return None, None
    seed_cells = sorted({c["seeds"] for c in cells if c["seeds"] <= seeds and c["seeds"] >= 2})
    if not seed_cells:
        return None, None
    at_seeds = seed_cells[-1]
    at_sizes = min({c["sizes"] for c in cells}, key=lambda s: (abs(s - sizes), s))
    found = [v for c in cells if c["seeds"] == at_seeds and c["sizes"] == at_sizes
             for v in c["coverage"].values() if v is not None]
    return (min(found) if found else None), {"seeds": at_seeds, "sizes": at_sizes}


# -----------------------------------------------------------------------------
# the report


def within(x, low, high):
    return bool(low * (1 - 1e-9) <= x <= high * (1 + 1e-9))


def estimate(point, per_seed, key):
    ci = t_interval(per_seed[key]) if per_seed else None
    return {"value": finite(point[key]), "ci": None if ci is None else [finite(x) for x in ci]}


def gap_entry(t, point, per_seed, n_range):
    entry = {"N": t["N"], "D": t["D"], "C": t["C"], **estimate(point, per_seed, f"gap.{t['key']}")}
    return {**entry, "ci_spans_zero": spans_zero(entry["ci"]), "beyond_ladder": not within(t["N"], *n_range)}


def multiplier_entry(t, point, per_seed, c_range):
    log_k = point[f"log_k.{t['key']}"]
    ci = t_interval(per_seed[f"log_k.{t['key']}"]) if per_seed else None
    sa_compute = t["C"] * exp(log_k)  # what SA needs for XSA's loss: inside the ladder too, or extrapolated
    return {"N": t["N"], "C": t["C"], "value": finite(exp(log_k)), "infinite": log_k == math.inf,
            "ci": None if ci is None else [finite(exp(x)) for x in ci],
            "ci_unbounded": ci is not None and ci[1] == math.inf, "log_ci_spans_zero": spans_zero(ci),
            "beyond_ladder": not (within(t["C"], *c_range) and within(sa_compute, *c_range))}


def law_entry(point, per_seed, attn, axis):
    return {name: estimate(point, per_seed, f"{attn}.{axis}.{name}") for name in ("E", "A", "alpha")}


def head_widths(points):
    """{head_dim: [N of the rungs with it]}."""
    widths = {}
    for p in points:
        widths.setdefault(p["config"].get("head_dim"), set()).add(p["N"])
    return {w: sorted(ns) for w, ns in widths.items()}


def sensitivity(points, targets, shared_floor):
    """Where the head width changes along the ladder (the paper's 0.7B has heads of 256, its other sizes 128):
    gamma and alpha refitted without the rungs of the less common head width, where 3 sizes remain."""
    widths = head_widths(points)
    if len(widths) < 2:
        return None
    common_width = max(widths, key=lambda w: (len(widths[w]), str(w)))
    left_out = sorted(n for w, ns in widths.items() if w != common_width for n in ns)
    kept = [p for p in points if p["N"] not in left_out]
    try:
        values = ladder_statistics(kept, [], shared_floor)
    except NotIdentified:
        return {"head_dims": {str(w): ns for w, ns in widths.items()}, "without": left_out, "growth": None}
    return {"head_dims": {str(w): ns for w, ns in widths.items()}, "without": left_out,
            "growth": values["growth"], "alpha": {attn: values[f"{attn}.N.alpha"] for attn in TYPES}}


def build_report(points, targets, point, per_seed, seeds, incomplete, left_out, tokens_per_param, shared_floor):
    rungs = [t for t in targets if t["kind"] == "rung"]
    paper = [t for t in targets if t["kind"] == "paper"]
    n_range = (min(p["N"] for p in points), max(p["N"] for p in points))
    c_range = (min(p["C"] for p in points), max(p["C"] for p in points))
    coverage, cell = measured_coverage(len(seeds), len(rungs)) if per_seed else (None, None)
    growth_ci = t_interval(per_seed["growth"]) if per_seed else None
    slope_ci = t_interval(per_seed["gap_slope"]) if per_seed else None
    report = {
        "law": ("L(x) = E + A_type * x^-alpha_type, one E for SA and XSA" if shared_floor else
                "L(x) = E_type + A_type * x^-alpha_type, a floor per type")
        + "; x = N (non-embedding parameters) or, under compute, C (training FLOPs)",
        "confidence": CONFIDENCE,
        "intervals": {"method": "t over seeds" if per_seed else "none: one seed",
                      "seeds": seeds, "left_out_seeds": [s for s, _ in incomplete],
                      "coverage": coverage, "coverage_cell": cell},
        "tokens_per_param": tokens_per_param,
        "floor": {"shared": shared_floor, **estimate(point, per_seed, "floor.N"),
                  "compute": estimate(point, per_seed, "floor.C")},
        **{attn: {**law_entry(point, per_seed, attn, "N"), "compute": law_entry(point, per_seed, attn, "C")}
           for attn in TYPES},
        "growth": {"value": finite(point["growth"]), "ci": None if growth_ci is None else list(growth_ci),
                   "spans_zero": spans_zero(growth_ci)},
        "gap_trend": {"unit": "per decade of N", "value": point["gap_slope"],
                      "ci": None if slope_ci is None else list(slope_ci), "spans_zero": spans_zero(slope_ci)},
        "gap": {"per_rung": [gap_entry(t, point, per_seed, n_range) for t in rungs],
                "extrapolated": {t["label"]: gap_entry(t, point, per_seed, n_range) for t in paper}},
        "multiplier": {"per_rung": [multiplier_entry(t, point, per_seed, c_range) for t in rungs],
                       "extrapolated": {t["label"]: multiplier_entry(t, point, per_seed, c_range) for t in paper}},
        "sensitivity": sensitivity(points, targets, shared_floor),
        "runs": [{"path": p["path"], "attn_type": p["attn_type"], "seed": p["seed"], "N": p["N"], "D": p["D"],
                  "C": p["C"], "val_loss": p["loss"]} for p in points],
        "left_out": left_out,
    }
    report["notes"] = notes(report, rungs, paper, incomplete)
    return report


def notes(report, rungs, paper, incomplete):
    """What the numbers say, in words."""
    return (interval_notes(report["intervals"], incomplete) + floor_notes(report) + trend_notes(report)
            + size_notes(report, rungs, paper))


def interval_notes(intervals, incomplete):
    said = []
    if intervals["method"].startswith("none"):
        said.append('One seed: no interval; SEEDS="1 2 3" gives one. With one seed nothing separates the law '
                    'from the noise of the runs, and no interval we measured covers the truth at one seed.')
    elif len(intervals["seeds"]) == 2:
        said.append("Two seeds: the t interval has 1 degree of freedom (its quantile is 12.7, not 1.96), so "
                    "the intervals are wide; a third seed narrows them about 3-fold.")
    if intervals["coverage"] is not None:
        cell = intervals["coverage_cell"]
        said.append(f"Measured coverage of these intervals (python -m eval.scaling --calibrate, {cell['seeds']} "
                    f"seeds x {cell['sizes']} sizes, the lowest over the quantities and noise levels): "
                    f"{100 * intervals['coverage']:.0f}%.")
    for seed, missing in incomplete:
        said.append(f"Seed {seed} is left out: it lacks finished SA and XSA runs at N = "
                    f"{', '.join(format_count(n) for n in missing)}.")
    return said


def floor_notes(report):
    said = []
    if not report["floor"]["shared"]:
        said.append("Separate floors (--separate_floors): k beyond the ladder is not identified, since there "
                    "it is set by the gap between two noisy floors, not by the runs; gamma is not a growth "
                    "rate of k.")
    elif report["floor"]["ci"] and report["floor"]["ci"][0] is not None and report["floor"]["ci"][0] <= 1e-6:
        said.append("The floor E's interval reaches 0: the loss no size reaches is not pinned down.")
    for attn in TYPES:
        ci = report[attn]["alpha"]["ci"]
        if ci and ci[0] is not None and ci[0] <= ALPHA_BOUNDS[0] + 1e-6:
            said.append(f"{attn.upper()}'s alpha interval reaches 0: on this evidence its loss need not fall "
                        f"with size at all.")
    sens = report["sensitivity"]
    if sens:
        widths = ", ".join(f"{w} at N = {', '.join(format_count(n) for n in ns)}"
                           for w, ns in sens["head_dims"].items())
        refit = ("too few sizes remain to refit without them" if sens["growth"] is None else
                 f"without the rungs at N = {', '.join(format_count(n) for n in sens['without'])}, gamma is "
                 f"{sens['growth']:+.3f} (with them {report['growth']['value']:+.3f})")
        said.append(f"The head width changes along the ladder (head_dim {widths}); XSA projects per head, so "
                    f"this is not a neutral detail: {refit}.")
    return said


def verdict(entry, sign):
    """What an interval says of a quantity for XSA: None without an interval, 0 where it spans zero, else +1 where
    the quantity's sign (times `sign`: -1 for a quantity where lower favours XSA) favours XSA, -1 where not."""
    if entry["ci"] is None:
        return None
    if entry["spans_zero"]:
        return 0
    return sign if entry["ci"][0] > 0 else -sign


def trend_notes(report):
    """gamma and the gap's slope in words, and where they point different ways."""
    g, slope = report["growth"], report["gap_trend"]
    verdict_g, verdict_s = verdict(g, 1), verdict(slope, -1)  # a falling XSA - SA difference: XSA's lead widens
    said = []
    if verdict_g is not None:
        said.append(f"gamma = {g['value']:+.3f} [{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}] " + (
            "includes 0: a compute multiplier that stays constant with scale fits these runs." if verdict_g == 0 else
            f"excludes 0: XSA's compute multiplier {'grows' if verdict_g > 0 else 'shrinks'} with compute."))
    if verdict_s is not None:
        said.append(f"The loss gap's slope, {slope['value']:+.4f} per decade of N [{slope['ci'][0]:+.4f}, "
                    f"{slope['ci'][1]:+.4f}], " + (
                        "includes 0: no trend of ΔL with size is resolved." if verdict_s == 0 else
                        f"excludes 0: XSA's lead in loss {'widens' if verdict_s > 0 else 'narrows'} with size."))
    if verdict_g is not None and verdict_s is not None and verdict_g * verdict_s < 0:
        said.append("The two point different ways: in compute XSA's advantage "
                    f"{'grows' if verdict_g > 0 else 'shrinks'}, in loss it {'widens' if verdict_s > 0 else 'narrows'} "
                    "(with one floor, ΔL shrinks toward 0 at large N unless gamma is large).")
    return said


def size_notes(report, rungs, paper):
    where = [(f"N = {format_count(t['N'])}", g, k) for t, g, k in
             zip(rungs, report["gap"]["per_rung"], report["multiplier"]["per_rung"])]
    where += [(f"the paper's {t['label']}", report["gap"]["extrapolated"][t["label"]],
               report["multiplier"]["extrapolated"][t["label"]]) for t in paper]
    said = []
    beyond = [t["label"] for t in paper if report["gap"]["extrapolated"][t["label"]]["beyond_ladder"]
              or report["multiplier"]["extrapolated"][t["label"]]["beyond_ladder"]]
    if beyond:
        said.append(f"The paper's {', '.join(beyond)} lie beyond the ladder (marked †): their numbers are "
                    f"extrapolated, at the ladder's {report['tokens_per_param']:.3g} tokens per parameter (the "
                    f"paper trained 105B tokens).")
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
            said.append(f"At {at}, k's interval is unbounded above: in some seeds XSA's loss is below SA's floor.")
    return said


def with_ci(entry, show, one_seed="one seed: no interval"):
    """'value [low, high]', each shown by show(x); without an interval, the value and why."""
    ci = entry["ci"]
    return f"{show(entry['value'])} [{show(ci[0])}, {show(ci[1])}]" if ci else f"{show(entry['value'])} ({one_seed})"


def fmt_k(entry):
    """k [low, high], infinity spelled out (null in scaling.json); † beyond the ladder."""
    def one(x, infinite=False):
        return "∞" if infinite or x is None else f"{x:.3g}"
    ci = entry["ci"]
    text = one(entry["value"], entry["infinite"]) + (" †" if entry["beyond_ladder"] else "")
    return f"{text} [{one(ci[0])}, {one(ci[1])}]" if ci else text


def gap_and_k(gap, k):
    mark = " †" if gap["beyond_ladder"] else ""
    gap_text = with_ci(gap, lambda x: fmt(x, signed=True), one_seed="no interval")
    return f"{gap_text}{mark} | {fmt_k(k)}"


def laws_table(report):
    lines = ["| attention | law | E | A | α |", "|---|---|---|---|---|"]
    for attn in TYPES:
        for law, entry in (("L(N)", report[attn]), ("L(C)", report[attn]["compute"])):
            lines.append(f"| {attn.upper()} | {law} | {with_ci(entry['E'], fmt, 'no interval')} | "
                         f"{with_ci(entry['A'], lambda x: fmt(x) if x is None else f'{x:.3g}', 'no interval')} | "
                         f"{with_ci(entry['alpha'], lambda x: fmt(x) if x is None else f'{x:.3f}', 'no interval')} |")
    return lines


def sizes_table(report, points, rungs):
    """Each size: its runs' tokens and FLOPs, their seeds and final losses, the fitted gap and k."""
    lines = ["| N | tokens | FLOPs | seeds | SA val loss | XSA val loss | ΔL = XSA − SA, fitted | k, XSA's compute "
             "multiplier |", "|---|---|---|---|---|---|---|---|"]
    for t, gap, k in zip(rungs, report["gap"]["per_rung"], report["multiplier"]["per_rung"]):
        at = sorted((p for p in points if p["N"] == t["N"]), key=lambda p: str(p["seed"]))
        seeds = ", ".join(str(s) for s in sorted({p["seed"] for p in at}, key=str))
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


def trend_lines(report):
    g, s, floor = report["growth"], report["gap_trend"], report["floor"]
    show = (lambda x: "–" if x is None else f"{x:+.3f}")
    lines = [f"- growth of XSA's compute multiplier, γ = α_XSA/α_SA − 1 (k ∝ C^γ): "
             f"{with_ci(g, show, 'no interval')}",
             f"- trend of the loss gap, ΔL per decade of N (negative: XSA's lead widens): "
             f"{with_ci(s, lambda x: fmt(x, signed=True), 'no interval')}"]
    if floor["shared"]:
        lines.append(f"- the shared floor E: L(N) {with_ci(floor, fmt, 'no interval')}, "
                     f"L(C) {with_ci(floor['compute'], fmt, 'no interval')}")
    return lines


def markdown(report, points, rungs, paper):
    iv, sizes = report["intervals"], sorted({p["N"] for p in points})
    per_param = f"{report['tokens_per_param']:.3g} tokens per parameter"
    seeds = ("seed " if len(iv["seeds"]) == 1 else "seeds ") + ", ".join(map(str, iv["seeds"]))
    how = (f"{100 * CONFIDENCE:g}% intervals: Student t over the seeds' own fits" if iv["method"] == "t over seeds"
           else "one seed: no intervals")
    floors = "one loss floor E shared by SA and XSA" if report["floor"]["shared"] else "a loss floor per type"
    lines = ["# Scaling ladder: SA vs XSA", "",
             f"{len(points)} runs at {len(sizes)} sizes (N = {format_count(sizes[0])} to {format_count(sizes[-1])} "
             f"non-embedding parameters), {seeds}; {per_param}. Least squares fits of L = E + A·x^−α per "
             f"attention type with {floors}, in N and in training FLOPs C; {how}. † marks a number beyond the "
             f"ladder's range (extrapolated).",
             "", "## Does the gain grow?", "", *trend_lines(report),
             "", "## Fitted laws", "", *laws_table(report),
             "", "## Per size", "", *sizes_table(report, points, rungs),
             "", f"## At the paper's sizes (at {per_param})", "", *paper_table(report, paper)]
    if report["notes"]:
        lines += ["", "## What the numbers say", ""] + [f"- {note}" for note in report["notes"]]
    if report["left_out"]:
        lines += ["", "## Left out", ""] + [f"- {r['path']}: {r['reason']}" for r in report["left_out"]]
    return "\n".join(lines) + "\n"


COLOURS, STYLES = {"sa": "tab:blue", "xsa": "tab:orange"}, {"sa": "--", "xsa": "-"}


def drawn_law(values, attn, axis):
    """The Law of one attention type and axis from a dict of statistics (the fit, or one seed's)."""
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
    """Both fits of the loss against N or C and the shared floor, every run as a point marked by its seed."""
    xs = axis_span(points, paper, axis)
    for attn in TYPES:
        ax.plot(xs, drawn_law(point, attn, axis)(xs), STYLES[attn], color=COLOURS[attn], label=f"{attn.upper()} fit")
        for seed, marker in markers.items():  # one collection per seed: a point per run
            own = [p for p in points if p["attn_type"] == attn and p["seed"] == seed]
            ax.scatter([p[axis] for p in own], [p["loss"] for p in own], marker=marker, color=COLOURS[attn], s=22,
                       zorder=3)
    if math.isfinite(point[f"floor.{axis}"]):
        ax.axhline(point[f"floor.{axis}"], color="grey", lw=0.8, label="shared floor E")
    mark_paper(ax, paper, axis)
    ax.set(xscale="log", xlabel="non-embedding parameters N" if axis == "N" else "training FLOPs C",
           ylabel="validation loss", title=f"loss against {axis}")
    ax.grid(alpha=0.3)


def band(curves):
    """(low, high) of the Student t interval over the seeds' curves at each x, or None with one seed."""
    curves = np.asarray(curves)
    if len(curves) < 2:
        return None
    quantile = t_quantile(CONFIDENCE, len(curves) - 1)
    half = quantile * curves.std(axis=0, ddof=1) / math.sqrt(len(curves))
    return curves.mean(axis=0) - half, curves.mean(axis=0) + half


def split_at_ladder(ax, xs, ys, inside, label, **style):
    """ys against xs: solid where inside, dashed where extrapolated; one legend entry."""
    ax.plot(np.where(inside, xs, np.nan), ys, ls="-", label=label, **style)
    ax.plot(np.where(~inside, xs, np.nan), ys, ls="--", **style)


def plot_gap(ax, points, paper, point, seed_fits, markers):
    """The fitted XSA - SA gap against N with its band over the seeds, and each seed's pair of runs."""
    xs = axis_span(points, paper, "N")
    inside = (xs >= min(p["N"] for p in points)) & (xs <= max(p["N"] for p in points))
    gaps = band([drawn_law(d, "xsa", "N")(xs) - drawn_law(d, "sa", "N")(xs) for d in seed_fits])
    if gaps is not None:
        ax.fill_between(xs, *gaps, color=COLOURS["xsa"], alpha=0.2, label=f"{100 * CONFIDENCE:g}% interval (seeds)")
    split_at_ladder(ax, xs, drawn_law(point, "xsa", "N")(xs) - drawn_law(point, "sa", "N")(xs), inside,
                    color=COLOURS["xsa"], label="fitted (dashed: extrapolated)")
    pairs = {}
    for p in points:
        pairs.setdefault((p["N"], p["seed"]), {})[p["attn_type"]] = p["loss"]
    for seed, marker in markers.items():
        gaps = [(n, d["xsa"] - d["sa"]) for (n, s), d in pairs.items() if s == seed and len(d) == 2]
        ax.scatter([n for n, _ in gaps], [g for _, g in gaps], marker=marker, color="black", s=18, zorder=3)
    ax.axhline(0.0, color="black", lw=0.8)
    mark_paper(ax, paper, "N")
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="XSA − SA validation loss",
           title="the gap: fitted, and each seed's pair")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_multiplier(ax, points, paper, point, seed_fits):
    """k(C) with its band over the seeds; dashed where C or k C lies beyond the ladder."""
    cs = axis_span(points, paper, "C")
    low, high = min(p["C"] for p in points), max(p["C"] for p in points)

    def curve(values):
        return np.array([log_multiplier(c, drawn_law(values, "xsa", "C"), drawn_law(values, "sa", "C")) for c in cs])

    log_k = curve(point)
    inside = (cs >= low) & (cs <= high) & (cs * np.exp(np.minimum(log_k, 700)) >= low) & (
        cs * np.exp(np.minimum(log_k, 700)) <= high)
    ks = band([curve(d) for d in seed_fits])
    if ks is not None and np.all(np.isfinite(ks)):
        ax.fill_between(cs, np.exp(ks[0]), np.exp(ks[1]), color=COLOURS["xsa"], alpha=0.2,
                        label=f"{100 * CONFIDENCE:g}% interval (seeds)")
    split_at_ladder(ax, cs, np.exp(np.minimum(log_k, 700)), inside, color=COLOURS["xsa"],
                    label="k(C) (dashed: beyond the ladder)")
    ax.axhline(1.0, color="black", lw=0.8)
    mark_paper(ax, paper, "C")
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="k: SA's compute / XSA's, same loss",
           title="XSA's compute multiplier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot(points, targets, seed_fits, point, out):
    """Loss against N and against C with both fits and the shared floor (points marked by seed, the paper's
    sizes by dotted lines), the fitted gap against N and k against C, each with its interval over the seeds:
    out/scaling.png."""
    plt = common.pyplot()
    fig, (ax_n, ax_c, ax_gap, ax_k) = plt.subplots(1, 4, figsize=(22, 4.8))
    seeds = sorted({p["seed"] for p in points}, key=str)
    markers = {s: "osD^v<>ph*"[i % 10] for i, s in enumerate(seeds)}
    paper = [t for t in targets if t["kind"] == "paper"]
    plot_losses(ax_n, "N", points, paper, point, markers)
    plot_losses(ax_c, "C", points, paper, point, markers)
    for s in seeds:
        ax_n.scatter([], [], marker=markers[s], color="grey", label=f"seed {s}")
    ax_n.legend(fontsize="small")
    ax_c.legend(fontsize="small")
    plot_gap(ax_gap, points, paper, point, seed_fits, markers)
    plot_multiplier(ax_k, points, paper, point, seed_fits)
    common.save_figure(fig, out, "scaling.png", dpi=110)


def check_decreasing(points, laws):
    """Exit in one line where a type's loss does not fall with size: its losses flat or rising in log N, or
    its fitted exponent at the lower bound (a flat law). No law is identified there: numbers with intervals
    would read as confident."""
    for attn in TYPES:
        own = [p for p in points if p["attn_type"] == attn]
        n, loss = np.array([p["N"] for p in own]), np.array([p["loss"] for p in own])
        slope = np.polyfit(np.log(n), loss, 1)[0]
        law = laws[attn]["N"]
        drop = law(n.min()) - law(n.max())  # what the fitted law falls across the ladder
        if slope >= -1e-9 * loss.mean() or drop <= 1e-6 * loss.mean() or law.alpha <= ALPHA_BOUNDS[0] * (1 + 1e-3):
            why = ("does not fall with size" if slope >= -1e-9 * loss.mean() or drop <= 1e-6 * loss.mean() else
                   f"falls with an exponent at its lower bound ({law.alpha:.3g})")
            exits.fail(f"no law is identified: {attn.upper()}'s loss {why} over N = {format_count(n.min())} to "
                       f"{format_count(n.max())}; a scaling law needs a loss that falls with size")


def main(argv=None):
    parser = common.make_parser(__doc__.split("\n\n")[0], checkpoints=None, device=False,
                                out="scaling.json, scaling.md and scaling.png (calibration.json and .md)")
    parser.add_argument("runs", nargs="*", help="run directories or globs (quoted), or directories of runs")
    parser.add_argument("--separate_floors", action="store_true",
                        help="an E per attention type (an ablation: k beyond the ladder is then not identified)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the intervals' coverage on ladders simulated from known laws, instead of fitting")
    parser.add_argument("--ladders", type=common.positive_int, default=200,
                        help="--calibrate: simulated ladders per cell (default 200)")
    parser.add_argument("--sigmas", default=",".join(map(str, CALIBRATION_SIGMAS)),
                        help="--calibrate: the noise levels, std of a run's final loss, comma-separated "
                             "(default 0.002,0.02)")
    parser.add_argument("--shared", type=float, default=0.5,
                        help="--calibrate: the share of a run's noise variance common to a seed's SA and XSA run "
                             "at one size (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="--calibrate: the simulation's seed (default 0)")
    args = parser.parse_args(argv)

    if args.calibrate:
        try:
            sigmas = [float(s) for s in args.sigmas.split(",")]
        except ValueError:
            parser.error(f"--sigmas {args.sigmas}: expected numbers separated by commas")
        if not 0 <= args.shared < 1 or any(s <= 0 for s in sigmas):
            parser.error("--shared must be in [0, 1) and every sigma positive")
        return calibrate(common.output_dir(args.out), args.ladders, args.seed, sigmas, args.shared)
    if not args.runs:
        parser.error("give the ladder's run directories (or --calibrate)")
    out = common.output_dir(args.out)

    runs = find_runs(args.runs)
    if not runs:
        exits.fail(f"no run directories (with metrics.jsonl and config.json) in {' '.join(args.runs)}")
    points, left_out = ladder_points(runs)
    check_identified(points)
    check_one_ladder(points)
    seeds, incomplete = complete_seeds(points)
    for seed, missing in incomplete:
        print(f"warning: seed {seed} lacks finished SA and XSA runs at N = "
              f"{', '.join(format_count(n) for n in missing)}; left out", file=sys.stderr)
        left_out += [{"path": p["path"], "reason": f"seed {seed} is incomplete"} for p in points if p["seed"] == seed]
    points = [p for p in points if p["seed"] in seeds]
    check_identified(points)
    shared_floor = not args.separate_floors
    check_decreasing(points, fit_laws(points, shared_floor))
    tokens_per_param = statistics.median(p["D"] / p["N"] for p in points)
    rungs, paper = ladder_sizes(points), paper_sizes(tokens_per_param)
    targets = rungs + paper

    point = ladder_statistics(points, targets, shared_floor)
    point["gap_slope"] = statistics.fmean(gap_slope([p for p in points if p["seed"] == s]) for s in seeds)
    per_seed = seed_statistics(points, seeds, targets, shared_floor) if len(seeds) >= 2 else None
    report = build_report(points, targets, point, per_seed, seeds, incomplete, left_out, tokens_per_param,
                          shared_floor)
    table = markdown(report, points, rungs, paper)
    info = json.dumps(report, indent=2, allow_nan=False) + "\n"
    common.write_text(out, "scaling.json", info)
    common.write_text(out, "scaling.md", table)
    seed_fits = [ladder_statistics([p for p in points if p["seed"] == s], targets, shared_floor)
                 for s in seeds] if len(seeds) >= 2 else []
    plot(points, targets, seed_fits, point, out)
    print(table)
    print(f"wrote {os.path.join(out, 'scaling.json')}, scaling.md and scaling.png")


if __name__ == "__main__":
    main()
