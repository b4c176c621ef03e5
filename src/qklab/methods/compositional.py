"""Compositional Muon's QK rule, in its isotropic form (each head's step of W_Q scaled by the inverse of its
partner's, the W_K head's, current scale, and vice versa) or in its exact form (the step whitened by the
partner's Gram root inside and after Muon's orthogonalisation). Source: "Towards Compositional Steepest
Descent", Tilde Research 2026 (blog.tilderesearch.com/blog/compositional-muon; reference code
github.com/tilde-research/comp-muon-release).

Orientation (qklab stores W (out, in), y = W x). Head h's slices are W_Q^h (d, C) and W_K^h (d, C), and its
logit is s = (W_Q^h x)^T (W_K^h x') = x^T M_h x' with the composed map M_h = W_Q^h^T W_K^h (C, C). A step
dW_Q changes it by dM = dW_Q^T W_K, and for every v,

    ||W_K^T dW_Q v||^2 = v^T dW_Q^T (W_K W_K^T) dW_Q v = ||C_K dW_Q v||^2,   C_K = (W_K W_K^T)^{1/2}  (d x d),

so ||dM||_op = ||C_K dW_Q||_op: the Gram that whitens the logit change is over the head's d output rows,
W_K W_K^T, acting on dW_Q from the left (W_K^T W_K, over the C inputs, would act on the wrong side of dW_Q).
The source writes W (in, out) and whitens from the right: the same d x d matrix. Steepest descent on the
linearised loss <G_Q, dW_Q> under ||dM||_op <= eta/2 (the operator-norm budget of M split in half between
the two factors): with B = C_K dW_Q, <G_Q, C_K^{-1} B> = <C_K^{-1} G_Q, B> is least at B = -(eta/2)
msign(C_K^{-1} G_Q), so

    dW_Q^h = -(eta / 2) C_K^{-1} msign(C_K^{-1} G_Q^h),     C_K = (W_K^h W_K^h^T + lambda I)^{1/2}
    dW_K^h = -(eta / 2) C_Q^{-1} msign(C_Q^{-1} G_K^h),     C_Q = (W_Q^h W_Q^h^T + lambda I)^{1/2}

``form=exact`` computes this per head, in fp32, with Muon's momentum in place of G and Muon's
Newton-Schulz (torch's NS_5) as msign: ``HeadMuon`` runs pre(U^h) = C^{-1} U^h before the head's
Newton-Schulz and post(O^h) = tau C^{-1} O^h after it, at the head's Muon rate eta_h (so tau = 1/2 is the
half split), decoupled weight decay at the group's rate. Any factor R with R^T R = C^2 gives the same
step: R = Q C (Q orthogonal), R^{-1} msign(R^{-T} G) = C^{-1} Q^T Q msign(C^{-1} G), and NS_5 commutes
with Q as msign does (NS(Q X) = Q NS(X)). qklab takes R = L^T from the Cholesky factor C^2 = L L^T
(``cholesky_ex``: no host synchronisation; triangular solves instead of an eigendecomposition):
pre(U) = L^{-1} U, post(O) = tau L^{-T} O.

lambda = damping + rel_damping * tr(W W^T) / d, per head: ``rel_damping`` (default 1e-3, a fraction of the
Gram's mean eigenvalue) keeps the rule scale-free (W_K -> a W_K turns W_Q's step into its 1/a, as with
lambda = 0), makes C positive definite for any nonzero partner (also a rank-deficient head, d > C), bounds
cond(C) by sqrt(1 + d / rel_damping) (fp32 Cholesky and solves stay accurate), and at a Gaussian init, whose
smallest Gram eigenvalue is about (1 - sqrt(d / C))^2 of the mean, moves C by < 0.1%. ``damping`` (0) is
the absolute lambda of both forms.

When the partner's Gram is near-isotropic, C ~ c I and the rule becomes Muon on the head at the rate
(tau / c) * eta. ``form=isotropic`` (the default) does that: the per-head factor

    c(W^h) = sqrt(||W^h||_F^2 / d + lambda)     (the RMS singular value of the head block, damped)
    f(W_Q^h) = tau / c(W_K^{g(h)})              f(W_K^g) = tau / max_{h in g} c(W_Q^h)

rescales each head's slice of whatever the optimizer stepped (``HeadScaledUpdate``), with the partner's
scale now (unlike QuacK, no ratio to initialisation). With ``train.optimizer=muon`` and
``train.muon_per_head=qk`` it is the published isotropic rule; with packed Muon, "partner-rescaled Muon".

Choices where the source is silent (docs: the optimizer definitions):
* GQA: isotropic, a shared key head takes the largest scale of its group's query heads (QuacK's choice);
  exact, its C is the Gram root of the group's query heads stacked, (sum_{h in g} W_Q^h W_Q^h^T + lambda
  I)^{1/2}, whose norm ||C dW_K||_op is that of the stacked changes [dM_h]_{h in g}: it bounds every query
  head's composed change (exact and isotropic agree when each group has one query head).
* MLA: the pairs of head h are (W_uq^h, W_uk^h) on the nope part, both acting on RMS-normalised latents,
  and (W_qr^h, W_kr) on the rope part, the shared rope key taking the largest W_qr head scale (exact: the
  stacked W_qr Grams). The down-projections W_dq, W_dkv sit in front of the latent RMSNorms, which remove
  their scale from the logits: they are left to the optimizer (factor 1).
* ``decay``: isotropic, as QuacK's (``scaled``: the decoupled decay moves with the factor; ``base``: at
  the group's rate); exact needs ``base`` (its factor is a matrix; a matrix-scaled decay is not built).
* Sharded (FSDP2): exact gathers each governed matrix whole on every rank for its Grams (a head's rows
  may be split between ranks), so every rank holds the same C; ``HeadMuon`` orthogonalises whole heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from qklab.errors import ConfigError
from qklab.fields import above, at_least, option
from qklab.methods.applied import MeasuredUpdate, head_norms, per_layer, rows_head_sq
from qklab.methods.base import QKController
from qklab.methods.headwise import HeadMatrix, group_decay, is_mla, logit_matrices
from qklab.methods.options import Options
from qklab.methods.shards import is_sharded, local_rows


@dataclass
class CompositionalOptions(Options, section="qk.compositional"):
    tau: float = option(0.5, "the share of the composed budget each factor gets (0.5: the published half split)",
                        above(0))
    damping: float = option(0.0, "absolute lambda in C = (W W^T + lambda I)^{1/2}; > 0 bounds the factors of a "
                                 "small partner", at_least(0))
    decay: Literal["scaled", "base"] = option("scaled", "as QuacK's decay (form=exact: base)")
    # late: added after results with the isotropic form; hashed only away from their defaults
    form: Literal["isotropic", "exact"] = option("isotropic", "isotropic, or exact (whitened inside HeadMuon)",
                                                 late=True)
    rel_damping: float = option(1e-3, "exact: lambda += rel_damping * tr(W W^T) / d", at_least(0), late=True)

    def check(self) -> None:
        if self.form == "exact" and self.decay != "base":
            raise ValueError("qk.compositional.form=exact keeps the decoupled weight decay at the group's rate "
                             "(its per-head factor is a matrix): set qk.compositional.decay=base")


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


def partner_grams(attn, grams: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Gram whose root whitens each governed matrix's heads, from the per-head Grams W^h W^h^T of the
    layer's governed matrices (name -> (n_heads, d, d)): name -> (n_heads, d, d). W_Q^h: its KV head's
    W_K Gram; W_K^g: the sum of its query heads' W_Q Grams (MLA: W_uq^h <-> W_uk^h, W_qr^h: W_kr's, W_kr:
    the sum over the heads of W_qr's)."""
    if not is_mla(attn):
        gq, gk = grams["wq"], grams["wk"]  # (H, d, d), (Hkv, d, d)
        grp = gq.shape[0] // gk.shape[0]
        return {"wq": gk.repeat_interleave(grp, dim=0), "wk": gq.unflatten(0, (gk.shape[0], grp)).sum(dim=1)}
    H = grams["wuq"].shape[0]
    return {"wuq": grams["wuk"], "wuk": grams["wuq"], "wqr": grams["wkr"].expand(H, -1, -1),
            "wkr": grams["wqr"].sum(dim=0, keepdim=True)}


def whitening_factor(gram: torch.Tensor, damping: float, rel_damping: float) -> torch.Tensor:
    """L (n, d, d) lower triangular with L L^T = gram + lambda I, lambda = damping + rel_damping * tr / d
    per head, in fp32 (``cholesky_ex``: no host read; a non-positive-definite Gram gives non-finite L)."""
    g = gram.float()
    d = g.shape[-1]
    lam = damping + rel_damping * g.diagonal(dim1=-2, dim2=-1).sum(-1) / d  # (n,)
    eye = torch.eye(d, device=g.device, dtype=g.dtype)
    return torch.linalg.cholesky_ex(g + lam.view(-1, 1, 1) * eye)[0]


class Whitening:
    """The ``HeadMuon`` preconditioner of one governed matrix: pre(U) = C^{-1} U, post(O) = tau C^{-1} O per
    head, realised with the Cholesky factor L of C^2 (L^{-1} U and tau L^{-T} O: the same step, see the
    module docstring). ``L`` (n_heads, d, d) is set by the controller before every optimizer step."""

    def __init__(self, tau: float, where: str) -> None:
        self.tau, self.where = tau, where
        self.L: torch.Tensor | None = None

    def _factor(self, x: torch.Tensor) -> torch.Tensor:
        if self.L is None:
            raise RuntimeError(f"compositional (exact): {self.where} was stepped without the controller's "
                               "before_step (its whitening is computed there, from the weights before the step)")
        return self.L.to(x.device)

    def pre(self, update: torch.Tensor) -> torch.Tensor:
        """(n_heads, d, C) -> L^{-1} U per head."""
        return torch.linalg.solve_triangular(self._factor(update), update, upper=False)

    def post(self, ortho: torch.Tensor) -> torch.Tensor:
        """(n_heads, d, C) -> tau L^{-T} O per head."""
        return self.tau * torch.linalg.solve_triangular(self._factor(ortho).mT, ortho, upper=True)


def _whole_heads(m: HeadMatrix) -> torch.Tensor:
    """(n_heads, rows, C) fp32 of the whole matrix: gathered on every rank when it is sharded (a collective)."""
    w = m.weight.detach()
    if is_sharded(w):
        w = w.full_tensor()
    return m.heads(w).float()


def _holder(optimizers: list, w: torch.Tensor):
    """(the optimizer that orthogonalises parameter w, or a view covering all of it, with hooks; the
    parameter), or (None, None)."""
    for opt in optimizers:
        if not hasattr(opt, "set_preconditioner"):
            continue
        for g in opt.param_groups:
            for p in g["params"]:
                same = p is w or (not is_sharded(p) and not is_sharded(w) and p.numel() == w.numel()
                                  and p.data_ptr() == w.data_ptr() and w.is_contiguous())
                if same:
                    return opt, p
    return None, None


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
        self.last: list[dict[str, torch.Tensor]] = []  # per layer: isotropic factors, or exact Cholesky factors
        self.exact = opts.form == "exact"
        self.hooks: list[Whitening] = []
        if self.exact:
            self.hooks = [self._register(m, i) for i, layer in enumerate(layers) for m in layer.values()]
        self._before: list[torch.Tensor] | None = None

    def _register(self, m: HeadMatrix, layer: int) -> Whitening:
        """Hook a Whitening into the HeadMuon that orthogonalises m's heads; refuse any other optimizer."""
        opts = self.optimizer if isinstance(self.optimizer, list | tuple) else [self.optimizer]
        opt, p = _holder(list(opts), m.weight)
        rows = m.weight.shape[-2] if m.weight.dim() == 3 else m.weight.shape[0] // m.n_heads
        if opt is None or opt.rows_of(p) != rows:
            raise ConfigError(f"qk.compositional.form=exact needs Muon orthogonalising W_Q, W_K head by head "
                              f"(train.optimizer=muon with train.muon_per_head=qk or qkv; outside qklab's trainer "
                              f"a qklab.parallel.muon.HeadMuon with head_rows): layer {layer} {m.name} is not")
        hook = Whitening(self.opts.tau, f"layer {layer} {m.name}")
        opt.set_preconditioner(p, hook)
        return hook

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

    def whitenings(self) -> list[dict[str, torch.Tensor]]:
        """Per layer: matrix name -> the Cholesky factor L (n_heads, d, d) of its heads' C^2 = partner Gram +
        lambda I, from the weights now (sharded: gathered whole on every rank); no value is read on the host."""
        out = []
        it = iter(self.mats)
        for a, names in zip(self.attns, self.names, strict=True):
            grams = {}
            for k in names:
                w = _whole_heads(next(it))  # (n_heads, d, C)
                grams[k] = w @ w.mT  # (n_heads, d, d)
            out.append({k: whitening_factor(g, self.opts.damping, self.opts.rel_damping)
                        for k, g in partner_grams(a, grams).items()})
        return out

    def before_step(self, step: int) -> None:
        if not self.exact:
            self.last = self.factors()
            self.update.snapshot()
            return
        self.last = self.whitenings()
        for hook, L in zip(self.hooks, (layer[k] for layer, names in zip(self.last, self.names, strict=True)
                                        for k in names), strict=True):
            hook.L = L
        self._before = [local_rows(m.weight)[0].detach().clone() for m in self.mats]

    def after_step(self, step: int) -> None:
        if not self.exact:
            opts = self.optimizer if isinstance(self.optimizer, list | tuple) else [self.optimizer]
            decay = [group_decay(opts, m.weight) for m in self.mats] if self.opts.decay == "base" else None
            self.update.apply([f[k] for f, names in zip(self.last, self.names, strict=True) for k in names], decay)
            return
        assert self._before is not None, "before_step() must run before the optimizer step"
        with torch.no_grad():  # the change HeadMuon made, per head, on the rows held here
            self.update.sq = [rows_head_sq(m, local_rows(m.weight)[0] - old)
                              for m, old in zip(self.mats, self._before, strict=True)]
        self._before = None
        for hook in self.hooks:
            hook.L = None  # a step without before_step is refused, not run with stale weights

    def skip_step(self, step: int) -> None:
        self._before = None
        for hook in self.hooks:
            hook.L = None

    def exact_factors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per governed matrix (n_heads,): the effective rate factor tau * rms(C^{-1}) = tau sqrt(tr(C^{-2}) / d)
        (tau / c when C = c I: the isotropic factor), and cond(C) = cond(L), of the last step's whitening."""
        rms, cond = [], []
        for layer, names in zip(self.last, self.names, strict=True):
            for k in names:
                L = layer[k]  # (n, d, d)
                eye = torch.eye(L.shape[-1], device=L.device, dtype=L.dtype).expand_as(L)
                inv = torch.linalg.solve_triangular(L, eye, upper=False)  # L^{-1}: ||L^{-1}||_F^2 = tr(C^{-2})
                rms.append(self.opts.tau * inv.flatten(1).norm(dim=1) / math.sqrt(L.shape[-1]))
                s = torch.linalg.svdvals(L)  # (n, d), descending
                cond.append(s[:, 0] / s[:, -1])
        return rms, cond

    def metrics(self) -> dict[str, Any]:
        """Per layer and head: the factor applied (exact: tau rms(C^{-1}), and cond(C)) and the norm of the
        change each matrix took; the range of the factors."""
        if not self.last:
            return {}
        extra: dict[str, Any] = {}
        if self.exact:
            factors, cond = self.exact_factors()
            extra = per_layer("compositional_cond", cond, self.names)
        else:
            factors = [f[k] for f, names in zip(self.last, self.names, strict=True) for k in names]
        flat = torch.cat(factors)
        return {**per_layer("compositional", factors, self.names), **extra,
                **per_layer("compositional_update", head_norms(self.update.sq, self.mats, self.reduce), self.names),
                "compositional_factor_min": flat.min().item(), "compositional_factor_max": flat.max().item()}
