"""qklab.hf.apply with QUEST, SSMax and the QK-Norm variants on a tiny Llama (built from a config): each
layer equals qklab's own attention module with the same weights, and cached generate() equals greedy full
forwards (SSMax counts keys and ALiBi distances from the position ids, left padding included)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.hf import apply  # noqa: E402
from qklab.hf.apply import method_options  # noqa: E402
from qklab.model import Attention, Rope  # noqa: E402
from tests.hf.common import HKV, C, H, check_padded_generation, tiny_model  # noqa: E402
from tests.hf.test_apply import _causal, _rotary  # noqa: E402

CASES = [("quest", {}), ("quest", {"head_scale": True}), ("ssmax", {"ref_len": 16}), ("alibi", {"slope_scale": 4.0}),
         ("qknorm", {"q_gain": False}), ("qknorm", {"stats": "flat", "gains": "head"}), ("qknorm", {"p": 3.0})]


@pytest.mark.parametrize("method, opts", CASES, ids=str)
def test_layer_equals_qklab_attention(method, opts):
    model = apply(tiny_model("llama"), method, **opts)
    mod = model.model.layers[1].self_attn
    ours = Attention(ModelConfig(d_model=C, n_heads=H, n_kv_heads=HKV, max_seq_len=128, attn_impl="eager"),
                     QKConfig(method=method, options={method: method_options(method, opts)}), layer_idx=1).eval()
    with torch.no_grad():
        for a, b in ((ours.wq, mod.q_proj), (ours.wk, mod.k_proj), (ours.wv, mod.v_proj), (ours.wo, mod.o_proj)):
            a.weight.copy_(b.weight)
        for p in mod.qk_method.parameters():  # non-trivial gains and scales
            p.uniform_(0.5, 1.5)
        ours.qk.load_state_dict(mod.qk_method.state_dict())
    B, T = 2, 18
    x = torch.randn(B, T, C)
    rope = Rope(128, model.config.rope_parameters["rope_theta"])
    with torch.no_grad():
        got, _ = mod(x, _rotary(model, x, T), _causal(B, T), position_ids=torch.arange(T).expand(B, T))
        ref = ours(x, rope)
        plain = Attention(ModelConfig(d_model=C, n_heads=H, n_kv_heads=HKV, max_seq_len=128), QKConfig(), 1).eval()
        plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("qk.")})
        assert (plain(x, rope) - ref).abs().max() > 1e-3  # the method changes this layer
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, opts", [("quest", {}), ("ssmax", {"ref_len": 16}), ("qknorm", {"p": 3.0}),
                                          ("alibi", {"slope_scale": 4.0})], ids=str)
def test_generate_and_left_padding(method, opts):
    model = apply(tiny_model("llama"), method, **opts)
    check_padded_generation(model)
