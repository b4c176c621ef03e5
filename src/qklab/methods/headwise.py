"""Per-head learning rates for packed Q/K matrices, shared by the optimizer-side controllers.

A packed W_Q (H * d, C) holds every head's rows. An optimizer step changes p by delta(lr); for AdamW
and for Muon (decoupled weight decay included) that change is proportional to lr, because their state
(moments, momentum) does not depend on lr. So a head learning rate lr * f_h is realised exactly by
keeping the optimizer's step at lr and rescaling each head's slice of the change:

    p_new[h] = p_old[h] + f_h * (p_stepped[h] - p_old[h])

``HeadScaledUpdate`` snapshots the matrices before ``optimizer.step()`` and rescales after it.

Sharded matrices (FSDP2: a DTensor split by rows over the ranks, ``qklab.methods.shards``) are handled on
the rows this process holds: per-head sums of squares of the local rows (``HeadMatrix.head_sq``), added
over the ranks by the controller's reduce function, give the exact per-head norms, and factors are
applied row by row, so a head split between two ranks is treated as one head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qklab.methods.shards import is_sharded, local_rows

AttnKind = Literal["mha", "mla"]  # an attention layer's ``kind``, named as ``model.attention`` names it


@dataclass
class HeadMatrix:
    """One matrix on the logit path: ``weight`` (n_heads * rows, C) split into n_heads row blocks
    (n_heads = 1 for a matrix shared by all heads), or already as a (n_heads, rows, C) view into a
    parameter whose head blocks are strided (e.g. DeepSeek's q_b_proj, whose heads interleave the nope
    and rope rows; a fused QKV matrix); in-place updates of the view reach the parameter."""

    name: str
    weight: nn.Parameter
    n_heads: int

    def heads(self, w: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if w is None else w
        if w.dim() == 3:
            return w
        return w.view(self.n_heads, -1, w.shape[-1])  # (n_heads, rows, C)

    def head_norms(self, kind: str = "fro", gain: torch.Tensor | None = None) -> torch.Tensor:
        """(n_heads,) Frobenius or spectral norm of each head's block; with ``gain`` (C,), of the block
        times diag(gain) (an RMSNorm gain on the matrix's input folded in)."""
        blocks = self.heads().detach().float()
        if gain is not None:
            blocks = blocks * gain.detach().float().to(blocks.device)
        if kind == "spectral":
            return torch.linalg.matrix_norm(blocks, ord=2)
        return blocks.flatten(1).norm(dim=1)

    def head_sq(self, gain: torch.Tensor | None = None) -> torch.Tensor:
        """(n_heads,) sum of squares of each head's rows held here (times diag(gain)); summed over the
        ranks it is the squared Frobenius norm of every head, whichever rows each rank holds."""
        rows, start = local_rows(self.weight)
        rows = rows.detach().float()  # (r, C)
        if gain is not None:
            rows = rows * gain.detach().float().to(rows.device)
        per_head = self.weight.shape[0] // self.n_heads
        head = (torch.arange(rows.shape[0], device=rows.device) + start) // per_head  # (r,)
        return torch.zeros(self.n_heads, device=rows.device).index_add_(0, head, rows.pow(2).sum(dim=1))

    def row_factor(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows held here (r, C), f (n_heads,) expanded to those rows (r, 1))."""
        rows, start = local_rows(self.weight)
        per_head = self.weight.shape[0] // self.n_heads
        head = (torch.arange(rows.shape[0], device=rows.device) + start) // per_head
        return rows, f.to(rows.device, rows.dtype)[head].view(-1, 1)

    @torch.no_grad()
    def scale_heads(self, f: torch.Tensor) -> None:
        """Multiply head h's rows by f[h] (n_heads,), in place, on whatever rows this process holds."""
        if not is_sharded(self.weight):
            self.heads().mul_(f.to(self.weight.device).view(-1, 1, 1))
            return
        rows, fr = self.row_factor(f)
        rows.mul_(fr)


def is_mla(attn: nn.Module) -> bool:
    """MLA (latent q/k/v: ``wuq``, ``wuk``, ``wqr`` ...) rather than MHA/GQA (``wq``, ``wk``), as the layer's
    ``kind`` says: qklab's ``Attention`` and ``MLAttention`` and ``qklab.hf``'s ``QKLayer`` all carry one."""
    return attn.kind == "mla"


def logit_matrices(attn: nn.Module) -> dict[str, HeadMatrix]:
    """The matrices on an attention layer's logit path, by name.

    MHA/GQA: ``wq`` (per query head) and ``wk`` (per KV head). MLA: ``wuq``, ``wuk``, ``wqr`` (per
    head), and ``wdq`` (absent without a query latent), ``wdkv``, ``wkr`` (shared by all heads).
    """
    if not is_mla(attn):
        return {"wq": HeadMatrix("wq", attn.wq.weight, attn.n_heads),
                "wk": HeadMatrix("wk", attn.wk.weight, attn.n_kv_heads)}
    H = attn.n_heads
    mats = {"wuq": HeadMatrix("wuq", attn.wuq.weight, H), "wuk": HeadMatrix("wuk", attn.wuk.weight, H),
            "wqr": HeadMatrix("wqr", attn.wqr.weight, H)}
    if attn.wdq is not None:
        mats["wdq"] = HeadMatrix("wdq", attn.wdq.weight, 1)
    mats["wdkv"] = HeadMatrix("wdkv", attn.wdkv.weight, 1)
    mats["wkr"] = HeadMatrix("wkr", attn.wkr.weight, 1)
    return mats


class HeadScaledUpdate:
    """Rescale each head's slice of the optimizer update by a factor (see module docstring)."""

    def __init__(self, mats: list[HeadMatrix]) -> None:
        self.mats = mats
        self._before: list[torch.Tensor] | None = None

    @torch.no_grad()
    def snapshot(self) -> None:
        self._before = [local_rows(m.weight)[0].detach().clone() for m in self.mats]

    @torch.no_grad()
    def apply(self, factors: list[torch.Tensor], decay: list[float] | None = None) -> None:
        """factors[i]: (n_heads,) for mats[i]. Call right after optimizer.step().

        decay[i] (optional): lr * weight_decay of mats[i]'s group in that step. The decoupled decay is
        then kept at the group's rate instead of scaling with the factor: AdamW and Muon change p by
        -lr wd p_old - lr u, so p_old + f (p_new - p_old) + (f - 1) lr wd p_old = p_old - lr wd p_old - f lr u."""
        assert self._before is not None, "snapshot() must run before the optimizer step"
        for i, (m, old, f) in enumerate(zip(self.mats, self._before, factors, strict=True)):
            if is_sharded(m.weight):  # the rows held here, each with its head's factor
                new, fr = m.row_factor(f)  # (r, C), (r, 1)
                step = old + fr * (new - old)
                if decay is not None and decay[i]:
                    step = step + (fr - 1) * decay[i] * old
                new.copy_(step)
                continue
            new = m.heads()  # view into the parameter
            oldh = m.heads(old)
            f = f.to(new.device, new.dtype).view(-1, 1, 1)
            step = oldh + f * (new - oldh)
            if decay is not None and decay[i]:
                step = step + (f - 1) * decay[i] * oldh
            new.copy_(step)
        self._before = None


def group_decay(optimizers: list[torch.optim.Optimizer], p: torch.Tensor) -> float:
    """lr * weight_decay of the optimizer group holding parameter p, or a view into one (0: none)."""
    for opt in optimizers:
        for g in opt.param_groups:
            if any(q is p or _storage(q) == _storage(p) for q in g["params"]):
                return float(g["lr"]) * float(g.get("weight_decay", 0.0))
    return 0.0


def _storage(t: torch.Tensor) -> int:
    return local_rows(t)[0].untyped_storage().data_ptr()
