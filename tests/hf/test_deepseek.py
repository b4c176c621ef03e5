"""DeepSeek-V2/V3 attention weights to and from qklab's MLA: imported layers match transformers' attention
to 1e-5 in fp32 (RoPE interleaved and half, with and without a query latent, default and YaRN RoPE, the
latent norms' eps), on the materialised and the absorbed latent-cache paths; export is the exact inverse."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.config import QKConfig  # noqa: E402
from qklab.hf.deepseek import load_deepseek_attention, mla_config, mla_from_deepseek, save_deepseek_attention  # noqa: E402
from qklab.model import MLAttention, Rope  # noqa: E402
from qklab.model.rope import Yarn, rope_tables  # noqa: E402

H, NOPE, ROPE, V, KV_RANK, Q_RANK, C = 4, 16, 8, 12, 24, 20, 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _hf(version="v3", q_lora=Q_RANK, interleave=True, rope=DEFAULT, seed=3):
    mod = {"v2": transformers.models.deepseek_v2.modeling_deepseek_v2,
           "v3": transformers.models.deepseek_v3.modeling_deepseek_v3}[version]
    Cfg = transformers.DeepseekV2Config if version == "v2" else transformers.DeepseekV3Config
    kw = {} if version == "v2" else {"rope_interleave": interleave}
    cfg = Cfg(vocab_size=97, hidden_size=C, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora,
              kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
              max_position_embeddings=64, rope_parameters=dict(rope), attention_bias=False, attention_dropout=0.0,
              rms_norm_eps=1e-6, num_hidden_layers=1, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    Attn = mod.DeepseekV2Attention if version == "v2" else mod.DeepseekV3Attention
    Rot = mod.DeepseekV2RotaryEmbedding if version == "v2" else mod.DeepseekV3RotaryEmbedding
    attn = Attn(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.ndim == 1:  # latent RMSNorm gains: non-trivial
                p.uniform_(0.5, 1.5)
            elif name.startswith(("q_b_proj", "q_proj", "kv_b_proj", "kv_a_proj")):
                p.mul_(4.0)  # peaked attention, so that the tests can fail
    if attn.q_a_layernorm is not None:
        attn.q_a_layernorm.variance_epsilon = 0.3  # eps far from the config's rms_norm_eps
    attn.kv_a_layernorm.variance_epsilon = 0.5
    return attn, Rot(cfg)


def _hf_forward(version, attn, rot, x):
    B, T, _ = x.shape
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    mask = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)
    pe = rot(x, pos)
    if version == "v2":
        return attn(x, attention_mask=mask, position_embeddings=pe)[0]
    return attn(x, pe, mask)[0]


CASES = [("v3", Q_RANK, True), ("v3", None, True), ("v3", Q_RANK, False), ("v3", None, False), ("v2", Q_RANK, True),
         ("v2", None, True)]


@pytest.mark.parametrize("rope", [DEFAULT, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("version, q_lora, interleave", CASES)
def test_imported_mla_matches_transformers(version, q_lora, interleave, rope):
    theirs, rot = _hf(version, q_lora, interleave, rope)
    ours = mla_from_deepseek(theirs).eval()
    cfg = mla_config(theirs.config)
    B, T = 2, 40  # beyond the YaRN original context (16)
    x = torch.randn(B, T, C)
    rope_ = Rope(64, cfg.rope_theta, Yarn.from_config(cfg))
    with torch.no_grad():
        ref = _hf_forward(version, theirs, rot, x)
        torch.testing.assert_close(ours(x, rope_), ref, atol=1e-5, rtol=1e-5)
        ours.latent_path = "absorbed"  # the latent-cache decode path, one token at a time
        cache = ours.make_cache(B, T, x.device, x.dtype)
        dec = torch.cat([ours(x[:, t: t + 1], rope_, cache) for t in range(T)], dim=1)
        torch.testing.assert_close(dec, ref, atol=1e-5, rtol=1e-5)
        ours.latent_path = "auto"
        if rope is YARN:  # YaRN matters here: plain RoPE, or YaRN without the softmax correction, do not match
            assert not torch.allclose(ours(x, Rope(64, cfg.rope_theta)), ref, atol=1e-3)
            ours.softmax_mscale = 1.0
            assert not torch.allclose(ours(x, rope_), ref, atol=1e-3)
        elif interleave and version == "v3":  # the permutation is what makes the layouts agree
            theirs.config.rope_interleave = False  # read as if the rows were in halves already
            plain = load_deepseek_attention(MLAttention(cfg, QKConfig(), 0).eval(), theirs)
            theirs.config.rope_interleave = True
            assert not torch.allclose(plain(x, rope_), ref, atol=1e-3)


def test_latent_norm_eps_is_carried_over():
    theirs, rot = _hf("v3")
    ours = mla_from_deepseek(theirs)
    assert ours.kv_norm.eps == 0.5 and ours.q_norm.eps == 0.3
    x = torch.randn(2, 12, C)
    with torch.no_grad():
        ref = _hf_forward("v3", theirs, rot, x)
        ours.kv_norm.eps = 1e-6  # the config's eps would be wrong
        assert not torch.allclose(ours(x, Rope(64, 10000.0)), ref, atol=1e-4)


@pytest.mark.parametrize("version, q_lora, interleave", CASES)
def test_export_then_import_is_exact(version, q_lora, interleave):
    src, _ = _hf(version, q_lora, interleave, YARN, seed=5)
    ours = mla_from_deepseek(src)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # weights of our own
    dst, rot = _hf(version, q_lora, interleave, YARN, seed=6)
    save_deepseek_attention(ours, dst)
    back = mla_from_deepseek(dst)
    for (k, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    x = torch.randn(2, 30, C)
    cfg = mla_config(dst.config)
    with torch.no_grad():
        torch.testing.assert_close(_hf_forward(version, dst, rot, x), ours(x, Rope(64, 10000.0, Yarn.from_config(cfg))),
                                   atol=1e-5, rtol=1e-5)


def test_yarn_tables_match_transformers():
    """The YaRN frequencies and attention factor equal transformers' (an independent implementation)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, _ = _hf("v3", rope=YARN)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs.config)
    y = Yarn(4.0, 16, 32.0, 1.0, 1.0, 0.8)
    torch.testing.assert_close(y.inv_freq(ROPE, 10000.0).float(), inv_freq)
    assert abs(y.attention_factor() - factor) < 1e-7 and factor != 1.0
    cos, _ = rope_tables(ROPE, 8, 10000.0, yarn=y)
    torch.testing.assert_close(cos[0], torch.full((ROPE,), factor))
    assert abs(y.softmax_mscale() * (NOPE + ROPE) ** -0.5 - theirs.scaling) < 1e-9


def test_unsupported_deepseek_settings_are_refused():
    theirs, _ = _hf("v3", rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        mla_config(theirs.config)


def test_yarn_config_keys():
    from qklab.config import ConfigError, load_config
    from qklab.model import GPT

    cfg = load_config("tiny", ["model.attention=mla", "model.rope_scaling=yarn", "model.yarn_factor=4",
                               "model.yarn_mscale_all_dim=0.8"]).model
    yarn = Yarn.from_config(cfg)
    assert yarn == Yarn(4.0, cfg.max_seq_len // 4, 32.0, 1.0, 0.0, 0.8)
    model = GPT(dataclasses.replace(cfg, vocab_size=97))
    assert model.rope.yarn == yarn and model.blocks[0].attn.softmax_mscale == yarn.softmax_mscale() > 1
    with pytest.raises(ConfigError, match="yarn_factor"):
        load_config("tiny", ["model.rope_scaling=yarn"])
