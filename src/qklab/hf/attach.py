"""``qklab.attach``: run an optimizer-side controller (QuacK, QK-clip, the fixed multiplier) on any
PyTorch model, with the same controller classes as qklab's trainer.

    handle = qklab.attach(model, optimizer, "qkclip", tau_clip=50.0)
    ... a plain training loop: the controller runs from optimizer hooks around every optimizer.step() ...
    handle.metrics()  # the controller's figures and the per-head max logit since the last call
    handle.remove()   # the model and optimizer exactly as they were (weights aside)

Layers are found by name in transformers models (``layers.find_layers``) or given as ``LayerSpec``s. In a
transformers model the max logits come from qklab's registered attention function: the model runs on it
while max logits are measured (with no forward-side method it computes standard attention) and on its own
implementation otherwise (``attention.AttnSwitch``).

One live handle per model, optimizer and attention layer: a second ``attach`` on any of them is refused
(``ConfigError``, naming the live handle), since two controllers would compound (two fixed multipliers at
tau 0.1 give 0.01x). ``remove()`` first, then attach again.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from qklab.errors import ConfigError, UserError
from qklab.hf.apply import method_options
from qklab.hf.attention import AttnSwitch
from qklab.hf.layers import LayerSpec, QKLayer, find_layers, norm_refusal, spec_layer
from qklab.methods import CONTROLLERS
from qklab.methods.base import watched_metrics

_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model, optimizer, layer module -> weakref(handle)


class Attached:
    """A controller bound to a model's QK layers. Controllers see it as their "model": ``attention_layers()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, controller: str, layers: list[QKLayer],
                 opts: Any, hooks: bool, track: bool, switch: AttnSwitch | None = None) -> None:
        self.model, self.optimizer, self.qk_layers, self.switch = model, optimizer, layers, switch
        # QK-clip reads every step's max logits, and so does a method that watches its own (QK-Guard)
        self.needs_logits = (CONTROLLERS[controller].reads_max_logits
                             or any(layer.qk.watches_logits for layer in layers))
        self.step, self.removed, self._hooks = 0, False, []
        self._window: list[torch.Tensor | None] = [None] * len(layers)  # per layer (H,), on the device
        try:
            self.set_tracking(track)
            for layer in (layer for layer in layers if layer.model_norm):  # it fixes q and k as a QK-Norm would
                try:
                    CONTROLLERS[controller].check_method(norm_refusal(layer), opts)  # QK-clip refuses it
                except ValueError as e:
                    raise ConfigError(f"{layer.name}: the model's own {layer.model_norm} comes before "
                                      f"{layer.qk.name}; {e}") from None
            self.controller = CONTROLLERS[controller](self, optimizer, opts)
        except Exception as e:
            self.remove()  # e.g. QK-clip refused on a QK-Norm model: leave the model as it was
            if isinstance(e, ValueError) and not isinstance(e, UserError):  # a controller's refusal: one line
                raise ConfigError(str(e)) from None
            raise
        if hooks:  # torch's own extension points: the user's loop stays as it is
            self.run_around(optimizer)
        for obj in _keys(model, optimizer, layers):
            _LIVE[obj] = weakref.ref(self)

    @classmethod
    def of(cls, obj: object) -> Attached | None:
        """The live handle (attached, not yet removed) of a model, optimizer or attention module, or None."""
        ref = _LIVE.get(obj)
        return ref() if ref is not None else None

    def __repr__(self) -> str:
        state = "removed" if self.removed else "live"
        return (f"<qklab handle: {self.controller.name} on {type(self.model).__name__}, "
                f"{len(self.qk_layers)} layers, {state}>")

    def check_measurable(self) -> None:
        """Raise the one-line ``ConfigError`` of the first layer whose max logits cannot be measured (a
        ``LayerSpec`` on a model with RoPE that names nowhere its logits are formed); nothing when all can."""
        refused = next((layer.refusal for layer in self.qk_layers if layer.refusal), "")
        if refused:
            raise ConfigError(refused)

    def run_around(self, optimizer) -> None:
        """Run the controller from ``optimizer``'s step hooks (``before_step`` before every ``step()``,
        ``after_step`` after it): the optimizer given to ``attach``, or an object that steps them all (a
        framework's container of optimizers). ``remove()`` takes the hooks out."""
        self._hooks += [optimizer.register_step_pre_hook(lambda *a: self.before_step()),
                        optimizer.register_step_post_hook(lambda *a: self.after_step())]

    def set_tracking(self, on: bool) -> None:
        """Measure per-head max logits from the next forward on, or stop (QK-clip always measures). A
        transformers model runs qklab's attention function while measuring, its own otherwise."""
        on = on or self.needs_logits
        if on:
            self.check_measurable()
        for layer in self.qk_layers:
            layer.track_max_logit = on
        if self.switch is not None:
            self.switch.use_qklab(on)
        self.tracking = on

    def attention_layers(self) -> list[QKLayer]:
        return list(self.qk_layers)

    def before_step(self) -> None:
        """Call after the gradients are ready, right before optimizer.step()."""
        self.controller.before_step(self.step)

    def after_step(self) -> None:
        """Call right after optimizer.step()."""
        if self.tracking:  # fold this step's per-head max logits into the logging window, before QK-clip pops them
            self._fold()
        biased = self.controller.rescales_heads and any(layer.biases for layer in self.qk_layers)
        before = self._head_norms() if biased else None
        self.controller.after_step(self.step)
        if before is not None:
            self._scale_biases(before)
        for layer in self.qk_layers:
            if layer.qk.watches_logits:  # QK-Guard: this step's maxima decide its switch
                layer.qk.step_end(layer.pop_max_logit(), self.step)
            elif self.tracking and not self.controller.reads_max_logits:  # QK-clip popped its own
                layer.pop_max_logit()
        self.step += 1

    def _fold(self) -> None:
        """The per-head max logits of this step into the window, on their device: no host sync per step."""
        for i, layer in enumerate(self.qk_layers):
            m, w = layer.max_logit.detach().float(), self._window[i]
            self._window[i] = m if w is None else torch.maximum(w.to(m.device), m)

    def _head_norms(self) -> list[dict[str, torch.Tensor]]:
        return [self._head_norms_of(layer) for layer in self.qk_layers]

    @torch.no_grad()
    def _scale_biases(self, before: list[dict[str, torch.Tensor]]) -> None:
        """QK-clip scales each head's W_Q/W_K block by a scalar; the head's bias gets the same scalar, so
        that its logits (W x + b) . (W' x + b') shrink exactly as without biases."""
        for layer, old in zip(self.qk_layers, before, strict=True):
            now = self._head_norms_of(layer)
            for k, b in layer.biases.items():
                s = torch.where(old[k] > 0, now[k] / old[k].clamp_min(1e-30), torch.ones_like(now[k]))
                b.mul_(s.to(b.device, b.dtype).view(-1, 1))

    @staticmethod
    def _head_norms_of(layer) -> dict[str, torch.Tensor]:
        return {k: getattr(layer, k).weight.detach().float().flatten(1).norm(dim=1) for k in layer.biases}

    def max_logits(self) -> list[list[float]]:
        """Per layer, per head: the largest pre-softmax logit of the training forwards measured since the last
        call; [] when none was (tracking off, no training forward)."""
        window, self._window = self._window, [None] * len(self.qk_layers)
        if any(w is None for w in window):
            return []
        flat = torch.cat([w.to(window[0].device) for w in window]).cpu()  # one host read for all layers
        if not torch.isfinite(flat).any():
            return []
        return [h.tolist() for h in flat.split([len(w) for w in window])]

    def metrics(self) -> dict[str, Any]:
        """The controller's figures, and what was measured since the last call: ``max_logit_per_head`` (per
        layer, per head) and ``max_logit`` (their max); no max-logit key when nothing was."""
        out = dict(self.controller.metrics())
        out.update(watched_metrics(self.qk_layers))  # a watching method's own figures (QK-Guard: its switches)
        heads = self.max_logits()
        if heads:
            out["max_logit_per_head"] = heads
            out["max_logit"] = max(x for h in heads for x in h if math.isfinite(x))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.controller.load_state_dict(state["controller"])

    def remove(self) -> None:
        """Detach, leaving the model and optimizer exactly as they were before ``attach`` (weights aside): the
        optimizer's step hooks and the projections' hooks go, tracking stops, every attention module loses its
        ``qk_layer``, the model gets its own attention implementation back (every config's setting as it
        was) and Compositional's whitening leaves HeadMuon. A second call does nothing."""
        if self.removed:
            return
        for h in self._hooks + [h for layer in self.qk_layers for h in layer.hooks]:
            h.remove()
        self._hooks = []
        for layer in self.qk_layers:
            layer.track_max_logit, layer.hooks = False, []
            if getattr(layer.module, "qk_layer", None) is layer:
                del layer.module.qk_layer
        if self.switch is not None:
            self.switch.restore()
        self._drop_preconditioners()
        for obj in _keys(self.model, self.optimizer, self.qk_layers):
            if Attached.of(obj) is self:
                del _LIVE[obj]
        self.tracking, self.removed = False, True

    def _drop_preconditioners(self) -> None:
        """Compositional's exact form hooked a whitening into the HeadMuon of each of its matrices."""
        if not getattr(getattr(self, "controller", None), "hooks", None):
            return
        from qklab.methods.compositional import _holder

        for m in self.controller.mats:
            opt, p = _holder(_optimizers(self.optimizer), m.weight)
            if opt is not None:
                opt.set_preconditioner(p, None)


def _optimizers(optimizer) -> list:
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def _keys(model: nn.Module, optimizer, layers: list[QKLayer]) -> list[object]:
    """What a live handle holds: the model, its optimizer(s) and each layer's attention module."""
    return [model, *_optimizers(optimizer), *(layer.module for layer in layers)]


def _refuse_live(model: nn.Module, optimizer, layers: list[QKLayer]) -> None:
    """One line naming the live handle of the model, an optimizer or an attention module, if any."""
    kinds = ["model", *["optimizer"] * len(_optimizers(optimizer)), *["attention module"] * len(layers)]
    for kind, obj in zip(kinds, _keys(model, optimizer, layers), strict=True):
        live = Attached.of(obj)
        if live is not None:
            raise ConfigError(f"this {kind} ({type(obj).__name__}) already has a live qklab handle, {live!r}: call "
                              f"its .remove() first (qklab.hf.Attached.of({kind.split()[-1]}) returns it)")


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, controller: str,
           layers: list[LayerSpec | QKLayer] | None = None, hooks: bool = True, track: bool = False,
           **options) -> Attached:
    """Run ``controller`` ("quack", "qkclip", "qk_lr_multiplier", "compositional"; "none": max-logit logging
    only) with its ``options`` (e.g. tau_clip=50) on ``model``, whose parameters ``optimizer`` updates.

    ``layers``: explicit LayerSpecs (any model); default: found by name in a transformers model.
    ``hooks``: run from optimizer step hooks (False: call ``before_step``/``after_step`` yourself).
    ``track``: keep per-head max logits for ``metrics()`` (always on for qkclip; ``set_tracking`` switches).

    A model, optimizer or attention layer that already has a live handle is refused (``ConfigError``, one
    line naming that handle): a second controller would compound with the first. ``remove()`` it first."""
    opts = method_options(controller, options, controller=True)
    _refuse_live(model, optimizer, [])
    if layers is not None:  # LayerSpecs, or layers an integration built (QKLayer)
        qk_layers = [s if isinstance(s, QKLayer) else spec_layer(model, s, i) for i, s in enumerate(layers)]
    else:
        qk_layers = find_layers(model)
    try:
        _refuse_live(model, optimizer, qk_layers)
    except ConfigError:
        for h in (h for layer in qk_layers for h in layer.hooks):
            h.remove()
        raise
    switch = None
    if layers is None:
        switch = AttnSwitch(model)  # the model on qklab's attention function (for now)
    for layer in qk_layers:
        if layers is None or layer.fed:
            layer.module.qk_layer = layer  # the registered attention function or the qklab.QK feeds its tracker
    return Attached(model, optimizer, controller, qk_layers, opts, hooks, track, switch)
