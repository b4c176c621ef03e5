"""``QKCallback``: qklab's optimizer-side controllers and max-logit logging under transformers' ``Trainer``.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[QKCallback("quack", tau=0.5)])

The controller runs around every optimizer step (``on_pre_optimizer_step`` / ``on_optimizer_step``). Each
log record of the training loop gets scalars only, so that every reporter (``report_to``: TensorBoard,
W&B, ...) takes them and the console line stays short:

* ``qk/max_logit``: the largest pre-softmax logit, over layers and heads, of the training forwards of the
  step the record reports (``every_step=True``: of every step since the previous record);
  ``qk/max_logit/layer{i}``: layer i's, over its heads; ``per_head=True`` adds ``qk/max_logit/layer{i}/head{h}``.
  A record with nothing measured has no max-logit key (never -inf).
* the controller's scalars as they are (``qk/quack_factor_min``, ``qk/qkclip_heads_clipped``, ...), and each
  of its per-layer, per-head arrays (QuacK's factors ``quack_wq``, the norms of the changes ``quack_update_wq``,
  QK-clip's gains ``qkclip_g``, ...) as its min, max and mean over every layer and head: ``qk/quack_wq/min``,
  ``qk/quack_wq/max``, ``qk/quack_wq/mean``; ``per_head=True`` adds ``qk/quack_wq/layer{i}/head{h}``.

The arrays themselves go to ``qk_heads.jsonl`` in ``args.output_dir`` (``heads_file``; None: not written),
one line per record, never to the console: ``{"step": 10, "max_logit": [[per head] per layer], "quack_wq":
[[...]], ...}``. The file is appended to (a resumed run adds its records; a step's last line is its record).
A step gets one qk record: a second log at the same step (evaluation, the end-of-training summary) gets none.

Cost. Measuring max logits needs q.k; the other steps need nothing. So by default only the steps whose
record is logged (``logging_strategy="steps"``: every ``logging_steps``-th, and the first with
``logging_first_step``) run qklab's attention function, fused SDPA plus a chunked QK^T max pass; every other
step runs the model's own attention implementation, untouched (``logging_strategy="epoch"``: every step
measures, as with ``every_step=True``). ``benchmarks/hf_callback.py`` (CPU, 2 threads; a 4-layer Llama,
d_model 256, 8 heads, 4 KV heads, batch 8 x 256 tokens, AdamW; ``logging_steps=10``; median of 12 paired
rounds): ``QKCallback("none")`` 1.00x the step time of the plain ``sdpa`` model, ``every_step=True`` 1.08x
(as ``logging_steps=1``), ``QKCallback("quack")`` 1.02x; eager attention (materialised logits) on every step
costs 1.23x. QK-clip reads every step's max logits, so it measures every step.

transformers calls ``on_log`` on its callbacks in list order and lists the reporters of ``report_to`` before
the user's callbacks, so they would never see the qk scalars: at ``on_train_begin`` the callback moves
itself to the front of the Trainer's list.

``remove()`` (``on_train_end`` calls it) leaves the model and optimizer exactly as they were (weights aside):
``Attached.remove``. A second ``train()`` attaches again; a handle of this callback's that an interrupted
``train()`` left live is replaced, any other live handle on the model or optimizer is refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from typing import Any

from transformers import TrainerCallback

from qklab.errors import ConfigError
from qklab.hf.attach import Attached, attach
from qklab.hf.layers import LayerSpec


class QKCallback(TrainerCallback):
    """``controller`` with its ``options`` (those of ``qklab.attach``) on ``layers`` (default: found by name).
    ``log_max_logit``: measure and log max logits; ``per_head``: log each head's values too; ``every_step``:
    measure every step, not only the logged ones; ``heads_file``: the per-head arrays' file in
    ``args.output_dir`` (None: not written)."""

    def __init__(self, controller: str = "none", layers: list[LayerSpec] | None = None, log_max_logit: bool = True,
                 per_head: bool = False, every_step: bool = False, heads_file: str | None = "qk_heads.jsonl",
                 **options: Any) -> None:
        self.controller, self.layers, self.log_max_logit, self.options = controller, layers, log_max_logit, options
        self.per_head, self.every_step, self.heads_file = per_head, every_step, heads_file
        self.attached: Attached | None = None
        self.history: list[dict[str, Any]] = []  # every qk record this callback added to a log, in order
        self.sampled = False  # max logits measured on the logged steps only
        self._logged_step: int | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._go_first()
        self.remove()  # this callback's own handle, if an interrupted train() left it live
        # the steps that log are known in advance unless records come per epoch
        self.sampled = self.log_max_logit and not self.every_step and args.logging_strategy != "epoch"
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        self.attached = attach(model, opt, self.controller, layers=self.layers, hooks=False,
                               track=self.log_max_logit and not self.sampled, **self.options)
        if self.log_max_logit:  # refused now, not at the first logged step
            try:
                self.attached.check_measurable()
            except ConfigError:
                self.remove()
                raise
        self._logged_step = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.sampled:
            self.attached.set_tracking(self._logs_after(args, state))

    @staticmethod
    def _logs_after(args, state) -> bool:
        """Whether the Trainer logs after the optimizer step about to run (``DefaultFlowCallback``'s rule)."""
        step = state.global_step + 1
        return (step == 1 and args.logging_first_step) or (args.logging_strategy == "steps" and state.logging_steps > 0
                                                           and step % state.logging_steps == 0)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.attached.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.attached.after_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.attached is None or self.attached.removed or state.global_step == self._logged_step:
            return
        self._logged_step = state.global_step
        figures = self.attached.metrics()
        rec = scalars(figures, self.per_head)
        if not rec:  # nothing measured, no controller figures
            return
        logs.update(rec)  # seen by the callbacks after this one: the reporters, the console printer
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(rec)  # the Trainer recorded this log before calling back
        self.history.append({"step": state.global_step, **rec})
        arrays = head_arrays(figures)
        if arrays and self.heads_file and args.output_dir and state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, self.heads_file), "a") as f:
                f.write(json.dumps({"step": state.global_step, **arrays}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self.remove()

    def remove(self) -> None:
        """Detach from the model: the model and optimizer exactly as they were before training (weights aside)."""
        if self.attached is not None:
            self.attached.remove()

    def _go_first(self) -> None:
        """Move this callback to the front of the Trainer's callback list (the module docstring says why).
        transformers hands a callback no reference to it: the list is the ``CallbackHandler`` calling this
        event, found up the stack; moving an entry forward keeps the handler's loop over the list intact."""
        from transformers.trainer_callback import CallbackHandler

        frame = sys._getframe(1)
        while frame is not None:
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and any(cb is self for cb in handler.callbacks):
                handler.callbacks.remove(self)
                handler.callbacks.insert(0, self)
                return
            frame = frame.f_back
        warnings.warn("QKCallback found no Trainer calling it: its qk scalars reach only the callbacks after it",
                      stacklevel=2)


def _rows(v: list) -> list[list[float]]:
    """Per layer, per head (a flat list: one layer)."""
    return v if v and isinstance(v[0], list) else [v]


def scalars(figures: dict[str, Any], per_head: bool = False) -> dict[str, float]:
    """The ``qk/`` scalars of one log record from ``Attached.metrics()`` (the module docstring lists them);
    non-finite values are left out."""
    out: dict[str, float] = {}
    for key, v in figures.items():
        if not isinstance(v, list):
            if math.isfinite(v):
                out[f"qk/{key}"] = v
            continue
        name, rows = ("max_logit" if key == "max_logit_per_head" else key), _rows(v)
        finite = [[x for x in h if math.isfinite(x)] for h in rows]
        flat = [x for h in finite for x in h]
        if not flat:
            continue
        if key == "max_logit_per_head":
            out.update({f"qk/max_logit/layer{i}": max(h) for i, h in enumerate(finite) if h})
        else:
            out.update({f"qk/{name}/min": min(flat), f"qk/{name}/max": max(flat),
                        f"qk/{name}/mean": sum(flat) / len(flat)})
        if per_head:
            out.update({f"qk/{name}/layer{i}/head{j}": x for i, h in enumerate(rows) for j, x in enumerate(h)
                        if math.isfinite(x)})
    return out


def head_arrays(figures: dict[str, Any]) -> dict[str, list[list[float | None]]]:
    """The per-layer, per-head arrays of ``Attached.metrics()`` for the JSONL file (non-finite: null)."""
    return {("max_logit" if k == "max_logit_per_head" else k): [[x if math.isfinite(x) else None for x in h]
                                                                for h in _rows(v)]
            for k, v in figures.items() if isinstance(v, list)}
