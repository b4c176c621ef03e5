"""The fixed-multiplier ablation of QuacK: the Q/K matrices (MLA: all six on the logit path) learn at a
constant tau * eta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qklab.fields import above, option
from qklab.methods.applied import MeasuredUpdate, head_norms, per_layer
from qklab.methods.base import QKController
from qklab.methods.headwise import logit_matrices
from qklab.methods.options import Options


@dataclass
class QKLRMultiplierOptions(Options, section="qk.qk_lr_multiplier"):
    tau: float = option(0.1, "the Q/K matrices' constant learning rate relative to eta", above(0))


class QKLRMultiplier(QKController):
    name = "qk_lr_multiplier"
    Options = QKLRMultiplierOptions

    def __init__(self, model, optimizer, opts: QKLRMultiplierOptions) -> None:
        super().__init__(model, optimizer, opts)
        layers = [logit_matrices(a) for a in model.attention_layers()]
        self.names = [list(m) for m in layers]
        mats = [m for layer in layers for m in layer.values()]  # MLA: all six
        self.update = MeasuredUpdate(mats)
        self.factors = [torch.full((m.n_heads,), float(opts.tau)) for m in mats]

    def before_step(self, step: int) -> None:
        self.update.snapshot()

    def after_step(self, step: int) -> None:
        self.update.apply(self.factors)

    def metrics(self) -> dict[str, Any]:
        """Per layer and head: the factor applied (tau) and the norm of the change each matrix took."""
        if not self.update.sq:
            return {}
        return {**per_layer("qk_lr_multiplier", self.factors, self.names),
                **per_layer("qk_lr_multiplier_update", head_norms(self.update.sq, self.update.mats, self.reduce),
                            self.names)}
