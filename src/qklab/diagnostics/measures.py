"""Per-head measurements of one layer's captured attention (docs/diagnostics.md), all in fp32.

Shapes: logits and probs (B, H, Tq, Tk), mask (Tq, Tk) with True where query i (absolute position
Tk - Tq + i) may see key j. Each function returns one value per head, (H,).
"""

from __future__ import annotations

import torch

from qklab.diagnostics.capture import per_query_head

SINK_THRESHOLD = 0.3  # a head is a sink when its mean first-token weight exceeds this


def _first_query_row(mask: torch.Tensor) -> int:
    """Index of the first query row at absolute position >= 1 (rows before it can only see key 0)."""
    Tq, Tk = mask.shape
    return max(0, 1 - (Tk - Tq))


def max_logit(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max pre-softmax logit over queries and allowed keys, per head."""
    return logits.float().masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))  # (H,)


def entropy(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the attention distribution of queries at positions >= 1, per head."""
    p = probs.float()[:, :, _first_query_row(mask) :]  # (B, H, Tq', Tk); masked keys hold p = 0
    h = -torch.special.xlogy(p, p).sum(dim=-1)  # (B, H, Tq')
    return h.mean(dim=(0, 2))


def first_token(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean attention weight that queries at positions >= 1 give to position 0, per head."""
    return probs.float()[:, :, _first_query_row(mask) :, 0].mean(dim=(0, 2))  # (H,)


def distance(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean attention distance (tokens): sum_j p_ij (i - j) averaged over queries at positions >= 1, per head
    (uniform causal attention over T tokens gives T / 4; attention on the query's own token gives 0)."""
    Tq, Tk = mask.shape
    r = _first_query_row(mask)
    gap = torch.arange(Tk - Tq + r, Tk, device=mask.device)[:, None] - torch.arange(Tk, device=mask.device)  # (Tq', Tk)
    p = probs.float()[:, :, r:]  # (B, H, Tq', Tk); masked keys hold p = 0
    return (p * gap.clamp_min(0)).sum(dim=-1).mean(dim=(0, 2))


def sink_rate(first: torch.Tensor, threshold: float = SINK_THRESHOLD) -> float:
    """Share of heads (all entries of first, e.g. (L, H)) whose mean first-token weight exceeds threshold."""
    return (first > threshold).float().mean().item()


def mean_cosine(a: torch.Tensor, b: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Mean cosine between matching vectors of a and b (B, Hx, T, F) over batch and positions; (H,)."""
    cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)  # (B, Hx, T)
    return per_query_head(cos.mean(dim=(0, 2)), n_heads)
