"""qklab.hf.apply with the attention gate (arXiv 2505.06708) and per-head sinks on tiny Llama-style models
(built from a config, no downloads): a patched layer equals qklab's own ``Attention`` with the same weights
(MHA and GQA, SDPA and eager paths, with QK methods); gate and sink against attention written out here in
fp64, values and gradients; cached generate() and left padding; Qwen3 keeps its own q/k norms; refusals."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.errors import ConfigError  # noqa: E402
from qklab.hf import apply, find_layers  # noqa: E402
from qklab.hf.apply import method_options  # noqa: E402
from qklab.model import Attention, Rope  # noqa: E402
from tests.hf.common import HKV, C, H, check_padded_generation, tiny_model  # noqa: E402
from tests.hf.test_apply import _causal, _rotary  # noqa: E402

D = C // H
SINKS = torch.tensor([-1.0, 0.0, 1.5, 3.0])  # away from the init (0): heads that give the sink little and much


def _patched(family="llama", method="none", gate="none", sink=False, n_kv=HKV, opts=None, seed=0):
    model = apply(tiny_model(family, seed=seed, num_key_value_heads=n_kv), method, attn_gate=gate, attn_sink=sink,
                  **(opts or {}))
    with torch.no_grad():
        for mod in (layer.self_attn for layer in model.model.layers):
            if getattr(mod, "attn_gate", None) is not None:
                mod.attn_gate.weight.normal_(0, 0.5)  # gates far from 1/2
            if getattr(mod, "attn_sink", None) is not None:
                mod.attn_sink.copy_(SINKS)
    return model


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("n_kv", [H, HKV], ids=["mha", "gqa"])
@pytest.mark.parametrize("method, gate, sink, opts", [
    ("none", "head", False, {}), ("none", "element", False, {}), ("none", "none", True, {}),
    ("none", "element", True, {}), ("qknorm", "head", True, {}), ("softcap", "element", True, {"cap": 2.0}),
], ids=str)
def test_layer_equals_qklab_attention(method, gate, sink, opts, n_kv, eager):
    model = _patched("llama", method, gate, sink, n_kv, opts)
    mod = model.model.layers[1].self_attn
    cfg = ModelConfig(d_model=C, n_heads=H, n_kv_heads=n_kv, max_seq_len=128, attn_impl="eager" if eager else "sdpa"
                      if method != "softcap" else "auto", attn_gate=gate, attn_sink=sink)
    ours = Attention(cfg, QKConfig(method=method, options={method: method_options(method, opts)}), 1).eval()
    with torch.no_grad():
        for a, b in ((ours.wq, mod.q_proj), (ours.wk, mod.k_proj), (ours.wv, mod.v_proj), (ours.wo, mod.o_proj)):
            a.weight.copy_(b.weight)
        if gate != "none":
            ours.wg.weight.copy_(mod.attn_gate.weight)
        if sink:
            ours.sink.copy_(mod.attn_sink)
        for p in mod.qk_method.parameters():
            p.uniform_(0.5, 1.5)
        ours.qk.load_state_dict(mod.qk_method.state_dict())
    B, T = 2, 18
    x = torch.randn(B, T, C)
    rope = Rope(128, model.config.rope_parameters["rope_theta"])
    with torch.no_grad():
        got, w = mod(x, _rotary(model, x, T), _causal(B, T), position_ids=torch.arange(T).expand(B, T),
                     output_attentions=eager)
        ref = ours(x, rope)
        plain = Attention(ModelConfig(d_model=C, n_heads=H, n_kv_heads=n_kv, max_seq_len=128),
                          QKConfig(method=method, options={method: method_options(method, opts)}), 1).eval()
        plain.load_state_dict({k: v for k, v in ours.state_dict().items() if k not in ("wg.weight", "sink")})
        assert (plain(x, rope) - ref).abs().max() > 1e-2  # the gate / the sink change this layer
    assert (w is not None) == (eager or method == "softcap")  # the path under test
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _written_out(mod, x, cos, sin, n_kv):
    """Per head, fp64: q, k from the projections, RoPE on (i, i + D/2) pairs, p_ij = exp(s_ij) / (exp(b_h) +
    sum_{j <= i} exp(s_ij)), o_h = p V_h times sigmoid(w_h . x) (head gate) or sigmoid(W_g,h x) (element
    gate), then W_O."""
    B, T, _ = x.shape
    q = (x @ mod.q_proj.weight.T).view(B, T, H, D)
    k = (x @ mod.k_proj.weight.T).view(B, T, n_kv, D)
    v = (x @ mod.v_proj.weight.T).view(B, T, n_kv, D)
    c, s = cos[:, :, None, : D // 2], sin[:, :, None, : D // 2]

    def rot(z):
        a, b = z[..., : D // 2], z[..., D // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    q, k = rot(q), rot(k)
    gate = getattr(mod, "attn_gate", None)
    sink = getattr(mod, "attn_sink", None)
    outs = []
    for h in range(H):
        g = h // (H // n_kv)
        logits = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, g]) / math.sqrt(D)
        e = torch.exp(logits).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
        den = e.sum(-1, keepdim=True) + (torch.exp(sink[h]) if sink is not None else 0.0)
        o = (e / den) @ v[:, :, g]  # (B, T, D)
        if gate is not None:
            wg = gate.weight
            o = o * torch.sigmoid(x @ (wg[h : h + 1] if wg.shape[0] == H else wg[h * D : (h + 1) * D]).T)
        outs.append(o)
    return torch.cat(outs, -1) @ mod.o_proj.weight.T


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("n_kv", [H, HKV], ids=["mha", "gqa"])
@pytest.mark.parametrize("gate, sink", [("head", False), ("element", False), ("none", True), ("head", True),
                                        ("element", True)])
def test_gate_and_sink_against_written_out_attention(gate, sink, n_kv, eager):
    """fp64, values and the gradients of the input, the gate, the sinks and every projection."""
    model = _patched("llama", "none", gate, sink, n_kv).double()
    mod = model.model.layers[0].self_attn
    B, T = 2, 11
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    cos, sin = _rotary(model, x, T)
    mask = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1).expand(B, 1, T, T)
    got, _ = mod(x, (cos, sin), mask, output_attentions=eager)
    ref = _written_out(mod, x, cos, sin, n_kv)
    tol = 1e-5 if eager else 1e-9  # the eager path takes its softmax in fp32, as qklab's own
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    params = [x, *mod.parameters()]
    wts = torch.randn_like(ref)
    for d1, d2 in zip(torch.autograd.grad((got * wts).sum(), params), torch.autograd.grad((ref * wts).sum(), params),
                      strict=True):
        torch.testing.assert_close(d1, d2, rtol=10 * tol, atol=10 * tol)
    names = {n for n, _ in mod.named_parameters()}
    assert ("attn_gate.weight" in names) == (gate != "none") and ("attn_sink" in names) == sink


def test_new_parameters_are_initialised_as_qklab_does():
    """W_g ~ N(0, initializer_range) (qklab: N(0, init_std)), no bias; sinks 0; shapes (H | H * D, C), (H,)."""
    model = apply(tiny_model("llama", initializer_range=0.05), "none", attn_gate="element", attn_sink=True)
    ws = torch.cat([layer.self_attn.attn_gate.weight.flatten() for layer in model.model.layers])
    assert model.model.layers[0].self_attn.attn_gate.weight.shape == (H * D, C)
    assert model.model.layers[0].self_attn.attn_gate.bias is None
    assert abs(ws.std().item() - 0.05) < 0.005 and abs(ws.mean().item()) < 0.005
    assert all(torch.equal(layer.self_attn.attn_sink, torch.zeros(H)) for layer in model.model.layers)
    head = apply(tiny_model("llama"), "qknorm", attn_gate="head")
    assert head.model.layers[1].self_attn.attn_gate.weight.shape == (H, C)
    assert getattr(head.model.layers[1].self_attn, "attn_sink", None) is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_and_left_padding(family):
    model = _patched(family, "none", "element", True)
    check_padded_generation(model)


def test_qwen3_keeps_its_own_qk_norms():
    """'none' with a gate leaves the family's q/k norms in place: with W_g = 0 (gates 1/2) and sinks at -40
    (exp(b) ~ 4e-18) every layer computes half of what Qwen3's own layer does."""
    model = tiny_model("qwen3")
    x = torch.randn(2, 13, C)
    cos, sin = _rotary(model, x, 13)
    with torch.no_grad():
        before = [layer.self_attn(x, (cos, sin), _causal(2, 13))[0] for layer in model.model.layers]
        apply(model, "none", attn_gate="head", attn_sink=True)
        for layer in model.model.layers:
            layer.self_attn.attn_gate.weight.zero_()
            layer.self_attn.attn_sink.fill_(-40.0)
        after = [layer.self_attn(x, (cos, sin), _causal(2, 13))[0] for layer in model.model.layers]
    assert model.model.layers[0].self_attn.q_norm is not None
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, 0.5 * b, atol=1e-6, rtol=1e-5)
    assert all(layer.qk.name == "qknorm" for layer in find_layers(model))  # QK-clip still sees the family's norms


def test_a_method_applied_later_keeps_the_gate_and_sink():
    model = _patched("llama", "none", "head", True)
    gate = model.model.layers[0].self_attn.attn_gate
    apply(model, "qknorm")
    mod = model.model.layers[0].self_attn
    assert mod.attn_gate is gate and torch.equal(mod.attn_sink, SINKS) and mod.qk_method.name == "qknorm"


def test_unsupported_combinations_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="use none, head or element"):
        apply(tiny_model("llama"), "none", attn_gate="vector")
    with pytest.raises(ConfigError, match="True or False"):
        apply(tiny_model("llama"), "none", attn_sink="yes")
    model = apply(tiny_model("llama"), "none", attn_gate="head")
    with pytest.raises(ConfigError, match="already has its attn_gate"):
        apply(model, "qknorm", attn_gate="element")
    assert model.model.layers[0].self_attn.qk_method.name == "none"  # refused before any layer changed
    cfg = transformers.DeepseekV3Config(vocab_size=97, hidden_size=C, num_attention_heads=H, num_key_value_heads=H,
                                        q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                        v_head_dim=12, num_hidden_layers=1, intermediate_size=64,
                                        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
    deepseek = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="'deepseek_v3' \\(MLA\\) is not supported"):
        apply(deepseek, "qknorm", attn_sink=True)
    sinky = _patched("llama", "none", "none", True)
    sinky.set_attn_implementation("sdpa")  # transformers' own SDPA would drop the sink
    with pytest.raises(ConfigError, match="only the 'qklab' attention"):
        sinky(torch.randint(3, 101, (1, 5)))
