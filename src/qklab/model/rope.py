"""Rotary position embedding, "rotate half" layout (pair i is (x_i, x_{i + D/2}), as in Llama/Qwen).

Tables are built lazily per feature dimension, because a QK method may change the q/k width.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_tables(dim: int, max_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_len, dim), in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)  # (D/2,)
    t = torch.arange(max_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Rope(nn.Module):
    """Apply RoPE to x (B, H, T, D) at absolute positions pos .. pos + T - 1."""

    def __init__(self, max_len: int, theta: float) -> None:
        super().__init__()
        self.max_len = max_len
        self.theta = theta
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dim, device)
        if key not in self._tables:
            self._tables[key] = rope_tables(dim, self.max_len, self.theta, device)
        return self._tables[key]

    def forward(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        T, D = x.shape[-2], x.shape[-1]
        if pos + T > self.max_len:
            raise ValueError(f"position {pos + T} exceeds model.max_seq_len={self.max_len}")
        cos, sin = self.tables(D, x.device)
        cos, sin = cos[pos : pos + T].to(x.dtype), sin[pos : pos + T].to(x.dtype)  # (T, D)
        return x * cos + rotate_half(x) * sin
