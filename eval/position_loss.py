"""
Validation loss as a function of the position in the context: does a model use its long
context, and does XSA's gain grow with position (the paper: XSA's gain grows with sequence length)?
Positions are grouped into --buckets equal ranges; every sequence is a full block_size window
of the fixed validation tokens, so each position is scored equally often.

    python eval/position_loss.py out/sa_0p7b out/xsa_0p7b    # val shards: the first checkpoint's data_dir
    python eval/position_loss.py out/sa_0p7b out/xsa_0p7b --data_dir data/fineweb/fineweb100B
    python eval/position_loss.py out/sa_tiny out/xsa_tiny --block_size 4x    # past the training context

Past the training context: RoPE has no learned positions, so a model runs on longer sequences once its
tables extend (model.GPT.extend_context). `--block_size 4x` scores 4 times the first model's training length;
a length in tokens beyond it needs --extend_context. The buckets then split at the training length, and
the report gives each model's mean loss inside and beyond the trained range, and the difference of the
second model from the first in both: does XSA extrapolate better than SA?
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eval import common  # noqa: E402
from runtime import autocast  # noqa: E402


@torch.no_grad()
def position_losses(model, x, y, batch_size=16, dtype="float32", quiet=True, desc=None):
    """Mean cross-entropy at each position over the sequences x, y (N, T): a float64 tensor (T,).
    With quiet=False, a progress bar over the batches (desc: its label)."""
    total = torch.zeros(x.size(1), dtype=torch.float64, device=x.device)
    for i in common.progress(range(0, len(x), batch_size), quiet, desc=desc, unit="batch"):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        with autocast(x.device.type, dtype):
            logits, _ = model(xb)
        loss = F.cross_entropy(logits.float().transpose(1, 2), yb, reduction="none")  # (B, T)
        total += loss.double().sum(dim=0)
    return total / len(x)


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
    args = parser.parse_args()
    checkpoints = common.label_checkpoints(parser, args.checkpoints, args.labels)
    device, dtype = common.device_and_dtype(parser, args)
    out = common.output_dir(args.out)

    results, x, y = {}, None, None
    for label, path in checkpoints.items():
        model, config = common.load(path, device)
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
        per_position = position_losses(model, x, y, args.batch_size, dtype, args.quiet, label).cpu()
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
        model.to("cpu")
    table = format_table(results)
    print(table)

    report = {"data_dir": data_dir, "num_sequences": len(x), "block_size": x.size(1), "models": results}
    path = common.write_text(out, "position_loss.json", json.dumps(report, indent=2))
    common.write_text(out, "position_loss.md", f"Validation loss by position, {len(x)} sequences of {x.size(1)} "
                                               f"tokens from {data_dir}.\n\n{table}\n")
    plot(results, out)
    print(f"wrote {path}, position_loss.md and position_loss.png")


if __name__ == "__main__":
    main()
