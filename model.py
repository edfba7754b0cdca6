"""
A GPT language model with standard (SA) or exclusive (XSA) self-attention, in one file.

XSA (Zhai, "Exclusive Self Attention", arXiv:2603.09078): after y = softmax(qk^T)v, each
head removes from y_i its component along the token's own value vector,
    z_i = y_i - (y_i . v_i / |v_i|^2) v_i,
so a head can only pass on information from the *other* tokens. No new parameters.

The architecture is nanoGPT with the paper's three changes: RoPE instead of learned
positions, a LayerNorm right after the token embedding, and a head width set
independently of the model width. Beyond the paper: gated XSA, learned attention sinks,
grouped-query attention (n_kv_head), XSA in some blocks only (xsa_layers), and attention
within documents only (attn_mask="document").
"""

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ATTN_TYPES = ("sa", "xsa")
ATTN_MASKS = ("causal", "document")
# the device types on which a document mask runs as FlexAttention with a block-sparse mask (the blocks between
# two documents are skipped); elsewhere it is SDPA with a dense boolean mask: FlexAttention has no backward on
# CPU. Changed only within flex_attention_devices.
_flex_devices = ("cuda",)


def setting(default, meaning, variant=None):
    """A hyperparameter with its one-line meaning, which `python train.py --help` shows. variant: for a key
    that makes an attention variant, how run names spell its value (None: no part of the name)."""
    return field(default=default, metadata={"help": meaning, "variant": variant})


@dataclass
class GPTConfig:
    """The model's hyperparameters; train.py takes each as a config key of the same name."""
    block_size: int = setting(1024, "longest sequence the model is trained on (sinks not counted)")
    vocab_size: int = setting(50304, "GPT-2's 50257 padded up to a multiple of 64 for efficiency")
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention (query) heads per block")
    n_kv_head: int | None = setting(None, "key/value heads (GQA: n_head a multiple of it; 1 is MQA); None means n_head")
    n_embd: int = setting(768, "model (residual stream) width")
    head_dim: int | None = setting(None, "width of one head; None means n_embd // n_head")
    attn_type: Literal[ATTN_TYPES] = setting("sa", '"sa": standard self-attention, "xsa": exclusive self-attention',
                                             variant=str)
    xsa_gate: bool = setting(False, "XSA only: z = y - tanh(alpha) * proj, alpha per head, zero-init (starts as SA)",
                             variant=lambda on: "gate" if on else None)
    xsa_layers: int | str | list[int] | None = setting(
        None, 'XSA only, in some blocks: the last k (an int), or the blocks listed ([0, 5, 11] or "0,5,11"); '
              'None: every block',
        variant=lambda k: None if k is None else f"last{k}" if isinstance(k, int) else "blocks" + k.replace(",", "-"))
    n_sinks: int = setting(0, "learned sink tokens prepended to every sequence (StreamingLLM-style); never scored")
    rope_theta: float = setting(10000.0, "RoPE base frequency")
    bias: bool = setting(False, "biases in Linear and LayerNorm layers")
    dropout: float = setting(0.0, "dropout on attention weights and residual branches")
    attn_mask: Literal[ATTN_MASKS] = setting("causal", '"causal": a query sees every earlier token of its window; '
                                             '"document": only those of its own document, whose positions start at 0')
    eot_token: int = setting(50256, "the token that starts every document (GPT-2's <|endoftext|>), where "
                                    'attn_mask="document" splits a window')

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.n_sinks >= 0:
            raise ValueError(f"n_sinks must not be negative, got {self.n_sinks!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.attn_type not in ATTN_TYPES:
            raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {self.attn_type!r}")
        if self.attn_mask not in ATTN_MASKS:
            raise ValueError(f"attn_mask must be one of {ATTN_MASKS}, got {self.attn_mask!r}")
        if self.attn_mask == "document" and not 0 <= self.eot_token < self.vocab_size:
            raise ValueError(f"eot_token={self.eot_token} is not a token of vocab_size={self.vocab_size}")
        if self.attn_mask == "document" and self.dropout:
            warnings.warn("attn_mask='document' with dropout trains with a dense (T x T) mask on every device "
                          "(FlexAttention has no dropout): its memory grows with the square of block_size")
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; set head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.xsa_gate and self.attn_type != "xsa":
            raise ValueError("xsa_gate=True needs attn_type='xsa'")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.xsa_layers is not None:
            if self.attn_type != "xsa":
                raise ValueError("xsa_layers needs attn_type='xsa'")
            self.xsa_layers = self.canonical_xsa_layers()

    def canonical_xsa_layers(self):
        """xsa_layers checked, in one spelling per meaning: k (the last k blocks), or "0,5,11" (those)."""
        L, spec = self.n_layer, self.xsa_layers
        if type(spec) is int:
            if spec == 0:
                raise ValueError("xsa_layers=0 puts XSA in no block, which is SA: use attn_type='sa'")
            if not 0 < spec <= L:
                raise ValueError(f"xsa_layers={spec}: the last k blocks needs 0 < k <= n_layer={L}")
            return spec
        items = spec.split(",") if isinstance(spec, str) else spec if isinstance(spec, (list, tuple)) else None
        if items is None or not all(type(i) is int or (type(i) is str and i.strip().isdigit()) for i in items):
            raise ValueError(f"xsa_layers={spec!r}: expected the last k blocks (an int) or the blocks' indices "
                             f"([0, 5, 11] or '0,5,11')")
        blocks = [int(i) for i in items]
        if not blocks or any(not 0 <= i < L for i in blocks) or len(set(blocks)) != len(blocks):
            raise ValueError(f"xsa_layers={spec!r}: block indices must be distinct and in 0..{L - 1}")
        return ",".join(map(str, sorted(blocks)))

    def xsa_blocks(self):
        """Indices of the blocks that use XSA."""
        if self.attn_type != "xsa":
            return set()
        if self.xsa_layers is None:
            return set(range(self.n_layer))
        if type(self.xsa_layers) is int:
            return set(range(self.n_layer - self.xsa_layers, self.n_layer))
        return {int(i) for i in self.xsa_layers.split(",")}


# -----------------------------------------------------------------------------
# Exclusive self-attention: remove from each head's output its projection on the own value.

def exclude_self_reference(y, v):
    """The paper's two lines: the readable reference the fast version is tested against."""
    vn = F.normalize(v, dim=-1)
    return y - (y * vn).sum(dim=-1, keepdim=True) * vn


def _normalized(v):
    """(v / max(|v|, eps), 1 / max(|v|, eps), |v|) with F.normalize's eps. The eps is a literal:
    dynamo traces a literal into the graph, where reading a class attribute breaks it."""
    norm = v.norm(dim=-1, keepdim=True)
    r = 1.0 / norm.clamp_min(1e-12)
    return v * r, r, norm


def _at_least_fp32(*tensors):
    # the reductions in fp32 at least; float64 stays float64 (gradcheck)
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [t.to(dtype) for t in tensors]


class ExcludeSelf(torch.autograd.Function):
    """
    Same result as exclude_self_reference, with a hand-written backward.
    Autograd through the two lines saves several head-sized tensors and launches many small
    kernels; here only y and v are saved (SDPA keeps both anyway) and vn is recomputed.
    Dot products run in fp32 so the projection is removed accurately under bf16 autocast.
    With g = dL/dz, s = g.vn, c = y.vn, r = 1/max(|v|, eps):
        dL/dy = g - s vn,   u = -(c g + s y),   dL/dv = (u - (u.vn) vn) r
    v may broadcast against y (GQA: one value head for a group of query heads); its gradient then
    sums u over the group before the projection, which is linear in u.
    forward and backward read only tensors and literals, so torch.compile keeps them in one graph.
    """

    @staticmethod
    def forward(ctx, y, v):
        ctx.save_for_backward(y, v)
        yf, vf = _at_least_fp32(y, v)
        vn, _, _ = _normalized(vf)
        c = (yf * vn).sum(dim=-1, keepdim=True)
        return (yf - c * vn).to(y.dtype)

    @staticmethod
    def backward(ctx, grad_z):
        y, v = ctx.saved_tensors
        yf, vf, g = _at_least_fp32(y, v, grad_z)
        vn, r, norm = _normalized(vf)
        c = (yf * vn).sum(dim=-1, keepdim=True)
        s = (g * vn).sum(dim=-1, keepdim=True)
        grad_y = g - s * vn
        u = (-(c * g + s * yf)).sum_to_size(vf.shape)  # summed over the query heads sharing v
        # below eps F.normalize is v / eps, a plain scaling with no tangential projection
        tangential = torch.where(norm > 1e-12, (u * vn).sum(dim=-1, keepdim=True), 0.0)
        grad_v = (u - tangential * vn) * r
        return grad_y.to(y.dtype), grad_v.to(v.dtype)


def exclude_self(y, v):
    """z = y - (y.v / |v|^2) v per head and position; y: (B, n_head, T, head_dim), v: (B, n_kv_head,
    T, head_dim), where query head h reads value head h // (n_head / n_kv_head), as in SDPA's GQA.
    The groups broadcast against their value head: v is never repeated."""
    B, H, T, D = y.shape
    groups = y.unflatten(1, (v.size(1), H // v.size(1)))  # (B, n_kv_head, queries per kv head, T, D)
    return ExcludeSelf.apply(groups, v.unsqueeze(2)).flatten(1, 2)


# -----------------------------------------------------------------------------
# Rotary position embedding (rotate-half form, as in GPT-NeoX and Llama)

def rope_tables(seq_len, head_dim, theta, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()  # (seq_len, head_dim // 2) each


def apply_rope(x, cos, sin):
    """x: (B, n_head, T, head_dim); cos, sin: (T, head_dim // 2), or (B, 1, T, head_dim // 2) where each
    sequence has positions of its own (padding)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


# -----------------------------------------------------------------------------
# Attention within documents

_compiled_flex = None  # (flex_attention, create_block_mask) compiled, once first needed


@contextlib.contextmanager
def flex_attention_devices(*device_types):
    """Within it, a document mask runs as FlexAttention on these device types (by default CUDA alone), e.g.
    ("cuda", "cpu") to run FlexAttention's forward on the CPU, or none for the dense mask everywhere;
    restored on exit."""
    global _flex_devices
    before, _flex_devices = _flex_devices, tuple(device_types)
    try:
        yield
    finally:
        _flex_devices = before


def flex_functions():
    """FlexAttention and its block-mask builder. Inside a compiled model, the model's graph holds them. Outside
    one, fused kernels need them compiled on their own: done on first use, so that importing model.py stays
    free of torch.compile's cost; with dynamic shapes, so that a second shape (evaluation batches, prompts)
    compiles once more, not once per shape, and no (B, L, L) mask is ever built."""
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention, create_block_mask
    if _compiled_flex is None:
        _compiled_flex = (torch.compile(flex_attention), torch.compile(create_block_mask))
    return _compiled_flex


def document_segments(tokens, valid, eot_token):
    """Which document each token is in, and its position within it, for tokens (B, L) of which `valid`
    (B, L) are real (False: left padding). A document starts at each eot_token and at the first real
    token; positions count real tokens only."""
    count = valid.long().cumsum(dim=1) - 1  # the index of each token among the real ones
    starts = (tokens == eot_token) & valid
    start_count = torch.where(starts, count, torch.zeros_like(count)).cummax(dim=1).values
    return starts.long().cumsum(dim=1), (count - start_count).clamp_min(0)


def document_block_mask(segments, n_sinks):
    """FlexAttention's block-sparse mask of a document mask: causal, within a document, sinks seen by all.
    segments: (B, sinks + T), the sinks' entries ignored."""
    def within_document(b, h, q, k):
        return (k <= q) & ((k < n_sinks) | (segments[b, q] == segments[b, k]))
    B, L = segments.shape
    return flex_functions()[1](within_document, B, None, L, L, device=segments.device)


# -----------------------------------------------------------------------------
# The KV cache of generation

class KVCache:
    """The keys and values of the positions seen so far, one pair per block: a new token attends to them
    instead of the whole prefix being computed again, so a generated token costs O(T), not a forward over
    T. The methods are those of transformers' Cache (update, get_seq_length), so the Hugging Face wrapper
    (scripts/export_hf.py) passes its own cache in this one's place."""

    def __init__(self):
        self.keys, self.values = [], []
        self.tokens = None  # the token ids so far (B, tokens), which a document mask splits into documents

    def get_seq_length(self, layer_idx=0):
        """Positions cached so far, the sinks included."""
        return self.keys[layer_idx].size(2) if len(self.keys) > layer_idx else 0

    def update(self, k, v, layer_idx):
        """Append the new positions' k, v (B, n_kv_head, T, head_dim) of block layer_idx; returns all of them."""
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat((self.keys[layer_idx], k), dim=2)
            self.values[layer_idx] = torch.cat((self.values[layer_idx], v), dim=2)
        return self.keys[layer_idx], self.values[layer_idx]


# -----------------------------------------------------------------------------
# Building blocks

class CausalSelfAttention(nn.Module):

    def __init__(self, config, xsa=False, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx  # this block's place in a KVCache
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        attn_width = config.n_head * config.head_dim  # may differ from n_embd (paper, Table 1)
        kv_width = config.n_kv_head * config.head_dim
        # q, k and v as three matrices (not one fused qkv): Muon orthogonalises each on its own
        self.c_q = nn.Linear(config.n_embd, attn_width, bias=config.bias)
        self.c_k = nn.Linear(config.n_embd, kv_width, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, kv_width, bias=config.bias)
        self.c_proj = nn.Linear(attn_width, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.attn_type = "xsa" if xsa else "sa"  # this block's (xsa_layers may leave some blocks SA)
        # gated XSA: alpha = 0 makes the block exactly SA at initialisation
        self.xsa_alpha = nn.Parameter(torch.zeros(config.n_head)) if xsa and config.xsa_gate else None

    def project_qkv(self, x, cos, sin):
        """q (rotated): (B, n_head, T, head_dim); k (rotated) and v: (B, n_kv_head, T, head_dim)."""
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def exclude_self(self, y, v):
        """XSA on the heads' outputs y (B, n_head, T, head_dim) given their values v; gated XSA
        removes tanh(alpha) of the projection instead of all of it."""
        z = exclude_self(y, v)
        if self.xsa_alpha is None:
            return z
        gate = torch.tanh(self.xsa_alpha).view(1, -1, 1, 1).to(y.dtype)
        return y + gate * (z - y)  # = y - tanh(alpha) * proj

    def forward(self, x, cos, sin, mask=None, cache=None):
        """mask: None for causal attention over x alone (nothing cached); a BlockMask (documents, on
        flex_attention_devices); else which keys each query sees, (B or 1, 1, T, cached + T) booleans. cache: the
        earlier positions' keys and values, extended here."""
        B, T, _ = x.size()
        q, k, v = self.project_qkv(x, cos, sin)
        keys, values = (k, v) if cache is None else cache.update(k, v, self.layer_idx)
        gqa = self.n_kv_head != self.n_head
        if isinstance(mask, BlockMask):
            y = flex_functions()[0](q, keys, values, block_mask=mask, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=gqa, dropout_p=self.dropout if self.training else 0.0)
        if self.attn_type == "xsa":  # the projection on each query's own value: the new positions' v
            y = self.exclude_self(y, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config, xsa=False, layer_idx=0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, xsa, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.attn(self.ln_1(x), cos, sin, mask, cache)
        x = x + self.mlp(self.ln_2(x))
        return x


# -----------------------------------------------------------------------------
# The model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            ln_emb=nn.LayerNorm(config.n_embd, bias=config.bias),  # the paper's extra LayerNorm
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, xsa=i in config.xsa_blocks(), layer_idx=i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.sinks = nn.Parameter(torch.empty(config.n_sinks, config.n_embd)) if config.n_sinks else None
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings
        # the longest sequence forward takes: block_size, unless extend_context says otherwise (evaluation)
        self.context = config.block_size
        # RoPE tables are derived, not learned: kept out of the state dict
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    def init_weights(self):
        """nanoGPT init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        self.set_rope_tables()
        # sinks drawn last, so that n_sinks does not change any other weight's initialisation
        params = sorted(self.named_parameters(), key=lambda item: item[0] == "sinks")
        for name, p in params:
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif name.endswith("xsa_alpha") or name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_"):
                nn.init.ones_(p)
            else:  # Linear and embedding weights, sinks
                nn.init.normal_(p, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count; non_embedding leaves out the (tied) token embedding, as the paper counts."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token (forward + backward): 6N for the matmuls, including the output
        layer, plus 12 * n_layer * attention width * seq_len for QK^T and AV (PaLM convention)."""
        c = self.config
        seq_len = seq_len or c.block_size
        n_matmul = self.num_params(non_embedding=True) + self.lm_head.weight.numel()
        return 6 * n_matmul + 12 * c.n_layer * c.n_head * c.head_dim * (seq_len + c.n_sinks)

    def set_rope_tables(self):
        """The RoPE tables of every position forward may see: the sinks', then context tokens'."""
        self.rope_cos, self.rope_sin = rope_tables(self.config.n_sinks + self.context, self.config.head_dim,
                                                   self.config.rope_theta, device=self.lm_head.weight.device)

    def extend_context(self, length):
        """Take sequences of up to `length` tokens, past block_size: RoPE has no learned positions, so its
        tables just extend. For evaluation and generation past the training context, which ask for it
        explicitly (training never does: forward refuses longer sequences)."""
        if length > self.context:
            self.context = length
            self.set_rope_tables()

    def rope_and_mask(self, idx, past, sinks, attention_mask=None, tokens=None):
        """(cos, sin, mask) of the sinks (if `sinks`) and tokens idx that follow `past` cached positions
        (sinks included). Under a causal mask without an attention mask, every sequence has the same
        positions, and the mask is None (SDPA's is_causal) when nothing is cached. Otherwise each sequence
        has positions of its own: with an attention mask (B, cached tokens + T), left padding is never
        attended to and positions count real tokens only (a padded query sees itself alone; its output is
        never used); under a document mask, a query sees only its own document's tokens (and the sinks),
        and positions restart at each document. tokens: the token ids so far, the cached ones then idx
        (cached_tokens), which a document mask splits into documents; idx when nothing is cached."""
        S, document = self.config.n_sinks, self.config.attn_mask == "document"
        B, new = idx.size(0), sinks + idx.size(1)
        if attention_mask is None and not document:
            cos, sin = self.rope_cos[past:past + new], self.rope_sin[past:past + new]
            if past == 0:
                return cos, sin, None
            keys = torch.arange(past + new, device=cos.device)
            return cos, sin, (keys <= keys[past:, None]).view(1, 1, new, past + new)
        valid = (attention_mask.bool() if attention_mask is not None
                 else torch.ones(B, past - S + new, dtype=torch.bool, device=idx.device))
        positions, segments = self.positions(idx if tokens is None else tokens, valid, past)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        if self.runs_flex_attention(idx.device, past, attention_mask):
            return cos, sin, document_block_mask(segments, S)
        return cos, sin, self.dense_mask(valid, segments, past, new)

    def positions(self, tokens, valid, past):
        """(positions, segments) of the positions after the `past` cached ones, for tokens (B, L) so far of
        which `valid` are real (False: left padding): each new position's RoPE position (B, new), the sinks'
        first, then the tokens' counting real tokens only, from 0 again at each document under a document
        mask; and there, the document of every position so far (B, S + L; the sinks' -1), else None."""
        S, B = self.config.n_sinks, tokens.size(0)
        if self.config.attn_mask == "document":
            segments, token_positions = document_segments(tokens, valid, self.config.eot_token)
        else:
            segments, token_positions = None, (valid.long().cumsum(dim=1) - 1).clamp_min(0)
        sink_positions = torch.arange(S, device=tokens.device).expand(B, S)
        positions = torch.cat((sink_positions, S + token_positions), dim=1)[:, past:]  # (B, new)
        if segments is not None:
            segments = torch.cat((torch.full_like(sink_positions, -1), segments), dim=1)  # (B, past + new)
        return positions, segments

    def runs_flex_attention(self, device, past, attention_mask):
        """Whether a document mask is FlexAttention's block-sparse mask here (else a dense boolean one): on the
        device types flex_attention_devices names (CUDA), for a whole sequence (nothing cached, no padding),
        and without dropout, which FlexAttention does not have."""
        return (self.config.attn_mask == "document" and attention_mask is None and past == 0
                and device.type in _flex_devices and not (self.training and self.config.dropout))

    def dense_mask(self, valid, segments, past, new):
        """Which keys each of the new queries sees, (B, 1, new, past + new) booleans: the earlier positions that
        are real tokens (valid, the sinks always) and, under a document mask (segments), of its own document
        or sinks; and itself, always (a padded query sees itself alone)."""
        S = self.config.n_sinks
        keys = torch.arange(past + new, device=valid.device)
        queries = keys[past:, None]
        real_keys = torch.cat((torch.ones(valid.size(0), S, dtype=torch.bool, device=valid.device), valid), dim=1)
        mask = (keys <= queries) & real_keys[:, None, :]
        if segments is not None:
            mask = mask & ((keys < S) | (segments[:, past:, None] == segments[:, None, :]))
        mask = mask | (keys == queries)  # (B, new, past + new)
        return mask.unsqueeze(1)

    def cached_tokens(self, cache, idx, past):
        """The token ids so far, the cache's then idx (B, tokens), kept in cache.tokens for the next call: a
        document mask splits them into documents, and the document a new token is in may have begun earlier."""
        tokens = idx
        if past:  # the cached positions' tokens (a cache cropped since, by assisted decoding, holds fewer)
            S = self.config.n_sinks
            history = getattr(cache, "tokens", None)
            if history is None or history.size(0) != idx.size(0) or history.size(1) < past - S:
                raise ValueError("a document mask needs the token ids of the cached positions in cache.tokens, "
                                 "row for row (a cache whose rows were reordered must reorder them too)")
            tokens = torch.cat((history[:, :past - S], idx), dim=1)
        cache.tokens = tokens
        return tokens

    def forward(self, idx, targets=None, cache=None, attention_mask=None):
        """idx, targets: (B, T) token ids; targets of -1 are ignored. Returns (logits, loss).
        cache: a KVCache (or transformers' Cache) of the positions idx continues, extended by this call;
        the sinks enter it once, on the first call. attention_mask: (B, cached tokens + T), 1 for tokens and
        0 for padding (left padding, for prompts of different lengths): padding is never attended to, and
        each sequence's positions count its tokens alone."""
        B, T = idx.size()
        S = self.config.n_sinks
        past = cache.get_seq_length() if cache is not None else 0
        sinks = S if past == 0 else 0  # the sinks enter a cache once, on its first call
        if past + sinks - S + T > self.context:
            raise ValueError(f"sequence of length {past + sinks - S + T} exceeds block_size {self.context}")
        # under a document mask, the cache keeps the token ids too: a document may have begun in an earlier call
        tokens = self.cached_tokens(cache, idx, past) if cache is not None and self.config.attn_mask == "document" \
            else None
        x = self.transformer.wte(idx)
        if sinks:
            x = torch.cat((self.sinks.to(x.dtype).expand(B, -1, -1), x), dim=1)
        x = self.transformer.drop(self.transformer.ln_emb(x))
        cos, sin, mask = self.rope_and_mask(idx, past, sinks, attention_mask, tokens)
        for block in self.transformer.h:
            x = block(x, cos, sin, mask, cache)
        x = self.transformer.ln_f(x[:, sinks:])  # sink outputs never reach the loss
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Sample max_new_tokens continuations of idx (B, T); temperature 0 is greedy. With use_cache, a
        KVCache holds the keys and values of the tokens so far, so each new token costs one position's
        forward; a sequence longer than the context is cut to its last `context` tokens, and the cache
        filled again from them, as the full forward over that window would see them."""
        cache = KVCache() if use_cache else None
        logits = self(idx[:, -self.context:], cache=cache)[0][:, -1, :]
        for step in range(max_new_tokens):
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
            if step == max_new_tokens - 1:
                break
            if use_cache and idx.size(1) <= self.context:
                logits = self(next_id, cache=cache)[0][:, -1, :]
            else:  # past the context (or no cache): the last `context` tokens, from scratch
                cache = KVCache() if use_cache else None
                logits = self(idx[:, -self.context:], cache=cache)[0][:, -1, :]
        return idx
