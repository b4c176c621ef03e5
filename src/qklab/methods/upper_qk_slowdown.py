"""Slowed upper-layer Q/K: early in training, the Q/K matrices of the upper layers learn at factor * eta,
then at eta again (arXiv 2605.10504; its abstract names neither the layers, the factor nor the duration:
the choices are options, documented in docs/baselines.md).

Layer i of L is slowed when i >= L - n_upper, n_upper = max(1, round(share * L)). Its logit-path matrices
(MHA/GQA: W_Q, W_K; MLA: all six, as the fixed multiplier takes them) learn at rate factor f(step):

    f(step) = factor                                         step < steps
              factor + (1 - factor) * (step - steps + 1) / ramp   steps <= step < steps + ramp
              1                                              afterwards

realised on the optimizer's update (decoupled decay with it, as a rate would) by ``HeadScaledUpdate``,
so it holds for AdamW and Muon alike. Once every factor is 1 the controller does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qklab.fields import above, at_least, between, option
from qklab.methods.applied import MeasuredUpdate, head_norms, per_layer
from qklab.methods.base import QKController
from qklab.methods.headwise import logit_matrices
from qklab.methods.options import Options


@dataclass
class UpperQKSlowdownOptions(Options, section="qk.upper_qk_slowdown"):
    share: float = option(0.5, "share of the layers, counted from the top, whose Q/K are slowed",
                          between(0, 1, lo_open=True))
    factor: float = option(0.1, "their Q/K learning rate relative to eta while slowed", above(0))
    steps: int = option(100, "optimizer steps at the slowed rate, from the first", at_least(0))
    ramp: int = option(0, "steps of a linear return from factor to 1 after them (0: a switch)", at_least(0))


def slowdown_factor(step: int, opts: UpperQKSlowdownOptions) -> float:
    """The slowed layers' Q/K rate relative to eta at optimizer step ``step`` (0-based)."""
    if step < opts.steps:
        return opts.factor
    if step < opts.steps + opts.ramp:
        return opts.factor + (1 - opts.factor) * (step - opts.steps + 1) / opts.ramp
    return 1.0


def slowed_layers(n_layers: int, share: float) -> list[int]:
    """Indices of the upper layers that are slowed: the top max(1, round(share * n_layers))."""
    n_upper = max(1, round(share * n_layers))
    return list(range(n_layers - n_upper, n_layers))


class UpperQKSlowdown(QKController):
    name = "upper_qk_slowdown"
    Options = UpperQKSlowdownOptions

    def __init__(self, model, optimizer, opts: UpperQKSlowdownOptions) -> None:
        super().__init__(model, optimizer, opts)
        layers = [logit_matrices(a) for a in model.attention_layers()]
        self.layers = slowed_layers(len(layers), opts.share)
        self.names = [list(layers[i]) for i in self.layers]
        self.update = MeasuredUpdate([m for i in self.layers for m in layers[i].values()])  # the slowed only
        self.factors = [torch.ones(m.n_heads) for m in self.update.mats]
        self.active = False  # whether the step in progress is rescaled

    def before_step(self, step: int) -> None:
        f = slowdown_factor(step, self.opts)
        self.active = f != 1.0
        if self.active:
            self.factors = [torch.full_like(t, f) for t in self.factors]
            self.update.snapshot()

    def after_step(self, step: int) -> None:
        if self.active:
            self.update.apply(self.factors)

    def skip_step(self, step: int) -> None:
        self.active = False

    def metrics(self) -> dict[str, Any]:
        """While slowing: the slowed layers' indices and, per slowed layer and head, the factor applied in
        the last step and the norm of the change each matrix took; nothing once the schedule is over."""
        if not self.active:
            return {}
        return {"upper_qk_slowdown_layers": list(self.layers),
                **per_layer("upper_qk_slowdown", self.factors, self.names),
                **per_layer("upper_qk_slowdown_update", head_norms(self.update.sq, self.update.mats,
                                                                    self.reduce), self.names)}
