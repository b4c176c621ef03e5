"""Compositional Muon's QK rule (isotropic form) against its formula on random matrices: MHA, GQA, MLA."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from qklab.config import ModelConfig, QKConfig, TrainConfig
from qklab.methods.compositional import Compositional, CompositionalOptions
from qklab.model import GPT
from qklab.train.optim import build_optimizer
from tests.conftest import tiny_gpt
from tests.train import test_host_sync as host_sync

reads = host_sync.reads  # the fixture that watches host reads from qklab's source


def _randomise(model, seed=1):
    """Every matrix scaled by its own random factor and each row by another: partner scales differ per head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(torch.rand(p.shape[0], 1, generator=g) * 3 + 0.2)


def _c(w, heads, damping=0.0):
    """Isotropic partner scale per head, written out: sqrt(||W_h||_F^2 / rows + lambda)."""
    rows = w.shape[0] // heads
    return [math.sqrt(w[h * rows : (h + 1) * rows].double().pow(2).sum().item() / rows + damping) for h in range(heads)]


@pytest.mark.parametrize("n_kv, damping", [(0, 0.0), (2, 0.0), (2, 0.3)])
def test_factors_match_formula_mha_gqa(n_kv, damping):
    model = tiny_gpt(n_kv_heads=n_kv)
    _randomise(model)
    ctrl = Compositional(model, [], CompositionalOptions(tau=0.5, damping=damping))
    for a, got in zip(model.attention_layers(), ctrl.factors(), strict=True):
        H, Hkv = a.n_heads, a.n_kv_heads
        cq, ck = _c(a.wq.weight.detach(), H, damping), _c(a.wk.weight.detach(), Hkv, damping)
        grp = H // Hkv
        want_q = [0.5 / ck[h // grp] for h in range(H)]
        want_k = [0.5 / max(cq[g * grp : (g + 1) * grp]) for g in range(Hkv)]
        assert set(got) == {"wq", "wk"}
        torch.testing.assert_close(got["wq"], torch.tensor(want_q, dtype=torch.float32), rtol=1e-5, atol=0)
        torch.testing.assert_close(got["wk"], torch.tensor(want_k, dtype=torch.float32), rtol=1e-5, atol=0)
        assert len(set(got["wq"].tolist())) > 1  # heads differ


@pytest.mark.parametrize("q_rank", [24, 0])
def test_factors_match_formula_mla(q_rank):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, attention="mla",
                      q_rank=q_rank, kv_rank=16, nope_dim=8, rope_dim=8, v_dim=8)
    model = GPT(cfg, QKConfig()).eval()
    _randomise(model, seed=2)
    ctrl = Compositional(model, [], CompositionalOptions(tau=0.7))
    for a, got in zip(model.attention_layers(), ctrl.factors(), strict=True):
        uq, uk, qr = (_c(getattr(a, n).weight.detach(), 4) for n in ("wuq", "wuk", "wqr"))
        (kr,) = _c(a.wkr.weight.detach(), 1)
        want = {"wuq": [0.7 / uk[h] for h in range(4)], "wuk": [0.7 / uq[h] for h in range(4)],
                "wqr": [0.7 / kr] * 4, "wkr": [0.7 / max(qr)]}
        assert set(got) == set(want)  # the down-projections are left to the optimizer
        for k, v in want.items():
            torch.testing.assert_close(got[k], torch.tensor(v, dtype=torch.float32), rtol=1e-5, atol=0)


def _step_pair(model, cfg, opts):
    """One optimizer step with the controller on ``model`` and without on a copy (same weights and
    gradients): (controller, {name: (before, with, without)})."""
    ref = copy.deepcopy(model)
    oa, ob = build_optimizer(model, cfg), build_optimizer(ref, cfg)
    ctrl = Compositional(model, oa, opts)
    g = torch.Generator().manual_seed(5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctrl.before_step(0)
    for o in oa:
        o.step()
    ctrl.after_step(0)
    for o in ob:
        o.step()
    rp = dict(ref.named_parameters())
    return ctrl, {n: (before[n], p.detach(), rp[n].detach()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer, per_head", [("adamw", "none"), ("muon", "qk"), ("muon", "none")])
def test_step_is_the_optimizer_step_times_the_factor(optimizer, per_head):
    """dW_Q^h = f_h * (the optimizer's step of head h); with per-head Muon that is the isotropic published
    rule -(tau / c_K) lr_h NS(M_h); other matrices take the plain optimizer step."""
    model = tiny_gpt(n_kv_heads=2)
    _randomise(model)
    cfg = TrainConfig(optimizer=optimizer, lr=0.02 if optimizer == "muon" else 1e-2, weight_decay=0.1,
                      muon_per_head=per_head)
    a = model.blocks[0].attn
    ck = _c(a.wk.weight.detach(), 2)
    ctrl, w = _step_pair(model, cfg, CompositionalOptions())
    old, new, plain = w["blocks.0.attn.wq.weight"]
    for h in range(4):
        s = slice(h * 16, (h + 1) * 16)
        torch.testing.assert_close(new[s] - old[s], (0.5 / ck[h // 2]) * (plain[s] - old[s]), atol=1e-7, rtol=1e-4)
    old, new, plain = w["blocks.0.attn.wv.weight"]
    assert torch.equal(new, plain)


def test_host_reads_nothing_inside_a_step(tmp_path, reads):
    t = host_sync._trainer(tmp_path, "c", "qk.controller=compositional", "train.optimizer=muon",
                           "train.muon_per_head=qkv")
    reads.on[0] = True
    for _ in range(3):
        t.train_step()
    reads.on[0] = False
    assert reads == [], f"host reads inside train_step: {reads}"
    m = t.controller.metrics()
    assert len(m["compositional_wq"]) == 2 and len(m["compositional_update_wk"][0]) == 4


def test_options_are_checked():
    from qklab.config import ConfigError, load_config

    assert load_config("tiny", ["qk.controller=compositional"]).qk.controller == "compositional"
    with pytest.raises(ConfigError, match="damping"):
        load_config("tiny", ["qk.controller=compositional", "qk.compositional.damping=-1.0"])

