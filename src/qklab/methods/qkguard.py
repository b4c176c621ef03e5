"""QK-Guard (arXiv 2608.02091, "One QK Channel, Many Sources"): standard attention that watches its logits
and, once a head's logits begin to saturate the softmax, switches that head (or its whole layer) to
parameter-free QK-Norm for the rest of training, q_h <- q_h / rms(q_h), k_h <- k_h / rms(k_h).

The abstract names neither the trigger nor its threshold; the choices, written down in docs/baselines.md:

* **measure** ``max_logit`` (default): the head's largest scaled pre-softmax logit over every
  training-mode forward of an optimizer step, the quantity qklab already measures for QK-clip and the
  logs. The softmax is saturated, one key taking nearly all the weight, once the largest logit leads the
  rest by far more than log(T); a runaway drives it up without bound (our ladder: 83 -> 2765 at 4x the
  tuned rate) while a healthy head stays in the tens. ``growth``: that maximum divided by the head's own
  maximum at the first step the guard saw (a scale-free trigger: a head whose logits grew by the factor).
* **threshold** 100 (QK-clip's default tau, the value MuonClip bounds logits at): a head is switched once
  its measure exceeds it at the end of a step; from the next step on it is normalised.
* **per** ``head`` (default): the unit switched is a key head with the query heads that share it (GQA:
  parameter-free QK-Norm normalises the shared key, so its query heads switch together; MHA: one head);
  ``layer``: every head of the layer once any of them trips.

Once switched a head stays switched (the abstract's guard "switches on" normalisation; nothing switches it
back). The state is two buffers, saved with the weights (checkpoints, ``save_pretrained``): ``on``, one
flag per key head, and ``since``, the optimizer step at whose end each switched (-1: dormant); ``ref``
holds the first step's maxima for ``growth``. Parameter-free RMS commutes with RoPE and is one inverse RMS
per token and key head on the key side, so QK-Guard keeps MLA's latent cache, before and after switching.
The trigger runs from the training loop (``step_end``, once per optimizer step, the maxima reduced over
data-parallel ranks first); a model used without it (inference, a loaded model) keeps the state it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from qklab.fields import above, option
from qklab.methods.base import AttnShape, QKMethod
from qklab.methods.options import Options


@dataclass
class QKGuardOptions(Options, section="qk.qkguard"):
    threshold: float = option(100.0, "a head is switched to parameter-free QK-Norm once its measure exceeds this",
                              above(0))
    measure: Literal["max_logit", "growth"] = option(
        "max_logit", "max_logit: the head's largest logit in a step; growth: that over its largest logit at the "
                     "guard's first step")
    per: Literal["head", "layer"] = option("head", "what switches: a key head with its query heads, or the whole "
                                                   "layer")
    eps: float = option(1e-6, "added to the mean square under the root (RMSNorm's epsilon)")


class QKGuard(QKMethod):
    name = "qkguard"
    Options = QKGuardOptions
    watches_logits = True  # the training loop tracks its per-head max logit and calls step_end
    latent_key_scale = True  # a switched key head: one inverse RMS per token beside the MLA latent

    def __init__(self, shape: AttnShape, opts: QKGuardOptions) -> None:
        super().__init__(shape, opts)
        opts.validate()
        self.group = shape.n_heads // shape.n_kv_heads  # query heads per key head
        self.register_buffer("on", torch.zeros(shape.n_kv_heads, dtype=torch.bool))
        self.register_buffer("since", torch.full((shape.n_kv_heads,), -1, dtype=torch.long))
        self.register_buffer("ref", torch.full((shape.n_heads,), -math.inf))  # -inf: none seen yet
        self._armed = (None, False)  # (the flags' identity and version, whether any head is on)

    @property
    def armed(self) -> bool:
        """Whether any head is switched: read from the flags once per change of them (their identity and
        version counter), so a dormant guard's forward reads no device value. Compiled: True (the
        normalisation, masked per head, is right either way)."""
        if torch.compiler.is_compiling():
            return True
        key = (id(self.on), self.on._version)
        if self._armed[0] != key:
            self._armed = (key, not self.on.is_meta and bool(self.on.any()))
        return self._armed[1]

    def _inv_rms(self, x: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, D) -> (B, heads, T, 1): 1 / rms over D where the head is switched, else 1."""
        ms = x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
        inv = torch.rsqrt(ms + self.opts.eps)
        return torch.where(on.view(1, -1, 1, 1), inv, torch.ones_like(inv)).to(x.dtype)

    def _q_on(self) -> torch.Tensor:
        return self.on.repeat_interleave(self.group)  # (H,): a query head follows its key head

    def map_qk(self, q, k, rope, pos):
        # q: (B, H, T, D), k: (B, Hkv, T, D); a switched head is normalised (parameter-free), then rotated
        if self.armed:
            q, k = q * self._inv_rms(q, self._q_on()), k * self._inv_rms(k, self.on)
        return rope(q, pos), rope(k, pos)

    def latent_map(self, q, k, rope, pos):
        # the key map is k * s, s the inverse RMS of a switched head's key (else 1): no gain
        if not self.armed:
            return rope(q, pos), None, None if k is None else torch.ones_like(k[..., :1])
        return rope(q * self._inv_rms(q, self._q_on()), pos), None, self._inv_rms(k, self.on)

    @torch.no_grad()
    def step_end(self, max_logit: torch.Tensor, step: int) -> None:
        """After optimizer step ``step`` (0-based): ``max_logit`` (H,), the heads' largest logits over the
        step's training forwards (-inf: none seen). Switches the key heads whose measure exceeds the
        threshold; they are normalised from the next forward on."""
        m = max_logit.to(self.ref.device, torch.float32)
        seen = torch.isfinite(m)
        if self.opts.measure == "growth":
            fresh = torch.isneginf(self.ref) & seen
            self.ref.copy_(torch.where(fresh, m, self.ref))
            m = m / self.ref.abs().clamp_min(1e-12)
        trip = (seen & (m > self.opts.threshold)).view(-1, self.group).any(dim=1)  # (Hkv,)
        if self.opts.per == "layer":
            trip = trip.any().expand_as(trip)
        new = trip & ~self.on
        if bool(new.any()):
            self.since.copy_(torch.where(new, torch.full_like(self.since, step), self.since))
            self.on |= new

    def step_metrics(self) -> dict[str, Any]:
        """For metrics.jsonl, per layer: the step at whose end each key head switched (-1: dormant)."""
        return {"qkguard_since": self.since.tolist()}

    def clip_refusal(self, tau_clip: float) -> str:
        return ("qk.controller=qkclip with qk.method=qkguard: the guard already answers a head whose logits run "
                "away (it normalises the head, after which clipping W_Q/W_K cannot change its logits); use one")

    def extra_repr(self) -> str:
        return f"name={self.name}, opts={self.opts}, on={self.on.tolist()}"
