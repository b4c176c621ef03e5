"""Muon on FSDP2 shards, computing exactly what one process computes.

Muon's momentum is elementwise, so it stays on the rows each rank holds. Its Newton-Schulz
orthogonalisation needs the whole matrix: every rank gathers the (momentum) update of a matrix whole,
orthogonalises it with torch's own routine, and keeps its rows. Running the iteration on sharded
DTensors instead would reduce partial bf16 products over the ranks (torch's Muon iterates in bf16) and
drift from the single-process result; the gathered form is the same arithmetic as one process.
Costs: one all-gather of each matrix's update per step and the orthogonalisation repeated on every rank.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from qklab.methods.shards import is_sharded, local_rows


class ShardedMuon(torch.optim.Muon):
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
            lr, wd, mom = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs, strict=True):
                rows, start = local_rows(p)  # (r, C): this rank's rows of the parameter
                b, gl = (buf.to_local(), g.to_local()) if is_sharded(p) else (buf, g)
                b.lerp_(gl, 1 - mom)
                update = gl.lerp(b, mom) if group["nesterov"] else b  # (r, C)
                whole = _gather_rows(update, p) if is_sharded(p) else update  # (N, C)
                ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                rows.mul_(1 - lr * wd)
                rows.add_(ortho[start : start + rows.shape[0]], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _gather_rows(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole (N, C) matrix from each rank's rows ``local``, sharded as the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()
