"""Direct formulas the streamed and batched diagnostics are checked against (fp32, whole tensors)."""

from __future__ import annotations

import torch

from qklab.diagnostics.capture import per_query_head
from qklab.diagnostics.measures import _first_query_row


def mean_norm(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Mean L2 norm of the per-head vectors x (B, Hx, T, F) over batch and positions; (H,)."""
    return per_query_head(x.float().norm(dim=-1).mean(dim=(0, 2)), n_heads)


def mean_distance(probs: torch.Tensor) -> torch.Tensor:
    """Mean attention distance of full causal probs (B, H, T, T), query by query in a plain loop: for each
    query i >= 1, sum over keys j <= i of p_ij (i - j); the mean over batch and queries, per head."""
    B, H, T, _ = probs.shape
    total = torch.zeros(H, dtype=torch.float64)
    for i in range(1, T):
        for j in range(i + 1):
            total += probs[:, :, i, j].double().sum(dim=0) * (i - j)
    return (total / (B * (T - 1))).float()


def mean_abs_change(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean |new - old| over all allowed (query, key) pairs of the batch, per head."""
    d = (new.float() - old.float()).abs().masked_fill(~mask, 0.0)  # (B, H, Tq, Tk)
    n = mask.sum() * new.shape[0]
    return d.sum(dim=(0, 2, 3)) / n  # (H,)


def js_divergence(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean Jensen-Shannon divergence (nats, at most ln 2) between the attention rows of p and q over
    queries at positions >= 1, per head."""
    r = _first_query_row(mask)
    p, q = p.float()[:, :, r:], q.float()[:, :, r:]  # (B, H, Tq', Tk)
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(dim=-1)  # (B, H, Tq')
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(dim=-1)
    return (0.5 * (kl_pm + kl_qm)).clamp_min(0.0).mean(dim=(0, 2))
