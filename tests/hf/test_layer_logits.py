"""``LayerSpec.logits``: QK-clip on a model of one's own measures the logits the softmax sees (after RoPE and
the method: through the layer's ``qklab.QK``, or a hook on the module called with the final q and k) and
clips each head to tau; it refuses in one line where it cannot measure them (RoPE after the projections,
nothing named) and where a norm on q and k bounds them (the method's, or the model's own)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qklab
from qklab.errors import ConfigError
from qklab.hf import LayerSpec
from tests.examples import load_example

ex = load_example("nanogpt_qk")
T = 32


def _layer_inputs(model) -> list[torch.Tensor]:
    """Every attention layer's input in the next forward, kept by a pre-hook."""
    seen: list[torch.Tensor] = []
    for b in model.h:
        b.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    return seen


@torch.no_grad()
def _real_max(attn, x: torch.Tensor) -> torch.Tensor:
    """Per-head max causal logit of an example layer on its input x, written out: the model's RoPE, the
    method's map, scale and rewrite."""
    B, T_, _ = x.shape
    q, k, _ = attn.c_attn(x).split(attn.split, dim=-1)
    q, k = attn.qk(q.view(B, T_, attn.H, -1).transpose(1, 2), k.view(B, T_, attn.Hkv, -1).transpose(1, 2))
    k = k.repeat_interleave(attn.H // attn.Hkv, dim=1)
    s = attn.qk.logits((q @ k.transpose(-2, -1)) * attn.qk.scale)
    return s.masked_fill(torch.ones(T_, T_, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


@torch.no_grad()
def _projection_max(attn, x: torch.Tensor) -> torch.Tensor:
    """What measuring on the projections' outputs (before RoPE) would give."""
    B, T_, _ = x.shape
    q, k, _ = attn.c_attn(x).split(attn.split, dim=-1)
    q, k = q.view(B, T_, attn.H, -1).transpose(1, 2), k.view(B, T_, attn.Hkv, -1).transpose(1, 2)
    s = q @ k.repeat_interleave(attn.H // attn.Hkv, dim=1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(torch.ones(T_, T_, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


def _sharpen(model, lo=3.0, hi=9.0) -> None:
    """Heads with different logit scales (W_Q rows of head h times a factor), so some exceed tau."""
    with torch.no_grad():
        for b in model.h:
            n = b.attn.split[0]
            b.attn.c_attn.weight[:n].mul_(torch.linspace(lo, hi, n).view(-1, 1))


@pytest.mark.parametrize("method, opts", [("none", {}), ("qkmap", {"temperature": 12.0}), ("softcap", {"cap": 8.0}),
                                          ("quest", {"head_scale": True})])
def test_qkclip_measures_the_rotated_logits_and_clips_each_head_to_tau(method, opts):
    torch.manual_seed(0)
    model = ex.GPT(ex.GPTConfig(qk=method, qk_options=opts, n_kv_head=4, block_size=T))
    _sharpen(model)
    idx = torch.randint(0, 16, (3, T))
    xs = _layer_inputs(model)
    model(idx)
    s0 = [_real_max(b.attn, xs[i]) for i, b in enumerate(model.h)]
    tau = float(torch.cat(s0).median())
    assert min(float(s.min()) for s in s0) < tau < max(float(s.max()) for s in s0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the clip alone acts
    specs = model.layer_specs()
    handle = qklab.attach(model, opt, "qkclip", layers=specs, tau_clip=tau)
    model.train()
    xs.clear()
    model(idx)[0].sum().backward()
    opt.step()
    heads = torch.tensor(handle.metrics()["max_logit_per_head"])
    torch.testing.assert_close(heads, torch.stack(s0), rtol=1e-5, atol=1e-5)  # the real logits were measured
    if method == "none":  # and they are not the projections' (RoPE turns q and k after them)
        assert (heads - torch.stack([_projection_max(b.attn, xs[i]) for i, b in enumerate(model.h)])).abs().max() > 0.1
    s1 = [_real_max(b.attn, xs[i]) for i, b in enumerate(model.h)]
    for i in range(len(s0)):
        torch.testing.assert_close(s1[i], torch.minimum(s0[i], torch.tensor(tau)), rtol=1e-4, atol=1e-4)


def test_detected_without_naming_the_module():
    """LayerSpec without logits: the qklab.QK inside the layer's attention module is found."""
    torch.manual_seed(0)
    model = ex.GPT(ex.GPTConfig(block_size=T))
    specs = [LayerSpec(q=s.q, k=s.k, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads) for s in model.layer_specs()]
    handle = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "none", layers=specs, track=True)
    assert [layer.module for layer in handle.qk_layers] == [b.attn.qk for b in model.h]
    xs = _layer_inputs(model)
    model.train()
    model(torch.randint(0, 16, (2, T)))[0].sum().backward()
    handle.optimizer.step()
    want = torch.stack([_real_max(b.attn, xs[i]) for i, b in enumerate(model.h)])
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"]), want, rtol=1e-5, atol=1e-5)
    handle.remove()
    assert not any(hasattr(b.attn.qk, "qk_layer") for b in model.h)


class RopeAttnModel(nn.Module):
    """A model with its own RoPE and no qklab.QK: fused qkv, rotary module, optional q/k norms, and an SDPA
    wrapper module ``core`` called on the final q and k."""

    class Core(nn.Module):
        def forward(self, q, k, v, scale=None):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def __init__(self, C=32, H=4, norm=False):
        super().__init__()
        self.H, self.D = H, C // H
        self.emb = nn.Embedding(16, C)
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.rotary = ex.RotaryEmbedding(self.D, T, 10000.0, False)
        self.q_norm = nn.RMSNorm(self.D) if norm else None
        self.k_norm = nn.RMSNorm(self.D) if norm else None
        self.core = self.Core()
        self.out = nn.Linear(C, 16, bias=False)

    def qk(self, x):
        B, T_, C = x.shape
        q, k, v = (t.view(B, T_, self.H, self.D).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        pos = torch.arange(T_)
        return self.rotary(q, pos), self.rotary(k, pos), v

    def forward(self, idx):
        x = self.emb(idx)
        q, k, v = self.qk(x)
        y = self.core(q, k, v, scale=0.5 / math.sqrt(self.D))
        return self.out(y.transpose(1, 2).flatten(2))


def _spec(**kw) -> LayerSpec:
    return LayerSpec(q="qkv.weight[0:32]", k="qkv.weight[32:64]", n_heads=4, **kw)


def test_a_hook_on_the_module_called_with_the_final_q_and_k_measures_them():
    torch.manual_seed(0)
    model = RopeAttnModel()
    handle = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "none",
                          layers=[_spec(logits="core")], track=True)
    idx = torch.randint(0, 16, (2, T))
    model.train()
    model(idx).sum().backward()
    handle.optimizer.step()
    with torch.no_grad():
        q, k, _ = model.qk(model.emb(idx))
        s = (q @ k.transpose(-2, -1)) * 0.5 / math.sqrt(model.D)  # the scale the model passes to its core
        want = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"][0]), want, rtol=1e-5, atol=1e-5)


def test_qkclip_refuses_a_rope_model_whose_logits_it_cannot_see():
    model = RopeAttnModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cannot measure its logits: the model rotates q and k after the "
                                          "projections \\('rotary'\\)") as e:
        qklab.attach(model, opt, "qkclip", layers=[_spec()], tau_clip=10.0)
    assert "\n" not in str(e.value)
    assert not model.qkv._forward_hooks and qklab.hf.Attached.of(model) is None  # nothing left behind
    qklab.attach(model, opt, "quack", layers=[_spec()]).remove()  # no logits needed: accepted
    qklab.attach(model, opt, "qkclip", layers=[_spec(logits="projections")], tau_clip=10.0).remove()  # as stated


def test_qkclip_refuses_logits_a_norm_bounds():
    """A norm on q and k, the method's (qknorm) or the model's own, fixes the logits' scale: rescaling W_Q
    and W_K cannot clip them, so QK-clip refuses, as on a transformers family with QK-Norm."""
    opt_of = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    model = ex.GPT(ex.GPTConfig(qk="qknorm", block_size=T))
    with pytest.raises(ValueError, match="qk.controller=qkclip cannot bound qk.method=qknorm"):
        qklab.attach(model, opt_of(model), "qkclip", layers=model.layer_specs(), tau_clip=10.0)
    own = RopeAttnModel(norm=True)
    with pytest.raises(ValueError, match="cannot bound qk.method=qknorm"):
        qklab.attach(own, opt_of(own), "qkclip", layers=[_spec(logits="core")], tau_clip=10.0)
    # the user says the norm is elsewhere: accepted
    qklab.attach(own, opt_of(own), "qkclip", layers=[_spec(logits="core", qk_norm=False)], tau_clip=10.0).remove()
    with pytest.raises(ConfigError, match="no module 'cor' in RopeAttnModel"):
        qklab.attach(own, opt_of(own), "qkclip", layers=[_spec(logits="cor")], tau_clip=10.0)


def test_logging_later_is_refused_as_early_as_asked():
    """A controller that needs no logits attaches to a RoPE model with nothing named; measuring (logging,
    QKCallback's logged steps) is refused when asked, in one line, and check_measurable says so up front."""
    model = RopeAttnModel()
    handle = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "quack", layers=[_spec()])
    with pytest.raises(ConfigError, match="cannot measure its logits"):
        handle.check_measurable()
    with pytest.raises(ConfigError, match="cannot measure its logits"):
        handle.set_tracking(True)
    handle.remove()
