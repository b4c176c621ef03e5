"""ALiBi's linear recency bias (Press et al. 2022, arXiv 2108.12409), added to RoPE attention.

Head h's logit of query i on key j gets the bias -m_h (i - j), with ALiBi's geometric slopes: for H a power
of two m_h = 2^(-8 h / H), h = 1..H; otherwise the H' = 2^floor(log2 H) slopes of H', then every other slope
of 2H' until there are H:

    s_ij = q_i . k_j / sqrt(d) - m_h (i - j)

qklab's models rotate q and k with RoPE, and this method keeps that rotation: it is a recency prior on top
of standard attention (the control for QK-MAP's starting recency prior, docs/qk-map.md), not the paper's
model without position embeddings. ``slope_scale`` multiplies every slope (0: standard attention).

The bias travels in q and k, so the fused kernels, GQA and the KV cache keep working. Eight features are
appended (five carry the bias; three zeros round the width up to a multiple of 8, the alignment SDPA's
memory-efficient CUDA kernel asks of q and k):

    q_i -> (q_i, 256 c_h, c_h, r1, r2, r3, 0, 0, 0)      k_j -> (k_j, a_j, b_j, 256, 256, 256, 0, 0, 0)

with c_h = sqrt(d) m_h / g (d: the per-head width before the extra features; g: the factor the layer
multiplies the method's scale by, DeepSeek's YaRN correction, else 1), j = 256 a_j + b_j and
r1 + r2 + r3 = -c_h i / 256; the dot product times the layer's scale g / sqrt(d) is m_h (j - i). Positions are
the absolute ones (the KV cache offset included; a left-padded transformers batch: its position ids), so the
bias depends on i - j alone. The features stay exact in bf16 and fp16 (to 65536 positions): c_h is rounded
once to the features' dtype (each slope off by at most half a unit in the last place), the key digits are
integers below 256, and -c_h i / 256, exact in fp32, is held as three parts of the features' dtype that sum
to it. So the logit at j = i is 0, not off by several nats in bf16 (which a sink's share and the max-logit
reading would see), and no feature grows with the position past 256 c_h (fp16 does not overflow). This holds
for kernels that scale the fp32-accumulated product (qklab's eager path, SDPA's fused kernels); PyTorch's math
kernel scales q and k before their product, which rounds the features in bf16 and fp16. ALiBi is causal (a
query sees no later key), and so is this method. An MLA latent cache cannot hold the key features (they are
not a rotation of the latent's keys): MLA materialises per-head keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qklab.fields import at_least, option
from qklab.methods.base import AttnShape, QKMethod, positions_of
from qklab.methods.options import Options


@dataclass
class ALiBiOptions(Options, section="qk.alibi"):
    slope_scale: float = option(1.0, "multiplies ALiBi's geometric slopes m_h (0: no bias, standard attention)",
                                at_least(0))


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's slopes m_h, H floats: 2^(-8 h / H) for H a power of two, else the slopes of the largest power
    of two below H followed by every other slope of twice that, until there are H."""
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    low = 2 ** int(math.floor(math.log2(n_heads)))
    return power_of_two(low) + power_of_two(2 * low)[0::2][: n_heads - low]


EXTRA = 8  # the features appended to q and k: five carry the bias, three zeros pad to a multiple of 8
PARTS = 3  # the parts of -c_h i / 256 (24 bits in fp32): three hold it exactly in bf16 (8 bits each) and fp16


def _parts(v: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """``PARTS`` tensors of ``dtype`` whose sum is ``v`` (fp32 or fp64) as exactly as PARTS of them can."""
    out = []
    for _ in range(PARTS):
        out.append(v.to(dtype))
        v = v - out[-1].to(v.dtype)
    return out


class ALiBi(QKMethod):
    name = "alibi"
    Options = ALiBiOptions
    latent_cache_ok = False  # the key features (a_j, b_j, 256, ...) are no rotation of MLA's latent keys
    keeps_model_qk_norm = True  # qklab.hf: it biases whatever (normalised) q and k the model makes
    causal_only = True  # the bias -m_h (i - j) is defined for keys at or before the query

    def __init__(self, shape: AttnShape, opts: ALiBiOptions) -> None:
        super().__init__(shape, opts)
        opts.validate()
        # plain floats, not a buffer: transformers' from_pretrained leaves non-persistent buffers uninitialised
        self.slopes = tuple(m * float(opts.slope_scale) for m in alibi_slopes(shape.n_heads))  # (H,)

    def feature_dim(self) -> int:
        return self.proj_dim() + EXTRA

    def rotated_dim(self) -> int:
        return self.proj_dim()  # RoPE turns q and k; the bias features are appended unrotated

    def scale(self, feature_dim: int) -> float:
        return 1.0 / math.sqrt(feature_dim - EXTRA)  # the scale of q . k alone; the bias features carry their own

    def map_qk(self, q, k, rope, pos):
        # q (B, H, T, d), k (B, Hkv, T, d) -> (B, H, T, d + 8), (B, Hkv, T, d + 8)
        dt = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 q
        i = positions_of(rope, q, pos).to(dt)  # (T,) or (B, T)
        i = i.view(-1 if i.ndim == 2 else 1, 1, q.shape[2], 1)  # (1 | B, 1, T, 1)
        c = torch.tensor(self.slopes, dtype=dt, device=q.device).view(1, -1, 1, 1)  # (1, H, 1, 1)
        c = (c * (math.sqrt(self.proj_dim()) / self.shape.logit_gain)).to(q.dtype)  # rounded once, here
        row = _parts(-c.to(dt) * i / 256, q.dtype)  # 3 x (1 | B, H, T, 1): -c_h i / 256, exact in fp32
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q_ext = torch.cat(torch.broadcast_tensors(256 * c, c, *row, zero, zero, zero), dim=-1)  # (1 | B, H, T, 8)
        hi = torch.div(i, 256, rounding_mode="floor")
        k_ext = torch.cat([hi, i - 256 * hi] + [torch.full_like(i, 256.0)] * PARTS + [torch.zeros_like(i)] * 3,
                          dim=-1)  # (1 | B, 1, T, 8): (a_j, b_j, 256, 256, 256, 0, 0, 0)
        q, k = rope(q, pos), rope(k, pos)
        q_ext = q_ext.expand(q.shape[0], -1, -1, -1)
        k_ext = k_ext.to(k.dtype).expand(k.shape[0], k.shape[1], -1, -1)
        return torch.cat([q, q_ext], dim=-1), torch.cat([k, k_ext], dim=-1)
