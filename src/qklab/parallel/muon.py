"""Muon per attention head, and Muon on FSDP2 shards computing exactly what one process computes.

Per head (``train.muon_per_head``, docs: the optimizer definitions): a Muon group may carry
``head_rows``, one entry per parameter: the rows of one head (0: the matrix is orthogonalised whole). Such
a matrix (n_heads * rows, C) has its update orthogonalised block by block, each head's (rows, C) block
with torch's own Newton-Schulz (``torch.optim._muon._zeropower_via_newtonschulz``), and the step's rate
adjusted by torch's ``_adjust_lr`` on the head's shape (rows, C): under ``match_rms_adamw`` each head's
update has the RMS 0.2 * lr that a whole matrix's has. Momentum and decoupled weight decay are
elementwise, so they are those of torch's Muon. Without ``head_rows`` a group computes torch's Muon bit for
bit.

Preconditioned heads (``HeadMuon.set_preconditioner``): a controller may wrap the Newton-Schulz of one
parameter's head blocks, U^h -> pre(U^h) before it and O^h -> post(O^h) after it, on all heads at once as
(n_heads, rows, C) fp32 tensors (Compositional Muon's exact rule: pre = C^{-1} U, post = tau C^{-1} O).
The step is then W <- (1 - lr wd) W - lr_adj post(NS(pre(U))), lr_adj torch's rate on the head's shape.

Sharded: Muon's momentum is elementwise, so it stays on the rows each rank holds. Its Newton-Schulz
orthogonalisation needs the whole matrix (or the whole head): every rank gathers the (momentum) update of
a matrix whole, orthogonalises it with torch's own routine (and its preconditioner, which every rank
holds whole), and keeps its rows. A head split between two ranks is therefore one head, as in one
process. Running the iteration on sharded DTensors instead would reduce partial bf16 products over the
ranks (torch's Muon iterates in bf16) and drift from the single-process result; the gathered form is the
same arithmetic as one process. Costs: one all-gather of each matrix's update per step and the
orthogonalisation repeated on every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from qklab.methods.shards import is_sharded, local_rows


class HeadPreconditioner(Protocol):
    """What ``HeadMuon.set_preconditioner`` takes: two maps of a parameter's head blocks, in fp32."""

    def pre(self, update: torch.Tensor) -> torch.Tensor:
        """(n_heads, rows, C) momentum update U of every head -> the Newton-Schulz input (same shape)."""

    def post(self, ortho: torch.Tensor) -> torch.Tensor:
        """(n_heads, rows, C) Newton-Schulz output O of every head -> the step direction, before -lr_adj."""


def orthogonalise(update: torch.Tensor, group: dict, rows: int = 0,
                  hook: HeadPreconditioner | None = None) -> tuple[torch.Tensor, torch.Size]:
    """(torch's Newton-Schulz of ``update`` (N, C), the shape its rate is adjusted for): of the whole
    matrix when ``rows`` is 0 (or N), else of each (rows, C) head block, stacked back in order. With
    ``hook``: post(NS(pre(U^h))) per head block, in fp32 around torch's (bf16) iteration."""
    coeffs, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    N, C = update.shape
    r = rows or N
    if N % r:
        raise ValueError(f"a {tuple(update.shape)} matrix does not split into heads of {rows} rows")
    shape = update.shape if r == N else torch.Size((r, C))
    if hook is not None:
        blocks = hook.pre(update.float().view(N // r, r, C))  # (n_heads, r, C)
        ortho = torch.stack([_zeropower_via_newtonschulz(b, coeffs, steps, eps) for b in blocks])
        return hook.post(ortho.float()).reshape(N, C), shape
    if r == N:
        return _zeropower_via_newtonschulz(update, coeffs, steps, eps), shape
    blocks = [_zeropower_via_newtonschulz(b, coeffs, steps, eps) for b in update.split(r)]
    return torch.cat(blocks), shape


def head_rows(group: dict) -> dict[int, int]:
    """id(parameter) -> rows per head of a group's per-head matrices (absent: orthogonalised whole)."""
    rows = group.get("head_rows")
    if rows is None:
        return {}
    return {id(p): r for p, r in zip(group["params"], rows, strict=True) if r}


class HeadMuon(torch.optim.Muon):
    """torch's Muon, with the per-head orthogonalisation of the matrices a group names in ``head_rows``, on
    whole parameters and on FSDP2 row shards alike (a whole parameter is its own rows, from 0), and the
    per-parameter preconditioners of ``set_preconditioner``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._preconditioners: dict[int, HeadPreconditioner] = {}  # id(parameter) -> its hook

    def rows_of(self, p: torch.Tensor) -> int | None:
        """The rows per head this optimizer orthogonalises ``p`` by (its whole row count when it is
        orthogonalised whole), or None when p is in none of its groups."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return head_rows(group).get(id(p), 0) or p.shape[0]
        return None

    def set_preconditioner(self, p: torch.Tensor, hook: HeadPreconditioner | None) -> None:
        """Run ``hook.pre`` / ``hook.post`` around the Newton-Schulz of parameter ``p``'s head blocks (the
        blocks ``head_rows`` gives it, or the whole matrix); None removes it. The hook sees whole heads:
        under FSDP2 the gathered update, on every rank."""
        if self.rows_of(p) is None:
            raise ValueError(f"a {tuple(p.shape)} parameter is not in this optimizer's groups")
        if hook is None:
            self._preconditioners.pop(id(p), None)
        else:
            self._preconditioners[id(p)] = hook

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            heads = head_rows(group)
            lr, wd, mom = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs, strict=True):  # torch's _single_tensor_muon, per head
                rows, start = local_rows(p)  # (r, C): this rank's rows of the parameter
                b, gl = (buf.to_local(), g.to_local()) if is_sharded(p) else (buf, g)
                b.lerp_(gl, 1 - mom)
                update = gl.lerp(b, mom) if group["nesterov"] else b  # (r, C)
                whole = _gather_rows(update, p) if is_sharded(p) else update  # (N, C)
                hook = self._preconditioners.get(id(p))
                ortho, shape = orthogonalise(whole, group, heads.get(id(p), 0), hook)
                rows.mul_(1 - lr * wd)
                step = ortho[start : start + rows.shape[0]]
                rows.add_(step.to(rows.dtype) if hook is not None else step,
                          alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
        return loss


ShardedMuon = HeadMuon  # the name FSDP2 runs use: the same step gathers each sharded update whole


def _gather_rows(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole (N, C) matrix from each rank's rows ``local``, sharded as the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()
