"""QK-Norm variants (DeepSeek-V4 style, flattened statistics, per-head gains, the Lp norm of arXiv
2602.05006) against formulas written out here in fp64, values and gradients; their MLA latent decode
equals the materialised forward where they keep the latent cache; the defaults are the original QK-Norm."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import AttnShape
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.model import GPT, KVCache, LatentCache
from qklab.model.rope import Rope
from tests.model.test_rope import complex_rope

B, H, HK, T, D = 2, 4, 2, 7, 16
VARIANTS = [
    {"q_gain": False},
    {"stats": "flat"},
    {"gains": "head"},
    {"p": 3.0},
    {"p": 1.0, "q_gain": False, "stats": "flat"},
]


def _stat(x, p, flat):
    """(mean |x|^p + eps)^(1/p) over each head's features, or over all heads of a token (flat)."""
    dims = (1, 3) if flat else (3,)
    return (x.abs().pow(p).mean(dim=dims, keepdim=True) + 1e-6).pow(1.0 / p)


def _reference_logits(m, q, k, pos, o):
    flat = o.get("stats") == "flat"
    p = o.get("p", 2.0)
    qn, kn = q / _stat(q, p, flat), k / _stat(k, p, flat)
    if o.get("gains") == "head":
        gq, gk = m.q_norm.weight.view(H, 1, D), m.k_norm.weight.view(HK, 1, D)
    else:
        gq, gk = m.q_norm.weight, m.k_norm.weight
    if o.get("q_gain", True):
        qn = gq * qn
    kn = gk * kn
    if p != 2.0:
        qn = qn * m.alpha
    rq, rk = complex_rope(qn, pos, 10000.0), complex_rope(kn, pos, 10000.0).repeat_interleave(H // HK, 1)
    return rq @ rk.transpose(-2, -1) / math.sqrt(D)


@pytest.mark.parametrize("pos", [0, 4])
@pytest.mark.parametrize("o", VARIANTS, ids=str)
def test_variant_logits_and_gradients_match_formula(o, pos):
    torch.manual_seed(0)
    m = QKNorm(AttnShape(64, H, HK, D, 0, 2), QKNormOptions(**o)).double()
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(1 + 0.4 * torch.randn_like(prm))
    assert (m.q_norm.weight is None) == (not o.get("q_gain", True))
    assert (m.alpha is not None) == (o.get("p", 2.0) != 2.0)
    q = (torch.randn(B, H, T, D, dtype=torch.float64) * 3).requires_grad_()
    k = (torch.randn(B, HK, T, D, dtype=torch.float64) * torch.rand(1, HK, T, 1, dtype=torch.float64) * 5
         ).requires_grad_()
    qm, km = m.map_qk(q, k, Rope(64, 10000.0), pos)
    s = qm @ km.repeat_interleave(H // HK, 1).transpose(-2, -1) * m.scale(D)
    ref = _reference_logits(m, q, k, pos, o)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)
    params = [q, k, *m.parameters()]
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((s * w).sum(), params), torch.autograd.grad((ref * w).sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_defaults_are_the_original_qknorm_bit_for_bit():
    """Explicit default options take the original path (the fused norm-rotate), with the same numbers."""
    torch.manual_seed(2)
    shape = AttnShape(64, H, HK, D, 0, 2)
    explicit = QKNormOptions(q_gain=True, stats="head", gains="shared", p=2.0)
    a, b = QKNorm(shape, QKNormOptions()), QKNorm(shape, explicit)
    assert [n for n, _ in a.named_parameters()] == ["q_norm.weight", "k_norm.weight"]
    q, k = torch.randn(B, H, T, D), torch.randn(B, HK, T, D)
    for x, y in zip(a.map_qk(q, k, Rope(64, 10000.0), 3), b.map_qk(q, k, Rope(64, 10000.0), 3), strict=True):
        assert torch.equal(x, y)


def test_flat_statistics_give_one_key_scalar_per_token():
    m = QKNorm(AttnShape(64, H, HK, D, 0, 2), QKNormOptions(stats="flat"))
    k = torch.randn(B, HK, T, D)
    inv = m.key_inv_rms(k)
    assert torch.equal(inv, inv[:, :1].expand_as(inv)) and m.latent_key_group == HK


def _mla_gpt(**o):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=H, max_seq_len=64, attention="mla", q_rank=20,
                      kv_rank=24, nope_dim=16, rope_dim=8, v_dim=12)
    model = GPT(cfg, QKConfig(method="qknorm", options={"qknorm": QKNormOptions(**o)})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim <= 1 and ("norm" in name or "alpha" in name):
                p.uniform_(0.5, 1.5)
            if name.endswith(("wuq.weight", "wqr.weight", "wuk.weight", "wkr.weight")):
                p.mul_(15.0)
    return model


def _decode(model, x, caches):
    parts = [model(x[:, :5], caches=caches)[0], model(x[:, 5:9], caches=caches)[0]]
    parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(9, x.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("path", ["auto", "absorbed", "materialised"])
@pytest.mark.parametrize("o", [v for v in VARIANTS if v.get("gains") != "head"] + [{"stats": "flat", "k_parts": True}],
                         ids=str)
def test_mla_latent_decode_equals_materialised(o, path):
    model = _mla_gpt(**o)
    x = torch.randint(0, 97, (2, 22))
    with torch.no_grad():
        full, _ = model(x)
        for b in model.blocks:
            b.attn.latent_path = path
        caches = model.make_caches(2, 24)
        assert isinstance(caches[0], LatentCache)
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    assert caches[0].values_per_token() == 24 + 8 + (1 if o.get("stats") == "flat" else H)


def test_mla_per_head_gains_decode_from_per_head_caches_and_refuse_the_latent_one():
    model = _mla_gpt(gains="head")
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 24)
        assert isinstance(caches[0], KVCache)
        torch.testing.assert_close(_decode(model, x, caches), full, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="needs per-head keys"):
            model.make_caches(2, 24, latent=True)


@pytest.mark.parametrize("sets, needle", [
    (["qk.qknorm.stats=all"], "use head or flat"),
    (["qk.qknorm.gains=layer"], "use shared or head"),
    (["qk.qknorm.p=0.5"], "must be >= 1"),
    (["qk.qknorm.stats=flat", "qk.qknorm.k_group=2"], "leave k_group at 1"),
])
def test_bad_variant_options_are_one_line(sets, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config("tiny", ["qk.method=qknorm", *sets])
    assert "\n" not in str(e.value)
