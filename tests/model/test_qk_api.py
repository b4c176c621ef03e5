"""qklab.QK, a method in any PyTorch attention: every form of a model's own RoPE (a callable in either layout,
(cos, sin) tables of both widths, a complex freqs_cis; half-split and interleaved) gives the logits of
qklab's own Rope; ``after_rope`` gives the same logits as ``forward`` for the methods that commute with
RoPE and refuses the others in one line; widths, init and mistakes."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.errors import ConfigError
from qklab.methods import METHODS
from qklab.model import Rope
from qklab.model.qk import QK
from qklab.model.rope import rope_tables
from qklab.model.user_rope import to_half, to_interleaved

B, H, HKV, T, D, L = 2, 4, 2, 12, 16, 32


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)


def _qk(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, HKV, T, D, generator=g, dtype=torch.float64))


def _interleaved_rope(cos_pair: torch.Tensor, sin_pair: torch.Tensor):
    """A GPT-J style RoPE written out: pairs (2i, 2i + 1), x (B, H, T, D), angles (L, D/2)."""
    def rope(x, positions):
        c, s = cos_pair[positions].to(x.dtype), sin_pair[positions].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    return rope


def _half_rope(cos: torch.Tensor, sin: torch.Tensor, layout: str = "bhtd"):
    def rope(x, positions):
        c, s = cos[positions].to(x.dtype), sin[positions].to(x.dtype)
        if layout == "bthd":
            c, s = c[:, None], s[:, None]  # (T, 1, D) against (B, T, H, D)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s
    return rope


COS, SIN = rope_tables(D, L, 10000.0)  # (L, D) fp32, as qklab's Rope keeps them
COS_P, SIN_P = COS[:, : D // 2], SIN[:, : D // 2]  # one angle per rotary pair
HALF_FORMS = {
    "callable": dict(rope=_half_rope(COS, SIN)),
    "callable_bthd": dict(rope=_half_rope(COS, SIN, "bthd"), layout="bthd"),
    "tables": dict(rope=(COS, SIN)),
    "pair_tables": dict(rope=(COS_P, SIN_P)),
}
INTERLEAVED_FORMS = {
    "callable": dict(rope=_interleaved_rope(COS_P, SIN_P)),
    "tables": dict(rope=(COS_P.repeat_interleave(2, -1), SIN_P.repeat_interleave(2, -1))),
    "pair_tables": dict(rope=(COS_P, SIN_P)),
    "freqs_cis": dict(rope=torch.polar(torch.ones_like(COS_P), torch.atan2(SIN_P, COS_P))),
}


def _own(method: str, **opts) -> QK:
    return QK(method, n_heads=H, n_kv_heads=HKV, head_dim=D, rope=Rope(L, 10000.0), **opts).double()


@pytest.mark.parametrize("method", ["none", "qknorm", "quest", "ssmax", "softcap"])
@pytest.mark.parametrize("form", sorted(HALF_FORMS))
def test_half_split_forms_give_qklab_rope_logits(method, form):
    q, k = _qk()
    ref = _own(method)
    ours = QK(method, n_heads=H, n_kv_heads=HKV, head_dim=D, **HALF_FORMS[form]).double()
    ours.load_state_dict(ref.state_dict())
    pos = torch.arange(3, 3 + T)
    want = _logits(*ref(q, k, positions=3), ref.scale)
    got = _logits(*ours(q, k, positions=pos), ours.scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-6 if form == "freqs_cis" else 1e-12)


@pytest.mark.parametrize("method", ["none", "qknorm", "quest", "ssmax", "qkmap"])
@pytest.mark.parametrize("form", sorted(INTERLEAVED_FORMS))
def test_interleaved_forms_give_the_logits_of_the_model_rope(method, form):
    """An interleaved RoPE: the logits are those of the model's own interleaved rotation of q and k, method
    applied to the same features (the method sees them in the half-split order)."""
    q, k = _qk(1)
    if method == "qkmap":  # the map's (cos, sin) pairs are what RoPE turns: q, k of proj_dim = D / 2
        q, k = q[..., : D // 2], k[..., : D // 2]
    qk = QK(method, n_heads=H, n_kv_heads=HKV, head_dim=D, convention="interleaved", **INTERLEAVED_FORMS[form]).double()
    got = _logits(*qk(q, k), qk.scale)
    # the reference: the method on half-split features with qklab's own (half-split) Rope, then compared
    ref = _own(method)
    ref.load_state_dict(qk.state_dict())
    want = _logits(*ref(to_half(q), to_half(k)), ref.scale)
    tol = 1e-6 if form == "freqs_cis" else 1e-12  # atan2/polar round the angles in fp32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if method == "none":  # and both are the model's own rotation of the raw features
        rope = _interleaved_rope(COS_P, SIN_P)
        pos = torch.arange(T)
        direct = _logits(rope(q, pos), rope(k, pos), 1 / math.sqrt(D))
        torch.testing.assert_close(got, direct, rtol=tol, atol=tol)


def test_to_half_and_back():
    x = torch.randn(3, 8)
    assert torch.equal(to_interleaved(to_half(x)), x)
    assert to_half(torch.arange(8.0)).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


AFTER_ROPE_OK = {"none": {}, "quest": {"head_scale": True}, "ssmax": {}, "softcap": {"cap": 3.0}, "alibi": {},
                 "qknorm": {"q_gain": False, "k_gain": False}, "qknorm_flat": {"q_gain": False, "k_gain": False,
                                                                                "stats": "flat"}}


@pytest.mark.parametrize("name", sorted(AFTER_ROPE_OK))
def test_after_rope_equals_before_rope_for_methods_that_commute(name):
    """Tables in fp64 (cos^2 + sin^2 = 1 to 1e-16: fp32 tables rotate with a norm error of ~1e-8, which
    a normalising method would show)."""
    method = name.split("_")[0]
    ang = torch.outer(torch.arange(L, dtype=torch.float64), 1.0 / 10000.0 ** (torch.arange(0, D, 2) / D).double())
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (L, D) fp64
    qk = QK(method, n_heads=H, n_kv_heads=HKV, head_dim=D, rope=(cos, sin), **AFTER_ROPE_OK[name]).double()
    with torch.no_grad():
        for p in qk.parameters():
            p.mul_(torch.linspace(0.5, 1.5, p.numel(), dtype=p.dtype).view(p.shape))  # not the init values
    q, k = _qk(2)
    pos = torch.arange(5, 5 + T)
    rope = _half_rope(cos, sin)
    want = _logits(*qk(q, k, positions=pos), qk.scale)
    got = _logits(*qk.after_rope(rope(q, pos), rope(k, pos), positions=pos), qk.scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method, opts, says", [
    ("qknorm", {}, "qknorm with learnable gains must sit before RoPE"),
    ("qknorm", {"q_gain": False}, "qknorm with learnable gains must sit before RoPE"),
    ("qknorm", {"q_gain": False, "k_gain": False, "p": 3.0}, "qknorm with p=3.0 must sit before RoPE"),
    ("qkmap", {}, "qkmap must sit before RoPE"),
])
def test_after_rope_refuses_methods_that_do_not_commute(method, opts, says):
    qk = _own(method, **opts)
    q, k = _qk()
    with pytest.raises(ConfigError, match=says) as e:
        qk.after_rope(q, k)
    assert "\n" not in str(e.value)
    # and it is right to: applied after RoPE, such a method gives other logits than before it
    rope = Rope(L, 10000.0)
    if method == "qknorm":
        if qk.method.k_norm.weight is not None:
            with torch.no_grad():
                qk.method.k_norm.weight.copy_(torch.linspace(0.2, 3.0, D))
        before = _logits(*qk(q, k), qk.scale)
        after = _logits(*qk.method.map_qk(rope(q), rope(k), _no_rope(), 0), qk.scale)
        assert (before - after).abs().max() > 1e-3


def _no_rope():
    from qklab.model.user_rope import NoRope

    return NoRope(torch.arange(T))


def test_ssmax_reads_per_row_positions():
    """(B, T) positions (a left-padded batch): s_h log(position + 1) per row, written out."""
    qk = QK("ssmax", n_heads=H, n_kv_heads=HKV, head_dim=D, rope=(COS, SIN)).double()
    q, k = _qk(3)
    pos = torch.stack([torch.arange(T), torch.arange(T) + 7])  # (B, T)
    got_q, got_k = qk(q, k, positions=pos)
    c, s = COS[pos].double().unsqueeze(1), SIN[pos].double().unsqueeze(1)  # (B, 1, T, D)
    rot = lambda x: x * c + torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1) * s  # noqa: E731
    factor = qk.method.s.view(1, H, 1, 1) * torch.log1p(pos.double()).view(B, 1, T, 1)
    torch.testing.assert_close(got_q, rot(q) * factor, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_k, rot(k), rtol=1e-12, atol=1e-12)


def test_widths_and_init_follow_the_method():
    qk = QK("qkmap", n_heads=H, n_kv_heads=HKV, head_dim=D, d_model=64)
    assert (qk.proj_dim, qk.feature_dim, qk.in_features) == (D // 2, D, 64)
    assert (qk.q_features, qk.k_features) == (H * D // 2, HKV * D // 2) and qk.scale == 1.0
    w = torch.empty(qk.q_features + qk.k_features, 64)
    torch.manual_seed(5)
    qk.init_qk_(w, std=0.02)
    torch.manual_seed(5)
    ref = torch.empty_like(w).normal_(0.0, 1.0 / math.sqrt(64))  # QK-MAP post: N(0, 1/fan_in), not 0.02
    torch.testing.assert_close(w, ref)
    assert QK("quest", n_heads=H, head_dim=D).scale == 1.0
    assert QK("none", n_heads=H, head_dim=D).scale == pytest.approx(1 / math.sqrt(D))


@pytest.mark.parametrize("kwargs, says", [
    (dict(method="qknrom"), "unknown QK method 'qknrom'; choose one of"),
    (dict(method="qkclip"), "'qkclip' is an optimizer-side controller: qklab.attach"),
    (dict(method="softcap", cap=-1.0), "qk.softcap.cap=-1.0 is out of range: it must be > 0"),
    (dict(method="qkmap", head_dim=5), "head_dim=5 divisible by 2\\*n_freqs=2"),
    (dict(method="none", n_kv_heads=3), "n_kv_heads dividing n_heads"),
    (dict(method="none", rope=(COS[:, :5], SIN[:, :5])), "columns, q/k features 16"),
    (dict(method="none", rope=COS), "must be complex"),
    (dict(method="none", rope="rope"), "rope must be a callable"),
    (dict(method="none", rope=(COS, SIN), convention="gptj"), "convention='gptj': use half or interleaved"),
])
def test_mistakes_are_one_line(kwargs, says):
    base = dict(n_heads=H, head_dim=D)
    with pytest.raises(ConfigError, match=says) as e:
        qk = QK(**{**base, **kwargs})
        qk(torch.randn(B, H, T, D), torch.randn(B, H, T, D))  # the tables' width is checked on use
    assert "\n" not in str(e.value)


def test_every_registered_method_builds_and_runs():
    for name in METHODS:
        qk = QK(name, n_heads=H, n_kv_heads=HKV, head_dim=D, rope=(COS, SIN))
        q, k = (t.float()[..., : qk.proj_dim] for t in _qk())
        q, k = qk(q, k)
        y = qk.attend(q, k, torch.randn(B, HKV, T, D))
        assert y.shape == (B, H, T, D) and torch.isfinite(y).all()
