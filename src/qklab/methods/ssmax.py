"""Scalable-Softmax, SSMax (Nakanishi 2025, arXiv 2501.19399).

softmax over n inputs, with the logits multiplied by s_h log n: z_i -> n^(s z_i) / sum_j n^(s z_j). In
causal attention n is the number of keys query i sees: its absolute position + 1 (the KV cache offset
included; a left-padded transformers batch: its position id + 1). s_h is learnable, one per head and layer.

    s_ij = (s_h log(n_i)) * q_i . k_j / sqrt(d)

The factor depends on the query alone, so it is applied to q after RoPE: the fused kernels and the KV
cache stay (and MLA's latent cache: the key map is untouched). The paper does not say how s starts; here
s_h = 1 / log(ref_len), so a query that sees ``ref_len`` keys (default 256, the presets' train.seq_len)
gets the standard logits, shorter prefixes softer and longer ones sharper ones. The paper's variant
with a bias (s log n + b) is not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from qklab.fields import at_least, option
from qklab.methods.base import AttnShape, QKMethod, positions_of
from qklab.methods.options import Options


@dataclass
class SSMaxOptions(Options, section="qk.ssmax"):
    ref_len: int = option(256, "s_h starts at 1 / log(ref_len): standard logits for a query that sees ref_len keys",
                          at_least(2))


class SSMax(QKMethod):
    name = "ssmax"
    Options = SSMaxOptions
    keeps_model_qk_norm = True  # qklab.hf: it scales whatever (normalised) q the model makes

    def __init__(self, shape: AttnShape, opts: SSMaxOptions) -> None:
        super().__init__(shape, opts)
        opts.validate()
        self.s = nn.Parameter(torch.full((shape.n_heads,), 1.0 / math.log(opts.ref_len)))

    def factor(self, q: torch.Tensor, rope, pos: int) -> torch.Tensor:
        """s_h log(n) for the rows of q (B, H, T, D): (1 | B, H, T, 1); n = absolute position + 1."""
        p = positions_of(rope, q, pos)  # (T,) or (B, T)
        dt = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 q
        logn = torch.log1p(p.to(dt)).view(-1 if p.ndim == 2 else 1, 1, q.shape[2], 1)
        return (self.s.to(dt).view(1, -1, 1, 1) * logn).to(q.dtype)

    def map_qk(self, q, k, rope, pos):
        return rope(q, pos) * self.factor(q, rope, pos), rope(k, pos)

    def latent_map(self, q, k, rope, pos):
        return rope(q, pos) * self.factor(q, rope, pos), None, None

    def reset_parameters(self) -> None:
        nn.init.constant_(self.s, 1.0 / math.log(self.opts.ref_len))
