"""model.py's decoding with a KV cache, left padding and a context extended past block_size, each against
the plain full forward: a decode path never compared with the full forward is known to drift silently."""

import pytest
import torch

from helpers import MODEL_VARIANTS, TOY_EOT, with_documents
from model import GPT, GPTConfig, KVCache, rope_tables

BASE = dict(n_layer=2, n_head=4, n_embd=32, head_dim=8, block_size=24, vocab_size=97)


def decisive_model(**overrides):
    """A model whose logits are far from ties (trained-like weights, not the near-uniform initialisation),
    so that greedy choices compare exactly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def argmax_loop(model, idx, steps):
    """Greedy decoding by the full forward over the whole sequence at every step: the reference."""
    for _ in range(steps):
        idx = torch.cat((idx, model(idx)[0][:, -1:].argmax(-1)), dim=1)
    return idx


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_decoding_with_the_cache_equals_without_and_the_full_forward(variant, batch):
    model = decisive_model(**MODEL_VARIANTS[variant])
    idx = with_documents(torch.randint(0, 97, (batch, 5)))
    with torch.no_grad():
        cached = model.generate(idx, 12, temperature=0, use_cache=True)
        uncached = model.generate(idx, 12, temperature=0, use_cache=False)
        reference = argmax_loop(model, idx, 12)
    assert torch.equal(cached, reference) and torch.equal(uncached, reference)


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_logits_position_by_position_through_the_cache_equal_the_full_forward(variant):
    model = decisive_model(**MODEL_VARIANTS[variant])
    idx = with_documents(torch.randint(0, 97, (2, 16)))
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache()
        parts = [model(idx[:, :6], cache=cache)[0], model(idx[:, 6:9], cache=cache)[0]]  # a prefill, then 3 at once
        parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(9, 16)]  # then one at a time
    assert torch.allclose(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == model.config.n_sinks + 16  # the sinks entered once


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
@pytest.mark.parametrize("pad", [0, TOY_EOT])  # padding with the end-of-text token (as transformers' exports do)
def test_a_left_padded_batch_computes_each_sequence_as_alone(variant, pad):
    """Padding is never attended to and positions count tokens only (the sinks in front): each row's
    logits equal those of its tokens run alone, in the prefill and through the cache."""
    model = decisive_model(**MODEL_VARIANTS[variant])
    torch.manual_seed(1)
    prompts = [with_documents(torch.randint(0, 97, (n,))) for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    idx = torch.full((3, width), pad)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, width - len(p):], mask[i, width - len(p):] = p, 1
    new = torch.randint(0, 97, (3, 4))
    with torch.no_grad():
        cache = KVCache()
        logits = [model(idx, cache=cache, attention_mask=mask)[0]]
        for t in range(4):
            mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), dim=1)
            logits.append(model(new[:, t:t + 1], cache=cache, attention_mask=mask)[0])
        logits = torch.cat(logits, dim=1)
        for i, p in enumerate(prompts):
            alone = model(torch.cat((p, new[i]))[None])[0][0]
            assert torch.allclose(logits[i, width - len(p):], alone, rtol=1e-5, atol=1e-5), i


def test_past_block_size_only_when_asked_and_the_trained_range_is_unchanged():
    model = decisive_model(attn_type="xsa", n_sinks=1)
    idx = torch.randint(0, 97, (2, 4 * BASE["block_size"]))
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceeds block_size 24"):
            model(idx)  # training and plain evaluation refuse
        inside = model(idx[:, :BASE["block_size"]])[0]
        model.extend_context(4 * BASE["block_size"])
        longer = model(idx)[0]
    assert longer.shape[1] == 4 * BASE["block_size"]
    assert torch.allclose(longer[:, :BASE["block_size"]], inside, rtol=1e-5, atol=1e-5)  # causal: the same view
    cos, sin = rope_tables(1 + 4 * BASE["block_size"], BASE["head_dim"], 10000.0)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)


def test_generation_past_the_context_continues_on_the_last_window():
    model = decisive_model(attn_type="xsa")
    idx = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        cached = model.generate(idx, 10, temperature=0, use_cache=True)  # runs past block_size 24
        uncached = model.generate(idx, 10, temperature=0, use_cache=False)
        reference = idx
        for _ in range(10):
            window = reference[:, -BASE["block_size"]:]
            reference = torch.cat((reference, model(window)[0][:, -1:].argmax(-1)), dim=1)
    assert torch.equal(cached, reference) and torch.equal(uncached, reference)
