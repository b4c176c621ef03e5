"""QK-Norm's gain initialisation sets its initial logit bound: a key equal to the query gets
g0^2 sqrt(d_head), the largest logit the normalised vectors allow."""

import math

import pytest
import torch

from qklab.config import ConfigError, load_config
from qklab.methods import AttnShape
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.model.rope import Rope


@pytest.mark.parametrize("g0", [1.0, math.sqrt(2.0)])
def test_gain_init_sets_the_logit_bound(g0):
    d = 32
    m = QKNorm(AttnShape(192, 6, 6, d, 0, 4), QKNormOptions(gain_init=g0))
    m.reset_parameters()
    z = torch.randn(1, 6, 5, d) * 7.0
    q, k = m.map_qk(z, z, Rope(64, 10000.0), 0)
    s = (q * k).sum(-1) * m.scale(d)  # (1, 6, 5): each query against its own key
    torch.testing.assert_close(s, torch.full_like(s, g0**2 * math.sqrt(d)), rtol=1e-5, atol=1e-5)
    other = (q[..., :1, :] * k[..., 1:, :]).sum(-1) * m.scale(d)
    assert (other.abs() <= g0**2 * math.sqrt(d) + 1e-4).all()


def test_gain_init_must_be_positive():
    with pytest.raises(ConfigError, match="qk.qknorm.gain_init=0.0 is out of range: it must be > 0"):
        load_config("tiny", ["qk.method=qknorm", "qk.qknorm.gain_init=0"])


def _reference_map(x, g, eps, pos):
    """x (B, H, T, D) fp64: g * x / sqrt(mean(x^2) + eps), then the complex-pair rotation."""
    from tests.model.test_rope import complex_rope
    return complex_rope(g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps), pos, 10000.0)


@pytest.mark.parametrize("pos", [0, 5])
def test_fused_norm_rope_matches_the_formula_values_and_gradients(pos):
    """The eager path (_NormRotate: gain folded into the tables, hand-written backward) against the
    direct formula through autograd, fp64, GQA keys, inputs in the projections' (B, T, H, D) memory."""
    torch.manual_seed(0)
    B, H, Hk, T, D = 2, 6, 2, 9, 16
    m = QKNorm(AttnShape(96, H, Hk, D, 0, 4), QKNormOptions(eps=1e-6)).double()
    with torch.no_grad():  # gains away from 1, so their gradients and the fold are exercised
        m.q_norm.weight.copy_(1 + 0.3 * torch.randn(D))
        m.k_norm.weight.copy_(1 + 0.3 * torch.randn(D))
    qm = (torch.randn(B, T, H, D, dtype=torch.float64) * 3).requires_grad_()
    km = (torch.randn(B, T, Hk, D, dtype=torch.float64) * 0.2).requires_grad_()
    q, k = m.map_qk(qm.transpose(1, 2), km.transpose(1, 2), Rope(64, 10000.0), pos)
    rq = _reference_map(qm.transpose(1, 2), m.q_norm.weight, 1e-6, pos)
    rk = _reference_map(km.transpose(1, 2), m.k_norm.weight, 1e-6, pos)
    torch.testing.assert_close(q, rq, rtol=0, atol=1e-5)  # fp32 rope tables
    torch.testing.assert_close(k, rk, rtol=0, atol=1e-5)
    wq, wk = torch.randn_like(q), torch.randn_like(k)
    params = [qm, km, m.q_norm.weight, m.k_norm.weight]
    got = torch.autograd.grad((q * wq).sum() + (k * wk).sum(), params)
    ref = torch.autograd.grad((rq * wq).sum() + (rk * wk).sum(), params)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the composite (nn.RMSNorm, the textbook rotation: the compiled path) with the same tables
    cq, ck = m._norm_rotate_composite(qm.transpose(1, 2), km.transpose(1, 2), Rope(64, 10000.0), pos)
    torch.testing.assert_close(q, cq, rtol=0, atol=1e-12)
    torch.testing.assert_close(k, ck, rtol=0, atol=1e-12)
    comp = torch.autograd.grad((cq * wq).sum() + (ck * wk).sum(), params)
    for a, b in zip(got, comp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fused_norm_rope_in_bf16_follows_fp32():
    torch.manual_seed(1)
    m = QKNorm(AttnShape(64, 2, 2, 32, 0, 4), QKNormOptions())
    x = torch.randn(2, 7, 2, 32)
    q32, _ = m.map_qk(x.transpose(1, 2), x.transpose(1, 2), Rope(64, 10000.0), 0)
    qb, _ = m.map_qk(x.bfloat16().transpose(1, 2), x.bfloat16().transpose(1, 2), Rope(64, 10000.0), 0)
    assert qb.dtype == torch.bfloat16
    torch.testing.assert_close(qb.float(), q32, rtol=2e-2, atol=2e-2)
