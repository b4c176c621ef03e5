"""Direct formulas the streamed and batched diagnostics are checked against (fp32, whole tensors)."""

from __future__ import annotations

import torch

from qklab.diagnostics.capture import per_query_head
from qklab.diagnostics.measures import _first_query_row


def mean_norm(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Mean L2 norm of the per-head vectors x (B, Hx, T, F) over batch and positions; (H,)."""
    return per_query_head(x.float().norm(dim=-1).mean(dim=(0, 2)), n_heads)


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
