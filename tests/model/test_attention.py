"""Fast (SDPA) and eager attention agree; KV-cached decoding equals the full forward; soft-cap is never
silently dropped."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qklab.methods import METHODS
from tests.conftest import tiny_gpt

ALL = sorted(METHODS)


def _set_impl(model, impl):
    for b in model.blocks:
        b.attn.impl = impl


@pytest.mark.parametrize("n_kv", [0, 2, 1])
@pytest.mark.parametrize("method", ALL)
def test_fast_and_eager_paths_agree(method, n_kv):
    model = tiny_gpt(method, n_kv_heads=n_kv)
    x = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        _set_impl(model, "sdpa" if not METHODS[method].modifies_logits else "auto")
        fast, _ = model(x)
        _set_impl(model, "eager")
        slow, _ = model(x)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv", [0, 2])
@pytest.mark.parametrize("impl", ["auto", "eager"])
@pytest.mark.parametrize("method", ALL)
def test_kv_cache_decoding_equals_full_forward(method, impl, n_kv):
    model = tiny_gpt(method, n_kv_heads=n_kv, impl=impl)
    x = torch.randint(0, 97, (2, 33))
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 40)
        parts = [model(x[:, :7], caches=caches)[0], model(x[:, 7:12], caches=caches)[0]]  # prefill + chunk
        parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(12, 33)]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ALL)
def test_generate_greedy_matches_argmax_of_full_forward(method):
    model = tiny_gpt(method)
    prompt = torch.randint(0, 97, (2, 5))
    out = model.generate(prompt, max_new_tokens=10, temperature=0)
    assert out.shape == (2, 15)
    with torch.no_grad():
        logits, _ = model(out[:, :-1])
    torch.testing.assert_close(out[:, 5:], logits[:, 4:].argmax(-1))


def test_softcap_never_uses_sdpa(monkeypatch):
    model = tiny_gpt("softcap")

    def refuse(*a, **k):
        raise AssertionError("softcap routed through SDPA")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 8)))
        model.generate(torch.randint(0, 97, (1, 3)), 3, temperature=0)


def test_softcap_logits_match_direct_formula():
    model = tiny_gpt("softcap")
    attn = model.blocks[0].attn
    attn.qk.cap = 0.5  # small cap so the tanh is active
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        attn.capture = {}
        attn(x, model.rope)
        q, k, s = attn.capture["q"], attn.capture["k"], attn.capture["logits"]
        raw = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        torch.testing.assert_close(s, 0.5 * torch.tanh(raw / 0.5))
        assert s.abs().max() < 0.5
        # and the output is softmax of the capped logits, not of the raw ones
        mask = torch.ones(10, 10, dtype=torch.bool).tril()
        p = torch.softmax((0.5 * torch.tanh(raw / 0.5)).masked_fill(~mask, -math.inf), -1)
        torch.testing.assert_close(attn.capture["probs"], p)


def test_qknorm_normalises_each_head():
    model = tiny_gpt("qknorm")
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.capture = {}
        attn(torch.randn(2, 6, 64) * 50, model.rope)
        q = attn.capture["q"]  # RoPE is a rotation: the rms of each head vector stays 1 (gain 1)
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones_like(q[..., 0]), atol=1e-4, rtol=1e-4)


def test_rope_is_relative():
    """q.k after RoPE depends only on the position difference."""
    model = tiny_gpt("none")
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = [(model.rope(q, p + 3) * model.rope(k, p)).sum() for p in (0, 5, 20)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3))


@pytest.mark.parametrize("dq, dv", [(48, 32), (32, 48)])
@pytest.mark.parametrize("tq", [12, 5, 1])
def test_sdpa_with_unequal_head_widths_matches_softmax_formula(dq, dv, tq):
    """MLA's q/k are wider than v: on CPU the narrower side is zero-padded so the flash kernel runs (not
    the math fallback); values and gradients equal softmax(q k^T * scale + causal mask) v."""
    from torch.profiler import profile

    from qklab.model.attention import causal_mask, sdpa_causal

    torch.manual_seed(0)
    B, H, Tk, scale = 2, 3, 12, 0.17
    q, k = torch.randn(B, H, tq, dq, requires_grad=True), torch.randn(B, H, Tk, dq, requires_grad=True)
    v = torch.randn(B, H, Tk, dv, requires_grad=True)
    with profile() as prof:
        y = sdpa_causal(q, k, v, scale)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_attention_math" not in names
    s = (q @ k.transpose(-2, -1)) * scale
    ref = torch.softmax(s.masked_fill(~causal_mask(tq, Tk, q.device), float("-inf")), dim=-1) @ v
    assert y.shape == (B, H, tq, dv)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((y * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
