"""``QKCallback``: qklab's optimizer-side controllers and per-head max-logit logging under transformers'
``Trainer``.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[QKCallback("quack", tau=0.5)])

The controller runs around every optimizer step (``on_pre_optimizer_step`` / ``on_optimizer_step``); every
log record gets the controller's figures and ``qk/max_logit`` (the largest pre-softmax logit of the training
forwards since the last log) with its per-head values in ``qk/max_logit/layer{i}``, one entry per head.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from qklab.hf.attach import Attached, attach
from qklab.hf.layers import LayerSpec


class QKCallback(TrainerCallback):
    def __init__(self, controller: str = "none", layers: list[LayerSpec] | None = None, log_max_logit: bool = True,
                 **options: Any) -> None:
        self.controller, self.layers, self.log_max_logit, self.options = controller, layers, log_max_logit, options
        self.attached: Attached | None = None
        self.history: list[dict[str, Any]] = []  # every log record this callback added to, in order

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        self.attached = attach(model, opt, self.controller, layers=self.layers, hooks=False,
                               track=self.log_max_logit, **self.options)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.attached.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.attached.after_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.attached is None:
            return
        rec = {}
        for k, v in self.attached.metrics().items():
            if k == "max_logit_per_head":
                rec.update({f"qk/max_logit/layer{i}": heads for i, heads in enumerate(v)})
            else:
                rec[f"qk/{k}"] = v
        logs.update(rec)  # seen by the callbacks after this one (e.g. the console printer)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(rec)  # the Trainer recorded this log before calling back
        self.history.append({"step": state.global_step, **rec})

    def on_train_end(self, args, state, control, **kwargs):
        if self.attached is not None:
            self.attached.remove()
