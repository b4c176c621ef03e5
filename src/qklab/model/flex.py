"""Causal attention that also returns each head's max logit, from one FlexAttention kernel (CUDA).

QK-clip needs, every step, each head's max over batch, queries and allowed keys of the pre-softmax
logit. On CPU that is a second pass over QK^T in query chunks (``head_max_logit``). On CUDA the
FlexAttention kernel already keeps every query row's running max for its online softmax and hands it
back (``AuxRequest(max_scores=True)``, (B, H, T)), so the per-head max costs one reduction of that
instead of a second QK^T. torch supports this output on CUDA only ("not supported on CPU/MPS").

Used for the training forward (queries and keys of one length, causal) of methods that leave the
logits as they are (those that rewrite them run the eager path, which reads its own logits), when the
query/key and value widths are powers of two from 16 on; anything else takes the chunked pass.
"""

from __future__ import annotations

import torch

_kernel = None  # flex_attention compiled once (uncompiled, it runs a slow reference implementation)
_masks: dict[tuple[int, str], object] = {}


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def flex_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q (B, H, Tq, F), k (B, Hkv, Tk, F), v (B, Hkv, Tk, Dv): can the fused max-score kernel run them?"""
    return q.is_cuda and q.shape[2] == k.shape[2] and _pow2(q.shape[-1]) and _pow2(v.shape[-1])


def flex_causal_with_max(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (B, H, T, Dv) and each head's max logit (H,), float32, from one kernel."""
    global _kernel
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if _kernel is None:
        _kernel = torch.compile(flex_attention, dynamic=False)
    y, aux = _kernel(q, k, v, block_mask=causal_block_mask(q.shape[2], q.device), scale=scale, enable_gqa=gqa,
                     return_aux=AuxRequest(max_scores=True))
    return y, aux.max_scores.detach().float().amax(dim=(0, 2))  # (B, H, T) -> (H,)


def causal_block_mask(T: int, device: torch.device):
    """The causal BlockMask of length T, made once per (T, device). The trainer makes the training
    length's before ``torch.compile`` traces the model, so a compiled forward only reads it."""
    from torch.nn.attention.flex_attention import create_block_mask

    d = torch.device(device)
    index = d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)
    key = (T, f"{d.type}:{index}")  # "cuda" and "cuda:0" name the same mask
    if key not in _masks:
        _masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
    return _masks[key]
