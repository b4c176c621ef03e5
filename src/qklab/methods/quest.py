"""QUEST, query-modulated spherical attention (Govindarajan et al., ICLR 2026, arXiv 2604.00199).

Keys are normalised to the unit sphere, queries are left as they are, and the logits are not scaled:

    k_hat = k / sqrt(||k||^2 + eps),   s_ij = c_h * q_i . RoPE(k_hat_j),   A = softmax(s + mask)

so |s_ij| <= c_h ||q_i||: each query's norm sets its own sharpness, and no key can win by being loud.
The paper writes A = softmax(Q K_hat^T), with no 1/sqrt(d) factor: c_h = 1 (the default). ``head_scale``
adds a learnable per-head factor c_h (init ``scale_init``; not in the paper), which also gives QK-clip a
parameter to clip exactly. The key is normalised over the whole head before RoPE (a rotation keeps the
norm); under MLA that is nope and rope parts together, and k_hat = k * (one scalar per token and head),
so the latent cache keeps it as it keeps QK-Norm: the scalar is cached beside the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qklab.fields import above, option
from qklab.methods.base import AttnShape, QKMethod
from qklab.methods.options import Options


@dataclass
class QuestOptions(Options, section="qk.quest"):
    eps: float = option(1e-6, "k / sqrt(||k||^2 + eps)", above(0))
    head_scale: bool = option(False, "a learnable logit factor c_h per head (the paper: none, c = 1)")
    scale_init: float = option(1.0, "initial c_h with head_scale", above(0))


class Quest(QKMethod):
    name = "quest"
    Options = QuestOptions
    latent_key_scale = True  # one inverse key norm per token and head beside the MLA latent

    def __init__(self, shape: AttnShape, opts: QuestOptions) -> None:
        super().__init__(shape, opts)
        opts.validate()
        c0 = torch.full((shape.n_heads,), float(opts.scale_init))
        self.head_scale = nn.Parameter(c0) if opts.head_scale else None

    def key_inv_norm(self, k: torch.Tensor) -> torch.Tensor:
        """k (B, Hkv, T, D) -> 1 / sqrt(||k||^2 + eps) (B, Hkv, T, 1), in fp32 or wider, cast to k's dtype."""
        n2 = k.to(torch.promote_types(k.dtype, torch.float32)).pow(2).sum(-1, keepdim=True)
        return torch.rsqrt(n2 + self.opts.eps).to(k.dtype)

    def _query(self, q: torch.Tensor) -> torch.Tensor:
        return q if self.head_scale is None else q * self.head_scale.to(q.dtype).view(1, -1, 1, 1)

    def map_qk(self, q, k, rope, pos):
        return rope(self._query(q), pos), rope(k * self.key_inv_norm(k), pos)

    def scale(self, feature_dim: int) -> float:
        return 1.0  # softmax(Q K_hat^T): the query's norm is the temperature

    def latent_map(self, q, k, rope, pos):
        return rope(self._query(q), pos), None, self.key_inv_norm(k)

    def clip_refusal(self, tau_clip: float) -> str:
        if self.head_scale is None:
            return ("qk.controller=qkclip cannot bound qk.method=quest exactly: its logits ignore the scale of W_K "
                    "(clipping W_Q and W_K shrinks them by sqrt(g) only); set qk.quest.head_scale=true, which it clips")
        return ""

    @torch.no_grad()
    def clip_logits(self, g: torch.Tensor) -> bool:
        if self.head_scale is None:
            return False
        self.head_scale.mul_(g.to(self.head_scale))  # the logits are linear in c_h: exact
        return True

    def reset_parameters(self) -> None:
        if self.head_scale is not None:
            nn.init.constant_(self.head_scale, self.opts.scale_init)
