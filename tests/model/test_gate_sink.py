"""model.attn_gate (gated attention, arXiv 2505.06708) and model.attn_sink (gpt-oss's per-head sink logit):
both attention paths against attention written out here in fp64, values and gradients; cached decoding
(MHA, GQA, MLA's latent cache) equals the full forward; the defaults add nothing."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.model import GPT, Attention, LatentCache
from qklab.model.rope import Rope

C, H = 32, 4
ROPE = Rope(64, 10000.0)


def _cfg(gate="none", sink=False, n_kv=0, impl="auto", **kw):
    return ModelConfig(vocab_size=97, d_model=C, n_layers=2, n_heads=H, n_kv_heads=n_kv, max_seq_len=64,
                       attn_impl=impl, attn_gate=gate, attn_sink=sink, **kw)


def _layer(gate, sink, n_kv, impl):
    a = Attention(_cfg(gate, sink, n_kv, impl), QKConfig(), 0).double()
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.5)  # peaked attention; sinks and gates away from neutral
        if a.sink is not None:
            a.sink.copy_(torch.tensor([-1.0, 0.0, 1.5, 3.0]))
    return a


def reference(a: Attention, x: torch.Tensor) -> torch.Tensor:
    """Per head: softmax with the sink exp(b_h) in the denominator, times V, times sigmoid(W_g x); then W_O."""
    Bn, T, _ = x.shape
    D, Hk = a.head_dim, a.n_kv_heads
    q = (x @ a.wq.weight.T).view(Bn, T, H, D).transpose(1, 2)
    k = (x @ a.wk.weight.T).view(Bn, T, Hk, D).transpose(1, 2)
    v = (x @ a.wv.weight.T).view(Bn, T, Hk, D).transpose(1, 2)
    q, k = ROPE(q), ROPE(k)  # qklab's tables (fp32 angles): RoPE is not under test here, the gate and sink are
    outs = []
    for h in range(H):
        g = h // (H // Hk)
        s = q[:, h] @ k[:, g].transpose(-2, -1) / math.sqrt(D)  # (B, T, T)
        e = torch.exp(s).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0)
        den = e.sum(-1, keepdim=True) + (torch.exp(a.sink[h]) if a.sink is not None else 0.0)
        o = (e / den) @ v[:, g]  # (B, T, D)
        if a.wg is not None:
            w = a.wg.weight
            o = o * torch.sigmoid(x @ (w[h : h + 1] if w.shape[0] == H else w[h * D : (h + 1) * D]).T)
        outs.append(o)
    return torch.cat(outs, -1) @ a.wo.weight.T


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("n_kv", [0, 2])
@pytest.mark.parametrize("gate, sink", [("head", False), ("element", False), ("none", True), ("head", True)])
def test_layer_matches_written_out_attention_values_and_gradients(gate, sink, n_kv, impl):
    torch.manual_seed(0)
    a = _layer(gate, sink, n_kv, impl)
    x = torch.randn(2, 11, C, dtype=torch.float64, requires_grad=True)
    got = a(x, Rope(64, 10000.0))
    ref = reference(a, x)
    tol = 1e-9 if impl == "sdpa" else 1e-5  # the eager path takes its softmax in fp32
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    plain = Attention(_cfg(n_kv=n_kv, impl=impl), QKConfig(), 0).double()
    plain.load_state_dict({k: v for k, v in a.state_dict().items() if k not in ("wg.weight", "sink")})
    assert (plain(x, Rope(64, 10000.0)) - got).abs().max() > 1e-2  # the gate / the sink change the layer
    params = [x, *a.parameters()]
    w = torch.randn_like(ref)
    for _p, d1, d2 in zip(params, torch.autograd.grad((got * w).sum(), params),
                         torch.autograd.grad((ref * w).sum(), params), strict=True):
        torch.testing.assert_close(d1, d2, rtol=10 * tol, atol=10 * tol)


def test_sink_takes_probability_mass():
    """With zero logits a query at position t keeps (t + 1) / (t + 1 + exp(b_h)) for its keys."""
    a = _layer("none", True, 0, "eager")
    a.capture = {}
    with torch.no_grad():
        a.wq.weight.zero_()
        a(torch.randn(1, 6, C, dtype=torch.float64), Rope(64, 10000.0))
    n = torch.arange(1, 7, dtype=torch.float64)
    want = n / (n + torch.exp(a.sink.detach()).view(H, 1))  # (H, T)
    torch.testing.assert_close(a.capture["probs"].sum(-1)[0], want, rtol=1e-6, atol=1e-6)


def _gpt(gate, sink, attention="mha", n_kv=0, impl="auto"):
    cfg = _cfg(gate, sink, n_kv, impl, attention=attention, kv_rank=24, nope_dim=8, rope_dim=8, v_dim=12)
    model = GPT(cfg, QKConfig(method="qknorm")).eval()
    with torch.no_grad():
        for b in model.blocks:
            if b.attn.sink is not None:
                b.attn.sink.uniform_(-1, 2)
    return model


def _decode(model, x, caches):
    parts = [model(x[:, :5], caches=caches)[0], model(x[:, 5:9], caches=caches)[0]]
    parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(9, x.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla-absorbed", "mla-auto", "mla-per-head"])
@pytest.mark.parametrize("gate, sink", [("element", True), ("head", True)])
def test_cached_decoding_equals_full_forward(gate, sink, kind):
    model = _gpt(gate, sink, attention="mla" if kind.startswith("mla") else "mha", n_kv=2 if kind == "gqa" else 0)
    x = torch.randint(0, 97, (2, 22))
    with torch.no_grad():
        full, _ = model(x)
        if kind in ("mla-absorbed", "mla-auto"):
            for b in model.blocks:
                b.attn.latent_path = kind[4:]
        caches = model.make_caches(2, 24, latent=False if kind == "mla-per-head" else None)
        assert isinstance(caches[0], LatentCache) == (kind in ("mla-absorbed", "mla-auto"))
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    if kind in ("mla-absorbed", "mla-auto"):  # gate and sink act outside the cache: kv_rank + rope + H (QK-Norm)
        assert caches[0].values_per_token() == 24 + 8 + H


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_fast_and_eager_paths_agree_with_gate_and_sink(attention):
    model = _gpt("element", True, attention)
    x = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        for b in model.blocks:
            b.attn.impl = "sdpa"
        fast, _ = model(x)
        for b in model.blocks:
            b.attn.impl = "eager"
        slow, _ = model(x)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_defaults_add_no_parameters_and_init_is_in_one_place():
    plain = GPT(_cfg(), QKConfig())
    assert not any(n.endswith(("wg.weight", "sink")) for n, _ in plain.named_parameters())
    torch.manual_seed(0)
    a = GPT(_cfg())
    torch.manual_seed(0)
    b = GPT(_cfg("none", False))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    g = GPT(_cfg("element", True))
    attn = g.blocks[0].attn
    assert attn.wg.weight.shape == (H * (C // H), C) and torch.equal(attn.sink, torch.zeros(H))
    assert abs(attn.wg.weight.std().item() - 0.02) < 0.005  # N(0, init_std), like W_V
    assert GPT(_cfg("head")).blocks[0].attn.wg.weight.shape == (H, C)


def test_bad_gate_is_one_clear_error():
    with pytest.raises(ConfigError, match="model.attn_gate='all': use none, head or element"):
        load_config("tiny", ["model.attn_gate=all"])
    assert load_config("tiny", ["model.attn_gate=head", "model.attn_sink=true"]).model.attn_sink
