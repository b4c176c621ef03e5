"""Compositional Muon's QK rule in its isotropic form: each head's step of W_Q scaled by the inverse of its
partner's (the W_K head's) current scale, and vice versa (Keigwin, Yang, Pai, Zhang, DeWulf, "Towards
Compositional Steepest Descent", Tilde Research 2026, blog.tilderesearch.com/blog/compositional-muon;
code github.com/tilde-research/comp-muon-release).

The published rule (steepest descent on the composed map M = W_Q^T W_K of a head, in nn.Linear
convention W (d, C), its operator-norm budget split in half between the two factors):

    dW_Q = -(eta / 2) C_K^{-1} msign(C_K^{-1} G_Q),   C_K = (W_K W_K^T + lambda I)^{1/2}   (d x d),

and symmetrically for W_K. When the partner's Gram is near-isotropic, C_K ~ c_K I with

    c_K = sqrt(||W_K||_F^2 / d + lambda)     (the RMS singular value of the head block, damped),

and the rule becomes Muon on the head at the rate (tau / c_K) * eta, tau = 1/2 the half split. That is
what this controller does: the per-head factor

    f(W_Q^h) = tau / c(W_K^{g(h)})           f(W_K^g) = tau / max_{h in g} c(W_Q^h)

rescales each head's slice of whatever the optimizer stepped (``HeadScaledUpdate``), with the partner's
scale now (unlike QuacK, no ratio to initialisation). With ``train.optimizer=muon`` and
``train.muon_per_head=qk`` the optimizer's step of a head is msign of that head's momentum, so the
controller then computes the published isotropic rule (at eta the head's Muon rate); with the packed Muon
it is "partner-rescaled Muon" of the packed matrix. The full (non-isotropic) whitening needs the
optimizer's momentum inside the orthogonalisation and is not built here.

Choices where the source is silent (docs: the optimizer definitions):
* GQA: a shared key head takes the largest scale of its group's query heads (its step then keeps every
  query head's composed change within budget), as QuacK does.
* MLA: the pairs of the composed map of head h are (W_uq^h, W_uk^h) on the nope part, both acting on
  RMS-normalised latents, and (W_qr^h, W_kr) on the rope part, the shared rope key taking the largest
  W_qr head scale. The down-projections W_dq, W_dkv sit in front of the latent RMSNorms, which remove
  their scale from the logits: they are left to the optimizer (factor 1).
* ``decay``: as QuacK's (``scaled``: the decoupled decay moves with the factor; ``base``: at the group's rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qklab.methods.applied import MeasuredUpdate, head_norms, per_layer, rows_head_sq
from qklab.methods.base import QKController
from qklab.methods.headwise import HeadMatrix, group_decay, is_mla, logit_matrices
from qklab.methods.shards import is_sharded, local_rows


@dataclass
class CompositionalOptions:
    tau: float = 0.5  # the share of the composed budget each factor gets (0.5: the published half split)
    damping: float = 0.0  # lambda in C = (W W^T + lambda I)^{1/2}; > 0 bounds the factors of a small partner
    decay: str = "scaled"  # scaled | base, as QuacK's

    def validate(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"qk.compositional.tau must be > 0, got {self.tau}")
        if self.damping < 0:
            raise ValueError(f"qk.compositional.damping must be >= 0, got {self.damping}")
        if self.decay not in ("scaled", "base"):
            raise ValueError(f"qk.compositional.decay='{self.decay}': use scaled or base")


def governed(attn) -> dict[str, HeadMatrix]:
    """The matrices the rule scales: MHA/GQA W_Q, W_K; MLA W_uq, W_uk, W_qr, W_kr."""
    mats = logit_matrices(attn)
    keep = ("wuq", "wuk", "wqr", "wkr") if is_mla(attn) else ("wq", "wk")
    return {k: mats[k] for k in keep}


def partner_factors(attn, sq: dict[str, torch.Tensor], tau: float = 0.5, damping: float = 0.0
                    ) -> dict[str, torch.Tensor]:
    """The per-head factors of one layer from the per-head squared Frobenius norms ``sq`` of its governed
    matrices (name -> (n_heads,)): tau / c(partner), c = sqrt(||W^h||_F^2 / rows + lambda)."""
    mats = governed(attn)
    c = {k: (sq[k] / (m.weight.shape[0] // m.n_heads) + damping).sqrt() for k, m in mats.items()}
    if not is_mla(attn):
        H, Hkv = mats["wq"].n_heads, mats["wk"].n_heads
        return {"wq": tau / c["wk"].repeat_interleave(H // Hkv), "wk": tau / c["wq"].view(Hkv, -1).amax(dim=1)}
    return {"wuq": tau / c["wuk"], "wuk": tau / c["wuq"], "wqr": (tau / c["wkr"]).expand_as(c["wqr"]),
            "wkr": tau / c["wqr"].max().view(1)}


class Compositional(QKController):
    name = "compositional"
    Options = CompositionalOptions

    def __init__(self, model, optimizer, opts: CompositionalOptions) -> None:
        super().__init__(model, optimizer, opts)
        self.attns = model.attention_layers()
        layers = [governed(a) for a in self.attns]
        self.names = [list(m) for m in layers]
        self.mats = [m for layer in layers for m in layer.values()]
        self.update = MeasuredUpdate(self.mats)
        self.last: list[dict[str, torch.Tensor]] = []

    def factors(self) -> list[dict[str, torch.Tensor]]:
        """Per layer: matrix name -> per-head factor, from the weights now. The per-head sums of squares of
        the rows each rank holds go through one all-reduce (FSDP2 shards); no value is read on the host."""
        sq = [rows_head_sq(m, local_rows(m.weight)[0]) for m in self.mats]
        packed = torch.cat(sq)
        if self.reduce is not None and any(is_sharded(m.weight) for m in self.mats):
            packed = self.reduce(packed, "sum")
        it = iter(packed.split([len(s) for s in sq]))
        return [partner_factors(a, {k: next(it) for k in names}, self.opts.tau, self.opts.damping)
                for a, names in zip(self.attns, self.names, strict=True)]

    def before_step(self, step: int) -> None:
        self.last = self.factors()
        self.update.snapshot()

    def after_step(self, step: int) -> None:
        opts = self.optimizer if isinstance(self.optimizer, list | tuple) else [self.optimizer]
        decay = [group_decay(opts, m.weight) for m in self.mats] if self.opts.decay == "base" else None
        self.update.apply([f[k] for f, names in zip(self.last, self.names, strict=True) for k in names], decay)

    def metrics(self) -> dict[str, Any]:
        """Per layer and head: the factor applied and the norm of the change each matrix took; the range of
        the factors."""
        if not self.last:
            return {}
        flat = torch.cat([f for layer in self.last for f in layer.values()])
        factors = [f[k] for f, names in zip(self.last, self.names, strict=True) for k in names]
        return {**per_layer("compositional", factors, self.names),
                **per_layer("compositional_update", head_norms(self.update.sq, self.mats, self.reduce), self.names),
                "compositional_factor_min": flat.min().item(), "compositional_factor_max": flat.max().item()}
