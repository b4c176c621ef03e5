"""Chunked per-head measurements from q and k agree with the full eager capture; no T x T tensor is
ever formed, between evaluations nothing of size T x T is held; sinks on 64-token inputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qklab.config import ModelConfig, QKConfig
from qklab.diagnostics import AttentionMonitor, capturing, qk_hooks, sink_stats, snapshot
from qklab.diagnostics import measures as M
from qklab.diagnostics.streamed import layer_stats, uniform_first_token
from qklab.model import GPT
from tests.conftest import tiny_gpt
from tests.diagnostics import oracles as O
from tests.diagnostics.handbuilt import sink_model


def _mla(method: str = "none") -> GPT:
    return GPT(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, attention="mla",
                           init_std=0.2), QKConfig(method=method)).eval()


MODELS = {"softcap-gqa": lambda: tiny_gpt("softcap", n_kv_heads=2, init_std=0.3),
          "qkmap": lambda: tiny_gpt("qkmap", init_std=0.3),
          "qknorm": lambda: tiny_gpt("qknorm", init_std=0.3),
          "mla": _mla}


def _eager(model, x):
    with torch.no_grad(), capturing(model) as caps:
        model(x)
    return caps


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_stats_equal_the_eager_reference(name):
    model = MODELS[name]()
    x = torch.randint(0, 97, (2, 40))
    caps = _eager(model, x)
    got = {}

    def on_layer(i, attn, q, k):
        got[i] = layer_stats(attn, q, k, prev=(q * 1.5, k), budget=2 * 4 * 40 * 3)  # 3 query rows per chunk

    with torch.no_grad(), qk_hooks(model, on_layer):
        model(x)
    for i, cap in enumerate(caps):
        s, p, mask = cap["logits"], cap["probs"], cap["mask"]
        H = s.shape[1]
        torch.testing.assert_close(got[i]["max_logit"], M.max_logit(s, mask), atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got[i]["entropy"], M.entropy(p, mask), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[i]["first_token"], M.first_token(p, mask), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[i]["distance"], O.mean_distance(p), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(M.distance(p, mask), O.mean_distance(p), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got[i]["q_norm"], O.mean_norm(cap["q"], H), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[i]["k_norm"], O.mean_norm(cap["k"], H), atol=1e-6, rtol=1e-6)
        rep = H // cap["k"].shape[1]
        attn = model.blocks[i].attn
        s_prev = attn.qk.logits(1.5 * cap["q"] @ cap["k"].repeat_interleave(rep, 1).transpose(-2, -1)
                                * attn.qk.scale(cap["q"].shape[-1]))
        torch.testing.assert_close(got[i]["logit_abs_change"], O.mean_abs_change(s, s_prev, mask),
                                   atol=1e-5, rtol=1e-5)


class _Sizes(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_t_by_t_tensor_during_or_between_evaluations(monkeypatch):
    monkeypatch.setattr("qklab.diagnostics.streamed.CHUNK_ELEMENTS", 2 * 4 * 256 * 16)  # 16 query rows
    model = GPT(ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=256)).eval()
    B, H, T = 2, 4, 256
    x = torch.randint(0, 32, (B, T))
    mon = AttentionMonitor(x)
    mon.measure(model, 0)
    with _Sizes() as sizes:
        rec = mon.measure(model, 1)
    # one chunk of logits (B, H, 16, T), or the model's own (T, T) causal mask; never (B, H, T, T)
    assert sizes.largest <= max(B * H * T * 16, T * T) < B * H * T * T
    assert rec["logit_change_mean"] == 0.0
    held = [t for qk in mon._prev.qk for t in qk]  # the reference for the next change: q and k only
    assert all(t.shape == (B, H, T, 8) for t in held)
    assert all(v.numel() == 2 * 4 for v in mon._prev.heads.values())


def test_sink_rate_is_measured_on_64_token_inputs():
    model = sink_model(max_len=128)  # every head attends to position 0 where the token is 0
    x = torch.randint(1, 32, (3, 100))
    x[:, 0] = 0
    sk = sink_stats(model, x)
    assert sk["seq_len"] == 64 and sk["rate"] == 1.0 and sk["rate_per_layer"] == [1.0, 1.0]
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wq.weight.zero_()  # uniform attention: first-token weight = its baseline, no sinks
    sk = sink_stats(model, x)
    base = sum(1 / (i + 1) for i in range(1, 64)) / 63
    assert sk["first_token_baseline"] == pytest.approx(base) and uniform_first_token(64) == pytest.approx(base)
    assert sk["first_token_mean"] == pytest.approx(base, rel=1e-5) and sk["rate"] == 0.0
    full = snapshot(model, x).heads["first_token"]  # at T = 100 the uniform weight is lower
    assert full.mean().item() == pytest.approx(uniform_first_token(100), rel=1e-5)


def test_monitor_record_has_the_baselines():
    rec = AttentionMonitor(torch.randint(0, 97, (2, 30))).measure(tiny_gpt("none"), 0)
    assert rec["first_token_baseline"] == pytest.approx(uniform_first_token(30))
    assert rec["sink"]["seq_len"] == 30 and rec["sink_rate"] == rec["sink"]["rate"]
    assert rec["sink_rate_at_T"] == M.sink_rate(torch.tensor(rec["first_token"]))


def test_monitor_logs_the_methods_own_stability_statistics():
    """QK-MAP's per-head phase statistics (w * std(z), phase spread, aliasing, pre-map norms) reach the
    diagnostics record, equal to the method's stats() of a recorded forward on the same batch; a method
    without statistics adds nothing."""
    x = torch.randint(0, 97, (2, 30))
    model = tiny_gpt("qkmap")
    rec = AttentionMonitor(x).measure(model, 0)
    assert not any(b.attn.qk.record for b in model.blocks)  # switched off again
    for a in model.blocks:
        a.attn.qk.record = True
    with torch.no_grad():
        model(x)
    direct = [b.attn.qk.stats() for b in model.blocks]
    assert set(rec["method_stats"]) == {"w_std", "phase_spread", "aliased", "q_norm", "k_norm", "temperature"}
    for key, per_layer in rec["method_stats"].items():
        assert len(per_layer) == len(model.blocks) and len(per_layer[0]) == 4  # (L, H)
        for got, want in zip(per_layer, direct, strict=True):
            assert got == pytest.approx(want[key], rel=1e-5)
    assert "method_stats" not in AttentionMonitor(x).measure(tiny_gpt("none"), 0)
