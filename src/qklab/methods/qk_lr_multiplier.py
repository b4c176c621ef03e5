"""The fixed-multiplier ablation of QuacK: the Q/K matrices (MLA: all six on the logit path) learn at a
constant tau * eta."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qklab.methods.base import QKController
from qklab.methods.headwise import HeadScaledUpdate, logit_matrices


@dataclass
class QKLRMultiplierOptions:
    tau: float = 0.1

    def validate(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"qk.qk_lr_multiplier.tau must be > 0, got {self.tau}")


class QKLRMultiplier(QKController):
    name = "qk_lr_multiplier"
    Options = QKLRMultiplierOptions

    def __init__(self, model, optimizer, opts: QKLRMultiplierOptions) -> None:
        super().__init__(model, optimizer, opts)
        mats = [m for a in model.attention_layers() for m in logit_matrices(a).values()]  # MLA: all six
        self.update = HeadScaledUpdate(mats)
        self.factors = [torch.full((m.n_heads,), float(opts.tau)) for m in mats]

    def before_step(self, step: int) -> None:
        self.update.snapshot()

    def after_step(self, step: int) -> None:
        self.update.apply(self.factors)
