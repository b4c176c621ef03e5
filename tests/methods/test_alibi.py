"""ALiBi's recency bias (arXiv 2108.12409) on RoPE attention: the slopes against transformers' Bloom
(``build_alibi_tensor``), the logits against the formula written out here in fp64 (RoPE logits minus
m_h (i - j)), the attention against Bloom's key-position form of the bias, and the whole model: fused and
eager kernels agree, cached decoding (MHA, GQA, MLA) equals the full forward."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import AttnShape
from qklab.methods.alibi import ALiBi, ALiBiOptions, alibi_slopes
from qklab.model import GPT
from qklab.model.attention import causal_mask
from qklab.model.rope import Rope
from tests.model.test_rope import complex_rope

transformers = pytest.importorskip("transformers")
from transformers.models.bloom.modeling_bloom import build_alibi_tensor  # noqa: E402

B, H, HK, T, D = 2, 6, 2, 9, 16
ROPE = Rope(1 << 16, 10000.0)  # tables to position 65536


def _logits(m, q, k, pos=0):
    """The method's pre-softmax logits (B, H, T, T) through its map and scale, GQA keys repeated."""
    qm, km = m.map_qk(q, k, ROPE, pos)
    km = km.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (qm @ km.transpose(-2, -1)) * m.scale(qm.shape[-1])


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 24])
def test_slopes_equal_bloom(n_heads):
    # Bloom's bias on key j is m_h * j: read the slopes off position 1
    bloom = build_alibi_tensor(torch.ones(1, 4), n_heads, torch.float64)[:, 0, 1]  # (H,)
    ours = torch.tensor(alibi_slopes(n_heads), dtype=torch.float64)
    torch.testing.assert_close(ours, bloom, rtol=3e-7, atol=0)  # Bloom computes them in fp32
    if n_heads == 8:  # the paper's example: 1/2, 1/4, ..., 1/256
        assert alibi_slopes(8) == [2.0 ** -h for h in range(1, 9)]


@pytest.mark.parametrize("pos", [0, 7])
@pytest.mark.parametrize("slope_scale", [1.0, 3.0])
def test_logits_and_gradients_match_formula(pos, slope_scale):
    torch.manual_seed(0)
    m = ALiBi(AttnShape(96, H, HK, D, 0, 2), ALiBiOptions(slope_scale=slope_scale)).double()
    q = (torch.randn(B, H, T, D, dtype=torch.float64) * 2).requires_grad_()
    k = (torch.randn(B, HK, T, D, dtype=torch.float64) * 2).requires_grad_()
    s = _logits(m, q, k, pos)
    rq, rk = complex_rope(q, pos, 10000.0), complex_rope(k, pos, 10000.0).repeat_interleave(H // HK, 1)
    i = torch.arange(T, dtype=torch.float64)
    slopes = torch.tensor([2.0 ** (-8 * h / 4) for h in range(1, 5)] + [2.0 ** (-8 * h / 8) for h in (1, 3)],
                          dtype=torch.float64) * slope_scale  # H = 6: the 4 of H' = 4, then 2 of 8 (every other)
    ref = rq @ rk.transpose(-2, -1) / math.sqrt(D) - slopes.view(1, H, 1, 1) * (i[:, None] - i[None, :])
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)  # fp32 rope tables
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((s * w).sum(), [q, k]), torch.autograd.grad((ref * w).sum(), [q, k]),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_equals_bloom_key_bias():
    """Bloom adds m_h j (key position only), ours -m_h (i - j): they differ by m_h i per query row, which the
    softmax drops. RoPE logits + Bloom's bias give the same probabilities."""
    torch.manual_seed(1)
    m = ALiBi(AttnShape(96, H, H, D, 0, 2), ALiBiOptions()).double()
    q, k = torch.randn(1, H, T, D, dtype=torch.float64) * 2, torch.randn(1, H, T, D, dtype=torch.float64) * 2
    mask = causal_mask(T, T, q.device)
    ours = _logits(m, q, k).masked_fill(~mask, float("-inf")).softmax(-1)
    bloom = build_alibi_tensor(torch.ones(1, T), H, torch.float64).view(1, H, 1, T)
    rope_logits = complex_rope(q, 0, 10000.0) @ complex_rope(k, 0, 10000.0).transpose(-2, -1) / math.sqrt(D)
    ref = (rope_logits + bloom).masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    plain = rope_logits.masked_fill(~mask, float("-inf")).softmax(-1)
    assert (plain - ref).abs().max() > 0.05  # the bias matters at these shapes


def test_slope_scale_zero_is_standard_attention():
    torch.manual_seed(2)
    m = ALiBi(AttnShape(96, H, HK, D, 0, 2), ALiBiOptions(slope_scale=0.0)).double()
    q, k = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, HK, T, D, dtype=torch.float64)
    ref = complex_rope(q, 3, 10000.0) @ complex_rope(k, 3, 10000.0).repeat_interleave(H // HK, 1).transpose(-2, -1)
    torch.testing.assert_close(_logits(m, q, k, 3), ref / math.sqrt(D), rtol=1e-5, atol=1e-5)


def _gpt(n_kv=0, attention="mha", impl="auto", slope_scale=4.0):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                      attn_impl=impl, attention=attention, kv_rank=24, nope_dim=16, rope_dim=8, v_dim=12)
    return GPT(cfg, QKConfig(method="alibi", options={"alibi": ALiBiOptions(slope_scale=slope_scale)})).eval()


@pytest.mark.parametrize("attention, n_kv", [("mha", 0), ("mha", 2), ("mla", 0)])
def test_model_fused_equals_eager_and_cached_decoding_equals_full(attention, n_kv):
    torch.manual_seed(3)
    model = _gpt(n_kv, attention)
    eager = _gpt(n_kv, attention, impl="eager")
    eager.load_state_dict(model.state_dict())
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full, _ = model(x)
        torch.testing.assert_close(eager(x)[0], full, atol=1e-5, rtol=1e-5)
        caches = model.make_caches(2, 32)
        parts = [model(x[:, :5], caches=caches)[0], model(x[:, 5:9], caches=caches)[0]]
        parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(9, 24)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
        none = GPT(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                               attention=attention, kv_rank=24, nope_dim=16, rope_dim=8, v_dim=12), QKConfig()).eval()
        none.load_state_dict(model.state_dict())
        assert (none(x)[0] - full).abs().max() > 1e-3  # the bias changes the model


def test_model_attends_locally_at_init():
    """At init (q . k small) each head's attention is about softmax(-m_h D) over the distances D = i - j: the
    mean attention distance of the last query follows sum_D D e^(-m_h D) / sum_D e^(-m_h D), not the uniform
    i / 2 of standard attention."""
    torch.manual_seed(4)
    model = _gpt(slope_scale=16.0)
    a = model.blocks[0].attn
    a.capture = {}
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 32)))
    p = a.capture["probs"][0, :, -1].double()  # (H, T): the last query's attention
    gap = torch.arange(31, -1, -1, dtype=torch.float64)  # i - j
    dist = (p * gap).sum(-1)
    w = torch.exp(-16.0 * torch.tensor(alibi_slopes(4), dtype=torch.float64)[:, None] * gap)  # (H, T)
    ref = (w * gap).sum(-1) / w.sum(-1)  # 0.07, 0.58, 3.5, 10.5 for slopes 4, 1, 1/4, 1/16
    torch.testing.assert_close(dist, ref, rtol=0.05, atol=0.02)
    assert dist.max() < 12.0  # uniform attention: 15.5


def test_bad_option_is_one_line():
    with pytest.raises(ConfigError, match="qk.alibi.slope_scale=-1.0 is out of range: it must be >= 0") as e:
        load_config("tiny", ["qk.method=alibi", "qk.alibi.slope_scale=-1"])
    assert "\n" not in str(e.value)


def _formula(q, k, pos, slopes):
    """fp64 RoPE logits minus m_h (i - j), (B, H, T, T), GQA keys repeated."""
    rq, rk = complex_rope(q, pos, 10000.0), complex_rope(k, pos, 10000.0).repeat_interleave(H // HK, 1)
    i = torch.arange(pos, pos + T, dtype=torch.float64)
    return rq @ rk.transpose(-2, -1) / math.sqrt(D) - slopes.view(1, H, 1, 1) * (i[:, None] - i[None, :])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos", [3001, 30011, 65500])
def test_half_precision_logits_are_exact_far_from_position_zero(dtype, pos):
    """Far from position 0 a bias built on -m_h i and j themselves is off by several nats in bf16, and in
    fp16 -c_h i overflows (NaN). The features keep each logit, the per-row level included (which a sink's share
    and the max-logit reading see), equal to the fp64 formula's to the precision of q . k alone in that dtype:
    the slopes rounded once to the dtype, the key digits exact, -c_h i / 256 held in three parts."""
    torch.manual_seed(5)
    m = ALiBi(AttnShape(96, H, HK, D, 0, 2), ALiBiOptions())
    q, k = torch.randn(1, H, T, D, dtype=torch.float64), torch.randn(1, HK, T, D, dtype=torch.float64)
    qm, km = m.map_qk(q.to(dtype), k.to(dtype), ROPE, pos)
    assert torch.isfinite(qm).all() and torch.isfinite(km).all()
    assert qm.abs().max() < 256 * math.sqrt(D) and km.abs().max() <= 256  # no feature grows with the position
    got = _logits(m, q.to(dtype), k.to(dtype), pos).double()
    c = (torch.tensor(alibi_slopes(H), dtype=torch.float64) * math.sqrt(D)).to(dtype).double() / math.sqrt(D)
    ref = _formula(q, k, pos, c)  # the slopes as the dtype holds them
    plain = _formula(q, k, pos, torch.zeros(H, dtype=torch.float64))
    qk_err = (_logits(ALiBi(AttnShape(96, H, HK, D, 0, 2), ALiBiOptions(slope_scale=0.0)), q.to(dtype), k.to(dtype),
                      pos).double() - plain).abs().max().item()  # q . k alone in this dtype
    mask = causal_mask(T, T, q.device)
    err = (got - ref).masked_fill(~mask, 0).abs().max().item()
    assert err < 2 * qk_err + 1e-3, (err, qk_err)
    # q = k = 0: the logit of query i on key j is exactly -m_h (i - j), 0 on the diagonal
    z = _logits(m, torch.zeros(1, H, T, D, dtype=dtype), torch.zeros(1, HK, T, D, dtype=dtype), pos).double()
    i = torch.arange(T, dtype=torch.float64)
    torch.testing.assert_close(z.masked_fill(~mask, 0), (-c.view(1, H, 1, 1) * (i[:, None] - i[None, :]))
                               .masked_fill(~mask, 0).to(dtype).double(), rtol=0, atol=0)
    # the slopes as rounded: each within half a unit in the last place of the dtype
    eps = torch.finfo(dtype).eps
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float64)
    assert ((c - slopes).abs() / slopes).max() <= eps / 2


def test_yarn_correction_leaves_the_slopes_alone():
    """MLA under YaRN multiplies the softmax scale by DeepSeek's correction mscale^2 (1.87 here); the bias
    features go through that scale too, so the method divides them by it: with the query projections zeroed
    the last query's attention is softmax(-m_h (i - j)) with YaRN as without."""
    for yarn in (False, True):
        kw = dict(rope_scaling="yarn", yarn_factor=40.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0) if yarn else {}
        cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=1, n_heads=4, max_seq_len=64, attn_impl="eager",
                          attention="mla", kv_rank=24, nope_dim=16, rope_dim=8, v_dim=12, **kw)
        torch.manual_seed(0)
        model = GPT(cfg, QKConfig(method="alibi", options={"alibi": ALiBiOptions()})).eval()
        a = model.blocks[0].attn
        if yarn:
            assert a.softmax_mscale > 1.8
        for name, p in a.named_parameters():
            if name.startswith(("wdq", "wuq", "wqr")) and p.dim() == 2:
                p.data.zero_()
        a.capture = {}
        with torch.no_grad():
            model(torch.randint(0, 97, (1, 16)))
        p = a.capture["probs"][0, :, -1].double()  # (H, T)
        gap = torch.arange(15, -1, -1, dtype=torch.float64)
        ref = torch.softmax(-torch.tensor(alibi_slopes(4), dtype=torch.float64)[:, None] * gap, -1)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)


def test_non_causal_use_is_refused():
    """ALiBi's bias -m_h (i - j) is for keys at or before the query: a later key would get a reward."""
    from qklab import QK

    with pytest.raises(ConfigError, match="alibi is defined for causal attention only"):
        QK("alibi", n_heads=4, head_dim=16, causal=False)
    qk = QK("alibi", n_heads=4, head_dim=16)
    q = torch.randn(1, 4, 6, 16)
    qm, km = qk(q, q)
    v = torch.randn(1, 4, 6, 16)
    causal = causal_mask(6, 6, q.device)
    torch.testing.assert_close(qk.attend(qm, km, v, mask=causal.view(1, 1, 6, 6)), qk.attend(qm, km, v))
    with pytest.raises(ConfigError, match="lets a query see a later key"):
        qk.attend(qm, km, v, mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))


def test_qkclip_keeps_clipped_heads_at_or_below_tau():
    """QK-clip shrinks W_Q, W_K by g = tau / S on logits s + b that include the bias b <= 0, which does not
    scale with the weights: g s + b <= g (s + b) <= tau, so a clipped head ends at or below tau (conservative),
    and a head below tau is untouched."""
    from tests.conftest import tiny_gpt
    from tests.methods.test_controllers import _blow_q, _clip_once

    tau = 10.0
    before, after = _clip_once(tiny_gpt("alibi"), _blow_q([0, 2], 400.0), tau, {})
    assert (before[:, [0, 2]] > tau).all() and (before[:, [1, 3]] < tau).all()
    assert (after[:, [0, 2]] <= tau * (1 + 1e-4)).all() and (after[:, [0, 2]] > 0.9 * tau).all()
    assert (after[:, [0, 2]] < 0.99 * tau).any()  # not exact: where the largest logit carries a bias, below tau
    torch.testing.assert_close(after[:, [1, 3]], before[:, [1, 3]], rtol=1e-5, atol=1e-5)
