"""QUEST (arXiv 2604.00199) and SSMax (arXiv 2501.19399): logits and their gradients against the formulas
written out here in fp64; cached decoding (MHA, GQA, MLA's latent cache) equals the full forward."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import AttnShape
from qklab.methods.quest import Quest, QuestOptions
from qklab.methods.ssmax import SSMax, SSMaxOptions
from qklab.model import GPT, LatentCache
from qklab.model.rope import Rope
from tests.model.test_rope import complex_rope

B, H, HK, T, D = 2, 4, 2, 9, 16


def _logits(m, q, k, pos=0):
    """The method's pre-softmax logits (B, H, T, T) through its map and scale, GQA keys repeated."""
    qm, km = m.map_qk(q, k, Rope(64, 10000.0), pos)
    km = km.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (qm @ km.transpose(-2, -1)) * m.scale(qm.shape[-1])


def _grads(out, ref, params):
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), params)
    want = torch.autograd.grad((ref * w).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _inputs(pos_scale=3.0):
    q = (torch.randn(B, H, T, D, dtype=torch.float64) * pos_scale).requires_grad_()
    k = (torch.randn(B, HK, T, D, dtype=torch.float64) * torch.linspace(0.1, 20, T, dtype=torch.float64)[:, None]
         ).requires_grad_()  # keys of very different norms: QUEST must ignore them
    return q, k


@pytest.mark.parametrize("head_scale", [False, True])
@pytest.mark.parametrize("pos", [0, 5])
def test_quest_logits_and_gradients_match_formula(head_scale, pos):
    torch.manual_seed(0)
    m = Quest(AttnShape(64, H, HK, D, 0, 2), QuestOptions(head_scale=head_scale)).double()
    if head_scale:
        with torch.no_grad():
            m.head_scale.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]))
    q, k = _inputs()
    s = _logits(m, q, k, pos)
    # the formula: c_h q . RoPE(k / sqrt(||k||^2 + eps)), no 1/sqrt(d)
    c = m.head_scale.view(1, H, 1, 1) if head_scale else 1.0
    khat = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    rq, rk = complex_rope(q * c, pos, 10000.0), complex_rope(khat, pos, 10000.0).repeat_interleave(H // HK, 1)
    ref = rq @ rk.transpose(-2, -1)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)  # fp32 rope tables
    # each query's norm bounds its logits, whatever the keys' norms
    assert (s.abs() <= (q * c).norm(dim=-1, keepdim=True) + 1e-4).all()
    params = [q, k] + ([m.head_scale] if head_scale else [])
    _grads(s, ref, params)


@pytest.mark.parametrize("pos", [0, 6])
def test_ssmax_logits_and_gradients_match_formula(pos):
    torch.manual_seed(1)
    m = SSMax(AttnShape(64, H, HK, D, 0, 2), SSMaxOptions(ref_len=128)).double()
    torch.testing.assert_close(m.s, torch.full((H,), 1 / math.log(128), dtype=torch.float64))
    with torch.no_grad():
        m.s.copy_(torch.tensor([0.1, 0.3, -0.2, 0.7]))
    q, k = _inputs()
    s = _logits(m, q, k, pos)
    n = torch.arange(pos + 1, pos + T + 1, dtype=torch.float64)  # keys query i sees: its position + 1
    rq, rk = complex_rope(q, pos, 10000.0), complex_rope(k, pos, 10000.0).repeat_interleave(H // HK, 1)
    ref = (m.s.view(1, H, 1, 1) * torch.log(n).view(1, 1, T, 1)) * (rq @ rk.transpose(-2, -1)) / math.sqrt(D)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)
    _grads(s, ref, [q, k, m.s])


def test_ssmax_position_zero_sees_one_key_with_zero_logit():
    m = SSMax(AttnShape(64, H, H, D, 0, 2), SSMaxOptions())
    q = torch.randn(1, H, 3, D)
    s = _logits(m, q, torch.randn(1, H, 3, D))
    assert torch.equal(s[..., 0, :], torch.zeros_like(s[..., 0, :]))  # log 1 = 0


def _gpt(method, n_kv=0, attention="mha", impl="auto", **opts):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                      attn_impl=impl, attention=attention, kv_rank=24, nope_dim=16, rope_dim=8, v_dim=12)
    options = {method: {"quest": QuestOptions, "ssmax": SSMaxOptions}[method](**opts)}
    model = GPT(cfg, QKConfig(method=method, options=options)).eval()
    with torch.no_grad():  # peaked attention, so that the comparisons can fail
        for name, p in model.named_parameters():
            if name.endswith(("wq.weight", "wk.weight", "wuq.weight", "wqr.weight", "wuk.weight", "wkr.weight")):
                p.mul_(8.0)
            if name.endswith(("head_scale", ".s")):
                p.uniform_(0.5, 2.0)
    return model


def _decode(model, x, caches):
    parts = [model(x[:, :5], caches=caches)[0], model(x[:, 5:9], caches=caches)[0]]
    parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(9, x.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("opts", [{}, {"head_scale": True}], ids=["paper", "head_scale"])
@pytest.mark.parametrize("method", ["quest", "ssmax"])
@pytest.mark.parametrize("n_kv", [0, 2])
def test_cached_decoding_equals_full_forward_mha_gqa(method, n_kv, opts):
    if method == "ssmax" and opts:
        pytest.skip("one option set for ssmax")
    model = _gpt(method, n_kv, **opts)
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full, _ = model(x)
        got = _decode(model, x, model.make_caches(2, 32))
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["auto", "absorbed", "materialised"])
@pytest.mark.parametrize("method", ["quest", "ssmax"])
def test_mla_latent_decoding_equals_materialised_forward(method, path):
    model = _gpt(method, attention="mla", **({"head_scale": True} if method == "quest" else {}))
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full, _ = model(x)
        for b in model.blocks:
            b.attn.latent_path = path
        caches = model.make_caches(2, 32)
        assert all(isinstance(c, LatentCache) for c in caches)
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    extra = 4 if method == "quest" else 0  # QUEST caches one inverse key norm per head; SSMax nothing
    assert caches[0].values_per_token() == 24 + 8 + extra
    a = model.blocks[0].attn
    a.capture = {}
    with torch.no_grad():
        model(x)
    assert a.capture["probs"][:, :, -1].max() > 0.2  # attention is far from uniform (1/24)


def test_mla_quest_normalises_each_full_head_key():
    model = _gpt("quest", attention="mla")
    a = model.blocks[0].attn
    a.capture = {}
    with torch.no_grad():
        a(torch.randn(2, 6, 64) * 30, model.rope)
    k = a.capture["k"]  # (B, H, T, nope + rope) post-RoPE: unit norm
    torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]), atol=1e-5, rtol=1e-5)


def test_quest_qkclip_clips_the_head_scale_exactly_or_is_refused():
    with pytest.raises(ConfigError, match="set qk.quest.head_scale=true"):
        load_config("tiny", ["qk.method=quest", "qk.controller=qkclip"])
    m = Quest(AttnShape(64, H, H, D, 0, 2), QuestOptions(head_scale=True))
    q, k = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    with torch.no_grad():
        before = _logits(m, q, k)
        g = torch.tensor([1.0, 0.5, 0.25, 0.8])
        assert m.clip_logits(g)
        after = _logits(m, q, k)
    torch.testing.assert_close(after, before * g.view(1, H, 1, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sets, needle", [
    (["qk.method=quest", "qk.quest.eps=0"], "qk.quest.eps=0.0 is out of range: it must be > 0"),
    (["qk.method=ssmax", "qk.ssmax.ref_len=1"], "qk.ssmax.ref_len=1 is out of range: it must be >= 2"),
])
def test_bad_options_are_one_line(sets, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config("tiny", sets)
    assert "\n" not in str(e.value)
