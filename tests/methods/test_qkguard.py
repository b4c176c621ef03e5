"""QK-Guard: dormant it is standard attention; a switched head is parameter-free QK-Norm (against qklab's
``qknorm`` without gains, a second code path, and the formula); the trigger (measure, threshold, GQA
groups, per layer); the KV cache and MLA's latent cache with switched heads; in training: the switch
recorded in metrics.jsonl, a switched head's logits bounded, resume bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import AttnShape
from qklab.methods.qkguard import QKGuard, QKGuardOptions
from qklab.methods.qknorm import QKNormOptions
from qklab.model import GPT, Rope
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer
from tests.model.test_mla import _set, assert_decoding_equals_full_forward, mla_gpt
from tests.train.test_resume import _assert_resumes_bitwise, _cfg


def _gpt(method: str, n_kv: int = 0, options: dict | None = None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64)
    model = GPT(cfg, QKConfig(method=method, options=options or {})).eval()
    with torch.no_grad():  # larger q/k weights: peaked attention, so that normalising a head matters
        for b in model.blocks:
            b.attn.wq.weight.mul_(8.0)
            b.attn.wk.weight.mul_(8.0)
    return model


def _switch(model: GPT, heads: dict[int, list[int]]) -> None:
    """Switch the given key heads of the given layers on, as step_end would."""
    for layer, kv in heads.items():
        g = model.blocks[layer].attn.qk
        g.on[kv] = True


@pytest.mark.parametrize("n_kv", [0, 2])
def test_dormant_is_standard_and_fully_switched_is_parameter_free_qknorm(n_kv):
    x = torch.randint(0, 97, (2, 24))
    guard = _gpt("qkguard", n_kv)
    none = _gpt("none", n_kv)
    plain = _gpt("qknorm", n_kv, {"qknorm": QKNormOptions(q_gain=False, k_gain=False)})
    for other in (none, plain):
        other.load_state_dict(guard.state_dict(), strict=False)  # the same weights (not the guard's buffers)
    with torch.no_grad():
        torch.testing.assert_close(guard(x)[0], none(x)[0], rtol=0, atol=0)
        _switch(guard, {i: list(range(b.attn.n_kv_heads)) for i, b in enumerate(guard.blocks)})
        got, ref = guard(x)[0], plain(x)[0]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert (got - none(x)[0]).abs().max() > 0.1  # the switch changes the model: the comparison has teeth


def test_a_switched_key_head_normalises_its_group_only():
    """GQA, 4 query heads on 2 key heads: key head 1 switched -> query heads 2, 3 and key head 1 have rms 1
    (the formula: x / sqrt(mean(x^2) + eps)), the others are the projections' own values."""
    g = QKGuard(AttnShape(64, 4, 2, 16, 0, 1), QKGuardOptions())
    g.on[1] = True
    ident = lambda x, pos: x  # noqa: E731  (no RoPE: the map itself)
    q, k = torch.randn(2, 4, 5, 16) * 7, torch.randn(2, 2, 5, 16) * 7
    mq, mk = g.map_qk(q, k, ident, 0)
    rms = lambda x: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    torch.testing.assert_close(mq[:, 2:], rms(q[:, 2:]))
    torch.testing.assert_close(mk[:, 1:], rms(k[:, 1:]))
    assert torch.equal(mq[:, :2], q[:, :2]) and torch.equal(mk[:, :1], k[:, :1])


def test_the_trigger():
    g = QKGuard(AttnShape(64, 4, 2, 16, 0, 1), QKGuardOptions(threshold=10.0))
    g.step_end(torch.tensor([10.0, -math.inf, 3.0, 9.0]), 0)  # at the threshold: not above it
    assert not g.on.any() and not g.armed
    g.step_end(torch.tensor([1.0, 1.0, 1.0, 10.5]), 4)  # query head 3 -> key head 1 (heads 2, 3)
    assert g.on.tolist() == [False, True] and g.since.tolist() == [-1, 4] and g.armed
    g.step_end(torch.tensor([50.0, 1.0, 0.0, 0.0]), 7)  # key head 0 now; key head 1 stays on, since kept
    g.step_end(torch.tensor([0.0, 0.0, 0.0, 0.0]), 8)  # once on, always on
    assert g.on.tolist() == [True, True] and g.since.tolist() == [7, 4]
    assert g.step_metrics() == {"qkguard_since": [7, 4]}

    layer = QKGuard(AttnShape(64, 4, 4, 16, 0, 1), QKGuardOptions(threshold=10.0, per="layer"))
    layer.step_end(torch.tensor([0.0, 11.0, 0.0, 0.0]), 2)
    assert layer.on.all() and layer.since.tolist() == [2] * 4

    growth = QKGuard(AttnShape(64, 2, 2, 16, 0, 1), QKGuardOptions(threshold=3.0, measure="growth"))
    growth.step_end(torch.tensor([2.0, -math.inf]), 0)  # references: head 0 from step 0, head 1 not yet seen
    growth.step_end(torch.tensor([6.5, 4.0]), 1)  # head 0: 3.25x its reference; head 1: its reference now
    growth.step_end(torch.tensor([1.0, 11.0]), 2)  # head 1: 2.75x
    assert growth.on.tolist() == [True, False] and growth.ref.tolist() == [2.0, 4.0]


def test_state_travels_with_the_weights():
    a, b = _gpt("qkguard"), _gpt("qkguard", seed=1)
    _switch(a, {1: [2]})
    a.blocks[1].attn.qk.since[2] = 17
    b.load_state_dict(a.state_dict())
    g = b.blocks[1].attn.qk
    assert g.armed and g.on.tolist() == [False, False, True, False] and g.since.tolist() == [-1, -1, 17, -1]
    assert not b.blocks[0].attn.qk.armed
    x = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])


@pytest.mark.parametrize("n_kv", [0, 2])
def test_kv_cache_decoding_with_switched_heads_equals_full_forward(n_kv):
    model = _gpt("qkguard", n_kv)
    _switch(model, {0: [1], 1: [0]})
    x = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 40)
        parts = [model(x[:, :7], caches=caches)[0]] + [model(x[:, t : t + 1], caches=caches)[0] for t in range(7, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["absorbed", "materialised", "per-head"])
def test_mla_latent_cache_with_switched_heads_equals_full_forward(kind):
    model = mla_gpt("qkguard")
    for b in model.blocks:
        b.attn.qk.on[1:3] = True
    assert_decoding_equals_full_forward(model, kind)
    a = model.blocks[0].attn
    a.capture = {}
    _set(model, latent_path="materialised")
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 26)))
    k = a.capture["k"]  # (B, H, T, F): switched heads' keys have rms 1 (RoPE is a rotation)
    torch.testing.assert_close(k[:, 1:3].pow(2).mean(-1), torch.ones_like(k[:, 1:3, :, 0]), atol=1e-4, rtol=1e-4)
    assert (k[:, 0].pow(2).mean(-1) - 1).abs().max() > 0.5


def test_latent_map_with_switched_heads_is_map_qk_factorised():
    g = QKGuard(AttnShape(64, 4, 4, 24, 0, 2, 8), QKGuardOptions())
    g.on[0], g.on[3] = True, True
    rope = Rope(64, 10000.0)
    q, k = torch.randn(2, 4, 7, 24) * 3, torch.randn(2, 4, 7, 24) * 3
    qm, km = g.map_qk(q, k, rope, 5)
    ql, gain, s = g.latent_map(q, k, rope, 5)
    assert gain is None
    torch.testing.assert_close(ql, qm)
    torch.testing.assert_close(rope(k, 5) * s, km)


def test_training_switches_records_and_bounds_the_switched_heads(tmp_path):
    cfg = _cfg(tmp_path, "guard", "qk.method=qkguard", "qk.qkguard.threshold=0.5", "train.diag_every=20")
    t = Trainer(cfg, log=lambda s: None)
    t.run()
    recs = [r for r in read_metrics(t.run_dir / "metrics.jsonl") if "qkguard_since" in r]
    assert [r["step"] for r in recs] == list(range(1, 21))  # logged every step
    last = recs[-1]["qkguard_since"]  # per layer, per key head: the step at whose end it switched
    on = [[s >= 0 for s in layer] for layer in last]
    assert any(map(any, on)) and not all(map(all, on))  # some heads switched, some stayed dormant
    for r in recs:  # a head appears switched from the log after its step on, with the same step
        for layer, since in zip(r["qkguard_since"], last, strict=True):
            assert [s if 0 <= s < r["step"] else -1 for s in since] == layer
    for layer, a in zip(last, t.model.attention_layers(), strict=True):
        assert a.qk.on.tolist() == [s >= 0 for s in layer]
    diag = [r for r in read_metrics(t.run_dir / "metrics.jsonl") if "diag" in r][-1]["diag"]["max_logit"]
    bound = math.sqrt(cfg.model.head_dim)  # |q.k| / sqrt(D) <= D / sqrt(D) once both have rms 1
    for layer, maxima in zip(on, diag, strict=True):
        assert all(m <= bound * (1 + 1e-4) for m, o in zip(maxima, layer, strict=True) if o)


def test_resume_with_a_switch_either_side_of_the_checkpoint_is_bitwise_exact(tmp_path):
    _assert_resumes_bitwise(tmp_path, ["qk.method=qkguard", "qk.qkguard.threshold=0.5"])


def test_options_and_refusals():
    cfg = load_config("tiny", ["qk.method=qkguard", "qk.qkguard.threshold=30", "qk.qkguard.per=layer"])
    assert cfg.qk.opts("qkguard") == QKGuardOptions(threshold=30.0, per="layer")
    for bad, needle in [("qk.qkguard.threshold=0", "threshold"), ("qk.qkguard.measure=entropy", "measure"),
                        ("qk.qkguard.per=token", "per")]:
        with pytest.raises(ConfigError, match=needle):
            load_config("tiny", ["qk.method=qkguard", bad])
    with pytest.raises(ConfigError, match="qkguard"):
        load_config("tiny", ["qk.method=qkguard", "qk.controller=qkclip"])


def test_switched_and_dormant_heads_values_and_gradients_in_fp64():
    """Against the formula written out in fp64: a switched key head and its query heads x / sqrt(mean(x^2) +
    eps), then RoPE; a dormant one RoPE alone; values and the gradients of a random loss."""
    g = QKGuard(AttnShape(64, 4, 2, 16, 0, 1), QKGuardOptions(eps=1e-6)).double()
    g.on[0] = True  # key head 0 and query heads 0, 1 switched; key head 1, query heads 2, 3 dormant
    rope = Rope(16, 10000.0)
    q = (torch.randn(2, 4, 6, 16, dtype=torch.float64) * 5).requires_grad_()
    k = (torch.randn(2, 2, 6, 16, dtype=torch.float64) * 5).requires_grad_()
    wq, wk = torch.randn(2, 4, 6, 16, dtype=torch.float64), torch.randn(2, 2, 6, 16, dtype=torch.float64)

    def norm(x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    mq, mk = g.map_qk(q, k, rope, 3)
    rq = rope(torch.cat([norm(q[:, :2]), q[:, 2:]], 1), 3)
    rk = rope(torch.cat([norm(k[:, :1]), k[:, 1:]], 1), 3)
    torch.testing.assert_close(mq, rq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mk, rk, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(((mq * wq).sum() + (mk * wk).sum()), (q, k))
    want = torch.autograd.grad(((rq * wq).sum() + (rk * wk).sum()), (q, k))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
