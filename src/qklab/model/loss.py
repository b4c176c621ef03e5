"""Mean token cross-entropy with a lean backward.

``F.cross_entropy`` computes log_softmax, then nll_loss, whose backward zero-fills an (N, V)
gradient and scatters into it before log_softmax's backward reads it again. For a GPT the (N, V)
logits are the largest activation, so those passes are a noticeable share of a CPU training step.
Here the backward turns the saved log-probabilities into the gradient in place:

    loss = -mean_i logp_i[t_i]                   logp = log_softmax(z)
    dloss/dz_iv = (exp(logp_iv) - [v == t_i]) / N

The saved log-probabilities are consumed, so a second backward through the same graph fails with
autograd's "modified by an inplace operation" error rather than giving a wrong gradient. The result
equals ``F.cross_entropy(z, t)`` (mean reduction, no ignore index, no smoothing); the tests compare
value and gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)  # (N, V)
        ctx.save_for_backward(logp, targets)
        return -logp.gather(1, targets.unsqueeze(1)).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logp, targets = ctx.saved_tensors
        g = logp.exp_()  # (N, V) softmax, in place
        g.scatter_add_(1, targets.unsqueeze(1), g.new_full((g.shape[0], 1), -1.0))
        return g.mul_(grad / g.shape[0]), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) against integer targets (N,), computed in fp32 (or fp64). With
    ``ignore_index``, the mean over the targets that are not it (torch's own loss: a task scored at a few
    positions, whose vocabulary is small)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if ignore_index is not None:
        return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index)
    return _CrossEntropy.apply(logits, targets.long())
