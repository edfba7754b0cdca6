"""
Validation loss as a function of the position in the context: does a model use its long
context, and does XSA's gain grow with position (the paper: XSA's gain grows with sequence length)?
Positions are grouped into --buckets equal ranges; every sequence is a full block_size window
of the fixed validation tokens, so each position is scored equally often.

    python -m eval.position_loss out/sa_0p7b out/xsa_0p7b    # val shards: the first checkpoint's data_dir
    python -m eval.position_loss out/sa_0p7b out/xsa_0p7b --data_dir data/fineweb/fineweb100B
    python -m eval.position_loss out/sa_tiny out/xsa_tiny --block_size 4x    # past the training context

Past the training context: RoPE has no learned positions, so a model runs on longer sequences once its
tables extend (model.GPT.extend_context). `--block_size 4x` scores 4 times the first model's training length;
a length in tokens beyond it needs --extend_context. The buckets then split at the training length, and
the report gives each model's mean loss inside and beyond the trained range, and the difference of the
second model from the first in both: does XSA extrapolate better than SA?

By position within the document (--by document): a window packs several documents, so position t of a
window is rarely position t of a document. This scores each token by how many tokens of its own document
it is conditioned on (1: the document's first token, its end-of-text, predicting the first word; a window's
first tokens start a document, as the document mask sees them), in log-spaced buckets 1-63, 64-255,
256-1023, ... up to the block size, with each bucket's token and document counts. With two or more models,
each one's difference from the first per bucket, with a 95% interval over documents (each document's tokens
vary together: the interval treats a document, not a token, as one draw, the pieces of a document that two
windows cut counted as one; with small-sample corrections for a few documents of unequal lengths, its
coverage measured by simulation): does XSA's gain grow deeper into long documents?
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.position_loss", file=sys.stderr)
    sys.exit(2)

import json
import math

import torch
import torch.nn.functional as F

from eval import common
from model import document_segments
from pretrain import checkpointer
from pretrain.runtime import autocast


@torch.no_grad()
def token_losses(model, x, y, batch_size=16, dtype="float32", quiet=True, desc=None):
    """Cross-entropy of every token of the sequences x, y (N, T): a float64 tensor (N, T) on the CPU.
    With quiet=False, a progress bar over the batches (desc: its label)."""
    losses = []
    for i in common.progress(range(0, len(x), batch_size), quiet, desc=desc, unit="batch"):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        with autocast(x.device.type, dtype):
            logits, _ = model(xb)
        losses.append(F.cross_entropy(logits.float().transpose(1, 2), yb, reduction="none").double().cpu())
    return torch.cat(losses)


def position_losses(model, x, y, batch_size=16, dtype="float32", quiet=True, desc=None):
    """Mean cross-entropy at each position over the sequences x, y (N, T): a float64 tensor (T,)."""
    return token_losses(model, x, y, batch_size, dtype, quiet, desc).mean(dim=0)


def bucket_losses(per_position, n_buckets, boundary=None):
    """Mean loss over n_buckets contiguous, near-equal ranges of positions that together cover
    every position once: [{"start", "end" (exclusive), "loss"}]. With a boundary (the training length,
    when scoring past it), no range straddles it: the buckets are shared out in proportion."""
    T = len(per_position)
    if boundary is not None and 0 < boundary < T:
        inside = max(1, min(n_buckets - 1, round(n_buckets * boundary / T)))
        beyond = bucket_losses(per_position[boundary:], n_buckets - inside)
        return bucket_losses(per_position[:boundary], inside) + [
            {**b, "start": b["start"] + boundary, "end": b["end"] + boundary} for b in beyond]
    positions = torch.arange(T)
    return [{"start": int(p[0]), "end": int(p[-1]) + 1, "loss": per_position[p].mean().item()}
            for p in torch.tensor_split(positions, min(n_buckets, T))]


# -----------------------------------------------------------------------------
# by position within the document

def document_positions(x, eot_token):
    """For the input tokens x (N, T), consecutive windows of one token stream: each token's position within
    its document, counted from 1 (the tokens of its document it is conditioned on), and its document's id.
    Positions restart at each eot_token and at each window's first token (model.document_segments, as the
    document mask sees them); ids are the stream's, so a document cut by a window's end is one document
    for the interval, whose pieces rise and fall together."""
    _, positions = document_segments(x, torch.ones_like(x, dtype=torch.bool), eot_token)
    return positions + 1, (x.flatten() == eot_token).long().cumsum(dim=0).view_as(x)


def log_buckets(block_size):
    """[(first, last)] positions: 1-63, 64-255, 256-1023, ... (x4), the last one ending at block_size."""
    buckets, first = [], 1
    while first <= block_size:
        last = min(block_size, 64 * 4 ** len(buckets) - 1)
        buckets.append((first, last))
        first = last + 1
    return buckets


def document_buckets(losses, positions, documents, buckets):
    """Mean loss of the tokens in each bucket of positions, with their token and document counts."""
    rows = []
    for first, last in buckets:
        inside = (positions >= first) & (positions <= last)
        n = int(inside.sum())
        rows.append({"start": first, "end": last + 1, "tokens": n, "documents": int(documents[inside].unique().numel()),
                     "loss": losses[inside].mean().item() if n else None})
    return rows


# The lowest coverage of difference_by_document's 95% interval over the simulated cases of
# tests/test_interval_coverage.py (documents of lognormal lengths, sigma 1.5; per-document effects, some
# growing with the length, some heavy-tailed; 1,000 draws each), by the number of documents: 3 or more cover
# at least 93% (5 to 20: 93-99%); 2 fall short.
DOCUMENT_COVERAGE = {2: 0.906, 3: 0.936}


def difference_by_document(losses, reference, positions, documents, buckets, confidence=0.95):
    """Per bucket: the mean over tokens of losses - reference, and its confidence interval with documents as
    the independent draws. The estimate is the ratio sum(d_j) / sum(n_j) over documents j (d_j: the sum of a
    document's differences in the bucket, n_j its tokens), estimating the population ratio E[d_j] / E[n_j].
    Its interval is cluster-robust with the small-sample corrections of Bell and McCaffrey (2002), which a
    few documents of very unequal lengths need (the plain J / (J - 1) sandwich with J - 1 degrees of freedom
    covered 71-90% at 5 to 20 documents of lognormal lengths; see docs/evaluation.md):
    - CR2: each document's squared residual (d_j - mean n_j)^2 divided by 1 - n_j / N (its leverage);
    - Student t with Satterthwaite degrees of freedom under a working model in which a document's sum varies
      as n_j s^2 + n_j^2 tau^2 (token noise s^2, a per-document effect tau^2, both estimated from the
      data: the within-document and between-document mean squares). A few long documents carrying most
      tokens leave few degrees of freedom, and the interval widens accordingly.
    With documents of equal size it is the t interval of the documents' mean differences (J - 1 degrees of
    freedom). Each row also has "df", the degrees of freedom used."""
    rows = []
    for first, last in buckets:
        inside = (positions >= first) & (positions <= last)
        ids, index = documents[inside].unique(return_inverse=True)
        J = ids.numel()
        if J == 0:
            rows.append({"start": first, "end": last + 1, "difference": None, "ci": None, "documents": 0, "df": None})
            continue
        differences = (losses - reference)[inside].double()
        sums = torch.zeros(J, dtype=torch.float64).index_add_(0, index, differences)
        squares = torch.zeros(J, dtype=torch.float64).index_add_(0, index, differences ** 2)
        counts = torch.bincount(index, minlength=J).double()
        mean = (sums.sum() / counts.sum()).item()
        ci = df = None
        if J > 1:
            low, high, df = cluster_interval(sums, squares, counts, confidence)
            ci = (low, high)
        rows.append({"start": first, "end": last + 1, "difference": mean, "ci": ci, "documents": J, "df": df})
    return rows


def cluster_interval(sums, squares, counts, confidence=0.95):
    """(low, high, degrees of freedom) of the ratio estimator sum(sums) / sum(counts) over J > 1 clusters, from
    each cluster's sum, sum of squares and size (difference_by_document: CR2 and Bell-McCaffrey's degrees of
    freedom under the working model var(sum_j) = n_j s^2 + n_j^2 tau^2)."""
    J, N = counts.numel(), counts.sum()
    mean = sums.sum() / N
    p = counts / N  # each cluster's leverage
    a = 1 / (1 - p).clamp_min(1e-12)
    variance = (a * (sums - mean * counts) ** 2).sum() / N ** 2
    # the working model's variances: s^2 from within the clusters, tau^2 from between them (moments, >= 0)
    within = (squares - sums ** 2 / counts).sum().clamp_min(0)
    s2 = within / (N - J) if N > J else torch.zeros((), dtype=torch.float64)
    between = (counts * (sums / counts - mean) ** 2).sum() / (J - 1)
    n0 = (N - (counts ** 2).sum() / N) / (J - 1)
    tau2 = ((between - s2) / n0).clamp_min(0) if n0 > 0 else torch.zeros((), dtype=torch.float64)
    v = counts * s2 + counts ** 2 * tau2
    if not v.sum() > 0:  # no spread at all: any working model; independent tokens
        v = counts
    df = satterthwaite_df(p, v, a)
    half = common.t_quantile(confidence, df) * math.sqrt(variance.item())
    return mean.item() - half, mean.item() + half, df


def satterthwaite_df(p, v, a):
    """Degrees of freedom of the variance estimate V = sum_j a_j r_j^2 (r = S - p sum(S): the residual cluster
    sums) when the cluster sums S are independent with variances v: 2 E[V]^2 / var(V) = tr(K)^2 / tr(K^2), with
    K = A^1/2 (I - p 1') diag(v) (I - 1 p') A^1/2 = diag(a v) + L, L = [u w] M [u w]' of rank 2
    (u = a^1/2 p, w = a^1/2 v, M = [[sum v, -1], [-1, 0]]): O(J), however many documents."""
    total = v.sum()
    x = a.sqrt()
    u, w, d = x * p, x * v, a * v
    trace = d.sum() - 2 * (u * w).sum() + total * (u * u).sum()
    gram = torch.stack([torch.stack([(u * u).sum(), (u * w).sum()]), torch.stack([(u * w).sum(), (w * w).sum()])])
    m = torch.tensor([[total.item(), -1.0], [-1.0, 0.0]], dtype=torch.float64)
    low_rank = torch.trace(m @ gram @ m @ gram)
    cross = (d * (-2 * u * w + total * u * u)).sum()
    square = (d * d).sum() + 2 * cross + low_rank
    return (trace ** 2 / square).item() if square > 0 else float(p.numel() - 1)


def format_document_table(results):
    """results: {label: {"buckets": [...], "differences": [...] (not for the first)}} -> markdown."""
    labels = list(results)
    header = [f"{label}" for label in labels] + [f"{label} - {labels[0]} [95% CI]" for label in labels[1:]]
    lines = ["| position in document | tokens | documents | " + " | ".join(header) + " |",
             "|---" * (len(header) + 3) + "|"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    for i, bucket in enumerate(results[labels[0]]["buckets"]):
        cells = [fmt(results[label]["buckets"][i]["loss"]) for label in labels]
        for label in labels[1:]:
            d = results[label]["differences"][i]
            cells.append(fmt(d["difference"]) + ("" if d["ci"] is None else
                                                 f" [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]"))
        lines.append(f"| {bucket['start']}-{bucket['end'] - 1} | {bucket['tokens']} | {bucket['documents']} | "
                     + " | ".join(cells) + " |")
    means = [results[label]["mean"] for label in labels]
    lines.append("| all (mean) | | | " + " | ".join(fmt(v) for v in means + [m - means[0] for m in means[1:]]) + " |")
    few = [f"{b['start']}-{b['end'] - 1}" for b in results[labels[0]]["buckets"] if b["documents"] == 2]
    if few and len(labels) > 1:
        lines += ["", f"Bucket{'s' * (len(few) > 1)} {', '.join(few)}: 2 documents only. With 2 documents this "
                      f"interval falls short of 95%: its coverage, measured by simulation (documents of very "
                      f"unequal lengths), was {100 * DOCUMENT_COVERAGE[2]:.0f}%; from 3 documents on, "
                      f"{100 * DOCUMENT_COVERAGE[3]:.0f}% or more."]
    return "\n".join(lines)


def plot_by_document(results, out):
    """position_loss.png in out: loss per bucket against the position in the document (log scale); with two
    or more models, each one's difference from the first, with its 95% interval."""
    plt = common.pyplot()
    labels = list(results)
    buckets = results[labels[0]]["buckets"]
    centers = [math.sqrt(b["start"] * (b["end"] - 1)) for b in buckets]  # the geometric middle
    panels = 2 if len(labels) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    for label in labels:
        axes[0][0].plot(centers, [b["loss"] for b in results[label]["buckets"]], marker="o", label=label)
    axes[0][0].set(xlabel="position in document", ylabel="validation loss", title="loss by position in document")
    for label in labels[1:]:
        rows = [d for d in results[label]["differences"] if d["difference"] is not None]
        xs = [math.sqrt(d["start"] * (d["end"] - 1)) for d in rows]
        ys = [d["difference"] for d in rows]
        errors = [[y - (d["ci"] or (y, y))[0] for y, d in zip(ys, rows)],
                  [(d["ci"] or (y, y))[1] - y for y, d in zip(ys, rows)]]
        axes[0][1].errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=f"{label} - {labels[0]}")
    if panels == 2:
        axes[0][1].axhline(0, color="gray", lw=0.8)
        axes[0][1].set(xlabel="position in document", ylabel="loss difference (95% CI over documents)",
                       title=f"difference from {labels[0]}")
        axes[0][1].legend()
    for ax in axes[0]:
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    return common.save_figure(fig, out, "position_loss.png")


# -----------------------------------------------------------------------------

def sequence_length(text):
    """argparse type of --block_size: tokens (512), or a multiple of each model's training length (4x)."""
    if text.endswith("x"):
        factor = float(text[:-1])
        if not factor > 0:
            raise ValueError(text)
        return ("x", factor)
    return ("tokens", common.positive_int(text))


def format_table(results):
    """results: {label: {"buckets": [...], "mean": float}} -> markdown; with two models, their difference."""
    labels = list(results)
    header = labels + ([f"{labels[1]} - {labels[0]}"] if len(labels) == 2 else [])
    lines = ["| positions | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]

    def row(name, values):
        if len(values) == 2:
            values = values + [values[1] - values[0]]
        return f"| {name} | " + " | ".join(f"{v:.4f}" for v in values) + " |"

    for i, bucket in enumerate(results[labels[0]]["buckets"]):
        losses = [results[label]["buckets"][i]["loss"] for label in labels]
        lines.append(row(f"{bucket['start']}-{bucket['end'] - 1}", losses))
    lines.append(row("all (mean)", [results[label]["mean"] for label in labels]))
    for part in ("inside", "beyond"):  # scored past the training length: each side of it
        if all(results[label].get(part) is not None for label in labels):
            trained = results[labels[0]]["trained_block_size"]
            name = f"{'inside' if part == 'inside' else 'beyond'} the training length ({trained})"
            lines.append(row(name, [results[label][part] for label in labels]))
    return "\n".join(lines)


def plot(results, out):
    """position_loss.png in out: loss per bucket against the bucket's middle position; with two
    models, their difference too."""
    plt = common.pyplot()
    labels = list(results)
    centers = [(b["start"] + b["end"] - 1) / 2 for b in results[labels[0]]["buckets"]]
    panels = 2 if len(labels) == 2 else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    for label in labels:
        axes[0][0].plot(centers, [b["loss"] for b in results[label]["buckets"]], marker="o", label=label)
    axes[0][0].set(xlabel="position in context", ylabel="validation loss", title="loss by position")
    axes[0][0].legend()
    if len(labels) == 2:
        a, b = (results[label]["buckets"] for label in labels)
        axes[0][1].plot(centers, [y["loss"] - x["loss"] for x, y in zip(a, b)], marker="o", color="C2")
        axes[0][1].axhline(0, color="gray", lw=0.8)
        axes[0][1].set(xlabel="position in context", ylabel="loss difference",
                       title=f"{labels[1]} - {labels[0]}")
    trained = results[labels[0]].get("trained_block_size")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if trained and trained < len(results[labels[0]]["per_position"]):
            ax.axvline(trained - 0.5, color="gray", ls="--", lw=1, label="training length")
    axes[0][0].legend()
    return common.save_figure(fig, out, "position_loss.png")


def main():
    parser = common.make_parser(__doc__, data_dir=True, out="position_loss.json, .md and .png", progress=True)
    parser.add_argument("--num_sequences", type=common.positive_int, default=512,
                        help="validation sequences, capped at what the val shards hold")
    parser.add_argument("--block_size", type=sequence_length, default=None,
                        help="sequence length in tokens, or a multiple of the training length (4x: past it); "
                             "default: the first checkpoint's block_size")
    parser.add_argument("--extend_context", action="store_true",
                        help="let --block_size (in tokens) run past a model's training length")
    parser.add_argument("--buckets", type=common.positive_int, default=16, help="number of position ranges")
    parser.add_argument("--batch_size", type=common.positive_int, default=16, help="sequences per forward pass")
    parser.add_argument("--by", choices=("window", "document"), default="window",
                        help="position in the window (equal buckets) or within the token's document (log-spaced "
                             "buckets, differences with a 95%% interval over documents)")
    args = parser.parse_args()
    checkpoints = common.label_checkpoints(parser, args.checkpoints, args.labels)
    device, dtype = common.device_and_dtype(parser, args)
    out = common.output_dir(args.out)

    results, x, y, first_losses = {}, None, None, None
    by_document = args.by == "document"
    for label, path in checkpoints.items():
        model, config = checkpointer.load_model_or_exit(path, device)
        extend = args.extend_context or bool(args.block_size and args.block_size[0] == "x")
        if x is None:  # the same tokens for every model (the first one's data by default), so the curves compare
            kind, value = args.block_size or ("tokens", config["block_size"])
            block_size = round(value * config["block_size"]) if kind == "x" else value
            common.check_block_size(block_size, config, path, extend=extend)
            data_dir, x, y = common.validation_sequences(args, config, block_size, args.num_sequences)
            x, y = x.to(device), y.to(device)
        else:
            common.check_block_size(block_size, config, path, "--block_size" if args.block_size else
                                    "the first checkpoint's block_size", extend=extend)
            if not args.data_dir and config["data_dir"] != data_dir:
                print(f"note: {label} was trained on {config['data_dir']}, scored on {data_dir} as the first model",
                      flush=True)
        model.extend_context(block_size)
        trained = config["block_size"]
        losses = token_losses(model, x, y, args.batch_size, dtype, args.quiet, label)
        model.to("cpu")
        if by_document:
            if first_losses is None:  # the first model's end-of-text token splits the documents for all
                eot_token = config.get("eot_token", 50256)
                positions, documents = document_positions(x.cpu(), eot_token)
                buckets = log_buckets(x.size(1))
                first_losses = losses
            results[label] = {"checkpoint": path, "attn_type": config["attn_type"],
                              "attn_mask": config.get("attn_mask", "causal"), "mean": losses.mean().item(),
                              "buckets": document_buckets(losses, positions, documents, buckets)}
            if len(results) > 1:
                results[label]["differences"] = difference_by_document(losses, first_losses, positions, documents,
                                                                       buckets)
        else:
            per_position = losses.mean(dim=0)
            past = trained < block_size
            results[label] = {"checkpoint": path, "attn_type": config["attn_type"], "trained_block_size": trained,
                              "mean": per_position.mean().item(),
                              "inside": per_position[:trained].mean().item() if past else None,
                              "beyond": per_position[trained:].mean().item() if past else None,
                              "buckets": bucket_losses(per_position, args.buckets,
                                                       results[next(iter(results))]["trained_block_size"]
                                                       if results else trained),
                              "per_position": per_position.tolist()}
        print(f"{label}: {path}, mean validation loss {results[label]['mean']:.4f} "
              f"over {len(x)} sequences of {x.size(1)} tokens from {data_dir}", flush=True)
    table = format_document_table(results) if by_document else format_table(results)
    print(table)

    report = {"data_dir": data_dir, "num_sequences": len(x), "block_size": x.size(1), "by": args.by,
              **({"eot_token": eot_token} if by_document else {}), "models": results}
    path = common.write_text(out, "position_loss.json", json.dumps(report, indent=2))
    where = " within the document" if by_document else ""
    common.write_text(out, "position_loss.md", f"Validation loss by position{where}, {len(x)} sequences of "
                                               f"{x.size(1)} tokens from {data_dir}.\n\n{table}\n")
    if by_document:
        plot_by_document(results, out)
    else:
        plot(results, out)
    print(f"wrote {path}, position_loss.md and position_loss.png")


if __name__ == "__main__":
    main()
