"""QK-clip (the clipping half of MuonClip): after each optimizer step, every head whose largest
pre-softmax logit since the last step S exceeds tau_clip gets W_Q^h and W_K^h scaled by sqrt(tau_clip / S),
so its logits shrink by tau_clip / S from the next step on (logits are bilinear in W_Q, W_K).

GQA: each query head is scaled by its own sqrt(g_h); a shared key head by the sqrt of its group's
smallest g. MLA: W_uq^h and W_uk^h by sqrt(g_h), W_qr^h by g_h (its partner, the shared rope key W_kr,
is left alone). A head with S <= 0 (or none seen) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qklab.methods.base import QKController
from qklab.methods.headwise import is_mla, logit_matrices


@dataclass
class QKClipOptions:
    tau_clip: float = 100.0

    def validate(self) -> None:
        if self.tau_clip <= 0:
            raise ValueError(f"qk.qkclip.tau_clip must be > 0, got {self.tau_clip}")


class QKClip(QKController):
    name = "qkclip"
    Options = QKClipOptions

    def __init__(self, model, optimizer, opts: QKClipOptions) -> None:
        super().__init__(model, optimizer, opts)
        self.attns = [b.attn for b in model.blocks]
        for a in self.attns:
            a.track_max_logit = True
        self.last: dict[str, Any] = {}

    def gains(self, s_max: torch.Tensor) -> torch.Tensor:
        """(H,) logit gain g = tau / S for heads above tau_clip, else 1 (S <= 0 guarded)."""
        tau = self.opts.tau_clip
        over = torch.isfinite(s_max) & (s_max > tau)
        return torch.where(over, tau / torch.where(over, s_max, torch.ones_like(s_max)), torch.ones_like(s_max))

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        clipped, smax_all, gmin = 0, [], 1.0
        for a in self.attns:
            s_max = a.pop_max_logit()  # (H,)
            g = self.gains(s_max)
            smax_all.append(s_max.max().item())
            if (g < 1).any():
                self.rescale(a, g)
                clipped += int((g < 1).sum())
                gmin = min(gmin, g.min().item())
        self.last = {"qkclip_heads_clipped": clipped, "qkclip_min_gain": gmin, "qkclip_smax": max(smax_all)}

    def skip_step(self, step: int) -> None:
        for a in self.attns:  # a dropped step's logits must not decide the next clip
            a.pop_max_logit()

    @staticmethod
    @torch.no_grad()
    def rescale(attn, g: torch.Tensor) -> None:
        """Scale the logit-path weights of ``attn`` so that head h's logits shrink by g[h]."""
        mats = logit_matrices(attn)

        def scale(name: str, f: torch.Tensor) -> None:
            mats[name].heads().mul_(f.to(mats[name].weight.device).view(-1, 1, 1))

        if is_mla(attn):
            scale("wuq", g.sqrt())
            scale("wuk", g.sqrt())
            scale("wqr", g)
        else:
            H, Hkv = mats["wq"].n_heads, mats["wk"].n_heads
            scale("wq", g.sqrt())
            scale("wk", g.view(Hkv, H // Hkv).amin(dim=1).sqrt())

    def metrics(self) -> dict[str, Any]:
        return dict(self.last)
