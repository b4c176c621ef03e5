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



# --- the exact form: C^{-1} msign(C^{-1} U) per head, inside per-head Muon ----------------------------------

NS_ARGS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch Muon's defaults: the msign Muon uses


def _aniso(model, seed=3):
    """Every 2-D weight times a random row scale and each head block mixed by a random matrix: the partner
    Grams are far from isotropic (condition numbers ~10), so the exact and isotropic forms differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(torch.rand(p.shape[0], 1, generator=g) * 3 + 0.2)
                p.add_(0.5 * p.roll(1, dims=0))  # correlated rows within each head


def _inv_root(w, lam_abs=0.0, rel=1e-3):
    """fp64 (W W^T + lambda I)^{-1/2} of rows w (r, C) by eigendecomposition, lambda = lam_abs + rel tr / r."""
    G = w.double() @ w.double().T
    lam = lam_abs + rel * G.trace() / G.shape[0]
    e, V = torch.linalg.eigh(G + lam * torch.eye(G.shape[0], dtype=torch.float64))
    return V @ torch.diag(e.rsqrt()) @ V.T


def _msign(x):
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def _ns(x):
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(x.float(), *NS_ARGS).double()


def _exact_setup(model, tau=0.5, damping=0.0, rel=1e-3, lr=0.02, wd=0.1, per_head="qk"):
    cfg = TrainConfig(optimizer="muon", lr=lr, weight_decay=wd, muon_per_head=per_head)
    opts = build_optimizer(model, cfg)
    ctrl = Compositional(model, opts, CompositionalOptions(tau=tau, damping=damping, rel_damping=rel, form="exact",
                                                           decay="base"))
    g = torch.Generator().manual_seed(9)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return ctrl, opts


def _partner_inv_roots(a, name, damping=0.0, rel=1e-3):
    """Per head of matrix ``name`` of attention a: the fp64 C^{-1} of its partner, written out (GQA / MLA keys:
    the stacked Grams of their query heads)."""
    W = {k: getattr(a, k).weight.detach().double() for k in ("wq", "wk", "wuq", "wuk", "wqr", "wkr") if hasattr(a, k)}
    if "wq" in W:
        H, Hkv = a.n_heads, a.n_kv_heads
        d, grp = W["wq"].shape[0] // H, H // Hkv
        if name == "wq":
            return [_inv_root(W["wk"][(h // grp) * d : (h // grp + 1) * d], damping, rel) for h in range(H)]
        return [_inv_root(torch.cat([W["wq"][h * d : (h + 1) * d] for h in range(g * grp, (g + 1) * grp)], dim=1),
                          damping, rel) for g in range(Hkv)]  # [W_Q^h ...] side by side: sum of the Grams
    H = a.n_heads
    n, r = W["wuq"].shape[0] // H, W["wqr"].shape[0] // H
    if name in ("wuq", "wuk"):
        other = W["wuk" if name == "wuq" else "wuq"]
        return [_inv_root(other[h * n : (h + 1) * n], damping, rel) for h in range(H)]
    if name == "wqr":
        return [_inv_root(W["wkr"], damping, rel)] * H
    return [_inv_root(torch.cat([W["wqr"][h * r : (h + 1) * r] for h in range(H)], dim=1), damping, rel)]


def _mla_model():
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, attention="mla",
                      q_rank=24, kv_rank=16, nope_dim=8, rope_dim=8, v_dim=8)
    return GPT(cfg, QKConfig()).eval()


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_exact_hooks_are_the_formula_with_an_exact_msign(kind):
    """The controller's pre / post around an exact (fp64 SVD) msign are tau C^{-1} msign(C^{-1} U), C the
    partner's Gram root by fp64 eigendecomposition: fp32 accuracy, every governed matrix and head."""
    model = _mla_model() if kind == "mla" else tiny_gpt(n_kv_heads=2 if kind == "gqa" else 0)
    _aniso(model)
    ctrl, _ = _exact_setup(model, tau=0.7, damping=0.01, rel=1e-3)
    ctrl.before_step(0)
    g = torch.Generator().manual_seed(4)
    hooks = iter(ctrl.hooks)
    for a, names in zip(model.attention_layers(), ctrl.names, strict=True):
        for name in names:
            hook, w = next(hooks), getattr(a, name).weight
            inv = _partner_inv_roots(a, name, 0.01, 1e-3)
            U = torch.randn(len(inv), w.shape[0] // len(inv), w.shape[1], generator=g, dtype=torch.float64)
            got = hook.post(torch.stack([_msign(x) for x in hook.pre(U.float()).double()]).float()).double()
            for h, ci in enumerate(inv):
                want = 0.7 * ci @ _msign(ci @ U[h])
                torch.testing.assert_close(got[h], want, rtol=0, atol=2e-5 * want.abs().max().item())


def _one_exact_step(model, **kw):
    """One step with the exact form: (controller, weights before it, gradients, a copy of the model before it)."""
    ctrl, opts = _exact_setup(model, **kw)
    snap = copy.deepcopy(model)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    ctrl.before_step(0)
    for o in opts:
        o.step()
    ctrl.after_step(0)
    return ctrl, before, grads, snap


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_exact_step_matches_the_formula(kind):
    """One optimizer step: W^h <- (1 - lr wd) W^h - lr_h tau C^{-1} NS_5(C^{-1} U^h), U^h Muon's Nesterov
    momentum of the head's gradient (first step: (1 - mu) G + mu (1 - mu) G), lr_h torch's rate on the head's
    shape, C from the weights before the step (fp64 eigendecomposition). NS_5 iterates in bf16, so the
    reference's Newton-Schulz of the same matrix rounds differently: 1-6% (Frobenius, per head) is bf16 noise,
    10% is allowed; the isotropic form, a missing post-whitening or the Gram over the inputs miss by > 30%."""
    model = _mla_model() if kind == "mla" else tiny_gpt(n_kv_heads=2 if kind == "gqa" else 0)
    _aniso(model)
    lr, wd, mu, tau = 0.02, 0.1, 0.95, 0.5
    ctrl, before, grads, snap = _one_exact_step(model, tau=tau, lr=lr, wd=wd)
    now = dict(model.named_parameters())
    for i, (a, names) in enumerate(zip(snap.attention_layers(), ctrl.names, strict=True)):
        for name in names:
            key = f"blocks.{i}.attn.{name}.weight"
            W, G, new = before[key], grads[key], now[key].detach().double()
            inv = _partner_inv_roots(a, name)
            r, C = W.shape[0] // len(inv), W.shape[1]
            lr_h = lr * 0.2 * math.sqrt(max(r, C))
            U = (1 - mu) * G + mu * (1 - mu) * G
            for h, ci in enumerate(inv):
                s = slice(h * r, (h + 1) * r)
                want = W[s] * (1 - lr * wd) - lr_h * tau * ci @ _ns(ci @ U[s])
                assert _rel(new[s] - W[s], want - W[s]) < 0.1, (key, h)
                iso = W[s] * (1 - lr * wd) - lr_h * tau * (ci.diagonal().mean()) * _ns(U[s])  # a scalar instead
                no_post = W[s] * (1 - lr * wd) - lr_h * tau * _ns(ci @ U[s]) * ci.diagonal().mean()
                inputs = _inv_root(W[s].T)  # (C, C): a Gram over the inputs, whitening from the other side
                wrong_side = W[s] * (1 - lr * wd) - lr_h * tau * _ns(U[s] @ inputs) @ inputs
                for bad in (iso, no_post, wrong_side):
                    assert _rel(bad - W[s], want - W[s]) > 0.3, (key, h)


def test_exact_equals_isotropic_for_isotropic_partners():
    """W_K^h = c_h * (orthonormal rows), c_h a power of two, rel_damping 0: C_K = c_h I exactly, so the exact
    form's step of W_Q equals the isotropic form's (decay=base) to fp32 rounding."""
    d = 16  # tiny_gpt: 4 heads of 16 rows, C = 64
    model = tiny_gpt()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for h, c in enumerate((0.25, 0.5, 1.0, 2.0)):
            q, _ = torch.linalg.qr(torch.randn(64, d, generator=g))  # (C, d) orthonormal columns
            for blk in model.blocks:
                blk.attn.wk.weight[h * d : (h + 1) * d] = c * q.T
    ref = copy.deepcopy(model)
    w0 = model.blocks[0].attn.wq.weight.detach().clone()
    cfg = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_per_head="qk")
    oa, ob = build_optimizer(model, cfg), build_optimizer(ref, cfg)
    ca = Compositional(model, oa, CompositionalOptions(form="exact", decay="base", rel_damping=0.0))
    cb = Compositional(ref, ob, CompositionalOptions(decay="base"))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    for ctrl, opts in ((ca, oa), (cb, ob)):
        ctrl.before_step(0)
        for o in opts:
            o.step()
        ctrl.after_step(0)
    for blk, rblk in zip(model.blocks, ref.blocks, strict=True):
        torch.testing.assert_close(blk.attn.wq.weight, rblk.attn.wq.weight, rtol=1e-6, atol=1e-7)
    assert (model.blocks[0].attn.wq.weight - w0).abs().max() > 1e-3  # it stepped


def test_exact_logs_its_rate_and_update_norms():
    """compositional_<m>: tau sqrt(tr(C^{-2}) / d) per head (the isotropic factor when C = c I);
    compositional_cond_<m>: cond(C); compositional_update_<m>: the norm of the change each head took."""
    model = tiny_gpt(n_kv_heads=2)
    _aniso(model)
    ctrl, before, _, snap = _one_exact_step(model, tau=0.5)
    m = ctrl.metrics()
    assert set(m) >= {"compositional_wq", "compositional_wk", "compositional_cond_wq", "compositional_update_wq",
                      "compositional_update_wk", "compositional_factor_min", "compositional_factor_max"}
    for i, a in enumerate(snap.attention_layers()):  # the whitening of the weights before the step
        for name, d in (("wq", 16), ("wk", 16)):
            inv = _partner_inv_roots(a, name)
            want = [0.5 * math.sqrt((ci @ ci).trace().item() / d) for ci in inv]
            torch.testing.assert_close(torch.tensor(m[f"compositional_{name}"][i]), torch.tensor(want),
                                       rtol=1e-4, atol=0)
            cond = [torch.linalg.cond(torch.linalg.inv(ci)).item() for ci in inv]
            torch.testing.assert_close(torch.tensor(m[f"compositional_cond_{name}"][i]), torch.tensor(cond),
                                       rtol=1e-3, atol=0)
            assert min(cond) > 2  # anisotropic partners: the whitening is not a scalar
    flat = [x for k in ("compositional_wq", "compositional_wk") for layer in m[k] for x in layer]
    assert m["compositional_factor_min"] == pytest.approx(min(flat)) and m["compositional_factor_max"] == pytest.approx(
        max(flat))
    for i, blk in enumerate(model.blocks):
        for name, heads in (("wq", 4), ("wk", 2)):
            new = getattr(blk.attn, name).weight.detach().double()
            old = before[f"blocks.{i}.attn.{name}.weight"]
            want = (new - old).view(heads, -1).norm(dim=1)
            torch.testing.assert_close(torch.tensor(m[f"compositional_update_{name}"][i], dtype=torch.float64),
                                       want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("optimizer, per_head", [("adamw", "none"), ("muon", "none")])
def test_exact_refuses_an_optimizer_without_per_head_muon(optimizer, per_head):
    from qklab.config import ConfigError

    model = tiny_gpt()
    opts = build_optimizer(model, TrainConfig(optimizer=optimizer, muon_per_head=per_head))
    with pytest.raises(ConfigError, match="muon_per_head=qk or qkv"):
        Compositional(model, opts, CompositionalOptions(form="exact", decay="base"))


def test_exact_refuses_a_step_without_before_step():
    model = tiny_gpt()
    ctrl, opts = _exact_setup(model)
    with pytest.raises(RuntimeError, match="before_step"):
        opts[0].step()
    assert ctrl.exact


def test_exact_options_are_checked_and_hash_only_when_set():
    from qklab.config import ConfigError, load_config
    from qklab.study.spec import _computing

    with pytest.raises(ConfigError, match="decay=base"):
        load_config("tiny", ["qk.controller=compositional", "qk.compositional.form=exact"])
    with pytest.raises(ConfigError, match="isotropic or exact"):
        load_config("tiny", ["qk.controller=compositional", "qk.compositional.form=full"])
    with pytest.raises(ConfigError, match="rel_damping"):
        load_config("tiny", ["qk.controller=compositional", "qk.compositional.rel_damping=-1.0"])
    old = load_config("tiny", ["qk.controller=compositional", "qk.compositional.tau=0.7"])
    assert set(_computing(old)["qk"]["options"]["compositional"]) == {"tau", "damping", "decay"}  # as before
    new = load_config("tiny", ["qk.controller=compositional", "qk.compositional.form=exact",
                               "qk.compositional.decay=base"])
    assert _computing(new)["qk"]["options"]["compositional"]["form"] == "exact"


def test_exact_host_reads_nothing_inside_a_step(tmp_path, reads):
    t = host_sync._trainer(tmp_path, "e", "qk.controller=compositional", "qk.compositional.form=exact",
                           "qk.compositional.decay=base", "train.optimizer=muon", "train.muon_per_head=qk",
                           "model.n_kv_heads=2")
    reads.on[0] = True
    for _ in range(3):
        t.train_step()
    reads.on[0] = False
    assert reads == [], f"host reads inside train_step: {reads}"
    m = t.controller.metrics()
    assert len(m["compositional_wq"]) == 2 and len(m["compositional_update_wk"][0]) == 2
    assert all(math.isfinite(x) for layer in m["compositional_wk"] for x in layer)
