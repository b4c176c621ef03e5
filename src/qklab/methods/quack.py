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
The latent RMSNorms are ignored, as in the paper's derivation (see docs/logit-control.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qklab.methods.base import QKController
from qklab.methods.headwise import HeadScaledUpdate, attention_layers, is_mla, logit_matrices


@dataclass
class QuacKOptions:
    tau: float = 1.0  # initial Q/K learning rate relative to eta
    norm: str = "fro"  # fro | spectral

    def validate(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"qk.quack.tau must be > 0, got {self.tau}")
        if self.norm not in ("fro", "spectral"):
            raise ValueError(f"qk.quack.norm='{self.norm}': use fro or spectral")


def partner_factors(attn, norm: str = "fro") -> dict[str, torch.Tensor]:
    """phi for every logit-path matrix of one layer, per head: name -> (n_heads,)."""
    mats = logit_matrices(attn)
    n = {k: m.head_norms(norm) for k, m in mats.items()}
    if not is_mla(attn):
        H, Hkv = mats["wq"].n_heads, mats["wk"].n_heads
        return {"wq": 1.0 / n["wk"].repeat_interleave(H // Hkv),
                "wk": 1.0 / n["wq"].view(Hkv, -1).amax(dim=1)}
    one = torch.ones(1)
    dq, dkv, kr = n.get("wdq", one), n["wdkv"], n["wkr"]
    uq, uk, qr = n["wuq"], n["wuk"], n["wqr"]  # (H,)
    out = {"wuq": 1.0 / (dq * uk * dkv), "wuk": 1.0 / (uq * dq * dkv), "wqr": 1.0 / (dq * kr).expand_as(qr),
           "wdkv": 1.0 / (uq * dq * uk).max().view(1), "wkr": 1.0 / (qr * dq).max().view(1)}
    if "wdq" in mats:
        out["wdq"] = torch.minimum(1.0 / (uq * uk * dkv).max(), 1.0 / (qr * kr).max()).view(1)
    return out


class QuacK(QKController):
    name = "quack"
    Options = QuacKOptions

    def __init__(self, model, optimizer, opts: QuacKOptions) -> None:
        super().__init__(model, optimizer, opts)
        self.attns = attention_layers(model)
        self.names = [list(logit_matrices(a)) for a in self.attns]
        self.update = HeadScaledUpdate([m for a in self.attns for m in logit_matrices(a).values()])
        self.phi0 = [partner_factors(a, opts.norm) for a in self.attns]  # at initialisation
        self.last: list[dict[str, torch.Tensor]] = []

    def factors(self) -> list[dict[str, torch.Tensor]]:
        """Per layer: matrix name -> per-head learning-rate factor tau * phi(now) / phi(init)."""
        out = []
        for a, phi0 in zip(self.attns, self.phi0, strict=True):
            now = partner_factors(a, self.opts.norm)
            out.append({k: self.opts.tau * now[k] / phi0[k] for k in now})
        return out

    def before_step(self, step: int) -> None:
        self.last = self.factors()
        self.update.snapshot()

    def after_step(self, step: int) -> None:
        self.update.apply([f[k] for f, names in zip(self.last, self.names, strict=True) for k in names])

    def metrics(self) -> dict[str, Any]:
        if not self.last:
            return {}
        flat = torch.cat([f for layer in self.last for f in layer.values()])
        per_head = {f"quack_{k}": [layer[k].tolist() for layer in self.last] for k in self.last[0]}
        return {**per_head, "quack_factor_min": flat.min().item(), "quack_factor_max": flat.max().item()}

    def state_dict(self) -> dict[str, Any]:
        return {"phi0": [{k: v.clone() for k, v in d.items()} for d in self.phi0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phi0 = [dict(d) for d in state["phi0"]]
