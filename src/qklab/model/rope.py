"""Rotary position embedding, "rotate half" layout (pair i is (x_i, x_{i + D/2}), as in Llama/Qwen).

Tables are built lazily per feature dimension, because a QK method may change the q/k width.

YaRN (``Yarn``, arXiv 2309.00071, as DeepSeek-V2/V3 use it) stretches the context by ``factor``: rotary
pairs that turn fewer than ``beta_slow`` times over the original context are interpolated (frequency /
factor), those turning more than ``beta_fast`` times are kept, with a linear ramp between; the tables are
multiplied by an attention factor, and ``softmax_mscale`` is the correction DeepSeek applies to the
softmax scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from qklab.config import ModelConfig


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    factor: float  # context extension, > 1
    original_max_len: int  # the context the frequencies were trained for
    beta_fast: float = 32.0  # pairs turning more often than this over original_max_len keep their frequency
    beta_slow: float = 1.0  # pairs turning less often than this are fully interpolated
    mscale: float = 0.0  # 0: unset; with mscale_all_dim, attention factor mscale(f, mscale) / mscale(f, mscale_all_dim)
    mscale_all_dim: float = 0.0  # 0: unset; else the softmax scale is multiplied by mscale(f, mscale_all_dim)^2

    @classmethod
    def from_config(cls, m: ModelConfig) -> Yarn | None:
        """The YaRN settings of a ``ModelConfig``, or None without rope scaling."""
        if m.rope_scaling != "yarn":
            return None
        orig = m.yarn_original_max_len or int(m.max_seq_len / m.yarn_factor)
        return cls(m.yarn_factor, orig, m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_mscale, m.yarn_mscale_all_dim)

    def attention_factor(self) -> float:
        """Multiplier of the cos/sin tables (so of both rotated q and k)."""
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    def softmax_mscale(self) -> float:
        """Multiplier of the softmax scale (DeepSeek's correction)."""
        return _mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float, device=None) -> torch.Tensor:
        """(dim/2,) fp64 inverse frequencies."""
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)  # (D/2,)

        def pair(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
            return dim * math.log(self.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = max(math.floor(pair(self.beta_fast)), 0), min(math.ceil(pair(self.beta_slow)), dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp  # 1: original frequency (fast pairs), 0: interpolated
        return (1.0 / base) * keep + (1.0 / (self.factor * base)) * (1 - keep)


def rope_tables(dim: int, max_len: int, theta: float, device=None, yarn: Yarn | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_len, dim), in fp32 (YaRN: its frequencies, times its attention factor)."""
    if yarn is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)  # (D/2,)
    else:
        inv_freq = yarn.inv_freq(dim, theta, device)
    t = torch.arange(max_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    a = 1.0 if yarn is None else yarn.attention_factor()
    return (emb.cos() * a).float(), (emb.sin() * a).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The textbook form, x * cos + rotate_half(x) * sin: what the compiler fuses, and the reference."""
    return x * cos + rotate_half(x) * sin


class _Rotate(torch.autograd.Function):
    """y = x * cos + roll(x, D/2) * sin_s with sin_s = (-sin_1, sin_2), which equals rotate_half(x) * sin.

    Eager, this is three passes over x forward and three backward, against five and five of the textbook
    form (chunk, neg, cat, two products, a sum). The backward is the transpose of the same map:
    dx = dy * cos + roll(dy * sin_s, D/2) (a roll by D/2 is its own inverse)."""

    @staticmethod
    def forward(ctx, x, cos, sin_s):
        ctx.save_for_backward(cos, sin_s)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_s)

    @staticmethod
    def backward(ctx, dy):
        cos, sin_s = ctx.saved_tensors
        return (dy * sin_s).roll(dy.shape[-1] // 2, -1).addcmul_(dy, cos), None, None


def heads_inner(x: torch.Tensor) -> bool:
    """True when x (B, H, T, D) is a transposed view of (B, T, H, D) memory, as projections produce."""
    return x.dim() == 4 and x.shape[1] > 1 and x.stride(1) < x.stride(2)


class Rope(nn.Module):
    """Apply RoPE to x (B, H, T, D) at absolute positions pos .. pos + T - 1."""

    def __init__(self, max_len: int, theta: float, yarn: Yarn | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.theta = theta
        self.yarn = yarn
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tables(self, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and the signed sin (-sin_1, sin_2), each (max_len, dim), made once per (dim, device)."""
        key = (dim, device)
        if key not in self._tables:
            cos, sin = rope_tables(dim, self.max_len, self.theta, device, self.yarn)
            h = dim // 2
            self._tables[key] = cos, sin, torch.cat([-sin[:, :h], sin[:, h:]], dim=-1)
        return self._tables[key]

    def window(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin, signed sin (T, D) for x (..., T, D) at positions pos .., in x's dtype."""
        T, D = x.shape[-2], x.shape[-1]
        if pos + T > self.max_len:
            raise ValueError(f"position {pos + T} exceeds model.max_seq_len={self.max_len}")
        return tuple(t[pos : pos + T].to(x.dtype) for t in self.tables(D, x.device))

    def positions(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """The absolute positions (T,) of x (..., T, D) rotated from pos on."""
        return torch.arange(pos, pos + x.shape[-2], device=x.device)

    def forward(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        cos, sin, sin_s = self.window(x, pos)  # (T, D)
        if torch.compiler.is_compiling():  # the compiler fuses the textbook form into one kernel
            return rope_reference(x, cos, sin)
        if heads_inner(x):  # rotate in the memory's own (B, T, H, D) order: no copies; same numbers
            return _Rotate.apply(x.transpose(1, 2), cos[:, None], sin_s[:, None]).transpose(1, 2)
        return _Rotate.apply(x, cos, sin_s)
