"""Our attention equals the reference implementations in ``transformers`` (fp32, eager, random weights):
``qknorm`` equals Qwen3 attention, ``none`` equals Llama attention."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Qwen3Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding  # noqa: E402

from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.hf.export import LAYER_KEYS  # noqa: E402
from qklab.model import Attention, Rope  # noqa: E402

D_MODEL, N_HEADS, THETA = 64, 4, 10000.0


def _hf_forward(attn, rotary, x):
    B, T, _ = x.shape
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    cos, sin = rotary(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)  # additive causal mask
    out, _ = attn(x, (cos, sin), mask)
    return out


def _copy(ours: Attention, hf) -> None:
    """Attention weights by the export's name mapping (qklab.hf.export.LAYER_KEYS)."""
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for ours_key, hf_key in LAYER_KEYS.items():
            if ours_key.startswith("attn.") and hf_key.removeprefix("self_attn.") in theirs:
                ours.get_parameter(ours_key.removeprefix("attn.")).copy_(theirs[hf_key.removeprefix("self_attn.")])


@pytest.mark.parametrize("n_kv", [4, 2])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_matches_transformers(family, impl, n_kv):
    torch.manual_seed(1)
    common = dict(hidden_size=D_MODEL, num_attention_heads=N_HEADS, num_key_value_heads=n_kv,
                  head_dim=D_MODEL // N_HEADS, max_position_embeddings=64, rope_theta=THETA,
                  attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-6)
    if family == "llama":
        cfg, Attn, Rot, method = LlamaConfig(**common), LlamaAttention, LlamaRotaryEmbedding, "none"
    else:
        cfg, Attn, Rot, method = Qwen3Config(**common), Qwen3Attention, Qwen3RotaryEmbedding, "qknorm"
    cfg._attn_implementation = "eager"
    hf = Attn(cfg, layer_idx=0).eval()
    if family == "qwen3":  # random, non-trivial norm gains
        with torch.no_grad():
            hf.q_norm.weight.uniform_(0.5, 1.5)
            hf.k_norm.weight.uniform_(0.5, 1.5)
    ours = Attention(ModelConfig(d_model=D_MODEL, n_heads=N_HEADS, n_kv_heads=n_kv, max_seq_len=64, attn_impl=impl,
                                 norm_eps=1e-6), QKConfig(method=method), layer_idx=0).eval()
    _copy(ours, hf)
    x = torch.randn(2, 24, D_MODEL)
    with torch.no_grad():
        ref = _hf_forward(hf, Rot(cfg), x)
        got = ours(x, Rope(64, THETA))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
