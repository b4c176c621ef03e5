"""QK-Norm: per-head RMSNorm with a learnable gain on q and k, before RoPE (Qwen3 style).

q_h <- g_q * q_h / rms(q_h),  k_h <- g_k * k_h / rms(k_h); the gains have one entry per head
coordinate and are shared by all heads, as in Qwen3. The gains start at 1 (Qwen3), which bounds the
initial logits by sqrt(d_head); ``gain_init`` g0 starts them at g0 (bound g0^2 sqrt(d_head)), for
comparisons at a matched logit range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qklab.methods.base import AttnShape, QKMethod


@dataclass
class QKNormOptions:
    eps: float = 1e-6
    gain_init: float = 1.0  # initial value of every gain entry

    def validate(self) -> None:
        if self.gain_init <= 0:
            raise ValueError(f"qk.qknorm.gain_init must be > 0, got {self.gain_init}")


class QKNorm(QKMethod):
    name = "qknorm"
    Options = QKNormOptions
    latent_key_scale = True  # one inverse RMS per token and key head beside the MLA latent

    def __init__(self, shape: AttnShape, opts: QKNormOptions) -> None:
        super().__init__(shape, opts)
        self.q_norm = nn.RMSNorm(shape.head_dim, eps=opts.eps)
        self.k_norm = nn.RMSNorm(shape.head_dim, eps=opts.eps)

    def map_qk(self, q, k, rope, pos):
        # q: (B, H, T, D), k: (B, Hkv, T, D); normalise over D, then rotate
        return rope(self.q_norm(q), pos), rope(self.k_norm(k), pos)

    def latent_map(self, q, k, rope, pos):
        # k_norm(k) = weight * k * rsqrt(mean(k^2) + eps): a static gain and one inverse RMS per token and head
        s = torch.rsqrt(k.float().pow(2).mean(-1, keepdim=True) + self.opts.eps)  # (B, Hkv, T, 1)
        return rope(self.q_norm(q), pos), self.k_norm.weight, s.to(k.dtype)

    def clip_refusal(self, tau_clip: float) -> str:
        return ("qk.controller=qkclip cannot bound qk.method=qknorm: its logits do not depend on the scale of "
                "W_Q/W_K (clipping only shrinks them) and its gains are shared by all heads; use qk.controller=quack, "
                "qk.method=softcap, or qknorm alone")

    def reset_parameters(self) -> None:
        nn.init.constant_(self.q_norm.weight, self.opts.gain_init)
        nn.init.constant_(self.k_norm.weight, self.opts.gain_init)
