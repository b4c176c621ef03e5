"""qklab.attach and QKCallback: Q/K weights found by name (Llama, Qwen3, DeepSeek-V3) or given explicitly
(a fused c_attn, GPT-2's transposed Conv1D), and the controllers' per-head effect against references
written out here (plain loops, norms and logits computed directly); one live handle per model and
optimizer, and remove() restoring the model exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import qklab  # noqa: E402
from qklab.errors import ConfigError, UserError  # noqa: E402
from qklab.hf import Attached  # noqa: E402
from qklab.hf.layers import LayerSpec, find_layers  # noqa: E402
from tests.hf.common import HKV, H, assert_same, snapshot, tiny_model  # noqa: E402


def _aliases(view: torch.Tensor, param: torch.Tensor) -> bool:
    """In-place changes of the view reach the parameter."""
    before = param.detach().clone()
    with torch.no_grad():
        view.mul_(2.0)
    changed = not torch.equal(param.detach(), before)
    with torch.no_grad():
        view.mul_(0.5)
    return changed and torch.equal(param.detach(), before)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_finds_llama_style_layers(family):
    model = tiny_model(family)
    layers = find_layers(model)
    assert len(layers) == 2
    a = model.model.layers[1].self_attn
    L = layers[1]
    assert (L.n_heads, L.n_kv_heads) == (H, HKV) and L.module is a and L.kind == "mha"
    assert L.wq.weight.shape == (H, 16, 64) and L.wk.weight.shape == (HKV, 16, 64)
    assert torch.equal(L.wq.weight[2], a.q_proj.weight[32:48])
    assert _aliases(L.wq.weight, a.q_proj.weight) and _aliases(L.wk.weight, a.k_proj.weight)


def _deepseek(q_lora=20):
    cfg = transformers.DeepseekV3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2, max_position_embeddings=64,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("q_lora", [20, None])
def test_finds_deepseek_mla_layers(q_lora):
    model = _deepseek(q_lora)
    a = model.model.layers[0].self_attn
    L = find_layers(model)[0]
    qb = (a.q_b_proj if q_lora else a.q_proj).weight.view(H, 24, -1)
    assert torch.equal(L.wuq.weight, qb[:, :16]) and torch.equal(L.wqr.weight, qb[:, 16:])
    kvb = a.kv_b_proj.weight.view(H, 28, 24)
    assert torch.equal(L.wuk.weight, kvb[:, :16])
    assert torch.equal(L.wdkv.weight, a.kv_a_proj_with_mqa.weight[:24])
    assert torch.equal(L.wkr.weight, a.kv_a_proj_with_mqa.weight[24:])
    assert (L.wdq is None) == (q_lora is None) and L.kind == "mla"
    assert _aliases(L.wqr.weight, qb) and _aliases(L.wuk.weight, a.kv_b_proj.weight)


class FusedGPT(nn.Module):
    """A nanoGPT-style model: one fused c_attn (3C, C) per block, learned positions, causal attention."""

    def __init__(self, C=32, n_heads=4, layers=2, vocab=50, T=16):
        super().__init__()
        self.H = n_heads
        self.wte, self.wpe = nn.Embedding(vocab, C), nn.Embedding(T, C)
        self.c_attn = nn.ModuleList(nn.Linear(C, 3 * C, bias=False) for _ in range(layers))
        self.c_proj = nn.ModuleList(nn.Linear(C, C, bias=False) for _ in range(layers))
        self.head = nn.Linear(C, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for qkv, proj in zip(self.c_attn, self.c_proj, strict=True):
            q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(B, T, -1))
        return self.head(x)


def _fused_inputs(model, idx):
    """The input of every FusedGPT layer, recomputed."""
    B, T = idx.shape
    xs = [model.wte(idx) + model.wpe(torch.arange(T))]
    for qkv, proj in zip(model.c_attn, model.c_proj, strict=True):
        q, k, v = (t.view(B, T, model.H, -1).transpose(1, 2) for t in qkv(xs[-1]).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        xs.append(xs[-1] + proj(y.transpose(1, 2).reshape(B, T, -1)))
    return xs[:-1]


def _fused_logit_max(model, x, layer):
    """Per-head max causal logit of one FusedGPT layer on its input x (B, T, C), written out."""
    B, T, _ = x.shape
    q, k, _ = (t.view(B, T, model.H, -1).transpose(1, 2) for t in model.c_attn[layer](x).chunk(3, dim=-1))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


def _fused_specs(C=32):
    return [LayerSpec(q=f"c_attn.{i}.weight[0:{C}]", k=f"c_attn.{i}.weight[{C}:{2 * C}]", n_heads=4)
            for i in range(2)]


def test_qkclip_on_fused_qkv_clips_each_head_to_tau():
    torch.manual_seed(0)
    model = FusedGPT()
    with torch.no_grad():
        for lin in model.c_attn:
            lin.weight[:64].mul_(torch.linspace(2, 8, 64).view(-1, 1))  # heads with different logit scales
    idx = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        xs = _fused_inputs(model, idx)
        s0 = [_fused_logit_max(model, xs[i], i) for i in range(2)]
    tau = float(torch.cat(s0).median())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the step changes nothing: the clip alone acts
    handle = qklab.attach(model, opt, "qkclip", layers=_fused_specs(), tau_clip=tau)
    model.train()
    model(idx).sum().backward()
    opt.step()  # hooks: before_step / after_step around it
    with torch.no_grad():  # each layer on the input it had in the training forward
        s1 = [_fused_logit_max(model, xs[i], i) for i in range(2)]
    for i in range(2):
        torch.testing.assert_close(s1[i], torch.minimum(s0[i], torch.tensor(tau)), rtol=1e-5, atol=1e-5)
        assert (s0[i] > tau).any() or i == 1
    assert handle.controller.metrics()["qkclip_heads_clipped"] == int(sum((s > tau).sum() for s in s0))
    # the per-head max logits the hooks saw are the same as the written-out ones
    heads = handle.metrics()["max_logit_per_head"]
    torch.testing.assert_close(torch.tensor(heads), torch.stack(s0), rtol=1e-5, atol=1e-5)


def test_qkclip_on_gpt2_transposed_conv1d():
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=4, bos_token_id=0,
                                  eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :32].mul_(torch.linspace(5, 40, 32))
        model.transformer.h[0].attn.c_attn.bias.normal_(0.0, 1.0)  # biases follow their head's scaling
    spec = LayerSpec(q="transformer.h.0.attn.c_attn.weight[0:32]", k="transformer.h.0.attn.c_attn.weight[32:64]",
                     n_heads=4, transposed=True)
    captured = {}
    model.transformer.h[0].attn.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    idx = torch.randint(0, 50, (2, 16))

    def head_max():
        x = captured.pop("x")
        q, k, _ = model.transformer.h[0].attn.c_attn(x).split(32, dim=-1)
        q, k = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k))
        s = q @ k.transpose(-2, -1) / math.sqrt(8)
        return s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))

    with torch.no_grad():
        model(idx)
        s0 = head_max()
    tau = float(s0.median())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    qklab.attach(model, opt, "qkclip", layers=[spec], tau_clip=tau)
    model.train()
    model(idx).logits.sum().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        model(idx)
        s1 = head_max()
    torch.testing.assert_close(s1, torch.minimum(s0, torch.tensor(tau)), rtol=1e-5, atol=1e-5)
    assert (s0 > tau).any() and (s0 < tau).any()


def test_quack_scales_each_heads_update_by_partner_norm_ratio():
    torch.manual_seed(1)
    model = FusedGPT()
    plain = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-2)
    qklab.attach(model, opt, "quack", layers=_fused_specs(), tau=0.5)
    C, d = 32, 8
    w0 = model.c_attn[0].weight.detach().clone()
    with torch.no_grad():  # partner norms move away from their init, head by head
        for m in (model, plain):
            m.c_attn[0].weight[C:2 * C].mul_(torch.linspace(0.5, 2.0, C).view(-1, 1))
    w1 = model.c_attn[0].weight.detach().clone()
    idx = torch.randint(0, 50, (3, 16))
    for m, o in ((model, opt), (plain, opt_plain)):
        m(idx).logsumexp(-1).mean().backward()
        o.step()
    delta, delta_plain = model.c_attn[0].weight - w1, plain.c_attn[0].weight - w1
    for h in range(4):
        k0, k1 = w0[C + h * d: C + (h + 1) * d].norm(), w1[C + h * d: C + (h + 1) * d].norm()
        q0, q1 = w0[h * d:(h + 1) * d].norm(), w1[h * d:(h + 1) * d].norm()
        rq, rk = slice(h * d, (h + 1) * d), slice(C + h * d, C + (h + 1) * d)
        torch.testing.assert_close(delta[rq], 0.5 * k0 / k1 * delta_plain[rq], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(delta[rk], 0.5 * q0 / q1 * delta_plain[rk], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(delta[2 * C:], delta_plain[2 * C:])  # V is left alone


def test_attach_refuses_bad_input():
    model = FusedGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="unknown QK controller 'quak'; choose one of"):
        qklab.attach(model, opt, "quak")
    with pytest.raises(ConfigError, match="'qknorm' is a forward-side method: qklab.hf.apply"):
        qklab.attach(model, opt, "qknorm")
    with pytest.raises(ValueError, match="no attention layers found"):
        qklab.attach(model, opt, "quack")
    with pytest.raises(ValueError, match="no parameter"):
        qklab.attach(model, opt, "quack", layers=[LayerSpec(q="c_attn.7.weight", k="c_attn.0.weight", n_heads=4)])


def test_qkclip_on_deepseek_mla_clips_each_head_to_tau():
    """MLA: q_nope, k_nope and q_rope are scaled inside the strided q_b_proj / kv_b_proj views; every head's
    max logit, recomputed with qklab's MLA on the same layer inputs, lands at min(S_h, tau)."""
    from qklab.hf.deepseek import mla_config, mla_from_deepseek
    from qklab.model import Rope
    from qklab.model.rope import Yarn

    model = _deepseek()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.view(H, 24, -1).mul_(torch.linspace(2, 12, H).view(-1, 1, 1))
    inputs = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw: inputs.append(kw["hidden_states"].detach()), with_kwargs=True)
    cfg = mla_config(model.config)

    def head_max(i, x):
        ours = mla_from_deepseek(model.model.layers[i].self_attn).eval()
        ours.capture = {}
        with torch.no_grad():
            ours(x, Rope(64, cfg.rope_theta, Yarn.from_config(cfg)))
        s, mask = ours.capture["logits"], ours.capture["mask"]
        return s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))

    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        model(idx)
    xs = inputs[:2]
    s0 = [head_max(i, xs[i]) for i in range(2)]
    tau = float(torch.cat(s0).median())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = qklab.attach(model, opt, "qkclip", tau_clip=tau)
    model.train()
    model(idx).logits.sum().backward()
    opt.step()
    for i in range(2):
        torch.testing.assert_close(head_max(i, xs[i]), torch.minimum(s0[i], torch.tensor(tau)), rtol=1e-4, atol=1e-4)
    assert 0 < handle.controller.metrics()["qkclip_heads_clipped"] < 2 * H


def _ids(n=3, T=16, seed=5):
    return torch.randint(3, 101, (n, T), generator=torch.Generator().manual_seed(seed))


def test_second_attach_is_refused_until_remove():
    """Two fixed multipliers at tau 0.1 would give 0.01x: the second attach is refused, on the model, on the
    optimizer and on an attention layer alike, and leaves nothing behind; after remove() one multiplier
    gives exactly tau x the plain SGD update (written out: -tau * lr * grad), the other weights the plain one."""
    lr, tau = 0.1, 0.1
    model = tiny_model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    first = qklab.attach(model, opt, "qk_lr_multiplier", tau=tau)
    with pytest.raises(ConfigError, match=r"^this model \(LlamaForCausalLM\) already has a live qklab handle, "
                                          r"<qklab handle: qk_lr_multiplier on LlamaForCausalLM, 2 layers, live>: "
                                          r"call its \.remove\(\) first"):
        qklab.attach(model, opt, "qk_lr_multiplier", tau=tau)
    with pytest.raises(ConfigError, match=r"^this optimizer \(SGD\) already has a live qklab handle"):
        qklab.attach(tiny_model("llama", seed=1), opt, "quack")
    with pytest.raises(ConfigError, match=r"^this attention module \(LlamaAttention\) already has a live"):
        qklab.attach(model.model, torch.optim.SGD(model.parameters(), lr=lr), "quack")  # the inner model's layers
    assert Attached.of(model) is first and Attached.of(opt) is first
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)  # the first's only
    first.remove()
    assert Attached.of(model) is None and Attached.of(opt) is None and "removed" in repr(first)
    again = qklab.attach(model, opt, "qk_lr_multiplier", tau=tau)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        f = tau if n.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
        torch.testing.assert_close(p.detach(), w0[n] - f * lr * grads[n], rtol=1e-6, atol=1e-7)
    # tau^2 would miss by (tau - tau^2) lr |grad|, far beyond the tolerance
    assert (tau - tau**2) * lr * grads["model.layers.0.self_attn.q_proj.weight"].abs().max() > 1e-5
    again.remove()


def _step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("controller,options", [("none", {"track": True}), ("quack", {"tau": 0.5}),
                                                ("qkclip", {"tau_clip": 1e6}), ("qk_lr_multiplier", {"tau": 0.1})])
def test_remove_restores_the_model_exactly(controller, options):
    """attach, train two steps at lr 0 (QK-clip's tau above every logit: no weight moves), remove: the model
    and optimizer are what they were (attention implementation, attributes, hooks) and the logits are the
    untouched model's bit for bit."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    untouched = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = snapshot(model, [opt])
    handle = qklab.attach(model, opt, controller, **options)
    tracks = controller == "qkclip" or options.get("track", False)
    assert model.config._attn_implementation == ("qklab" if tracks else "sdpa")
    model.train()
    for _ in range(2):
        _step(model, opt, _ids())
    assert ("max_logit" in handle.metrics()) == tracks
    handle.remove()
    handle.remove()  # a second call does nothing
    assert_same(snapshot(model, [opt]), before)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(_ids(seed=9)).logits, untouched(_ids(seed=9)).logits)


def test_remove_restores_hooked_layer_specs():
    """LayerSpec layers track through forward hooks on the projections: remove() takes them out."""
    torch.manual_seed(0)
    model = FusedGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = {n: len(m._forward_hooks) for n, m in model.named_modules()}
    handle = qklab.attach(model, opt, "qkclip", layers=_fused_specs(), tau_clip=1e6)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 4  # q and k on each c_attn
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    opt.step()
    assert "max_logit" in handle.metrics()
    handle.remove()
    assert {n: len(m._forward_hooks) for n, m in model.named_modules()} == before
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (0, 0)


def test_remove_takes_compositional_whitening_out_of_head_muon():
    from qklab.parallel.muon import HeadMuon

    model = tiny_model("llama")
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "k_proj.weight"))]
    opt = HeadMuon([{"params": qk, "head_rows": [16] * len(qk)}], lr=0.0)
    before = snapshot(model, [opt])
    handle = qklab.attach(model, opt, "compositional", form="exact", decay="base")
    assert len(opt._preconditioners) == len(qk)
    model.train()
    _step(model, opt, _ids())
    handle.remove()
    assert_same(snapshot(model, [opt]), before)


def test_refused_controller_leaves_the_model_as_it_was():
    """QK-clip on Qwen3's QK-Norm is refused inside the controller: nothing attach did stays."""
    model = tiny_model("qwen3")
    model.set_attn_implementation("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, [opt])
    with pytest.raises(UserError, match="(?i)qk-norm|qknorm"):  # the user's to fix: one line, exit 2
        qklab.attach(model, opt, "qkclip", tau_clip=1.0)
    assert_same(snapshot(model, [opt]), before)
    qklab.attach(model, opt, "quack").remove()  # not left live


def _gemma2():
    import transformers

    cfg = transformers.Gemma2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                    attn_logit_softcapping=1.0, final_logit_softcapping=None, pad_token_id=0,
                                    eos_token_id=1, bos_token_id=2, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _gpt_oss():
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=101, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, pad_token_id=0, eos_token_id=1,
                                    bos_token_id=2, layer_types=["sliding_attention", "full_attention"],
                                    attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2-softcap", "gpt_oss-sinks"])
def test_measuring_keeps_a_familys_own_logit_cap_and_sinks(build):
    """Layers found by name in other families run on qklab's attention function while it measures: Gemma 2's
    logit cap and gpt-oss's sinks are computed there as the family's own eager attention computes them."""
    torch.manual_seed(0)
    model = build().train()  # dropout 0: training forwards are deterministic
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "q_proj"):  # logits large enough for the cap to bite
                m.q_proj.weight.mul_(30.0)
            if hasattr(m, "sinks"):
                m.sinks.uniform_(-1.0, 3.0)
    x = _ids(2, 10)
    with torch.no_grad():
        own = model(x).logits  # transformers' eager attention of the family
    handle = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "quack", track=True)
    with torch.no_grad():
        measured = model(x).logits  # qklab's attention function, measuring
    handle.remove()
    torch.testing.assert_close(measured, own, atol=1e-5, rtol=1e-5)


def _deepseek_with(method: str, **opts):
    from qklab.hf import apply

    model = _deepseek()
    with torch.no_grad():  # logits of a few units: above the thresholds below
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(24.0)
            layer.self_attn.kv_b_proj.weight.mul_(3.0)
    return apply(model, method, **opts).train()


def test_deepseek_layers_keep_the_method_apply_gave_them():
    """On DeepSeek (MLA) layers that apply converted, the controllers see the layer's method, as on Llama-style
    layers: QK-clip refuses QK-Norm, inverts softcap's cap (raw logit cap * atanh(s / cap)), and
    QK-Guard's trigger gets every step's per-head max logits."""
    idx = _ids(2, 16)
    model = _deepseek_with("qknorm")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(UserError, match="cannot bound qk.method=qknorm"):
        qklab.attach(model, opt, "qkclip", tau_clip=1.0)

    cap, tau = 4.0, 1.0
    model = _deepseek_with("softcap", cap=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = qklab.attach(model, opt, "qkclip", tau_clip=tau)
    model(idx).logits.sum().backward()
    opt.step()
    m = handle.controller.metrics()
    smax = torch.tensor(m["qkclip_smax"])  # the capped logits' max, the layers' per head
    g = torch.tensor(m["qkclip_g"])  # (layers, H)
    assert smax > tau
    raw = cap * torch.atanh(smax / cap)
    assert torch.isclose(g.min(), cap * math.atanh(tau / cap) / raw, rtol=1e-5)

    model = _deepseek_with("qkguard", threshold=1.45)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = qklab.attach(model, opt, "none", track=True)
    model(idx).logits.sum().backward()
    opt.step()
    seen = torch.tensor(handle.metrics()["max_logit_per_head"])  # (layers, H)
    on = torch.stack([layer.self_attn.qk_method.on for layer in model.model.layers])  # (layers, H): MLA, Hkv = H
    assert on.any() and not on.all()
    assert torch.equal(on, seen > 1.45)


@pytest.mark.parametrize("method, opts", [("softcap", {"cap": 50.0}), ("ssmax", {})])
def test_qkclip_is_refused_where_a_familys_norm_stays_in_front_of_the_method(method, opts):
    """Qwen3 with softcap or SSMax keeps its own q/k norms in front of the method: its logits do not depend on
    the scale of W_Q/W_K, so QK-clip would shrink them every step for nothing; refused, model untouched."""
    from qklab.hf import apply

    model = apply(tiny_model("qwen3"), method, **opts).train()
    x = _ids(2, 12)
    with torch.no_grad():
        before = model(x).logits
        for layer in model.model.layers:  # what a clip would do: the logits stay where they were
            layer.self_attn.q_proj.weight.mul_(0.5)
            layer.self_attn.k_proj.weight.mul_(0.5)
        torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = snapshot(model, [opt])
    with pytest.raises(UserError, match=f"layer0: the model's own q_norm comes before {method}; qk.controller=qkclip "
                                        "cannot bound"):
        qklab.attach(model, opt, "qkclip", tau_clip=1.0)
    assert_same(snapshot(model, [opt]), snap)
    qklab.attach(model, opt, "quack").remove()  # the others attach


def test_qkclip_is_refused_where_a_models_norm_stays_in_front_of_its_qklab_qk():
    """The same for a model of one's own: a q/k norm outside its qklab.QK (softcap) fixes q and k first."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk = nn.Linear(16, 16), nn.Linear(16, 16)
            self.q_norm, self.k_norm = nn.RMSNorm(4), nn.RMSNorm(4)
            self.qk = qklab.QK("softcap", n_heads=4, head_dim=4, cap=30.0)

    model = nn.Sequential(Attn())
    spec = LayerSpec(q="0.wq.weight", k="0.wk.weight", n_heads=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match="the model's own 0.q_norm comes before softcap"):
        qklab.attach(model, opt, "qkclip", layers=[spec], tau_clip=1.0)
    qklab.attach(model, opt, "quack", layers=[spec]).remove()


def test_a_hooked_sdpa_wrapper_measures_under_its_attn_mask():
    """LayerSpec(logits=<a module called as f(q, k, v, attn_mask=...)>): the measured max logits are over the
    keys the mask leaves each query (two documents packed in one row), not over every causal pair."""

    class Sdpa(nn.Module):
        def forward(self, q, k, v, attn_mask=None):
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
            self.sdpa = Sdpa()

        def forward(self, x, mask):  # x (B, T, 16)
            q, k, v = (w(x).unflatten(-1, (4, 4)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            return self.sdpa(q, k, v, attn_mask=mask)

    torch.manual_seed(0)
    attn = Attn()
    with torch.no_grad():
        attn.wq.weight.mul_(8.0)
    model = nn.Sequential(attn)
    spec = LayerSpec(q="0.wq.weight", k="0.wk.weight", n_heads=4, logits="0.sdpa")
    handle = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "none", layers=[spec], track=True)
    T, cut = 12, 5
    doc = (torch.arange(T) >= cut).long()  # (T,) document ids
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal & (doc[:, None] == doc[None, :])  # (T, T): each query over its own document's earlier keys
    x = torch.randn(3, T, 16)
    model.train()
    with torch.no_grad():
        attn(x, mask)
    handle.after_step()
    with torch.no_grad():
        q, k = attn.wq(x).unflatten(-1, (4, 4)).transpose(1, 2), attn.wk(x).unflatten(-1, (4, 4)).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / 2.0  # (B, H, T, T), scale 1/sqrt(4)
        want = s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
        every = s.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    assert (every - want).max() > 0.1  # across the documents lie larger logits
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"][0]), want, rtol=1e-5, atol=1e-5)
    handle.remove()
