"""``logit_rows`` (the streamed measurements' logits) against logits rebuilt by hand from a layer's own
projections, with the softmax scale the forward uses: MLA with YaRN's softmax correction, MLA without
YaRN, and MHA/GQA. The reference's scale is checked against the forward itself (the layer's output
recomputed from it) and against the eager capture."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.diagnostics.capture import capturing, logit_rows, probe_mode, qk_hooks
from qklab.model import GPT
from qklab.model.mla import PartialRope

YARN = {"rope_scaling": "yarn", "yarn_factor": 4.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0}
CASES = {"mla-yarn": ("mla", YARN), "mla": ("mla", {}), "mha": ("mha", {}), "gqa": ("mha", {"n_kv_heads": 2})}


def _model(attention: str, extra: dict) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=4, max_seq_len=64, attention=attention,
                      init_std=0.2, **extra)
    return GPT(cfg, QKConfig(method="none")).eval()


def _expected_scale(attention: str, extra: dict, width: int) -> float:
    """1/sqrt(F), times DeepSeek's YaRN correction (0.1 m ln f + 1)^2 for MLA with yarn_mscale_all_dim."""
    scale = 1.0 / math.sqrt(width)
    if attention == "mla" and extra.get("rope_scaling") == "yarn":
        scale *= (0.1 * extra["yarn_mscale_all_dim"] * math.log(extra["yarn_factor"]) + 1.0) ** 2
    return scale


def _reference(attn, x, rope, attention: str, extra: dict):
    """Post-RoPE q (B, H, T, F), k (B, H, T, F), v (B, H, T, Dv) from the layer's projections, and
    the pre-mask logits q.k * scale (B, H, T, T)."""
    B, T, _ = x.shape
    if attention == "mla":
        c = attn.kv_norm(attn.wdkv(x))
        prope = PartialRope(rope, attn.rope_dim)
        q, k = prope(attn.queries(x)), prope(attn.keys(c, attn.wkr(x)))
        v = attn.values(c)
    else:
        H, Hk = attn.n_heads, attn.n_kv_heads
        q = rope(attn.wq(x).view(B, T, H, -1).transpose(1, 2))
        k = rope(attn.wk(x).view(B, T, Hk, -1).transpose(1, 2)).repeat_interleave(H // Hk, dim=1)
        v = attn.wv(x).view(B, T, Hk, -1).transpose(1, 2).repeat_interleave(H // Hk, dim=1)
    s = (q @ k.transpose(-2, -1)) * _expected_scale(attention, extra, q.shape[-1])
    return s, v


@pytest.mark.parametrize("name", list(CASES))
def test_logit_rows_use_the_forwards_softmax_scale(name):
    attention, extra = CASES[name]
    model = _model(attention, extra)
    attn = model.attention_layers()[0]
    if name == "mla-yarn":
        assert attn.softmax_mscale > 1.2  # the correction is on, so a missing one would show
    x_ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    seen: dict = {}

    def grab_input(_m, args):
        seen["x"], seen["rope"] = args[0], args[1]

    def grab_output(_m, _args, out):
        seen["y"] = out

    def rows(i, a, q, k):
        seen["rows"] = torch.cat([logit_rows(a, q, k, r0, min(r0 + 7, q.shape[2])) for r0 in range(0, q.shape[2], 7)],
                                 dim=2)

    handles = [attn.register_forward_pre_hook(grab_input), attn.register_forward_hook(grab_output)]
    try:
        with probe_mode(model), qk_hooks(model, rows):
            model(x_ids)  # the layer's default (fused) kernel
        with probe_mode(model), capturing(model) as caps:
            model(x_ids)  # eager
    finally:
        for h in handles:
            h.remove()

    with torch.no_grad():
        ref, v = _reference(attn, seen["x"], seen["rope"], attention, extra)
        T = ref.shape[-1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        p = torch.softmax(ref.masked_fill(~mask, float("-inf")), dim=-1)
        B, H = ref.shape[:2]
        y = attn.wo((p @ v).transpose(1, 2).reshape(B, T, -1))
    # the reference's scale is the one the forward attends with (fused kernel) and captures (eager)
    torch.testing.assert_close(seen["y"], y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caps[0]["logits"], ref, rtol=1e-5, atol=1e-5)
    # the streamed logits agree with it, and so does their max logit
    torch.testing.assert_close(seen["rows"], ref, rtol=1e-5, atol=1e-5)
    causal_max = ref.masked_fill(~mask, float("-inf")).amax(dim=(-2, -1))
    torch.testing.assert_close(seen["rows"].masked_fill(~mask, float("-inf")).amax(dim=(-2, -1)), causal_max)
