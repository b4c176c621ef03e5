"""qklab.hf.apply with QUEST, SSMax and the QK-Norm variants on a tiny Llama (built from a config): each
layer equals qklab's own attention module with the same weights, and cached generate() equals greedy full
forwards (SSMax counts keys from the position ids, left padding included)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.hf import apply  # noqa: E402
from qklab.hf.apply import method_options  # noqa: E402
from qklab.model import Attention, Rope  # noqa: E402
from tests.hf.common import HKV, C, H, tiny_model  # noqa: E402
from tests.hf.test_apply import _causal, _left_pad, _rotary  # noqa: E402

CASES = [("quest", {}), ("quest", {"head_scale": True}), ("ssmax", {"ref_len": 16}),
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


@pytest.mark.parametrize("method, opts", [("quest", {}), ("ssmax", {"ref_len": 16}), ("qknorm", {"p": 3.0})], ids=str)
def test_generate_and_left_padding(method, opts):
    model = apply(tiny_model("llama"), method, **opts)
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 101, (n,), generator=g) for n in (9, 5)]
    ids, mask = _left_pad(seqs)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        torch.testing.assert_close(padded[1, 4:], model(seqs[1].unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        seq, m = ids.clone(), mask.clone()
        for _ in range(8):
            logits = model(seq, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0), use_cache=False).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out, seq)
