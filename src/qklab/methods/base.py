"""The one interface for QK methods.

A QK method is either forward-side or optimizer-side:

* ``QKMethod`` (forward-side) is a small ``nn.Module`` owned by each attention layer. It decides the
  per-head width of the W_Q/W_K projections, maps q and k (before or after RoPE, its choice), the
  softmax scale, and may rewrite the pre-softmax logits. A method that rewrites logits sets
  ``modifies_logits = True``; attention then never routes it through a fused kernel that would drop the
  rewrite.
  What a method needs of RoPE is the ``Rope`` protocol below, always in the half-split layout (rotary
  pairs (i, i + D/2)): qklab's own ``Rope``, the adapters of ``qklab.hf``, or a model's own RoPE through
  ``qklab.model.user_rope`` (``qklab.QK``). A method whose map commutes with the rotation says so with
  ``after_rope_refusal``.
* ``QKController`` (optimizer-side) acts around ``optimizer.step()``: ``before_step`` may set per-head
  learning rates, ``after_step`` may rescale weights. Its state goes into checkpoints.

Adding a method means one new file with a subclass (and its ``Options`` dataclass, whose fields state
their ranges and choices: ``qklab.fields``) plus one registry line in ``qklab.methods``. The
subclass overrides what it changes, and nothing else: the widths (``proj_dim``, ``qk_in_dim``,
``feature_dim``, ``rotated_dim``, ``qk_init_std``), the maps (``map_input``, ``map_qk``, and
``latent_map`` for MLA's latent cache), ``scale``, ``logits`` (with ``modifies_logits``) and ``raw_logit``,
QK-clip's ``clip_refusal`` and ``clip_logits``, ``after_rope_refusal``, a watch on its own logits
(``watches_logits``, ``step_end``, ``step_metrics``: QK-Guard), and its parameters'
``reset_parameters`` and ``param_group``. Every user of a method (qklab's ``Attention`` and MLA,
``qklab.QK`` in any PyTorch attention, ``qklab.hf``, ``qklab.integrations``) calls these alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class Rope(Protocol):
    """What a method sees of RoPE: ``qklab.model.rope.Rope``, or the adapters of ``qklab.hf`` over a
    transformers model's own tables."""

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        """x (B, H, T, D) rotated as at positions pos, pos + 1, ..."""

    def window(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin, signed sin (T, D) of the positions x covers from pos on."""

    # optional: positions(x, pos) -> the absolute positions of x's T rows, (T,) or (B, T) (left padding);
    # a method that needs them (SSMax: log n keys per query) calls ``positions_of`` below.


def positions_of(rope: Rope, x: torch.Tensor, pos: int) -> torch.Tensor:
    """Absolute positions of the T rows of x (B, H, T, D): ``rope.positions`` where the rope knows them
    ((T,) or (B, T), e.g. the position ids of a left-padded transformers batch), else pos .. pos + T - 1."""
    fn = getattr(rope, "positions", None)
    out = fn(x, pos) if fn is not None else None
    return out if out is not None else torch.arange(pos, pos + x.shape[-2], device=x.device)


@dataclass(frozen=True)
class AttnShape:
    """What a method needs to know about the attention layer it lives in."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_idx: int
    n_layers: int
    rope_dim: int = 0  # MLA: the trailing per-head q/k features that RoPE rotates (the rest: nope); 0: MHA
    logit_gain: float = 1.0  # what the layer multiplies the method's scale by (DeepSeek's YaRN correction)

    @classmethod
    def of(cls, m: Any, layer_idx: int = 0) -> AttnShape:
        """The shape a ``ModelConfig`` gives its attention layers (MLA: per-head q/k of nope + rope)."""
        if m.attention == "mla":
            d = m.mla_dims
            return cls(m.d_model, m.n_heads, m.n_heads, d.nope + d.rope, layer_idx, m.n_layers, d.rope)
        return cls(m.d_model, m.n_heads, m.kv_heads, m.head_dim, layer_idx, m.n_layers)


@dataclass
class NoOptions:
    """A method without options."""


class QKMethod(nn.Module):
    """Forward-side QK method. The base class is standard attention: scale 1/sqrt(d)."""

    name = "base"
    Options: type = NoOptions
    modifies_logits = False  # True: logits(...) changes scores, so only the eager path may run it
    latent_cache_ok = True  # False: needs per-head keys materialised (cannot keep an MLA latent cache)
    latent_key_scale = False  # True: latent_map returns a key scalar s per token and head (cached; needs k)
    latent_key_group = 1  # heads sharing one cached key scalar (s is equal within each group of heads)
    latent_key_parts = False  # True: s has two values per key, one on the nope and one on the rope part
    keeps_model_qk_norm = False  # qklab.hf: True keeps a model's own q/k norms (Qwen3) in front of the method
    causal_only = False  # True: defined for causal attention alone (a query sees no later key)
    watches_logits = False  # True: the training loop tracks the layer's per-head max logit and calls step_end

    def __init__(self, shape: AttnShape, opts: Any) -> None:
        super().__init__()
        self.shape = shape
        self.opts = opts
        self.record = False  # True: the next forwards keep what stats() reports

    def proj_dim(self) -> int:
        """Per-head output width of W_Q and W_K."""
        return self.shape.head_dim

    def qk_in_dim(self) -> int:
        """Input width of W_Q and W_K (the width of ``map_input``'s output)."""
        return self.shape.d_model

    def map_input(self, x: torch.Tensor) -> torch.Tensor:
        """Map the (normalised) attention input x (B, T, C) before the Q/K projections; V sees raw x."""
        return x

    def qk_init_std(self, default: float) -> float:
        """Std of the normal init of W_Q and W_K (GPT.init_weights asks the method)."""
        return default

    def feature_dim(self) -> int:
        """Per-head width of q and k after the map (what enters the dot product and the KV cache)."""
        return self.proj_dim()

    def rotated_dim(self) -> int:
        """Per-head width of the q and k features RoPE rotates (a model's own RoPE tables must have it)."""
        return self.feature_dim()

    def map_qk(self, q: torch.Tensor, k: torch.Tensor, rope: Rope, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, H, T, d'), k: (B, Hkv, T, d') straight from the projections; returns the q, k that
        enter the dot product, RoPE applied. The default applies RoPE only."""
        return rope(q, pos), rope(k, pos)

    def scale(self, feature_dim: int) -> float:
        """Softmax scale applied to q.k."""
        return 1.0 / math.sqrt(feature_dim)

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """Rewrite pre-softmax logits s (B, H, Tq, Tk), already scaled, before the mask."""
        return s

    def latent_map(self, q: torch.Tensor, k: torch.Tensor, rope: Rope, pos: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``map_qk`` in the factorised form the MLA latent cache needs (asked only when
        ``latent_cache_ok``): returns (q', gain, s) with q' = map_qk(q, k)[0] and the key map written as
        map_qk(q, k)[1] = RoPE(gain * k) * s.

        q: (B, H, T, F), k: (B, Hkv, T, F) pre-RoPE. gain (F,) is static: the absorbed MLA path folds it
        into the query side and the shared rope key. s (B, Hkv, T, 1) is one scalar per token and key
        head, cached beside the latent. None stands for 1. A method whose key map has any other form must
        set ``latent_cache_ok = False``; ``tests/model/test_mla.py`` checks the identity for every
        registered method. A method without key scalars (s None) leaves ``latent_key_scale`` False and
        is called with k None (MLA then never builds per-head keys). With ``latent_key_parts``, s is
        (B, Hkv, T, F), constant on the nope and on the rope features (the rope one equal for all heads,
        so MLA folds it into the cached rope key). The default (keys only rotated): RoPE(q), 1, 1."""
        return rope(q, pos), None, None

    def after_rope_refusal(self) -> str:
        """"" when the map of ``map_qk`` commutes with RoPE (map(RoPE(x)) = RoPE(map(x)) for q and k), so that
        it may run on q and k a model has already rotated (``qklab.QK.after_rope``); else the one-line reason
        it must sit before RoPE. The default (no map) commutes."""
        return ""

    def clip_refusal(self, tau_clip: float) -> str:
        """QK-clip (qk.controller=qkclip) with this method: "" when it can bound the logits at
        ``tau_clip``, else the one-line reason it cannot."""
        return ""

    def clip_logits(self, g: torch.Tensor) -> bool:
        """QK-clip hook: shrink head h's logits by g[h] (H,) through the method's own parameters and
        return True, or return False when the logits scale with W_Q W_K (the weights are clipped)."""
        return False

    def raw_logit(self, s: torch.Tensor) -> torch.Tensor:
        """The inverse of ``logits`` (the scaled q.k behind a logit the method returns), for QK-clip."""
        return s

    def stats(self) -> dict[str, list[float]]:
        """Per-head stability statistics of the last forward run with ``self.record = True`` (QK-MAP:
        phase scale, phase spread, aliasing, pre-map norms); {} for methods without any."""
        return {}

    def step_end(self, max_logit: torch.Tensor, step: int) -> None:
        """With ``watches_logits``: called by the training loop after optimizer step ``step`` (0-based) with the
        layer's per-head largest logit over the step's training forwards, (H,) (reduced over data-parallel
        ranks; -inf: none seen). A method may change how it forms the logits from the next forward on."""

    def step_metrics(self) -> dict[str, Any]:
        """With ``watches_logits``: this layer's values for metrics.jsonl at the logging cadence (the loop
        gathers each key into a list over layers)."""
        return {}

    def param_group(self) -> tuple[str, float] | None:
        """None: the method's own parameters join the model's groups by shape (norm gains: no decay).
        (name, mult): they form their own optimizer group ``name``, without weight decay, at ``mult``
        times the base rate (``qklab.train.optim.build_optimizer``)."""
        return None

    def adopt_qk_norm(self, q_norm: nn.Module, k_norm: nn.Module) -> None:
        """qklab.hf: the model's own q/k norms, which this method replaces (``keeps_model_qk_norm`` False);
        a QK-Norm takes over their gains and eps."""

    def reset_parameters(self) -> None:
        """Initialise the method's own parameters (called from GPT.init_weights)."""

    def extra_repr(self) -> str:
        return f"name={self.name}, opts={self.opts}"


def watched_metrics(layers) -> dict[str, list[Any]]:
    """The metrics.jsonl values of the methods that watch their logits (``watches_logits``), each key a list
    over those layers; ``layers``: objects with the method as ``.qk`` (attention modules, qklab.hf's layers)."""
    out: dict[str, list[Any]] = {}
    for layer in layers:
        if layer.qk.watches_logits:
            for key, value in layer.qk.step_metrics().items():
                out.setdefault(key, []).append(value)
    return out


class QKController:
    """Optimizer-side QK method. The base class does nothing (controller "none")."""

    name = "none"
    Options: type = NoOptions
    # reduce(t, op) all-reduces t in place over the data-parallel ranks (op "sum" or "max") and returns
    # it; None in one process. A controller whose inputs differ between ranks (QK-clip's max logits,
    # norms of sharded weights) reduces them so that every rank computes the same thing.
    reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None
    # reads each step's per-head max logits itself (it pops the layers' trackers in after_step): QK-clip
    reads_max_logits = False
    # rescales the W_Q/W_K rows of a head by a scalar in after_step, so a bias of those rows must follow: QK-clip
    rescales_heads = False
    # the prefix of its per-head factors in metrics() (one L x H list each), which a study's result keeps over
    # training as the head series named by the prefix less its "_" ("": none kept): QuacK's "quack_"
    head_series_prefix = ""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, opts: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.opts = opts

    @classmethod
    def check_method(cls, method: QKMethod, opts: Any) -> None:
        """Raise ValueError (one line) when this controller cannot work with the forward-side ``method``
        (``RunConfig.validate`` and the constructor ask)."""

    def before_step(self, step: int) -> None:
        """Called after gradients are ready and the scheduled lr is set, before optimizer.step()."""

    def after_step(self, step: int) -> None:
        """Called right after optimizer.step()."""

    def skip_step(self, step: int) -> None:
        """Called instead of before_step/after_step when the trainer drops a non-finite step
        (train.nonfinite=skip): whatever the controller gathered during it must not carry over."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
