"""Optimizer-side controllers (QuacK, QK-clip, fixed multiplier) against independent references."""

from __future__ import annotations

import copy

import pytest
import torch

from qklab.config import TrainConfig
from qklab.methods.qk_lr_multiplier import QKLRMultiplier, QKLRMultiplierOptions
from qklab.methods.qkclip import QKClip, QKClipOptions
from qklab.methods.quack import QuacK, QuacKOptions
from qklab.model.attention import causal_mask, head_max_logit
from qklab.train.evaluate import max_attention_logits
from qklab.train.optim import build_optimizer
from tests.conftest import tiny_gpt


def _grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _step(model, opts, ctrl, step=0):
    ctrl.before_step(step)
    for o in opts:
        o.step()
    ctrl.after_step(step)


def _perturb_norms(model):
    """Make partner norms differ from init per head, so factors are not all 1."""
    with torch.no_grad():
        for b in model.blocks:
            a = b.attn
            a.wk.weight.view(a.n_kv_heads, -1, 64).mul_(torch.linspace(0.5, 2.0, a.n_kv_heads).view(-1, 1, 1))
            a.wq.weight.view(a.n_heads, -1, 64).mul_(torch.linspace(2.0, 0.7, a.n_heads).view(-1, 1, 1))


@pytest.mark.parametrize("n_kv", [0, 2])
def test_quack_factor_is_one_at_init_and_matches_partner_norms(n_kv):
    model = tiny_gpt(n_kv_heads=n_kv)
    (opt,) = build_optimizer(model, TrainConfig(lr=1e-3))
    ctrl = QuacK(model, [opt], QuacKOptions(tau=1.0))
    for layer in ctrl.factors():
        assert set(layer) == {"wq", "wk"}
        assert all(torch.equal(f, torch.ones_like(f)) for f in layer.values())
    a = model.blocks[0].attn
    H, Hkv, d = a.n_heads, a.n_kv_heads, a.head_dim
    q0 = [a.wq.weight[h * d : (h + 1) * d].norm().item() for h in range(H)]
    k0 = [a.wk.weight[g * d : (g + 1) * d].norm().item() for g in range(Hkv)]
    _perturb_norms(model)
    q1 = [a.wq.weight[h * d : (h + 1) * d].norm().item() for h in range(H)]
    k1 = [a.wk.weight[g * d : (g + 1) * d].norm().item() for g in range(Hkv)]
    group = H // Hkv
    f = ControllerTau(ctrl, 0.5).factors()[0]
    fq, fk = f["wq"], f["wk"]
    want_q = [0.5 * k0[h // group] / k1[h // group] for h in range(H)]
    want_k = [0.5 * max(q0[g * group : (g + 1) * group]) / max(q1[g * group : (g + 1) * group]) for g in range(Hkv)]
    torch.testing.assert_close(fq, torch.tensor(want_q), rtol=1e-5, atol=0)
    torch.testing.assert_close(fk, torch.tensor(want_k), rtol=1e-5, atol=0)


def _perturbed_quack_step(model, opts, ctrl):
    """Move the partner norms, take one step: (layer-0 attention, its W_Q before, W_Q's gradient, the
    W_Q factors of that step)."""
    _perturb_norms(model)
    a = model.blocks[0].attn
    w0 = a.wq.weight.detach().clone()
    _grads(model)
    g = a.wq.weight.grad.clone()
    fq = ctrl.factors()[0]["wq"]
    _step(model, opts, ctrl)
    return a, w0, g, fq


def ControllerTau(ctrl, tau):  # noqa: N802 -- same controller, another tau
    ctrl.opts = QuacKOptions(tau=tau, norm=ctrl.opts.norm)
    return ctrl


def test_quack_spectral_norm_option():
    model = tiny_gpt()
    ctrl = QuacK(model, [], QuacKOptions(norm="spectral"))
    a = model.blocks[1].attn
    want = torch.linalg.svdvals(a.wk.weight[16:32].detach()).max()  # spectral norm of KV head 1
    torch.testing.assert_close(1.0 / ctrl.phi0[1]["wq"][1], want)


def test_quack_adamw_update_equals_single_head_adamw():
    """Each head's actual update equals AdamW run on that head alone at lr * factor."""
    model = tiny_gpt()
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    (opt,) = build_optimizer(model, cfg)
    ctrl = QuacK(model, [opt], QuacKOptions(tau=0.7))
    a, w0, g, fq = _perturbed_quack_step(model, [opt], ctrl)
    d = a.head_dim
    for h in range(a.n_heads):
        ref = torch.nn.Parameter(w0[h * d : (h + 1) * d].clone())
        ref.grad = g[h * d : (h + 1) * d].clone()
        torch.optim.AdamW([ref], lr=1e-2 * fq[h].item(), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1).step()
        torch.testing.assert_close(a.wq.weight[h * d : (h + 1) * d], ref, atol=1e-7, rtol=1e-5)
    assert not torch.allclose(fq, torch.ones_like(fq))  # the factors did differ


def test_quack_muon_update_equals_muon_at_head_rate():
    """Muon orthogonalises the packed W_Q as a whole; each head's slice of the update equals that of a
    Muon step on the packed matrix at the head's learning rate (docs/logit-control.md)."""
    model = tiny_gpt()
    cfg = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1)
    opts = build_optimizer(model, cfg)
    ctrl = QuacK(model, opts, QuacKOptions(tau=1.0))
    _perturb_norms(model)
    a = model.blocks[1].attn
    w0 = a.wk.weight.detach().clone()
    _grads(model, seed=3)
    g = a.wk.weight.grad.clone()
    fk = ctrl.factors()[1]["wk"]
    _step(model, opts, ctrl)
    d = a.head_dim
    for h in range(a.n_kv_heads):
        ref = torch.nn.Parameter(w0.clone())
        ref.grad = g.clone()
        torch.optim.Muon([ref], lr=0.02 * fk[h].item(), weight_decay=0.1, momentum=0.95,
                         adjust_lr_fn="match_rms_adamw").step()
        torch.testing.assert_close(a.wk.weight[h * d : (h + 1) * d], ref[h * d : (h + 1) * d], atol=1e-6, rtol=1e-5)


def test_multiplier_scales_qk_updates_only():
    model, ref = tiny_gpt(), tiny_gpt()
    ref.load_state_dict(model.state_dict())
    (o1,), (o2,) = build_optimizer(model, TrainConfig(lr=1e-2)), build_optimizer(ref, TrainConfig(lr=1e-2))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    _grads(model), _grads(ref)
    _step(model, [o1], QKLRMultiplier(model, [o1], QKLRMultiplierOptions(tau=0.25)))
    o2.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if n.endswith(("wq.weight", "wk.weight")):
            torch.testing.assert_close(p - w0[n], 0.25 * (q - w0[n]), atol=1e-7, rtol=1e-5)
        else:
            assert torch.equal(p, q), n


def test_chunked_max_logit_equals_direct():
    q, k = torch.randn(2, 4, 300, 8), torch.randn(2, 2, 300, 8)
    kk = k.repeat_interleave(2, dim=1)
    s = (q @ kk.transpose(-1, -2)) * 0.3
    want = s.masked_fill(~causal_mask(300, 300, q.device), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_logit(q, k, 0.3, chunk=64), want)
    # decode-style offsets: 5 queries against 300 keys
    want5 = s[:, :, -5:].masked_fill(~causal_mask(5, 300, q.device), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_logit(q[:, :, -5:], k, 0.3), want5)
    for chunk in (1, 7, 32, 300, 512):  # chunks that do not divide T, one row, one chunk, wider than T
        torch.testing.assert_close(head_max_logit(q, k, 0.3, chunk=chunk), want)
    # a logits rewrite (soft-capping) applied to the scaled logits before the max
    cap = lambda x: 2.0 * torch.tanh(x / 2.0)  # noqa: E731
    torch.testing.assert_close(head_max_logit(q, k, 0.3, cap, chunk=48), cap(want))


@pytest.mark.parametrize("n_kv", [0, 2])
def test_qkclip_bounds_clipped_heads_and_leaves_others(n_kv):
    model = tiny_gpt(n_kv_heads=n_kv)
    model.train()
    with torch.no_grad():  # blow up heads 0 and 2 of every layer
        for b in model.blocks:
            b.attn.wq.weight.view(4, -1, 64)[[0, 2]] *= 400.0
    x = torch.randint(0, 97, (2, 32))
    inputs = {}  # each layer's attention input, to recompute its logits on the same input after the clip

    def keep(i):
        def hook(module, args):
            inputs[i] = args[0].detach()
        return hook

    hooks = [b.attn.register_forward_pre_hook(keep(i)) for i, b in enumerate(model.blocks)]
    before = max_attention_logits(model, x)  # (L, H)
    for h in hooks:
        h.remove()
    tau = 10.0
    assert (before[:, [0, 2]] > tau).all() and (before[:, [1, 3]] < tau).all()
    (opt,) = build_optimizer(model, TrainConfig(lr=0.0, weight_decay=0.0))  # lr 0: only the clip acts
    ctrl = QKClip(model, [opt], QKClipOptions(tau_clip=tau))
    w_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(x, x)  # fast path, tracking the per-head max
    loss.backward()
    for b, want in zip(model.blocks, before, strict=True):
        torch.testing.assert_close(b.attn.max_logit, want, rtol=1e-5, atol=1e-5)
    _step(model, [opt], ctrl)
    after = torch.stack([_layer_max(b.attn, inputs[i], model.rope) for i, b in enumerate(model.blocks)])
    assert (after[:, [0, 2]] <= tau * (1 + 1e-4)).all()
    torch.testing.assert_close(after[:, [0, 2]], torch.full_like(after[:, [0, 2]], tau), rtol=1e-4, atol=0)
    for b in model.blocks:
        i = next(i for i, bb in enumerate(model.blocks) if bb is b)
        wq = b.attn.wq.weight.view(4, -1, 64)
        torch.testing.assert_close(wq[[1, 3]], w_before[f"blocks.{i}.attn.wq.weight"].view(4, -1, 64)[[1, 3]],
                                   rtol=0, atol=0)
        if n_kv == 0:  # MHA: unclipped heads' keys untouched too
            wk = b.attn.wk.weight.view(4, -1, 64)
            assert torch.equal(wk[[1, 3]], w_before[f"blocks.{i}.attn.wk.weight"].view(4, -1, 64)[[1, 3]])
    assert ctrl.metrics()["qkclip_heads_clipped"] == 4


@torch.no_grad()
def _layer_max(attn, x, rope):
    attn.capture = {}
    attn(x, rope)
    s, mask = attn.capture["logits"], attn.capture["mask"]
    attn.capture = None
    return s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))


def test_qkclip_guards_nonpositive_max():
    ctrl = QKClip(tiny_gpt(), [], QKClipOptions(tau_clip=5.0))
    g = ctrl.gains(torch.tensor([-3.0, 0.0, float("-inf"), 4.0, 20.0]))
    torch.testing.assert_close(g, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.25]))


# --- MLA ---------------------------------------------------------------------------------------------


def _mla(q_rank=24):
    from qklab.config import ModelConfig, QKConfig
    from qklab.model import GPT

    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, attention="mla",
                      q_rank=q_rank, kv_rank=16, nope_dim=8, rope_dim=8, v_dim=8)
    return GPT(cfg, QKConfig()).eval()


@pytest.mark.parametrize("q_rank", [24, 0])
def test_quack_mla_factors_match_formulas(q_rank):
    model = _mla(q_rank)
    at_init = copy.deepcopy(model.blocks[1].attn)
    ctrl = QuacK(model, [], QuacKOptions(tau=2.0))
    for layer in ctrl.factors():  # tau at init
        assert all(torch.allclose(f, torch.full_like(f, 2.0)) for f in layer.values())
    with torch.no_grad():  # grow every logit-path matrix differently
        for i, p in enumerate(model.parameters()):
            if p.ndim == 2:
                p.mul_(1.0 + 0.1 * (i % 5))
        a = model.blocks[1].attn
        a.wuk.weight.view(4, -1, 16).mul_(torch.tensor([1.0, 3.0, 0.5, 2.0]).view(-1, 1, 1))
    a = model.blocks[1].attn
    H = 4

    def heads(w):
        return [w.view(H, -1, w.shape[-1])[h].norm().item() for h in range(H)]

    def norms(m):
        uq, uk, qr = heads(m.wuq.weight), heads(m.wuk.weight), heads(m.wqr.weight)
        dq = m.wdq.weight.norm().item() if m.wdq is not None else 1.0
        return uq, uk, qr, dq, m.wdkv.weight.norm().item(), m.wkr.weight.norm().item()

    def phi(m):
        uq, uk, qr, dq, dkv, kr = norms(m)
        out = {"wuq": [1 / (dq * uk[h] * dkv) for h in range(H)], "wuk": [1 / (uq[h] * dq * dkv) for h in range(H)],
               "wqr": [1 / (dq * kr)] * H, "wdkv": [1 / max(uq[h] * dq * uk[h] for h in range(H))],
               "wkr": [1 / max(qr[h] * dq for h in range(H))]}
        if m.wdq is not None:
            out["wdq"] = [min(1 / max(uq[h] * uk[h] * dkv for h in range(H)), 1 / max(qr[h] * kr for h in range(H)))]
        return out

    init = {k: torch.tensor(v) for k, v in phi(at_init).items()}
    got = ctrl.factors()[1]
    assert set(got) == set(init)
    for k, v in phi(a).items():
        torch.testing.assert_close(got[k], 2.0 * torch.tensor(v) / init[k], rtol=1e-5, atol=0)


def test_qkclip_mla_scales_uq_uk_by_sqrt_and_qr_fully():
    model = _mla()
    a = model.blocks[0].attn
    before = {n: getattr(a, n).weight.detach().clone() for n in ("wuq", "wuk", "wqr", "wkr", "wdq", "wdkv")}
    g = torch.tensor([1.0, 0.25, 1.0, 0.64])
    QKClip.rescale(a, g)
    for name, f in (("wuq", g.sqrt()), ("wuk", g.sqrt()), ("wqr", g)):
        w = getattr(a, name).weight.view(4, -1, getattr(a, name).weight.shape[-1])
        torch.testing.assert_close(w, before[name].view_as(w) * f.view(-1, 1, 1))
    for name in ("wkr", "wdq", "wdkv"):
        assert torch.equal(getattr(a, name).weight, before[name])


def test_qkclip_mla_end_to_end_bounds_clipped_heads():
    model = _mla()
    model.train()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wuq.weight.view(4, -1, 24)[[1, 3]] *= 60.0
            b.attn.wuk.weight.view(4, -1, 16)[[1, 3]] *= 60.0
            b.attn.wqr.weight.view(4, -1, 24)[[1, 3]] *= 60.0
            b.attn.wkr.weight.mul_(30.0)
    x = torch.randint(0, 97, (2, 32))
    inputs = {}

    def keep(i):
        def hook(module, args):
            inputs[i] = args[0].detach()
        return hook

    hooks = [b.attn.register_forward_pre_hook(keep(i)) for i, b in enumerate(model.blocks)]
    (opt,) = build_optimizer(model, TrainConfig(lr=0.0, weight_decay=0.0))
    tau = 5.0
    ctrl = QKClip(model, [opt], QKClipOptions(tau_clip=tau))
    _, loss = model(x, x)
    loss.backward()
    for h in hooks:
        h.remove()
    before = torch.stack([b.attn.max_logit.clone() for b in model.blocks])
    assert (before[:, [1, 3]] > tau).all()
    _step(model, [opt], ctrl)
    after = torch.stack([_layer_max(b.attn, inputs[i], model.rope) for i, b in enumerate(model.blocks)])
    over = before > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-5, atol=1e-5)


def test_max_logit_tracker_ignores_eval_forwards():
    model = tiny_gpt()
    QKClip(model, [], QKClipOptions(tau_clip=1.0))
    x = torch.randint(0, 97, (2, 16))
    model.eval()
    with torch.no_grad():
        model(x)
    assert torch.isinf(model.blocks[0].attn.max_logit).all()  # nothing tracked in eval mode
    model.train()
    model(x)
    torch.testing.assert_close(model.blocks[0].attn.max_logit, max_attention_logits(model, x)[0])


# --- QK-clip: refusals, the exact GQA rule, the MLA split, methods that clip their own parameters ----


def _clip_once(model, blow, tau, opts):
    """Blow up some heads with ``blow(model)``, run one training forward (tracking), clip at lr 0 and
    recompute every layer's per-head max logit on the same attention inputs: (before, after), (L, H)."""
    model.train()
    with torch.no_grad():
        blow(model)
    x = torch.randint(0, 97, (2, 32))
    inputs = {}
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, b in enumerate(model.blocks)]
    (opt,) = build_optimizer(model, TrainConfig(lr=0.0, weight_decay=0.0))
    ctrl = QKClip(model, [opt], QKClipOptions(tau_clip=tau, **opts))
    _, loss = model(x, x)
    loss.backward()
    for h in hooks:
        h.remove()
    before = torch.stack([b.attn.max_logit.clone() for b in model.blocks])
    _step(model, [opt], ctrl)
    after = torch.stack([_layer_max(b.attn, inputs[i], model.rope) for i, b in enumerate(model.blocks)])
    return before, after


def _blow_q(heads, by):
    def blow(model):
        for b in model.blocks:
            b.attn.wq.weight.view(4, -1, 64)[heads] *= by
    return blow


def test_qkclip_gqa_exact_rule_shrinks_each_head_by_its_own_gain():
    """GQA, 2 query heads per key head; head 0 blown up, head 1 (same group) not: with gqa=exact every
    head's max logit becomes exactly min(S_h, tau); with gqa=min head 1 is over-clipped."""
    tau = 5.0
    before, after = _clip_once(tiny_gpt(n_kv_heads=2), _blow_q([0], 300.0), tau, {"gqa": "exact"})
    assert (before[:, 0] > tau).all() and (before[:, 1:] < tau).all()
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(tau)), rtol=1e-4, atol=1e-5)
    before_m, after_m = _clip_once(tiny_gpt(n_kv_heads=2), _blow_q([0], 300.0), tau, {"gqa": "min"})
    g = tau / before_m[:, 0]
    torch.testing.assert_close(after_m[:, 0], torch.full_like(g, tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(after_m[:, 1], before_m[:, 1] * g.sqrt(), rtol=1e-4, atol=1e-6)  # sqrt(g_h g_min)


def test_qkclip_exact_gqa_weight_factors():
    model = tiny_gpt(n_kv_heads=2)
    a = model.blocks[0].attn
    wq0, wk0 = a.wq.weight.detach().clone().view(4, -1, 64), a.wk.weight.detach().clone().view(2, -1, 64)
    g = torch.tensor([0.25, 1.0, 0.5, 0.8])
    QKClip.rescale(a, g, QKClipOptions(gqa="exact"))
    gmin = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(a.wk.weight.view(2, -1, 64), wk0 * gmin.sqrt().view(-1, 1, 1))
    torch.testing.assert_close(a.wq.weight.view(4, -1, 64), wq0 * (g / gmin.sqrt().repeat_interleave(2)).view(-1, 1, 1))


@pytest.mark.parametrize("alpha", [0.5, 0.3, 1.0])
def test_qkclip_mla_alpha_split_against_recomputed_logits(alpha):
    model = _mla()
    a = model.blocks[0].attn
    before = {n: getattr(a, n).weight.detach().clone() for n in ("wuq", "wuk", "wqr", "wkr")}
    g = torch.tensor([1.0, 0.25, 1.0, 0.64])
    QKClip.rescale(a, g, QKClipOptions(alpha=alpha))
    for name, f in (("wuq", g ** alpha), ("wuk", g ** (1 - alpha)), ("wqr", g)):
        w = getattr(a, name).weight.view(4, -1, getattr(a, name).weight.shape[-1])
        torch.testing.assert_close(w, before[name].view_as(w) * f.view(-1, 1, 1))
    assert torch.equal(a.wkr.weight, before["wkr"])

    def blow(m):
        for b in m.blocks:
            b.attn.wuq.weight.view(4, -1, 24)[[1, 3]] *= 60.0
            b.attn.wqr.weight.view(4, -1, 24)[[1, 3]] *= 60.0
    b4, after = _clip_once(_mla(), blow, 5.0, {"alpha": alpha})
    torch.testing.assert_close(after, torch.minimum(b4, torch.tensor(5.0)), rtol=1e-4, atol=1e-5)


def test_qkclip_refuses_qknorm_in_one_line():
    from qklab.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["qk.method=qknorm", "qk.controller=qkclip"])
    assert "qk.method=qknorm" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="qknorm"):
        QKClip(tiny_gpt("qknorm"), [], QKClipOptions())
    with pytest.raises(ConfigError, match="never act"):  # capped logits never reach tau_clip >= cap
        load_config("tiny", ["qk.method=softcap", "qk.softcap.cap=30", "qk.controller=qkclip"])
    assert load_config("tiny", ["qk.method=softcap", "qk.softcap.cap=30", "qk.controller=qkclip",
                                "qk.qkclip.tau_clip=20"]).qk.controller == "qkclip"


def test_qkclip_on_qkmap_clips_the_temperature_exactly():
    """QK-MAP's logits are T_h times a bounded kernel: the clip scales T_h by g_h, not the weights."""
    from qklab.config import ModelConfig, QKConfig
    from qklab.methods.qkmap import QKMapOptions
    from qklab.model import GPT

    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    model = GPT(cfg, QKConfig(method="qkmap", options={"qkmap": QKMapOptions(temperature=20.0)}))
    w0 = model.blocks[0].attn.wq.weight.detach().clone()

    def blow(m):
        for b in m.blocks:
            b.attn.qk.log_temp.data[[0, 2]] += 1.0  # heads 0, 2: bound 20 e
    before, after = _clip_once(model, blow, 12.0, {})
    assert (before[:, [0, 2]] > 12.0).all()
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(12.0)), rtol=1e-4, atol=1e-5)
    assert torch.equal(model.blocks[0].attn.wq.weight, w0)


def test_qkclip_on_softcap_clips_the_raw_logits_exactly():
    """cap * tanh(g r / cap) = tau with g = atanh(tau / cap) / atanh(S / cap): one clip lands on tau."""
    model = tiny_gpt("softcap")
    model.blocks[0].attn.qk.cap = model.blocks[1].attn.qk.cap = 20.0
    before, after = _clip_once(model, _blow_q([0, 2], 400.0), 10.0, {})
    assert (before[:, [0, 2]] > 10.0).all() and (before < 20.0).all()
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(10.0)), rtol=1e-4, atol=1e-5)


# --- QuacK options: clamp, decay at the base rate, RMSNorm gains in the norms -------------------------


def test_quack_clamp_keeps_factors_within_bounds():
    model = tiny_gpt(n_kv_heads=2)
    free, clamped = QuacK(model, [], QuacKOptions(tau=0.5)), QuacK(model, [], QuacKOptions(tau=0.5, clamp=1.5))
    _perturb_norms(model)  # partner norms change by 0.5x .. 2x
    for f, c in zip(free.factors(), clamped.factors(), strict=True):
        for k in f:
            torch.testing.assert_close(c[k], f[k].clamp(0.5 / 1.5, 0.5 * 1.5))
        assert any(not torch.equal(f[k], c[k]) for k in f)  # the clamp did bind somewhere


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_quack_decay_at_base_rate(optimizer):
    """decay=base: each head moves by -lr wd p_old - f lr u, i.e. the optimizer at rate lr f with weight
    decay wd / f (the decay term lr wd unchanged)."""
    model = tiny_gpt()
    lr, wd = (1e-2, 0.1) if optimizer == "adamw" else (0.02, 0.1)
    opts = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=lr, weight_decay=wd))
    ctrl = QuacK(model, opts, QuacKOptions(tau=0.7, decay="base"))
    a, w0, g, fq = _perturbed_quack_step(model, opts, ctrl)
    d = a.head_dim
    for h in range(a.n_heads):
        f = fq[h].item()
        if optimizer == "adamw":
            ref = torch.nn.Parameter(w0[h * d : (h + 1) * d].clone())
            ref.grad = g[h * d : (h + 1) * d].clone()
            torch.optim.AdamW([ref], lr=lr * f, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd / f).step()
            want = ref
        else:  # Muon orthogonalises the packed matrix: the head's slice of a packed step at lr f, wd / f
            ref = torch.nn.Parameter(w0.clone())
            ref.grad = g.clone()
            torch.optim.Muon([ref], lr=lr * f, weight_decay=wd / f, momentum=0.95,
                             adjust_lr_fn="match_rms_adamw").step()
            want = ref[h * d : (h + 1) * d]
        torch.testing.assert_close(a.wq.weight[h * d : (h + 1) * d], want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(fq, torch.full_like(fq, 0.7))


@pytest.mark.parametrize("mla", [False, True])
def test_quack_gains_fold_rmsnorm_gains_into_the_norms(mla):
    model = _mla() if mla else tiny_gpt(n_kv_heads=2)
    ctrl = QuacK(model, [], QuacKOptions(gains=True))
    b = model.blocks[1]
    g0 = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the gains move, the matrices do not
        b.attn_norm.weight.copy_(torch.rand(64, generator=g0) * 2 + 0.2)
        if mla:
            b.attn.kv_norm.weight.mul_(3.0)
            b.attn.q_norm.weight.copy_(torch.rand(24, generator=g0) + 0.5)
    f = ctrl.factors()[1]
    a = b.attn
    if not mla:
        gam = b.attn_norm.weight.detach()
        kn = [(a.wk.weight[j * 16 : (j + 1) * 16] * gam).norm().item() for j in range(2)]
        kn0 = [a.wk.weight[j * 16 : (j + 1) * 16].norm().item() for j in range(2)]  # gains were 1 at init
        want = torch.tensor([kn0[h // 2] / kn[h // 2] for h in range(4)])
        torch.testing.assert_close(f["wq"], want, rtol=1e-5, atol=0)
    else:  # W_uq^h partners: ||W_dq diag(g)|| ||W_uk^h diag(g_kv)|| ||W_dkv diag(g)||; W_uk scales 3x
        gam, gq = b.attn_norm.weight.detach(), a.q_norm.weight.detach()
        ratio_dq = a.wdq.weight.norm() / (a.wdq.weight * gam).norm()
        ratio_dkv = a.wdkv.weight.norm() / (a.wdkv.weight * gam).norm()
        torch.testing.assert_close(f["wuq"], torch.full((4,), (ratio_dq * ratio_dkv / 3.0).item()), rtol=1e-5, atol=0)
        uq = a.wuq.weight.view(4, 8, 24)
        want_uk = ratio_dq * ratio_dkv * uq.flatten(1).norm(dim=1) / (uq * gq).flatten(1).norm(dim=1)
        torch.testing.assert_close(f["wuk"], want_uk.detach(), rtol=1e-5, atol=0)
    plain = QuacK(model, [], QuacKOptions()).factors()[1]  # without gains: built now, so all 1
    assert all(torch.allclose(v, torch.ones_like(v)) for v in plain.values())


# --- what a controller logs: the per-head factors and update norms it applied -------------------------


def _rows_scaled(model, seed=7):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(torch.rand(p.shape[0], 1, generator=g) * 2 + 0.3)


@pytest.mark.parametrize("name, optimizer, mla", [("quack", "muon", False), ("quack", "adamw", True),
                                                  ("qk_lr_multiplier", "adamw", True),
                                                  ("compositional", "adamw", False), ("compositional", "muon", True)])
def test_logged_factors_and_update_norms_are_those_applied(name, optimizer, mla):
    """One step with the controller and one without on a copy: per head, the ratio of the two changes is
    the logged factor and the norm of the controlled change the logged update norm."""
    from qklab.methods import CONTROLLERS

    model = _mla() if mla else tiny_gpt(n_kv_heads=2)
    cfg = TrainConfig(optimizer=optimizer, lr=0.02 if optimizer == "muon" else 1e-2, weight_decay=0.1)
    opts = build_optimizer(model, cfg)
    ctrl = CONTROLLERS[name](model, opts, CONTROLLERS[name].Options())
    _rows_scaled(model)  # after QuacK's phi at init: its factors move away from tau
    ref = copy.deepcopy(model)
    ref_opts = build_optimizer(ref, cfg)
    _grads(model), _grads(ref)
    before = [{k: getattr(a, k).weight.detach().clone() for k in ("wq", "wk", "wuq", "wuk", "wqr", "wkr", "wdkv")
               if hasattr(a, k)} for a in model.attention_layers()]
    _step(model, opts, ctrl)
    for o in ref_opts:
        o.step()
    m = ctrl.metrics()
    seen = 0
    for i, (a, r) in enumerate(zip(model.attention_layers(), ref.attention_layers(), strict=True)):
        for k, old in before[i].items():
            if f"{name}_{k}" not in m:
                continue
            f, norms = torch.tensor(m[f"{name}_{k}"][i]), torch.tensor(m[f"{name}_update_{k}"][i])
            heads = len(f)
            d_ctrl = (getattr(a, k).weight.detach() - old).view(heads, -1)
            d_plain = (getattr(r, k).weight.detach() - old).view(heads, -1)
            applied = (d_ctrl * d_plain).sum(1) / d_plain.pow(2).sum(1)
            torch.testing.assert_close(applied, f, rtol=1e-4, atol=0, msg=lambda s, k=k: f"{name} {k}: {s}")
            torch.testing.assert_close(d_ctrl.norm(dim=1), norms, rtol=1e-4, atol=0)
            seen += 1
    assert seen >= 4
    if name != "qk_lr_multiplier":
        assert len({round(x, 5) for layer in m[f"{name}_wk" if not mla else f"{name}_wuk"] for x in layer}) > 1


def test_qkclip_logs_the_weight_factors_and_changes_it_applied():
    model = tiny_gpt(n_kv_heads=2)
    w0 = {}

    def blow(m):
        _blow_q([0, 3], 300.0)(m)
        w0.update({(i, k): getattr(b.attn, k).weight.detach().clone() for i, b in enumerate(m.blocks)
                   for k in ("wq", "wk")})

    tau = 5.0
    model.train()
    with torch.no_grad():
        blow(model)
    x = torch.randint(0, 97, (2, 32))
    (opt,) = build_optimizer(model, TrainConfig(lr=0.0, weight_decay=0.0))
    ctrl = QKClip(model, [opt], QKClipOptions(tau_clip=tau))
    _, loss = model(x, x)
    loss.backward()
    s_max = torch.stack([b.attn.max_logit.clone() for b in model.blocks])
    _step(model, [opt], ctrl)
    m = ctrl.metrics()
    want_g = torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))
    torch.testing.assert_close(torch.tensor(m["qkclip_g"]), want_g)
    for i, b in enumerate(model.blocks):
        for k, heads in (("wq", 4), ("wk", 2)):
            f = torch.tensor(m[f"qkclip_{k}"][i])
            old, new = w0[(i, k)].view(heads, -1), getattr(b.attn, k).weight.detach().view(heads, -1)
            torch.testing.assert_close(new, old * f.view(-1, 1))
            torch.testing.assert_close(torch.tensor(m[f"qkclip_update_{k}"][i]), (new - old).norm(dim=1),
                                       rtol=1e-4, atol=1e-6)
    assert (torch.tensor(m["qkclip_wq"]) < 1).any()
