"""attn_mask="document": each token attends within its own document (and to the sinks), with positions that
restart at each document. Checked against a document run alone, against a softmax written out here, and
FlexAttention against the dense mask; the causal mask's outputs are the other tests' business (unchanged)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import (COMPILE_VARIANTS, DOCUMENT_MODEL, DOCUMENT_VARIANTS, TOY_EOT,
                     assert_similarity_reads_the_document_mask, document_model, documents, explain, packed_batch,
                     with_config)
from model import GPTConfig, document_segments, exclude_self_reference


def summed_loss_and_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    logits = model(idx)[0]
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -----------------------------------------------------------------------------
# the proof that matters: a document packed anywhere is computed as if alone

@pytest.mark.parametrize("variant", DOCUMENT_VARIANTS)
def test_packed_documents_equal_each_document_alone_in_logits_and_gradients(variant):
    model = document_model(**DOCUMENT_VARIANTS[variant])
    docs = documents([9, 1, 14, 5, 11])  # a one-token document among them
    g = torch.Generator().manual_seed(2)
    targets = [torch.randint(0, DOCUMENT_MODEL["vocab_size"], (len(d),), generator=g) for d in docs]
    packed, packed_grads = summed_loss_and_grads(model, torch.cat(docs)[None], torch.cat(targets)[None])
    # alone: each document by itself, under the plain causal mask (the path every other test checks)
    causal = with_config(model, attn_mask="causal")
    alone_grads = {}
    start = 0
    for doc, target in zip(docs, targets):
        alone, grads = summed_loss_and_grads(causal, doc[None], target[None])
        rel = (packed[0, start:start + len(doc)] - alone[0]).norm() / alone[0].norm()
        assert rel <= 1e-6, (start, rel)
        for name, grad in grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
        start += len(doc)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        assert (grad - alone_grads[name]).norm() <= 1e-6 * alone_grads[name].norm(), name


@pytest.mark.parametrize("variant", DOCUMENT_VARIANTS)
def test_under_the_causal_mask_every_document_after_the_first_differs_from_alone(variant):
    """The control: the packed == alone test cannot pass by accident."""
    model = document_model(attn_mask="causal", **DOCUMENT_VARIANTS[variant])
    docs = documents([9, 1, 14, 5, 11])
    packed = model(torch.cat(docs)[None])[0]
    start = 0
    for i, doc in enumerate(docs):
        alone = model(doc[None])[0]
        rel = (packed[0, start:start + len(doc)] - alone[0]).norm() / alone[0].norm()
        assert (rel <= 1e-6) == (i == 0), (i, rel)
        start += len(doc)


@pytest.mark.parametrize("variant", ["xsa", "xsa_sinks"])
def test_a_documents_offset_in_the_window_does_not_matter(variant):
    model = document_model(**DOCUMENT_VARIANTS[variant])
    a, b, c = documents([6, 10, 4])
    first = model(torch.cat((a, b, c))[None])[0][0]
    later = model(torch.cat((c, a, b))[None])[0][0]
    for x, y in ((first[:6], later[4:10]), (first[6:16], later[10:20]), (first[16:], later[:4])):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)


def test_a_windows_first_token_starts_a_document_whatever_it_is():
    """A window cut mid-document: its tokens up to the first TOY_EOT are one document, computed as if alone."""
    model = document_model(attn_type="xsa", n_sinks=2)
    tail = documents([8])[0][1:]  # no TOY_EOT in front
    a, = documents([9], seed=3)
    packed = model(torch.cat((tail, a))[None])[0][0]
    causal = with_config(model, attn_mask="causal")
    torch.testing.assert_close(packed[:7], causal(tail[None])[0][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(packed[7:], causal(a[None])[0][0], rtol=1e-9, atol=1e-9)


def test_document_segments_and_positions():
    tokens = torch.tensor([[3, 4, TOY_EOT, 5, 6, TOY_EOT, TOY_EOT, 8],
                           [0, 0, TOY_EOT, 4, TOY_EOT, 5, 6, 8]])  # the second row left-padded by two
    valid = torch.tensor([[True] * 8, [False, False] + [True] * 6])
    segments, positions = document_segments(tokens, valid, TOY_EOT)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 0, 0, 1, 0, 1, 2, 3]]
    assert segments.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [0, 0, 1, 1, 2, 2, 2, 2]]


# -----------------------------------------------------------------------------
# the dense mask against a softmax written out here, and FlexAttention against the dense mask

def naive_document_forward(model, idx):
    """The whole GPT with an explicit mask built by loops: key k is seen by query q iff k <= q and k is a sink
    or in q's document; a token's RoPE position is n_sinks + its index in its document."""
    c = model.config
    S, (B, T) = c.n_sinks, idx.shape
    doc = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            new_doc = t > 0 and idx[b, t].item() == c.eot_token
            doc[b, t] = doc[b, t - 1] + new_doc if t else 0
            pos[b, t] = 0 if t == 0 or new_doc else pos[b, t - 1] + 1
    positions = torch.cat((torch.arange(S).expand(B, S), S + pos), dim=1)
    seen = torch.zeros(B, S + T, S + T, dtype=torch.bool)
    for b in range(B):
        for q in range(S + T):
            for k in range(q + 1):
                seen[b, q, k] = k < S or (q >= S and doc[b, q - S] == doc[b, k - S])

    def rope(x):
        d = x.shape[-1]
        pairs = torch.complex(x[..., : d // 2], x[..., d // 2:])
        freqs = c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        rotated = pairs * torch.polar(torch.ones_like(freqs), positions[:, None, :, None] * freqs)
        return torch.cat((rotated.real, rotated.imag), dim=-1)

    ln = lambda mod, t: F.layer_norm(t, (c.n_embd,), mod.weight, mod.bias)  # noqa: E731
    x = model.transformer.wte.weight[idx]
    if S:
        x = torch.cat((model.sinks.expand(B, -1, -1), x), dim=1)
    x = ln(model.transformer.ln_emb, x)
    for block in model.transformer.h:
        attn, h = block.attn, ln(block.ln_1, x)
        heads = lambda t: t.reshape(B, S + T, -1, c.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = heads(h @ attn.c_q.weight.T), heads(h @ attn.c_k.weight.T), heads(h @ attn.c_v.weight.T)
        k, v = k.repeat_interleave(c.n_head // c.n_kv_head, 1), v.repeat_interleave(c.n_head // c.n_kv_head, 1)
        scores = (rope(q) @ rope(k).transpose(-1, -2)) / math.sqrt(c.head_dim)
        y = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1) @ v
        if attn.attn_type == "xsa":
            proj = ((y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)) * v
            y = y - (torch.tanh(attn.xsa_alpha).view(1, -1, 1, 1) if attn.xsa_alpha is not None else 1) * proj
        x = x + y.transpose(1, 2).reshape(B, S + T, -1) @ attn.c_proj.weight.T
        x = x + F.gelu(ln(block.ln_2, x) @ block.mlp.c_fc.weight.T) @ block.mlp.c_proj.weight.T
    return ln(model.transformer.ln_f, x[:, S:]) @ model.transformer.wte.weight.T


@pytest.mark.parametrize("variant", DOCUMENT_VARIANTS)
def test_dense_document_mask_equals_a_written_out_softmax_in_logits_and_gradients(variant):
    model = document_model(**DOCUMENT_VARIANTS[variant])
    idx = packed_batch()
    model.zero_grad(set_to_none=True)
    logits = model(idx)[0]
    logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    reference = naive_document_forward(model, idx)
    reference.square().mean().backward()
    # model.py rotates in float32 (apply_rope), the reference in float64: relative errors of about 1e-7
    assert (logits - reference).norm() <= 1e-6 * reference.norm()
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).norm() <= 1e-5 * p.grad.norm(), name


# -----------------------------------------------------------------------------
# torch.compile: one graph, no break, and what eager computes

@pytest.mark.parametrize("variant", COMPILE_VARIANTS)
def test_document_masked_variants_trace_as_one_graph_without_a_break(variant):
    model = document_model(dtype=torch.float32, **COMPILE_VARIANTS[variant]).train()
    idx = packed_batch()
    explained = explain(model, idx, idx)  # the forward and the loss
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["sinks", "gated"])
def test_compiled_document_masked_forward_and_backward_match_eager(variant):
    import torch._dynamo as dynamo
    dynamo.reset()
    model = document_model(dtype=torch.float32, **COMPILE_VARIANTS[variant]).train()
    idx = packed_batch()
    results = []
    for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        model.zero_grad(set_to_none=True)
        loss = run(idx, idx)[1]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_recomputed_blocks_give_the_same_training_under_a_document_mask():
    """Activation checkpointing recomputes each block with the same mask and the same dropout draws."""
    from pretrain.parallelize import apply_activation_checkpointing
    idx = packed_batch()
    results = {}
    for mode in ("none", "block", "selective"):
        model = document_model(dtype=torch.float32, attn_type="xsa", n_sinks=1, dropout=0.1).train()
        apply_activation_checkpointing(model, mode)
        torch.manual_seed(3)
        loss = model(idx, idx)[1]
        loss.backward()
        results[mode] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    for mode in ("block", "selective"):
        assert results[mode][0] == results["none"][0]
        assert all(torch.equal(a, b) for a, b in zip(results[mode][1], results["none"][1]))


# -----------------------------------------------------------------------------
# what the mask means for XSA at a document's first token

def first_token_outputs(model, idx, t):
    """The heads' outputs (before the output projection) and values of the first block at position t."""
    record = {}
    attn = model.transformer.h[0].attn
    hook = attn.c_proj.register_forward_pre_hook(lambda m, a: record.__setitem__("z", a[0]))
    model(idx)
    hook.remove()
    x = model.transformer.ln_emb(torch.cat((model.sinks.expand(1, -1, -1), model.transformer.wte(idx)), dim=1)
                                 if model.config.n_sinks else model.transformer.wte(idx))
    cos, sin, _ = model.rope_and_mask(idx, 0, model.config.n_sinks)
    q, k, v = attn.project_qkv(model.transformer.h[0].ln_1(x), cos, sin)
    S, H, D = model.config.n_sinks, model.config.n_head, model.config.head_dim
    z = record["z"][0, S + t].view(H, D)
    return z, q[0, :, :, :], k[0], v[0]


def test_at_a_documents_first_token_sa_passes_its_value_and_xsa_passes_nothing():
    docs = documents([6, 5])
    idx = torch.cat(docs)[None]
    t = 6  # the second document's first token: it sees itself alone
    sa = document_model(attn_type="sa")
    z, _, _, v = first_token_outputs(sa, idx, t)
    torch.testing.assert_close(z, v[:, t], rtol=1e-12, atol=1e-12)  # softmax over one key: y_i = v_i
    xsa = document_model(attn_type="xsa")
    z, _, _, v = first_token_outputs(xsa, idx, t)
    assert z.abs().max() < 1e-12 * v.abs().max()  # y_i - proj(y_i on v_i) = 0
    assert v.abs().max() > 0.1


def test_with_sinks_xsa_at_a_documents_first_token_passes_the_sinks_part_orthogonal_to_its_value():
    docs = documents([6, 5])
    idx = torch.cat(docs)[None]
    t, S = 6, 2
    model = document_model(attn_type="xsa", n_sinks=S)
    z, q, k, v = first_token_outputs(model, idx, t)
    # the query sees the S sinks and itself: softmax weights a_j; the own value's share vanishes in XSA
    seen = [*range(S), S + t]
    a = torch.softmax(torch.einsum("hd,hjd->hj", q[:, S + t], k[:, seen]) / math.sqrt(8), dim=-1)
    sinks_part = torch.einsum("hj,hjd->hd", a[:, :S], v[:, :S])
    expected = exclude_self_reference(sinks_part, v[:, S + t])
    torch.testing.assert_close(z, expected, rtol=1e-9, atol=1e-12)
    assert expected.norm() > 0.05 * sinks_part.norm()  # not zero: the sinks pass something on


# -----------------------------------------------------------------------------
# the config

def test_an_unknown_attn_mask_names_the_choices():
    with pytest.raises(ValueError, match=r"attn_mask must be one of \('causal', 'document'\), got 'doc'"):
        GPTConfig(**{**DOCUMENT_MODEL, "attn_mask": "doc"})


def test_dropout_under_the_document_mask_warns_of_the_dense_mask():
    with pytest.warns(UserWarning, match="dense"):
        GPTConfig(**{**DOCUMENT_MODEL, "attn_mask": "document", "dropout": 0.1})


def test_eot_token_must_be_a_token_of_the_vocabulary():
    with pytest.raises(ValueError, match="eot_token=97 is not a token of vocab_size=97"):
        GPTConfig(**{**DOCUMENT_MODEL, "attn_mask": "document", "eot_token": 97})


# -----------------------------------------------------------------------------
# eval/similarity.py reads the mask the attention was given

def test_the_similarity_diagnostic_scores_attention_under_the_models_own_mask():
    """Every token its own document (all TOY_EOT): under the document mask each query sees only itself, so a_ii
    is 1 in every layer; under the causal mask it is not. (FlexAttention's block mask: test_flex_attention.py.)"""
    assert_similarity_reads_the_document_mask()
