"""Logit soft-capping (Gemma 2): s <- cap * tanh(s / cap) on the scaled logits, before the mask.

It changes the logits, so attention runs it on the eager path only (never a fused kernel that would
silently skip it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qklab.fields import above, option
from qklab.methods.base import AttnShape, QKMethod
from qklab.methods.options import Options


@dataclass
class SoftCapOptions(Options, section="qk.softcap"):
    cap: float = option(50.0, "the logit bound: s <- cap * tanh(s / cap) on the scaled logits", above(0))


class SoftCap(QKMethod):
    name = "softcap"
    Options = SoftCapOptions
    modifies_logits = True
    keeps_model_qk_norm = True  # it caps the logits of whatever q and k the model makes

    def __init__(self, shape: AttnShape, opts: SoftCapOptions) -> None:
        super().__init__(shape, opts)
        self.cap = float(opts.cap)

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(s / self.cap)

    def clip_refusal(self, tau_clip: float) -> str:
        if tau_clip >= self.cap:
            return (f"qk.qkclip.tau_clip={tau_clip} >= qk.softcap.cap={self.cap}: capped logits never exceed the cap, "
                    "so QK-clip would never act; set tau_clip below the cap or drop the controller")
        return ""

    def raw_logit(self, s: torch.Tensor) -> torch.Tensor:
        # cap * atanh(s / cap); |s| < cap always (the tanh is strict), clamped against rounding to the cap
        lim = 1.0 - torch.finfo(torch.float32).eps
        return self.cap * torch.atanh((s.float() / self.cap).clamp(-lim, lim))
