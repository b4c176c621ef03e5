"""QuacK: per-head learning rates for the query/key matrices, inversely proportional to the norms of
their partners on the logit path (controlling changes to attention logits, arXiv 2511.21377; rules in
shared/specs/logit-control.md and docs/logit-control.md).

Every matrix M on the logit path gets, before every optimizer step, the rate

    lr(M^h) = tau * eta * phi_M^h(now) / phi_M^h(init),   phi = 1 / (product of the partner norms)

MHA/GQA (g(h) the KV head of query head h):
    phi(W_Q^h) = 1 / ||W_K^{g(h)}||          phi(W_K^g) = 1 / max_{h in g} ||W_Q^h||
(the max over a group keeps every query head's bound on the change caused by the shared key's step).

MLA (heads h; ||W_dq|| = 1 without a query latent):
    W_uq^h: 1 / (||W_dq|| ||W_uk^h|| ||W_dkv||)     W_uk^h: 1 / (||W_uq^h|| ||W_dq|| ||W_dkv||)
    W_qr^h: 1 / (||W_dq|| ||W_kr||)
    W_dq:   min(1 / max_h ||W_uq^h|| ||W_uk^h|| ||W_dkv||,  1 / max_h ||W_qr^h|| ||W_kr||)
    W_dkv:  1 / max_h ||W_uq^h|| ||W_dq|| ||W_uk^h||       W_kr: 1 / max_h ||W_qr^h|| ||W_dq||
The latent RMSNorms are ignored by default, as in the paper's derivation (see docs/logit-control.md).

Options the paper leaves open (each measured in docs/logit-control.md):
* ``clamp`` c > 0 keeps every factor within [tau / c, tau c];
* ``decay=base`` keeps the decoupled weight decay at the group's rate instead of scaling it with the
  factor (``HeadScaledUpdate.apply``);
* ``gains=true`` counts the RMSNorm gains in the norms: each matrix's norm is that of W diag(gamma),
  gamma the gain of the RMSNorm in front of it (the block's attention norm; MLA: the query latent's
  norm in front of W_uq, W_qr and the key/value latent's in front of W_uk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from qklab.fields import above, option
from qklab.methods.applied import MeasuredUpdate, head_norms, per_layer
from qklab.methods.base import QKController
from qklab.methods.headwise import (
    HeadMatrix,
    group_decay,
    is_mla,
    logit_matrices,
)
from qklab.methods.options import Options
from qklab.methods.shards import is_sharded


@dataclass
class QuacKOptions(Options, section="qk.quack"):
    tau: float = option(1.0, "initial Q/K learning rate relative to eta", above(0))
    norm: Literal["fro", "spectral"] = option("fro", "the norm of each matrix in its partner's factor (Frobenius or "
                                                     "spectral)")
    clamp: float = option(0.0, "every factor kept within [tau / clamp, tau * clamp]; 0: off",
                          (lambda v: v == 0 or v >= 1, "0 (off) or >= 1"))
    decay: Literal["scaled", "base"] = option("scaled", "scaled: the decoupled decay moves with the factor; base: "
                                                        "decay at the group's rate")
    gains: bool = option(False, "count the RMSNorm gains in front of each matrix in its norm")


def input_gains(block) -> dict[str, torch.Tensor]:
    """The RMSNorm gain (C_in,) in front of each logit-path matrix of a GPT ``block``'s attention."""
    a, g = block.attn, block.attn_norm.weight
    if not is_mla(a):
        return {"wq": g, "wk": g}
    gq = a.q_norm.weight if a.q_norm is not None else g
    out = {"wuq": gq, "wqr": gq, "wuk": a.kv_norm.weight, "wdkv": g, "wkr": g}
    if a.wdq is not None:
        out["wdq"] = g
    return out


def partner_factors(attn, norm: str = "fro", gains: dict[str, torch.Tensor] | None = None,
                    norms: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """phi for every logit-path matrix of one layer, per head: name -> (n_heads,). ``gains``: name ->
    the RMSNorm gain folded into that matrix's norm (``input_gains``), or None. ``norms``: the per-head
    norms when the caller measured them (sharded weights), else they are measured here."""
    mats = logit_matrices(attn)
    gains = gains or {}
    n = norms or {k: m.head_norms(norm, gains.get(k)) for k, m in mats.items()}
    if not is_mla(attn):
        H, Hkv = mats["wq"].n_heads, mats["wk"].n_heads
        return {"wq": 1.0 / n["wk"].repeat_interleave(H // Hkv),
                "wk": 1.0 / n["wq"].view(Hkv, -1).amax(dim=1)}
    one = torch.ones(1, device=n["wdkv"].device)  # no query latent: ||W_dq|| = 1, on the weights' device
    dq, dkv, kr = n.get("wdq", one), n["wdkv"], n["wkr"]
    uq, uk, qr = n["wuq"], n["wuk"], n["wqr"]  # (H,)
    out = {"wuq": 1.0 / (dq * uk * dkv), "wuk": 1.0 / (uq * dq * dkv), "wqr": 1.0 / (dq * kr).expand_as(qr),
           "wdkv": 1.0 / (uq * dq * uk).max().view(1), "wkr": 1.0 / (qr * dq).max().view(1)}
    if "wdq" in mats:
        out["wdq"] = torch.minimum(1.0 / (uq * uk * dkv).max(), 1.0 / (qr * kr).max()).view(1)
    return out


class QuacK(QKController):
    name = "quack"
    head_series_prefix = "quack_"
    Options = QuacKOptions

    def __init__(self, model, optimizer, opts: QuacKOptions) -> None:
        super().__init__(model, optimizer, opts)
        self.attns = model.attention_layers()
        self.gains: list[dict[str, torch.Tensor] | None] = [None] * len(self.attns)
        if opts.gains:
            if not hasattr(model, "blocks"):
                raise ValueError("qk.quack.gains=true needs a qklab GPT (its blocks' RMSNorm gains); leave it false")
            self.gains = [input_gains(b) for b in model.blocks]
        self.names = [list(logit_matrices(a)) for a in self.attns]
        self.mats = [m for a in self.attns for m in logit_matrices(a).values()]
        self.update = MeasuredUpdate(self.mats)  # keeps the change it applied, per head
        self.sharded = any(is_sharded(m.weight) for m in self.mats)  # FSDP2: norms need the reduce function
        # phi at init; sharded: at the first step (weights unchanged), once the reduce function is set
        self.phi0 = None if self.sharded else self.phis()
        self.last: list[dict[str, torch.Tensor]] = []

    def phis(self) -> list[dict[str, torch.Tensor]]:
        """phi of every layer now. Sharded Frobenius norms: per-head sums of squares of the local rows,
        all layers packed into one all-reduce; sharded spectral norms gather each matrix."""
        norms: list[dict[str, torch.Tensor] | None] = [None] * len(self.attns)
        if self.sharded:
            mats = [(logit_matrices(a), g or {}) for a, g in zip(self.attns, self.gains, strict=True)]
            if self.opts.norm == "spectral":
                norms = [{k: _gathered_spectral(m, g.get(k)) for k, m in ms.items()} for ms, g in mats]
            else:
                sq = [m.head_sq(g.get(k)) for ms, g in mats for k, m in ms.items()]
                packed = torch.cat(sq)
                if self.reduce is not None:
                    packed = self.reduce(packed, "sum")
                it = iter(packed.sqrt().split([len(x) for x in sq]))
                norms = [{k: next(it) for k in ms} for ms, _ in mats]
        return [partner_factors(a, self.opts.norm, g, n)
                for a, g, n in zip(self.attns, self.gains, norms, strict=True)]

    def factors(self) -> list[dict[str, torch.Tensor]]:
        """Per layer: matrix name -> per-head learning-rate factor tau * phi(now) / phi(init), the ratio
        clamped to [1 / clamp, clamp] when ``clamp`` is set."""
        out, c = [], self.opts.clamp
        if self.phi0 is None:
            self.phi0 = self.phis()
        for now, phi0 in zip(self.phis(), self.phi0, strict=True):
            ratio = {k: now[k] / phi0[k] for k in now}
            if c:
                ratio = {k: r.clamp(1.0 / c, c) for k, r in ratio.items()}
            out.append({k: self.opts.tau * r for k, r in ratio.items()})
        return out

    def before_step(self, step: int) -> None:
        self.last = self.factors()
        self.update.snapshot()

    def after_step(self, step: int) -> None:
        opts = self.optimizer if isinstance(self.optimizer, list | tuple) else [self.optimizer]
        decay = [group_decay(opts, m.weight) for m in self.mats] if self.opts.decay == "base" else None
        self.update.apply([f[k] for f, names in zip(self.last, self.names, strict=True) for k in names], decay)

    def metrics(self) -> dict[str, Any]:
        if not self.last:
            return {}
        flat = torch.cat([f for layer in self.last for f in layer.values()])
        per_head = {f"quack_{k}": [layer[k].tolist() for layer in self.last] for k in self.last[0]}
        # the norm of the change each head's matrix took in the last step (optimizer step times its factor)
        applied = per_layer("quack_update", head_norms(self.update.sq, self.mats, self.reduce), self.names)
        return {**per_head, **applied, "quack_factor_min": flat.min().item(), "quack_factor_max": flat.max().item()}

    def state_dict(self) -> dict[str, Any]:
        if self.phi0 is None:
            self.phi0 = self.phis()
        return {"phi0": [{k: v.clone() for k, v in d.items()} for d in self.phi0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phi0 = [dict(d) for d in state["phi0"]]


def _gathered_spectral(m: HeadMatrix, gain: torch.Tensor | None) -> torch.Tensor:
    """Spectral per-head norms of a sharded matrix: gathered whole on every rank (a collective)."""
    return HeadMatrix(m.name, m.weight.full_tensor(), m.n_heads).head_norms("spectral", gain)
