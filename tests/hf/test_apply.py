"""qklab.hf.apply on tiny transformers models: "none" changes nothing; qknorm equals a hand-written
QK-Norm and Qwen3's own code; qkmap equals qklab's attention; left padding and cached generate() are
unchanged in behaviour for every method."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.errors import ConfigError  # noqa: E402
from qklab.hf import apply  # noqa: E402
from qklab.methods import METHODS as REGISTRY  # noqa: E402
from qklab.methods.qkmap import QKMapOptions  # noqa: E402
from qklab.model import Attention, Rope  # noqa: E402
from tests.hf.common import HKV, C, H, check_padded_generation, left_pad, tiny_model  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
METHODS = [("qknorm", {}), ("qkmap", {}), ("softcap", {"cap": 2.0})]
D = C // H


def _rotary(model, x, T):
    pos = torch.arange(T).unsqueeze(0).expand(x.shape[0], T)
    return model.model.rotary_emb(x, pos)


def _causal(B, T):
    return torch.full((T, T), torch.finfo(torch.float32).min).triu(1).expand(B, 1, T, T)


@pytest.mark.parametrize("family", FAMILIES)
def test_none_leaves_logits_identical(family):
    model = tiny_model(family)
    x = torch.randint(3, 101, (2, 16))
    with torch.no_grad():
        before = model(x).logits
        impl = model.config._attn_implementation
        assert apply(model, "none") is model
        after = model(x).logits
    assert torch.equal(before, after) and model.config._attn_implementation == impl


def _reference_layer(mod, x, cos, sin, qgain=None, kgain=None, eps=1e-6, cap=None):
    """Attention written out per head: projections, optional QK-Norm, RoPE on (i, i + D/2) pairs,
    optional soft-cap, causal softmax, output projection."""
    B, T, _ = x.shape
    q = torch.nn.functional.linear(x, mod.q_proj.weight, mod.q_proj.bias).view(B, T, H, D)
    k = torch.nn.functional.linear(x, mod.k_proj.weight, mod.k_proj.bias).view(B, T, HKV, D)
    v = torch.nn.functional.linear(x, mod.v_proj.weight, mod.v_proj.bias).view(B, T, HKV, D)
    if qgain is not None:
        q = qgain * q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        k = kgain * k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    c, s = cos[:, :, None, : D // 2], sin[:, :, None, : D // 2]  # (B, T, 1, D/2)

    def rot(z):
        a, b = z[..., : D // 2], z[..., D // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    q, k = rot(q), rot(k)
    out = torch.zeros(B, T, H, D)
    for h in range(H):
        g = h // (H // HKV)
        logits = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, g]) / math.sqrt(D)
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = torch.softmax(logits, -1) @ v[:, :, g]
    return mod.o_proj(out.reshape(B, T, H * D))


@pytest.mark.parametrize("method, opts", [("qknorm", {}), ("softcap", {"cap": 2.0})])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_layer_equals_hand_written_reference(family, method, opts):
    model = apply(tiny_model(family), method, **opts)
    mod = model.model.layers[1].self_attn
    if method == "qknorm":
        with torch.no_grad():  # non-trivial gains
            mod.qk_method.q_norm.weight.uniform_(0.5, 1.5)
            mod.qk_method.k_norm.weight.uniform_(0.5, 1.5)
    B, T = 2, 14
    x = torch.randn(B, T, C)
    cos, sin = _rotary(model, x, T)
    with torch.no_grad():
        got, _ = mod(x, (cos, sin), _causal(B, T))
        if method == "qknorm":
            ref = _reference_layer(mod, x, cos, sin, mod.qk_method.q_norm.weight, mod.qk_method.k_norm.weight)
            plain = _reference_layer(mod, x, cos, sin)
            assert (got - plain).abs().max() > 1e-2  # QK-Norm changes this layer
        else:
            ref = _reference_layer(mod, x, cos, sin, cap=opts["cap"])
            assert (ref - _reference_layer(mod, x, cos, sin)).abs().max() > 1e-3  # the cap is active
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_llama_with_qknorm_equals_qwen3():
    """Qwen3 is Llama plus QK-Norm: a Llama with qknorm applied and Qwen3 with the same weights agree."""
    llama = apply(tiny_model("llama"), "qknorm")
    qwen = tiny_model("qwen3", seed=1)
    sd = {k.replace("qk_method.", ""): v for k, v in llama.state_dict().items()}
    with torch.no_grad():
        for k in sd:
            if k.endswith(("q_norm.weight", "k_norm.weight")):
                sd[k].uniform_(0.5, 1.5)
    missing, unexpected = qwen.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    x = torch.randint(3, 101, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(llama(x).logits, qwen(x).logits, atol=1e-5, rtol=1e-5)


def test_qwen3_qknorm_takes_over_its_own_norms():
    model = tiny_model("qwen3")
    x = torch.randint(3, 101, (2, 20))
    with torch.no_grad():
        before = model(x).logits
        apply(model, "qknorm")
        after = model(x).logits
    assert model.model.layers[0].self_attn.q_norm is None
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", [{}, {"n_freqs": 2, "sharing": "coord"}, {"variant": "polar", "proj_dim": 8,
                                                                          "n_freqs": 1}])
def test_qkmap_equals_qklab_attention(opts):
    model = apply(tiny_model("llama"), "qkmap", **opts)
    mod = model.model.layers[0].self_attn
    ours = Attention(ModelConfig(d_model=C, n_heads=H, n_kv_heads=HKV, max_seq_len=128, attn_impl="eager"),
                     QKConfig(method="qkmap", options={"qkmap": QKMapOptions(**opts)}), layer_idx=0).eval()
    with torch.no_grad():
        for a, b in ((ours.wq, mod.q_proj), (ours.wk, mod.k_proj), (ours.wv, mod.v_proj), (ours.wo, mod.o_proj)):
            a.weight.copy_(b.weight)
        for p in mod.qk_method.parameters():  # non-trivial frequencies and temperatures
            p.add_(torch.randn_like(p) * 0.3)
        ours.qk.load_state_dict(mod.qk_method.state_dict())
    B, T = 2, 18
    x = torch.randn(B, T, C)
    with torch.no_grad():
        got, _ = mod(x, _rotary(model, x, T), _causal(B, T))
        ref = ours(x, Rope(128, model.config.rope_parameters["rope_theta"]))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    ours.capture = {}
    with torch.no_grad():
        ours(x, Rope(128, model.config.rope_parameters["rope_theta"]))
    assert ours.capture["probs"][:, :, -1].max() > 3.0 / T  # attention is far from uniform: the map matters



@pytest.mark.parametrize("method, opts", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_matches_unpadded(family, method, opts):
    model = apply(tiny_model(family), method, **opts)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 101, (n,), generator=g) for n in (12, 7, 3)]
    ids, mask = left_pad(seqs)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=pos).logits
        for i, s in enumerate(seqs):
            alone = model(s.unsqueeze(0)).logits[0]
            torch.testing.assert_close(padded[i, ids.shape[1] - len(s):], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, opts", [("none", {}), *METHODS])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_equals_greedy_full_forwards(family, method, opts):
    model = apply(tiny_model(family), method, **opts)
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(7)
    ids, mask = left_pad([torch.randint(3, 101, (n,), generator=g) for n in (9, 5)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        seq, m = ids.clone(), mask.clone()
        for _ in range(10):  # no cache: the whole sequence every step
            logits = model(seq, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0), use_cache=False).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out, seq)
    assert len(set(out[:, ids.shape[1]:].flatten().tolist())) > 2  # not a degenerate constant output


def test_apply_refuses_bad_input():
    """Every refusal is the CLI's one-line ConfigError; a controller's name says which call takes it."""
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="unknown QK method 'qknrom'; choose one of alibi, none, qkguard,") as e:
        apply(model, "qknrom")
    assert "controller" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        apply(model, "quack")  # an optimizer-side controller (was a bare KeyError)
    assert str(e.value) == (f"unknown QK method 'quack'; choose one of {', '.join(sorted(REGISTRY))}; 'quack' is an "
                            "optimizer-side controller: qklab.attach(model, optimizer, 'quack')")
    with pytest.raises(ConfigError, match="has no option"):
        apply(model, "softcap", capp=3)
    with pytest.raises(ConfigError, match="head_dim"):
        apply(copy.deepcopy(model), "qkmap", proj_dim=3)
    # the option's own check, one line
    with pytest.raises(ConfigError, match="qk.qkmap.n_freqs=0 is out of range: it must be >= 1"):
        apply(copy.deepcopy(model), "qkmap", n_freqs=0)


# --- DeepSeek (MLA) ---------------------------------------------------------------------------------
def _deepseek(version="v3", q_lora=20, interleave=True, seed=0):
    Cfg = transformers.DeepseekV2Config if version == "v2" else transformers.DeepseekV3Config
    kw = dict(first_k_dense_replace=2) if version == "v3" else dict(first_k_dense_replace=2, n_group=1, topk_group=1)
    if version == "v3":
        kw["rope_interleave"] = interleave
    cfg = Cfg(vocab_size=101, hidden_size=C, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora, kv_lora_rank=24, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128, n_routed_experts=4,
              num_experts_per_tok=2, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("method, opts", [("qknorm", {}), ("softcap", {"cap": 2.0}), ("alibi", {"slope_scale": 4.0})])
@pytest.mark.parametrize("version, q_lora, interleave", [("v3", 20, True), ("v3", None, False), ("v2", 20, True)])
def test_deepseek_layer_equals_qklab_mla(version, q_lora, interleave, method, opts):
    from qklab.hf.deepseek import load_deepseek_attention, mla_config
    from qklab.methods import METHODS
    from qklab.model import MLAttention

    model = apply(_deepseek(version, q_lora, interleave), method, **opts)
    mod = model.model.layers[1].self_attn
    with torch.no_grad():
        for p in mod.qk_method.parameters():  # non-trivial QK-Norm gains
            p.uniform_(0.5, 1.5)
    options = {method: METHODS[method].Options(**opts)}
    ours = MLAttention(mla_config(model.config, attn_impl="eager"), QKConfig(method=method, options=options), 1)
    load_deepseek_attention(ours.eval(), mod)  # QK-Norm gains included (rope part permuted)
    B, T = 2, 20
    x = torch.randn(B, T, C)
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    pe = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        got = mod(x, position_embeddings=pe, attention_mask=_causal(B, T))[0]
        ref = ours(x, Rope(128, 10000.0))
        plain = MLAttention(mla_config(model.config), QKConfig(), 1).eval()
        load_deepseek_attention(plain, mod)
        assert (plain(x, Rope(128, 10000.0)) - ref).abs().max() > 1e-3  # the method changes this layer
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_deepseek_alibi_slopes_survive_yarn_scaling():
    """DeepSeek under YaRN multiplies its softmax scale by mscale^2 (here 1.28); ALiBi's bias rides in q and k
    through that scale, so the method divides its features by it: with the query projections zeroed, a layer's
    attention is softmax(-m_h (i - j)) exactly, with YaRN as without (the same ALiBi slopes)."""
    from qklab.methods.alibi import alibi_slopes

    for rope in ({"rope_type": "default", "rope_theta": 10000.0},
                 {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                  "mscale": 1.0, "mscale_all_dim": 1.0}):
        cfg = transformers.DeepseekV3Config(
            vocab_size=101, hidden_size=C, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, rope_parameters=rope)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        model = apply(transformers.AutoModelForCausalLM.from_config(cfg).eval(), "alibi")
        mod = model.model.layers[0].self_attn
        gain = mod.scaling * 24 ** 0.5
        assert (gain > 1.2) == (rope["rope_type"] == "yarn")
        with torch.no_grad():
            mod.q_proj.weight.zero_()
            B, T = 1, 12
            x = torch.randn(B, T, C)
            pe = model.model.rotary_emb(x, torch.arange(T).unsqueeze(0))
            _, w = mod(x, position_embeddings=pe, attention_mask=_causal(B, T), output_attentions=True)
        gap = torch.arange(T - 1, -1, -1, dtype=torch.float64)
        ref = torch.softmax(-torch.tensor(alibi_slopes(H), dtype=torch.float64)[:, None] * gap, -1)  # (H, T)
        torch.testing.assert_close(w[0, :, -1].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, opts", [("none", {}), ("qknorm", {}), ("softcap", {"cap": 2.0}),
                                          ("alibi", {"slope_scale": 4.0})])
def test_deepseek_generate_and_padding(method, opts):
    model = apply(_deepseek(), method, **opts)
    check_padded_generation(model)


def test_deepseek_refuses_qkmap():
    with pytest.raises(ValueError, match="projection widths"):
        apply(_deepseek(), "qkmap")


def test_attention_function_without_a_mask_is_causal():
    """Called with no mask (a custom caller), qklab's attention function is still causal."""
    from qklab.hf.attention import qklab_attention

    model = apply(tiny_model("llama"), "softcap", cap=2.0)
    mod = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, H, 6, D), torch.randn(1, HKV, 6, D), torch.randn(1, HKV, 6, D)
    got, _ = qklab_attention(mod, q, k, v, None, scaling=0.25)  # eager (soft-capped)
    ref, _ = qklab_attention(mod, q, k, v, _causal(1, 6), scaling=0.25)
    torch.testing.assert_close(got, ref)
    mod.qk_method = None  # the fused path
    got, _ = qklab_attention(mod, q, k, v, None, scaling=0.25)
    ref, _ = qklab_attention(mod, q, k, v, _causal(1, 6), scaling=0.25)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    full, _ = qklab_attention(mod, q, k, v, torch.zeros(1, 1, 6, 6), scaling=0.25)
    assert (full - ref).abs().max() > 1e-2  # a causal mask matters here


@pytest.mark.parametrize("build", [lambda: tiny_model("llama"), _deepseek], ids=["llama", "deepseek_v3"])
def test_softcap_is_never_dropped_by_another_attention_implementation(build):
    """softcap rewrites the logits, which transformers' SDPA cannot: switched to it, the model refuses in one
    line instead of computing uncapped attention; eager and qklab give the capped logits."""
    model = apply(build(), "softcap", cap=0.5)
    with torch.no_grad():
        for m in model.modules():  # large logits, so that the cap bites
            for name in ("q_proj", "q_b_proj", "kv_b_proj"):
                if isinstance(getattr(m, name, None), torch.nn.Linear):
                    getattr(m, name).weight.mul_(4.0)
    x = torch.randint(3, 101, (2, 9))
    with torch.no_grad():
        capped = model(x).logits  # "qklab"
        model.set_attn_implementation("sdpa")
        with pytest.raises(ConfigError, match="method softcap, which rewrites the logits, which only the 'qklab'"):
            model(x)
        for m in model.modules():  # what SDPA would have computed: the same model without the cap
            if hasattr(m, "qk_method"):
                m.qk_method.modifies_logits = False
        uncapped = model(x).logits
        assert (uncapped - capped).abs().max() > 1e-2
        for m in model.modules():
            if hasattr(m, "qk_method"):
                del m.qk_method.modifies_logits
        model.set_attn_implementation("eager")
        torch.testing.assert_close(model(x).logits, capped, atol=0, rtol=0)


def test_flash_kernels_are_refused_where_q_k_and_v_differ_in_width():
    """alibi makes q and k 8 features wider than v, which flash kernels (one width for all three) do not take:
    switched to one, the model refuses in one line (before the kernel is even imported); SDPA computes it."""
    model = apply(tiny_model("llama"), "alibi")
    x = torch.randint(3, 101, (2, 9))
    with torch.no_grad():
        ref = model(x).logits  # "qklab"
        model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ConfigError, match="makes q and k 24 features wide and v is 16, but the "
                                              "'flash_attention_2' kernel takes one width"):
            model(x)
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build, method, opts, says", [
    (lambda: tiny_model("llama"), "qkmap", {"n_freqs": 3}, "divisible by 2\\*n_freqs=6"),
    (lambda: tiny_model("llama"), "qknorm", {"k_group": 3}, "k_group=3 must divide the 2 key heads"),
    (_deepseek, "qknorm", {"k_parts": True, "k_group": 3}, "k_group=3 must divide")])
def test_a_shape_the_method_cannot_take_is_a_user_error(build, method, opts, says):
    """What a method refuses for the model's shapes is the user's to fix: a UserError (one line, exit 2), as
    qklab.QK gives for the same shapes; the model is left as it was."""
    from qklab.errors import UserError

    model = build()
    x = torch.randint(3, 101, (1, 7))
    with torch.no_grad():
        before = model(x).logits
    with pytest.raises(UserError, match=says):
        apply(model, method, **opts)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, before, atol=0, rtol=0)
