"""``qklab.attach``: run an optimizer-side controller (QuacK, QK-clip, the fixed multiplier) on any
PyTorch model, with the same controller classes as qklab's trainer.

    handle = qklab.attach(model, optimizer, "qkclip", tau_clip=50.0)
    ... a plain training loop: the controller runs from optimizer hooks around every optimizer.step() ...
    handle.metrics()  # the controller's figures and the per-head max logit since the last call

Layers are found by name in transformers models (``layers.find_layers``) or given as ``LayerSpec``s. In a
transformers model the max logits come from qklab's registered attention function (the model is switched
to it; with no forward-side method it computes standard attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qklab.hf.apply import method_options
from qklab.hf.layers import LayerSpec, QKLayer, find_layers, spec_layer
from qklab.methods import CONTROLLERS


class Attached:
    """A controller bound to a model's QK layers. Controllers see it as their "model": ``attention_layers()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, controller: str, layers: list[QKLayer],
                 opts: Any, hooks: bool, track: bool) -> None:
        self.model, self.optimizer, self.qk_layers = model, optimizer, layers
        self.track = track or controller == "qkclip"
        for layer in layers:
            layer.track_max_logit = self.track
        self.controller = CONTROLLERS[controller](self, optimizer, opts)
        self.step = 0
        self._window = [torch.full((layer.n_heads,), float("-inf")) for layer in layers]
        self._hooks = []
        if hooks:  # torch's own extension points: the user's loop stays as it is
            self._hooks = [optimizer.register_step_pre_hook(lambda *a: self.before_step()),
                           optimizer.register_step_post_hook(lambda *a: self.after_step())]

    def attention_layers(self) -> list[QKLayer]:
        return list(self.qk_layers)

    def before_step(self) -> None:
        """Call after the gradients are ready, right before optimizer.step()."""
        self.controller.before_step(self.step)

    def after_step(self) -> None:
        """Call right after optimizer.step()."""
        if self.track:  # fold this step's per-head max logits into the logging window, before QK-clip pops them
            for i, layer in enumerate(self.qk_layers):
                self._window[i] = torch.maximum(self._window[i], layer.max_logit.detach().float().cpu())
        biased = self.controller.name == "qkclip" and any(layer.biases for layer in self.qk_layers)
        before = self._head_norms() if biased else None
        self.controller.after_step(self.step)
        if before is not None:
            self._scale_biases(before)
        if self.track and self.controller.name != "qkclip":
            for layer in self.qk_layers:
                layer.pop_max_logit()
        self.step += 1

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
        """Per layer, per head: the largest pre-softmax logit of the training forwards since the last call."""
        out = [w.tolist() for w in self._window]
        self._window = [torch.full_like(w, float("-inf")) for w in self._window]
        return out

    def metrics(self) -> dict[str, Any]:
        out = dict(self.controller.metrics())
        if self.track:
            heads = self.max_logits()
            out["max_logit_per_head"] = heads
            out["max_logit"] = max(max(h) for h in heads)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.controller.load_state_dict(state["controller"])

    def remove(self) -> None:
        """Detach: optimizer hooks and projection hooks go, tracking stops."""
        for h in self._hooks + [h for layer in self.qk_layers for h in layer.hooks]:
            h.remove()
        for layer in self.qk_layers:
            layer.track_max_logit = False
            if getattr(layer.module, "qk_layer", None) is layer:
                del layer.module.qk_layer


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, controller: str,
           layers: list[LayerSpec] | None = None, hooks: bool = True, track: bool = False, **options) -> Attached:
    """Run ``controller`` ("quack", "qkclip", "qk_lr_multiplier", "compositional" in its isotropic form; "none":
    max-logit logging only) with its
    ``options`` (e.g. tau_clip=50) on ``model``, whose parameters ``optimizer`` updates.

    ``layers``: explicit LayerSpecs (any model); default: found by name in a transformers model.
    ``hooks``: run from optimizer step hooks (False: call ``before_step``/``after_step`` yourself).
    ``track``: keep per-head max logits for ``metrics()`` (always on for qkclip)."""
    opts = method_options(controller, options, controller=True)
    if layers is not None:
        qk_layers = [spec_layer(model, s, i) for i, s in enumerate(layers)]
    else:
        qk_layers = find_layers(model)
        from qklab.hf.attention import NAME, use_qklab_attention

        if model.config._attn_implementation != NAME:
            use_qklab_attention(model)
        for layer in qk_layers:
            layer.module.qk_layer = layer  # the registered attention function feeds its tracker
    return Attached(model, optimizer, controller, qk_layers, opts, hooks, track)
