"""FlexAttention's max scores (CUDA): the fused path gives the attention SDPA gives, the per-head max
logit the chunked pass gives, and the same gradients; on CPU the chunked pass is used instead."""

from __future__ import annotations

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.model import GPT
from qklab.model.attention import head_max_logit, sdpa_causal
from qklab.model.flex import flex_causal_with_max, flex_usable

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention max scores need CUDA")


def test_cpu_takes_the_chunked_pass():
    q = torch.randn(2, 4, 32, 64)
    assert not flex_usable(q, q, q)


@cuda
@pytest.mark.parametrize("h_kv", [4, 2])
def test_flex_equals_sdpa_and_the_chunked_max(h_kv):
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 256, 64
    q = torch.randn(B, H, T, D, device="cuda", requires_grad=True)
    k = torch.randn(B, h_kv, T, D, device="cuda", requires_grad=True)
    v = torch.randn(B, h_kv, T, D, device="cuda", requires_grad=True)
    assert flex_usable(q, k, v)
    y, m = flex_causal_with_max(q, k, v, 0.125, gqa=h_kv != H)
    ref = sdpa_causal(q, k, v, 0.125, gqa=h_kv != H)
    torch.testing.assert_close(y, ref, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(m, head_max_logit(q, k, 0.125), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@cuda
def test_model_tracks_the_same_max_on_both_paths():
    cfg = ModelConfig(vocab_size=97, d_model=128, n_layers=2, n_heads=2, max_seq_len=128)
    model = GPT(cfg, QKConfig()).cuda().train()
    for b in model.blocks:
        b.attn.track_max_logit = True
    x = torch.randint(0, 97, (2, 128), device="cuda")
    model(x, x)
    fused = [b.attn.pop_max_logit() for b in model.blocks]
    model.cpu()
    model(x.cpu(), x.cpu())
    chunked = [b.attn.pop_max_logit() for b in model.blocks]
    for a, b in zip(fused, chunked, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


@cuda
def test_block_mask_is_made_once_per_length_and_device():
    from qklab.model.flex import causal_block_mask

    a = causal_block_mask(128, torch.device("cuda"))
    assert causal_block_mask(128, torch.device("cuda", torch.cuda.current_device())) is a
    assert causal_block_mask(256, "cuda") is not a
