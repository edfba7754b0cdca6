"""
The paper's Figure 1 diagnostic, the "attention similarity bias": per layer, averaged over
heads and validation sequences,
    cos_vv  mean cos(v_i, v_j) between the value vectors of two tokens of one sequence, over
            all pairs i != j (the paper does not say whether causal pairs only; we take all)
    a_ii    mean diagonal attention weight, how much a token attends to itself
    cos_yv  mean cos(y_i, v_i) between the attention output and the token's own value, before XSA
    cos_zv  XSA layers only: mean |z_i . v_i| / (|v_i| |y_i|) after XSA, which should be ~0;
            y in the denominator because z itself can be ~0 (docs/design.md), and position 0 left
            out, where z = y - proj(y) is rounding noise
All positions of a sequence count, including the first (where a_00 = cos(y_0, v_0) = 1), so
the numbers follow the paper's plain definitions; learned sink tokens never count as tokens.
With grouped-query attention every quantity is per query head, with the value head it reads.
The paper averages over 1024 training sequences; we use held-out validation sequences.

    python -m eval.similarity out/sa_0p7b out/xsa_0p7b    # val shards: each checkpoint's data_dir
    python -m eval.similarity out/sa_0p7b out/xsa_0p7b --data_dir data/fineweb/fineweb100B
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.similarity", file=sys.stderr)
    sys.exit(2)

import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from eval import common
from pretrain import checkpointer
from pretrain.runtime import autocast

QUANTITIES = {
    "cos_vv": "cos(v_i, v_j), i != j",
    "a_ii": "diagonal attention a_ii",
    "cos_yv": "cos(y_i, v_i), before XSA",
    "cos_zv": "|z_i·v_i| / (|v_i| |y_i|), after XSA",
}


def dense_mask(mask, B, L, device):
    """Which keys each query sees, (B or 1, 1 or heads, L, L) booleans, from what the attention was given: None
    (causal), a boolean mask (a document mask off CUDA), or FlexAttention's BlockMask (a document mask on
    CUDA), whose mask_mod is evaluated at every pair."""
    if mask is None:
        return torch.ones(L, L, dtype=torch.bool, device=device).tril()
    if isinstance(mask, BlockMask):
        index = lambda n, dim: torch.arange(n, device=device).view([n if d == dim else 1 for d in range(4)])  # noqa: E731
        return mask.mask_mod(index(B, 0), index(1, 1), index(L, 2), index(L, 3))
    return mask


def layer_stats(attn, x, cos, sin, n_sinks, mask=None):
    """The four quantities for one attention layer, summed over the batch's sequences (each
    already a mean over heads and tokens). x: the layer's input (B, n_sinks + T, n_embd); mask: the
    attention's own (None: causal)."""
    # projected in the weights' dtype (FSDP's mixed precision gathers bfloat16 ones, which take no float32 input),
    # then float32; q: n_head heads; k, v: n_kv_head heads (GQA)
    q, k, v_kv = (t.float() for t in attn.project_qkv(x.to(attn.c_q.weight.dtype), cos, sin))
    # query head h reads key/value head h // (n_head / n_kv_head): every quantity is per query head
    k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v_kv))  # (B, n_head, L, head_dim)
    L, D = q.shape[-2:]
    # the explicit attention matrix, the only model math repeated here: SDPA does not return a_ii
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    seen = dense_mask(mask, x.size(0), L, x.device)
    att = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    y = att @ v
    tokens = slice(n_sinks, L)  # sink positions are not tokens of the sequence

    vn = F.normalize(v[:, :, tokens], dim=-1)
    T = vn.size(2)
    # mean over pairs i != j of vn_i . vn_j = (|sum_i vn_i|^2 - sum_i |vn_i|^2) / (T (T - 1))
    pair_sum = vn.sum(dim=2).square().sum(dim=-1) - vn.square().sum(dim=(-2, -1))
    stats = {
        "cos_vv": (pair_sum / (T * (T - 1))).mean(dim=1).sum().item() if T > 1 else float("nan"),
        "a_ii": att.diagonal(dim1=-2, dim2=-1)[:, :, tokens].mean(dim=(1, 2)).sum().item(),
        "cos_yv": F.cosine_similarity(y, v, dim=-1)[:, :, tokens].mean(dim=(1, 2)).sum().item(),
    }
    if attn.attn_type == "xsa":  # this block's: xsa_layers may leave some blocks SA
        z = attn.exclude_self(y, v_kv)  # with the gate of gated XSA
        ortho = (z * v).sum(dim=-1).abs() / (v.norm(dim=-1) * y.norm(dim=-1)).clamp_min(1e-12)
        stats["cos_zv"] = ortho[:, :, max(n_sinks, 1):].mean(dim=(1, 2)).sum().item()
    return stats


@torch.no_grad()
def similarity_stats(model, x, dtype="float32"):
    """Per-layer means over heads, tokens and the sequences x (B, T) of the Figure 1 quantities:
    {"cos_vv": [...], "a_ii": [...], "cos_yv": [...], "cos_zv": [...] or None}, one value per layer;
    cos_zv is None for an SA model and None in the SA layers of a model with XSA in some layers only.
    Each block's attention input is captured by a forward pre-hook during a normal, eager forward pass."""
    sums = [None] * model.config.n_layer

    def capture(i):
        def hook(attn, inputs):
            layer_input, cos, sin = inputs[:3]  # CausalSelfAttention.forward(x, cos, sin, mask=None, cache=None)
            mask = inputs[3] if len(inputs) > 3 else None
            with torch.autocast(device_type=layer_input.device.type, enabled=False):
                sums[i] = layer_stats(attn, layer_input, cos, sin, model.config.n_sinks, mask)
        return hook

    handles = [block.attn.register_forward_pre_hook(capture(i)) for i, block in enumerate(model.transformer.h)]
    try:  # eager: a compiled block (FSDP compiles each) would not call hooks registered after it was compiled
        with autocast(x.device.type, dtype), torch.compiler.set_stance("force_eager"):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    means = {name: [s[name] / len(x) if name in s else None for s in sums] for name in QUANTITIES}
    if all(value is None for value in means["cos_zv"]):
        means["cos_zv"] = None  # no XSA layer, nothing after XSA
    return means


def stats_over_batches(model, x, batch_size, dtype, quiet=True, desc=None):
    """similarity_stats over many sequences, in batches of batch_size: one mean over all of them.
    With quiet=False, a progress bar over the batches (desc: its label)."""
    batches = common.progress(x.split(batch_size), quiet, desc=desc, unit="batch")
    per_batch = [(len(batch), similarity_stats(model, batch, dtype)) for batch in batches]

    def mean(name):
        if per_batch[0][1][name] is None:
            return None
        layers = range(model.config.n_layer)
        return [None if per_batch[0][1][name][layer] is None else
                sum(n * stats[name][layer] for n, stats in per_batch) / len(x) for layer in layers]

    return {name: mean(name) for name in QUANTITIES}


@torch.no_grad()
def in_loop_record(model, x, runtime, dtype):
    """train.py's similarity-bias keys of metrics.jsonl for the fixed validation sequences x (B, T), by
    similarity_stats itself: similarity/layer<i>/cos_yv, .../self_weight (a_ii), .../cos_zv (XSA layers) and
    similarity/mean_cos_yv. Process r scores sequences r, r + W, ... and the sums are gathered: the numbers are
    those of this script on the same sequences. Every process runs one forward (FSDP's is collective)."""
    mine = x[runtime.rank::runtime.world_size]
    model.eval()
    stats = similarity_stats(model, (mine if len(mine) else x[:1]).to(runtime.device), dtype)
    model.train()
    names = {"cos_yv": "cos_yv", "a_ii": "self_weight", "cos_zv": "cos_zv"}
    xsa = [block.attn.attn_type == "xsa" for block in model.transformer.h]
    # per-layer sums over this process's sequences, then over all of them
    sums = torch.tensor([[(stats[name][i] if stats[name] and stats[name][i] is not None else 0.0) * len(mine)
                          for i in range(len(xsa))] for name in names], dtype=torch.float64, device=runtime.device)
    if runtime.distributed:
        torch.distributed.all_reduce(sums)
    means = (sums / len(x)).tolist()
    record = {}
    for i, is_xsa in enumerate(xsa):
        for (name, key), values in zip(names.items(), means):
            if key != "cos_zv" or is_xsa:
                record[f"similarity/layer{i}/{key}"] = values[i]
    record["similarity/mean_cos_yv"] = sum(means[0]) / len(xsa)
    return record


def format_table(results):
    """results: {label: stats} -> a markdown table, one row per layer, one column per quantity and model."""
    columns = [(label, name) for label, stats in results.items() for name in QUANTITIES if stats[name] is not None]
    lines = ["| layer | " + " | ".join(f"{label} {name}" for label, name in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    n_layer = max(len(stats["cos_yv"]) for stats in results.values())
    for layer in range(n_layer):
        values = [results[label][name][layer] if layer < len(results[label][name]) else None
                  for label, name in columns]
        cells = ["-" if value is None else f"{value:.4f}" for value in values]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, out):
    """similarity.png in out: one panel per model, side by side, each quantity against the layer index."""
    plt = common.pyplot()
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True, squeeze=False)
    for ax, (label, stats) in zip(axes[0], results.items()):
        for name, description in QUANTITIES.items():
            if stats[name] is not None:  # cos_zv: only the XSA layers
                layers = [i for i, value in enumerate(stats[name]) if value is not None]
                ax.plot(layers, [stats[name][i] for i in layers], marker="o", label=description)
        ax.set_title(label)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("mean over heads, tokens and sequences")
    return common.save_figure(fig, out, "similarity.png")


def main():
    parser = common.make_parser(__doc__, data_dir=True, out="similarity.json and similarity.png", progress=True,
                                dtype_help="autocast dtype of the forward pass (auto: bfloat16 on GPUs that "
                                           "support it); the statistics are computed in float32")
    parser.add_argument("--num_sequences", type=common.positive_int, default=1024,
                        help="validation sequences (paper: 1024), capped at what the val shards hold")
    parser.add_argument("--block_size", type=common.positive_int, default=None,
                        help="sequence length; default: each checkpoint's block_size")
    parser.add_argument("--batch_size", type=common.positive_int, default=4,
                        help="sequences per forward pass; small, as the attention matrix is explicit")
    args = parser.parse_args()
    checkpoints = common.label_checkpoints(parser, args.checkpoints, args.labels)
    device, dtype = common.device_and_dtype(parser, args)
    out = common.output_dir(args.out)

    results, info = {}, {}
    for label, path in checkpoints.items():
        model, config = checkpointer.load_model_or_exit(path, device)
        block_size = args.block_size or config["block_size"]
        common.check_block_size(block_size, config, path, "--block_size")
        data_dir, x, _ = common.validation_sequences(args, config, block_size, args.num_sequences)
        print(f"{label}: {path}, attn_type={config['attn_type']}, {len(x)} sequences of {block_size} tokens "
              f"from {data_dir}", flush=True)
        results[label] = stats_over_batches(model, x.to(device), args.batch_size, dtype, args.quiet, label)
        info[label] = {"checkpoint": path, "attn_type": config["attn_type"], "n_sinks": config.get("n_sinks", 0),
                       "data_dir": data_dir, "num_sequences": len(x), "block_size": block_size}
        model.to("cpu")
    print(format_table(results))

    models = {label: dict(info[label], **results[label]) for label in results}
    path = common.write_text(out, "similarity.json", json.dumps({"quantities": QUANTITIES, "models": models},
                                                                indent=2))
    plot(results, out)
    print(f"wrote {path} and similarity.png")


if __name__ == "__main__":
    main()
