"""ALiBi's linear recency bias (Press et al. 2022, arXiv 2108.12409), added to RoPE attention.

Head h's logit of query i on key j gets the bias -m_h (i - j), with ALiBi's geometric slopes: for H a power
of two m_h = 2^(-8 h / H), h = 1..H; otherwise the H' = 2^floor(log2 H) slopes of H', then every other slope
of 2H' until there are H:

    s_ij = q_i . k_j / sqrt(d) - m_h (i - j)

qklab's models rotate q and k with RoPE, and this method keeps that rotation: it is a recency prior on top
of standard attention (the control for QK-MAP's starting recency prior, docs/qk-map.md), not the paper's
model without position embeddings. ``slope_scale`` multiplies every slope (0: standard attention).

The bias travels in q and k, so the fused kernels, GQA and the KV cache keep working: three features are
appended, q_i -> (q_i, 256 c_h, c_h, -c_h i) and k_j -> (k_j, a_j, b_j, 1), with c_h = sqrt(d) m_h (d: the
per-head width before the extra features) and j = 256 a_j + b_j; their dot product times the scale
1 / sqrt(d) is m_h (j - i). Positions are the absolute ones (the KV cache offset included; a left-padded
transformers batch: its position ids), so the bias depends on i - j alone. The split of j into two base-256
digits keeps the bias exact in bf16 too (to 65536 positions): the key digits are integers below 256, exact
in bf16, so only c_h is rounded, once (each slope off by at most 2^-9 of itself); -c_h i is rounded as well,
but it is the same for every key of query i, which the softmax ignores (it moves only the row's logits as a
whole: the max-logit reading, and a sink's share where there is one). An MLA latent cache cannot hold the
key features (they are not a rotation of the latent's keys): MLA materialises per-head keys.
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


EXTRA = 3  # the bias features appended to q and k


class ALiBi(QKMethod):
    name = "alibi"
    Options = ALiBiOptions
    latent_cache_ok = False  # the key features (a_j, b_j, 1) are no rotation of MLA's latent keys
    keeps_model_qk_norm = True  # qklab.hf: it biases whatever (normalised) q and k the model makes

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
        # q (B, H, T, d), k (B, Hkv, T, d) -> (B, H, T, d + 3), (B, Hkv, T, d + 3)
        dt = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 q
        i = positions_of(rope, q, pos).to(dt)  # (T,) or (B, T)
        i = i.view(-1 if i.ndim == 2 else 1, 1, q.shape[2], 1)  # (1 | B, 1, T, 1)
        c = torch.tensor(self.slopes, dtype=dt, device=q.device).view(1, -1, 1, 1) * math.sqrt(self.proj_dim())
        q_ext = torch.cat(torch.broadcast_tensors(256 * c, c, -c * i), dim=-1)  # (1 | B, H, T, 3)
        hi = torch.div(i, 256, rounding_mode="floor")
        k_ext = torch.cat([hi, i - 256 * hi, torch.ones_like(i)], dim=-1)  # (1 | B, 1, T, 3): (a_j, b_j, 1)
        q, k = rope(q, pos), rope(k, pos)
        q_ext = q_ext.to(q.dtype).expand(q.shape[0], -1, -1, -1)
        k_ext = k_ext.to(k.dtype).expand(k.shape[0], k.shape[1], -1, -1)
        return torch.cat([q, q_ext], dim=-1), torch.cat([k, k_ext], dim=-1)
