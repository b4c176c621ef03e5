"""Validation loss and the max attention logit, computed the same way everywhere."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def eval_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device, autocast) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    model.train(was_training)
    return total / len(batches)


@torch.no_grad()
def max_attention_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per layer and head, the max pre-softmax logit (after the method's scaling and soft-cap) over
    query and allowed key positions of x (B, T), in fp32 on the eager path. Returns (L, H)."""
    was_training = model.training
    model.eval()
    attns = [b.attn for b in model.blocks]
    for a in attns:
        a.capture = {}
    try:
        model(x)
        out = []
        for a in attns:
            s, mask = a.capture["logits"].float(), a.capture["mask"]  # (B, H, T, T), (T, T)
            out.append(s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)))  # (H,)
        return torch.stack(out)
    finally:
        for a in attns:
            a.capture = None
        model.train(was_training)
