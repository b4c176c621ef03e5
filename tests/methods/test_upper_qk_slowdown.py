"""Slowed upper-layer Q/K: the schedule and the layers against a written-out formula, and each step against
a plain optimizer step on a copy (the slowed matrices' change is factor x the plain change; nothing else
differs)."""

from __future__ import annotations

import copy

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, TrainConfig, load_config
from qklab.methods import CONTROLLERS
from qklab.methods.upper_qk_slowdown import UpperQKSlowdownOptions, slowdown_factor, slowed_layers
from qklab.model import GPT
from qklab.train.optim import build_optimizer


def _gpt(n_layers=4, mla=False):
    extra = dict(attention="mla", q_rank=24, kv_rank=16, nope_dim=8, rope_dim=8, v_dim=8) if mla else {}
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=n_layers, n_heads=4, max_seq_len=64, **extra)
    return GPT(cfg, QKConfig()).eval()


def test_schedule_is_factor_then_a_linear_ramp_then_one():
    o = UpperQKSlowdownOptions(factor=0.2, steps=3, ramp=4)
    got = [slowdown_factor(s, o) for s in range(9)]
    want = [0.2, 0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0]  # 0.2 + 0.8 * (s - 2) / 4 on the ramp
    assert got == pytest.approx(want, abs=1e-12)
    assert [slowdown_factor(s, UpperQKSlowdownOptions(factor=0.5, steps=2)) for s in range(4)] == [0.5, 0.5, 1, 1]


@pytest.mark.parametrize("n, share, want", [(4, 0.5, [2, 3]), (12, 0.25, [9, 10, 11]), (2, 0.1, [1]),
                                            (3, 1.0, [0, 1, 2]), (5, 0.5, [3, 4])])
def test_the_top_share_of_layers_is_slowed(n, share, want):
    assert slowed_layers(n, share) == want  # round(share * n), at least one (round half to even: 2.5 -> 2)


@pytest.mark.parametrize("optimizer, mla", [("adamw", False), ("muon", False), ("adamw", True)])
def test_each_step_scales_the_upper_layers_qk_change_only(optimizer, mla):
    model = _gpt(mla=mla)
    cfg = TrainConfig(optimizer=optimizer, lr=0.02 if optimizer == "muon" else 1e-2, weight_decay=0.1)
    opts = build_optimizer(model, cfg)
    o = UpperQKSlowdownOptions(share=0.5, factor=0.25, steps=1, ramp=2)
    ctrl = CONTROLLERS["upper_qk_slowdown"](model, opts, o)
    ref = copy.deepcopy(model)
    ref_opts = build_optimizer(ref, cfg)
    qk = ("wuq", "wuk", "wqr", "wdq", "wdkv", "wkr") if mla else ("wq", "wk")
    for step, factor in enumerate([0.25, 0.625, 1.0]):  # steps=1, then a ramp of 2
        gen = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        ref.load_state_dict(model.state_dict())  # the plain step from the same point
        for mod, g in ((model, grads), (ref, grads)):
            for n, p in mod.named_parameters():
                p.grad = g[n].clone()
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        ctrl.before_step(step)
        for opt in opts:
            opt.step()
        ctrl.after_step(step)
        for opt in ref_opts:
            opt.step()
        plain = dict(ref.named_parameters())
        slowed = 0
        for n, p in model.named_parameters():
            layer, kind = (int(n.split(".")[1]), n.split(".")[-2]) if n.startswith("blocks.") else (-1, "")
            if layer >= 2 and kind in qk and factor != 1.0:
                torch.testing.assert_close(p.detach() - old[n], factor * (plain[n].detach() - old[n]),
                                           rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
                slowed += 1
            else:
                assert torch.equal(p.detach(), plain[n].detach()), n
        assert slowed == (0 if factor == 1.0 else 2 * len(qk))
        m = ctrl.metrics()
        if factor == 1.0:
            assert m == {}  # the schedule is over: nothing applied, nothing logged
        else:
            assert m["upper_qk_slowdown_layers"] == [2, 3]
            assert m[f"upper_qk_slowdown_{qk[0]}"] == [[factor] * 4, [factor] * 4]
            for i, k in enumerate(m["upper_qk_slowdown_layers"]):  # the logged norm is that of the change made
                w = dict(model.named_parameters())[f"blocks.{k}.attn.{qk[0]}.weight"].detach()
                change = (w - old[f"blocks.{k}.attn.{qk[0]}.weight"]).view(4, -1).norm(dim=1)
                torch.testing.assert_close(torch.tensor(m[f"upper_qk_slowdown_update_{qk[0]}"][i]), change)


def test_options_and_config():
    cfg = load_config("tiny", ["qk.controller=upper_qk_slowdown", "qk.upper_qk_slowdown.factor=0.05",
                               "qk.upper_qk_slowdown.steps=50"])
    assert cfg.qk.opts("upper_qk_slowdown").factor == 0.05
    for bad in ("share=0", "share=1.5", "factor=0", "steps=-1", "ramp=-2"):
        with pytest.raises(ConfigError, match=f"qk.upper_qk_slowdown.{bad.split('=')[0]}"):
            load_config("tiny", ["qk.controller=upper_qk_slowdown", f"qk.upper_qk_slowdown.{bad}"])
