"""Per-head measurements of one layer computed from its q and k in query chunks (docs/diagnostics.md), so
that at most one chunk of (B, H, rows, T) logits exists at a time.

The definitions are those of ``measures.py`` (which works on full captured tensors and serves as the
reference in the tests); here the sums run chunk by chunk and are divided at the end. Causal
attention without a cache: query i sees keys 0..i. Queries at position 0 are left out of entropy and
first-token attention (they can only see themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.diagnostics.capture import logit_rows, per_query_head, row_chunk

CHUNK_ELEMENTS = 1 << 18  # logits per query chunk (1 MB in fp32); a chunk holds at least one row


def _causal_rows(r0: int, r1: int, T: int, device: torch.device) -> torch.Tensor:
    """(r1 - r0, T) bool, True where query i in r0..r1-1 may see key j (j <= i)."""
    return torch.arange(T, device=device).view(1, T) <= torch.arange(r0, r1, device=device).view(-1, 1)


def layer_stats(attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                prev: tuple[torch.Tensor, torch.Tensor] | None = None,
                budget: int | None = None) -> dict[str, torch.Tensor]:
    """q (B, H, T, F), k (B, Hk, T, F) of one layer -> per-head (H,) fp32 on q's device:
    max_logit, entropy, first_token, distance (mean attention distance in tokens), q_norm, k_norm, and
    logit_abs_change (mean |s - s_prev| over allowed pairs, not yet divided by steps) when ``prev`` = (q, k)
    of an earlier evaluation is given."""
    B, H, T, _ = q.shape
    dev = q.device
    pq, pk = (p.to(dev) for p in prev) if prev is not None else (None, None)
    mx = torch.full((H,), float("-inf"), device=dev)
    ent, first, dist, change = (torch.zeros(H, device=dev) for _ in range(4))
    step = row_chunk(B, H, T, budget or CHUNK_ELEMENTS)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        mask = _causal_rows(r0, r1, T, dev)  # (c, T)
        s = logit_rows(attn, q, k, r0, r1).masked_fill(~mask, float("-inf"))  # (B, H, c, T)
        mx = torch.maximum(mx, s.amax(dim=(0, 2, 3)))
        p = torch.softmax(s, dim=-1)  # masked keys get exactly 0
        lo = 1 if r0 == 0 else 0  # drop query 0
        ent += -torch.special.xlogy(p, p).sum(dim=-1)[:, :, lo:].sum(dim=(0, 2))
        first += p[:, :, lo:, 0].sum(dim=(0, 2))
        gap = (torch.arange(r0, r1, device=dev)[:, None] - torch.arange(T, device=dev)[None, :]).clamp_min(0)  # (c, T)
        dist += (p[:, :, lo:] * gap[lo:]).sum(dim=(0, 2, 3))
        if pq is not None:
            sp = logit_rows(attn, pq, pk, r0, r1)  # (B, H, c, T)
            d = (s.masked_fill(~mask, 0.0) - sp.masked_fill(~mask, 0.0)).abs()
            change += d.sum(dim=(0, 2, 3))
        del s, p
    n_rows = B * max(T - 1, 1)
    out = {"max_logit": mx, "entropy": ent / n_rows, "first_token": first / n_rows, "distance": dist / n_rows,
           "q_norm": per_query_head(q.float().norm(dim=-1).mean(dim=(0, 2)), H),
           "k_norm": per_query_head(k.float().norm(dim=-1).mean(dim=(0, 2)), H)}
    if pq is not None:
        out["logit_abs_change"] = change / (B * T * (T + 1) / 2)
    return out


def first_token_only(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """Mean first-token attention of queries at positions >= 1, per head (H,)."""
    B, H, T, _ = q.shape
    first = torch.zeros(H, device=q.device)
    step = row_chunk(B, H, T, budget or CHUNK_ELEMENTS)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        s = logit_rows(attn, q, k, r0, r1).masked_fill(~_causal_rows(r0, r1, T, q.device), float("-inf"))
        first += torch.softmax(s, dim=-1)[:, :, 1 if r0 == 0 else 0 :, 0].sum(dim=(0, 2))
    return first / (B * max(T - 1, 1))


def uniform_distance(T: int) -> float:
    """Mean attention distance of uniform causal attention: query i spreads over distances 0..i, mean i / 2,
    averaged over queries i = 1..T-1: T / 4."""
    return T / 4.0 if T > 1 else 0.0


def uniform_first_token(T: int) -> float:
    """First-token attention of uniform causal attention: the mean of 1 / (i + 1) over queries i = 1..T-1."""
    return sum(1.0 / (i + 1) for i in range(1, T)) / max(T - 1, 1)
