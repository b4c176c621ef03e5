"""QK-Norm: per-head RMSNorm with a learnable gain on q and k, before RoPE (Qwen3 style).

q_h <- g_q * q_h / rms(q_h),  k_h <- g_k * k_h / rms(k_h); the gains have one entry per head
coordinate and are shared by all heads, as in Qwen3. The gains start at 1 (Qwen3), which bounds the
initial logits by sqrt(d_head); ``gain_init`` g0 starts them at g0 (bound g0^2 sqrt(d_head)), for
comparisons at a matched logit range.

Coarser key granularities (they shrink what an MLA latent cache keeps per token, H inverse RMS values):
``k_group`` n: the keys of n consecutive key heads share one RMS (over their n * d_head values: H / n
values per token); ``k_parts``: the nope and rope parts of an MLA key are normalised separately, and
the rope part's RMS, that of the one shared rope key, is folded into the cached rope key (no extra
value). Queries stay per head.

Variants (options; the defaults are the QK-Norm above, computed exactly as before):
* ``q_gain=false``: a parameter-free RMS on q, a learnable RMSNorm on k (DeepSeek-V4 style); ``k_gain=false``
  likewise on k (both false: a parameter-free QK-Norm, which commutes with RoPE);
* ``stats="flat"``: one statistic over all heads of a token (q over its H * d_head values, k over its
  Hkv * d_head values) instead of one per head (MLA latent cache: one key scalar per token);
* ``gains="head"``: a gain vector per head (q: H * d_head entries, k: Hkv * d_head) instead of one shared
  by the heads (MLA: no latent cache, the rope part of each head's key would differ);
* ``p`` (arXiv 2602.05006): an Lp statistic, x / (mean(|x|^p) + eps)^(1/p) (p = 2: the RMS), and with
  p != 2 a learnable logit scale alpha (one per layer, init 1) on the query side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qklab.fields import above, at_least, option
from qklab.methods.base import AttnShape, QKMethod
from qklab.methods.options import Options


@dataclass
class QKNormOptions(Options, section="qk.qknorm"):
    eps: float = option(1e-6, "added to the mean square under the root (RMSNorm's epsilon)")
    gain_init: float = option(1.0, "initial value of every gain entry", above(0))
    k_group: int = option(1, "key heads sharing one key RMS (1: per head)", at_least(1))
    k_parts: bool = option(False, "MLA: normalise the keys' nope and rope parts separately")
    # late: added after the CPU studies' results, hashed only away from their defaults (the old QK-Norm)
    q_gain: bool = option(True, "false: parameter-free RMS on q (DeepSeek-V4 style)", late=True)
    stats: Literal["head", "flat"] = option("head", "the statistic per head, or over all of a token's heads",
                                            late=True)
    gains: Literal["shared", "head"] = option("shared", "one gain vector for all heads, or one per head", late=True)
    p: float = option(2.0, "the statistic (mean |x|^p)^(1/p); p != 2: a learnable logit scale", at_least(1),
                      late=True)
    k_gain: bool = option(True, "false: parameter-free RMS on k (with q_gain=false: a QK-Norm that commutes with RoPE)",
                          late=True)

    def check(self) -> None:
        if self.stats == "flat" and self.k_group != 1:
            raise ValueError("qk.qknorm.stats=flat already takes one key statistic over all heads; leave k_group at 1")

    @property
    def plain(self) -> bool:
        """The original QK-Norm (RMS, statistics per head, gains shared, on q and k)."""
        return self.q_gain and self.k_gain and self.stats == "head" and self.gains == "shared" and self.p == 2.0


class _NormRotate(torch.autograd.Function):
    """y = rope(g * u), u = x * r, r = rsqrt(mean(x^2) + eps): RMSNorm with gain and RoPE in one step.

    x (B, T, H, D), in the projections' contiguous layout; g (D,); cos, sin_s (T, 1, D) with
    sin_s = (-sin_1, sin_2). The gain is folded into the tables (rope(g * u) = u * (g cos) +
    roll(u) * (roll(g) sin_s)), and the backward is written out:
        dv = rope^T(dy) = dy * cos + roll(dy * sin_s),   dg = sum over (B, T, H) of dv * u,
        dx = r * (dv * g) - r * <dv * g, u> / D * u.
    Eager, this makes 5 passes over x forward and 9 backward, about half of what autograd makes through
    nn.RMSNorm and the textbook rotation; the compiler fuses the composite form itself, so this is the
    eager path only (``tests/methods/test_qknorm.py`` holds the two to the formula and to each other)."""

    @staticmethod
    def forward(ctx, x, g, cos, sin_s, eps: float):
        D = x.shape[-1]
        # the statistic in one pass, in fp32 or wider: mean(x^2) = ||x||^2 / D
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
        r = torch.rsqrt(n.square_().div_(D).add_(eps)).to(x.dtype)  # (B, T, H, 1)
        u = x * r
        half = D // 2
        gc, gs = (g * cos).to(x.dtype), (g.roll(half, -1) * sin_s).to(x.dtype)  # (T, 1, D)
        ctx.save_for_backward(u, r, g, cos, sin_s)
        return torch.addcmul(u * gc, u.roll(half, -1), gs)

    @staticmethod
    def backward(ctx, dy):
        u, r, g, cos, sin_s = ctx.saved_tensors
        D = dy.shape[-1]
        dv = (dy * sin_s).roll(D // 2, -1).addcmul_(dy, cos)  # (B, T, H, D): the gradient of g * u
        p = dv * u
        dg = p.flatten(0, -2).sum(0)  # (D,)
        gdot = (p @ g.to(p.dtype)).unsqueeze(-1).mul_(r / D)  # (B, T, H, 1): r <dv * g, u> / D
        dx = (dv * g.to(dv.dtype)).mul_(r).addcmul_(u, gdot, value=-1)
        return dx, dg.to(g.dtype), None, None, None


class QKNorm(QKMethod):
    name = "qknorm"
    Options = QKNormOptions
    latent_key_scale = True  # one inverse RMS per token and key head beside the MLA latent

    def adopt_qk_norm(self, q_norm: nn.Module, k_norm: nn.Module) -> None:
        with torch.no_grad():  # the family's own QK-Norm (Qwen3): its trained gains and eps carry over
            for ours, theirs in ((self.q_norm, q_norm), (self.k_norm, k_norm)):
                if ours.weight is not None:  # per-head gains start from the shared ones, tiled
                    ours.weight.copy_(theirs.weight.repeat(ours.weight.numel() // theirs.weight.numel()))
                ours.eps = getattr(theirs, "variance_epsilon", getattr(theirs, "eps", ours.eps))

    def __init__(self, shape: AttnShape, opts: QKNormOptions) -> None:
        super().__init__(shape, opts)
        opts.validate()
        if shape.n_kv_heads % opts.k_group:
            raise ValueError(f"qk.qknorm.k_group={opts.k_group} must divide the {shape.n_kv_heads} key heads")
        if opts.k_parts and not 0 < shape.rope_dim < shape.head_dim:
            raise ValueError("qk.qknorm.k_parts needs keys with a nope and a rope part (model.attention=mla)")
        self.latent_key_group, self.latent_key_parts = opts.k_group, opts.k_parts
        if opts.stats == "flat":
            self.latent_key_group = shape.n_kv_heads  # one key statistic per token
        if opts.gains == "head":
            self.latent_cache_ok = False  # a per-head gain on the rope part: the shared rope key would differ
        # the gains live in nn.RMSNorm modules (per head: H * d_head entries, flat): 1-D, so no weight decay;
        # only the plain QK-Norm calls the modules, the variants use their weights (``_gain``)
        D, n_q, n_k = shape.head_dim, 1, 1
        if opts.gains == "head":
            n_q, n_k = shape.n_heads, shape.n_kv_heads
        self.q_norm = nn.RMSNorm(n_q * D, eps=opts.eps, elementwise_affine=opts.q_gain)
        self.k_norm = nn.RMSNorm(n_k * D, eps=opts.eps, elementwise_affine=opts.k_gain)
        self.alpha = nn.Parameter(torch.ones(())) if opts.p != 2.0 else None  # Lp: the learnable logit scale

    def _gain(self, norm: nn.RMSNorm, heads: int) -> torch.Tensor | None:
        """A norm's gain as it multiplies (B, heads, T, D): (D,), (heads, 1, D) per head, or None."""
        w = norm.weight
        if w is None or self.opts.gains == "shared":
            return w
        return w.view(heads, 1, self.shape.head_dim)

    def _inv_stat(self, sq: torch.Tensor) -> torch.Tensor:
        """mean(|x|^p) -> 1 / (mean(|x|^p) + eps)^(1/p) (p = 2: the inverse RMS)."""
        return torch.rsqrt(sq + self.opts.eps) if self.opts.p == 2.0 else (sq + self.opts.eps).pow(-1.0 / self.opts.p)

    def _pow(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # the statistic in fp32 or wider
        return x.pow(2) if self.opts.p == 2.0 else x.abs().pow(self.opts.p)

    def query_map(self, q: torch.Tensor) -> torch.Tensor:
        """The variants' query map before RoPE: gain * q / stat(q) (flat: over all heads), times alpha."""
        sq = self._pow(q)
        ms = sq.mean(dim=(1, 3), keepdim=True) if self.opts.stats == "flat" else sq.mean(-1, keepdim=True)
        out = q * self._inv_stat(ms).to(q.dtype)
        g = self._gain(self.q_norm, self.shape.n_heads)
        if g is not None:
            out = g * out
        return out if self.alpha is None else out * self.alpha.to(q.dtype)

    def key_inv_rms(self, k: torch.Tensor) -> torch.Tensor:
        """k (B, Hkv, T, D) -> inverse RMS (B, Hkv, T, 1), or (B, Hkv, T, D) constant on each part with
        ``k_parts``; equal within each group of ``k_group`` heads."""
        B, Hk, T, D = k.shape
        sq = self._pow(k)
        if self.opts.k_parts:
            r = self.shape.rope_dim
            ms = torch.stack([sq[..., : D - r].mean(-1), sq[..., D - r :].mean(-1)], dim=-1)  # (B, Hk, T, 2)
        else:
            ms = sq.mean(-1, keepdim=True)  # (B, Hk, T, 1)
        g = self.latent_key_group
        if g > 1:  # mean over the group's heads (every part has the same width in each head)
            ms = ms.view(B, Hk // g, g, T, -1).mean(2).repeat_interleave(g, dim=1)
        inv = self._inv_stat(ms)
        if self.opts.k_parts:
            inv = inv.repeat_interleave(torch.tensor([D - self.shape.rope_dim, self.shape.rope_dim],
                                                     device=inv.device), dim=-1)  # (B, Hk, T, D)
        return inv.to(k.dtype)

    def map_qk(self, q, k, rope, pos):
        # q: (B, H, T, D), k: (B, Hkv, T, D); normalise over D (keys: per the granularity), then rotate
        if not self.opts.plain:
            return rope(self.query_map(q), pos), rope(self._key_map(k), pos)
        if self.opts.k_group == 1 and not self.opts.k_parts:
            # in the projections' own (B, T, H, D) layout, where the rows are contiguous (no copies)
            # the compiler fuses the composite itself; MLA's partial RoPE rotates a slice only
            if torch.compiler.is_compiling() or not hasattr(rope, "window"):
                return self._norm_rotate_composite(q, k, rope, pos)
            cos, _, sin_s = rope.window(q, pos)  # (T, D)
            cos, sin_s = cos[:, None], sin_s[:, None]  # (T, 1, D)
            q = _NormRotate.apply(q.transpose(1, 2), self.q_norm.weight, cos, sin_s, self.opts.eps)
            k = _NormRotate.apply(k.transpose(1, 2), self.k_norm.weight, cos, sin_s, self.opts.eps)
            return q.transpose(1, 2), k.transpose(1, 2)
        return rope(self.q_norm(q), pos), rope(self.k_norm.weight * k * self.key_inv_rms(k), pos)

    def _key_map(self, k: torch.Tensor) -> torch.Tensor:
        g = self._gain(self.k_norm, self.shape.n_kv_heads)
        return k * self.key_inv_rms(k) if g is None else g * k * self.key_inv_rms(k)

    def _norm_rotate_composite(self, q, k, rope, pos):
        """nn.RMSNorm, then RoPE, through autograd: the form the compiler fuses."""
        q = self.q_norm(q.transpose(1, 2)).transpose(1, 2)
        k = self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        return rope(q, pos), rope(k, pos)

    def latent_map(self, q, k, rope, pos):
        # the key map is weight * k * inv_rms(k): a static gain and inverse RMS values per token and head
        if not self.opts.plain:  # (per-head gains have no latent form: latent_cache_ok is False for them)
            return rope(self.query_map(q), pos), self.k_norm.weight, self.key_inv_rms(k)
        return rope(self.q_norm(q), pos), self.k_norm.weight, self.key_inv_rms(k)

    def after_rope_refusal(self) -> str:
        # the RMS of a head (or of all heads, or a key group) is the same before and after a rotation; a gain
        # per feature, or an Lp statistic with p != 2, is not
        if self.opts.p != 2.0:
            return (f"qknorm with p={self.opts.p} must sit before RoPE (an Lp statistic changes under the rotation): "
                    "call qk(q, k) on the projections' outputs")
        if self.q_norm.weight is not None or self.k_norm.weight is not None:
            return ("qknorm with learnable gains must sit before RoPE (a gain per feature does not commute with the "
                    "rotation): call qk(q, k) on the projections' outputs")
        return ""

    def clip_refusal(self, tau_clip: float) -> str:
        return ("qk.controller=qkclip cannot bound qk.method=qknorm: its logits do not depend on the scale of "
                "W_Q/W_K (clipping only shrinks them) and its gains are shared by all heads; use qk.controller=quack, "
                "qk.method=softcap, or qknorm alone")

    def reset_parameters(self) -> None:
        if self.q_norm.weight is not None:
            nn.init.constant_(self.q_norm.weight, self.opts.gain_init)
        if self.k_norm.weight is not None:
            nn.init.constant_(self.k_norm.weight, self.opts.gain_init)
        if self.alpha is not None:
            nn.init.ones_(self.alpha)
