"""QK-clip (the clipping half of MuonClip): after each optimizer step, every head whose largest
pre-softmax logit since the last step S_h exceeds tau_clip gets its logits shrunk by g_h = tau_clip / S_h
from the next step on, by scaling the weights that make them (logits are bilinear in W_Q, W_K).

MHA: W_Q^h and W_K^h by sqrt(g_h). GQA (a key head shared by the query heads h of its group), ``gqa``:
* ``min`` (default, the usual rule): each query head by sqrt(g_h), the key head by sqrt(min_h g_h); head
  h's logits shrink by sqrt(g_h g_min) <= g_h, so the other heads of a group are clipped more than needed.
* ``exact``: the key head by sqrt(g_min), query head h by g_h / sqrt(g_min): every head's logits shrink
  by exactly g_h (an unclipped head of a clipped group keeps its logits).
MLA: q_nope (W_uq^h) by g^alpha, k_nope (W_uk^h) by g^(1 - alpha), q_rope (W_qr^h) by g; the shared
rope key W_kr and the values are left alone (``alpha`` 0.5: the split used by large MLA trainings).

Methods whose logits do not scale with W_Q W_K: QK-MAP (post, polar) clips its temperature T_h by g_h
instead (exact: the logit is T_h times a bounded kernel); QK-Norm is refused (its logits are
scale-invariant in W_Q, W_K and its gains are shared by the heads); soft-capping is clipped on the raw
logits behind the cap (g = atanh(tau/cap) / atanh(S/cap), exact) and refused when tau_clip >= cap.
A head with S <= 0 (or none seen) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from qklab.fields import above, between, option
from qklab.methods.applied import head_norms, rows_head_sq
from qklab.methods.base import QKController, QKMethod
from qklab.methods.headwise import is_mla, logit_matrices
from qklab.methods.options import Options
from qklab.methods.shards import local_rows


@dataclass
class QKClipOptions(Options, section="qk.qkclip"):
    tau_clip: float = option(100.0, "a head whose largest logit since the last step exceeds this is clipped to it",
                             above(0))
    gqa: Literal["min", "exact"] = option("min", "GQA: how a shared key head is clipped; min: by its group's "
                                                 "smallest factor, exact: each head's logits by exactly its own")
    alpha: float = option(0.5, "MLA: q_nope scaled by g^alpha, k_nope by g^(1 - alpha), q_rope by g", between(0, 1))


class QKClip(QKController):
    name = "qkclip"
    Options = QKClipOptions
    reads_max_logits = True
    rescales_heads = True

    @classmethod
    def check_method(cls, method: QKMethod, opts: QKClipOptions) -> None:
        reason = method.clip_refusal(opts.tau_clip)
        if reason:
            raise ValueError(reason)

    def __init__(self, model, optimizer, opts: QKClipOptions) -> None:
        super().__init__(model, optimizer, opts)
        self.attns = model.attention_layers()
        for a in self.attns:
            self.check_method(a.qk, opts)
            a.track_max_logit = True
        self.last: dict[str, Any] = {}

    def gains(self, s_max: torch.Tensor, method: QKMethod | None = None) -> torch.Tensor:
        """(H,) logit gain for heads above tau_clip, else 1 (S <= 0 guarded): tau / S, measured on the raw
        logits behind the method's ``logits`` rewrite (soft-capping) when ``method`` is given."""
        tau = torch.tensor(self.opts.tau_clip)
        over = torch.isfinite(s_max) & (s_max > tau)
        s = torch.where(over, s_max, torch.ones_like(s_max))
        if method is not None:
            tau, s = method.raw_logit(tau), method.raw_logit(s)
        return torch.where(over, tau / s, torch.ones_like(s_max))

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Clip every head above tau_clip. The per-head max logits of all layers go through ``reduce``
        (MAX over the data-parallel ranks) as one packed tensor; no value is read on the host here
        (heads at or below tau get g = 1, which leaves their weights bit for bit)."""
        s_all = [a.pop_max_logit() for a in self.attns]  # per layer (H,)
        packed = torch.cat([s.to(s_all[0].device) for s in s_all])  # (sum of H,)
        if self.reduce is not None:
            packed = self.reduce(packed, "max")
        gs, applied = [], []
        for a, s_max in zip(self.attns, packed.split([len(s) for s in s_all]), strict=True):
            g = self.gains(s_max, a.qk)
            if not a.qk.clip_logits(g):
                mats = logit_matrices(a)
                # per matrix: (each head's factor f, the squared change (|f - 1| ||W_old||)^2, the matrix)
                applied.append({k: (f, ((f - 1) / f).pow(2) * rows_head_sq(mats[k], local_rows(mats[k].weight)[0]),
                                    mats[k]) for k, f in self.rescale(a, g, self.opts).items()})
            gs.append(g)
        # read on the host only by metrics()
        self.last = {"g": torch.cat(gs), "smax": packed, "gains": gs, "applied": applied}

    def skip_step(self, step: int) -> None:
        for a in self.attns:  # a dropped step's logits must not decide the next clip
            a.pop_max_logit()

    @staticmethod
    @torch.no_grad()
    def rescale(attn, g: torch.Tensor, opts: QKClipOptions | None = None) -> dict[str, torch.Tensor]:
        """Scale the logit-path weights of ``attn`` so that head h's logits shrink by g[h] (exactly, except
        the other query heads of a clipped GQA group under ``gqa=min``); returns the per-head factor each
        matrix's rows took: name -> (n_heads,)."""
        opts = opts or QKClipOptions()
        mats = logit_matrices(attn)

        if is_mla(attn):
            factors = {"wuq": g.pow(opts.alpha), "wuk": g.pow(1.0 - opts.alpha), "wqr": g}
        else:
            H, Hkv = mats["wq"].n_heads, mats["wk"].n_heads
            gmin = g.view(Hkv, H // Hkv).amin(dim=1)  # (Hkv,)
            fq = g / gmin.sqrt().repeat_interleave(H // Hkv) if opts.gqa == "exact" else g.sqrt()
            factors = {"wq": fq, "wk": gmin.sqrt()}
        for name, f in factors.items():
            mats[name].scale_heads(f)  # the rows this process holds (FSDP2 shards) or all of them
        return factors

    def metrics(self) -> dict[str, Any]:
        if not self.last:
            return {}
        g, smax = self.last["g"], self.last["smax"]
        out: dict[str, Any] = {"qkclip_g": [x.tolist() for x in self.last["gains"]]}  # logit gain, per layer, head
        applied = self.last["applied"]  # layers whose weights were scaled (not a method's own parameters)
        if applied:
            items = [(k, f, sq, m) for layer in applied for k, (f, sq, m) in layer.items()]
            norms = iter(head_norms([sq for _, _, sq, _ in items], [m for *_, m in items], self.reduce))
            for k, f, _, _ in items:  # per layer: the factor each head's rows took, the norm of the change
                out.setdefault(f"qkclip_{k}", []).append(f.tolist())
                out.setdefault(f"qkclip_update_{k}", []).append(next(norms).tolist())
        return {**out, "qkclip_heads_clipped": int((g < 1).sum()), "qkclip_min_gain": min(1.0, g.min().item()),
                "qkclip_smax": smax.max().item()}
