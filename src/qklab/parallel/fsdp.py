"""FSDP2 (``fully_shard``): each block's weight matrices sharded by rows over the ranks.

What is sharded: every parameter with two or more dimensions (attention, MLP, embedding, head), split on
dim 0 as ``torch.chunk`` does (rank r holds rows [r * ceil(N / world), ...)). What is not: vectors (RMSNorm
gains) and the parameters of QK methods (QK-Norm gains, QK-MAP frequencies and temperatures). They are a
tiny share of the model, stay whole on every rank (``ignored_params``), and their gradients are averaged
over the ranks by ``sync_replicated_grads`` (one packed all-reduce) before clipping, so the optimizer
applies the same update everywhere. Controllers see the sharded matrices as DTensors and work on the local
rows (``qklab.methods.headwise``), reducing per-head sums through the reduce function they are given.

Checkpoints go through ``torch.distributed.checkpoint.state_dict``: ``full_state`` gathers the model and
optimizer states into full, CPU tensors on rank 0 (the consolidated checkpoint of ``qklab.rundir.checkpoint``,
atomic with its manifest, loadable by any number of processes), and ``load_full`` gives every rank its
shards back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qklab.methods.base import QKMethod
from qklab.methods.shards import is_sharded
from qklab.parallel.context import DistContext


def small_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters kept whole on every rank: vectors and the parameters of QK methods."""
    keep = {p for p in model.parameters() if p.ndim < 2}
    for mod in model.modules():
        if isinstance(mod, QKMethod):
            keep.update(mod.parameters())
    return keep


def shard_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Apply ``fully_shard`` to each block, then to the root (embedding and head, tied or not)."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh
    keep = small_params(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=keep)
    fully_shard(model, mesh=mesh, ignored_params=keep)
    return model


def set_grad_sync(model: nn.Module, on: bool) -> None:
    """FSDP2: reduce-scatter gradients on this backward (the last micro-batch of a step) or not."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(on)


def sync_replicated_grads(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Average the gradients of the parameters FSDP does not shard over the ranks (one all-reduce)."""
    grads = [p.grad for p in params if not is_sharded(p) and p.grad is not None]
    if not grads or not ctx.active:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numel,)
    ctx.reduce(flat).div_(ctx.world)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, ctx: DistContext) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded and whole gradients together: the squared norms
    of the local shards are summed over the ranks, the whole ones counted once. Returns the total norm."""
    sharded = [p.grad.to_local() for p in params if p.grad is not None and is_sharded(p)]
    whole = [p.grad for p in params if p.grad is not None and not is_sharded(p)]
    dev = (sharded or whole)[0].device
    sq = torch.zeros((), device=dev, dtype=torch.float32)
    for g in sharded:
        sq = sq + g.float().pow(2).sum()
    ctx.reduce(sq.view(1))
    for g in whole:
        sq = sq + g.float().pow(2).sum()
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in [*sharded, *whole]:
        g.mul_(coef.to(g.dtype))
    return total


def all_finite(params: list[torch.Tensor], ctx: DistContext) -> bool:
    local = all(bool(torch.isfinite(p.to_local() if is_sharded(p) else p).all()) for p in params)
    return not ctx.any(not local)


def full_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list[dict]]:
    """Full (unsharded) CPU copies of the model and optimizer states on rank 0 (a collective; the other
    ranks get empty dicts). Optimizer states are keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), [get_optimizer_state_dict(model, o, options=opts)
                                                      for o in optimizers]


def load_full(model: nn.Module, optimizers: list[torch.optim.Optimizer], model_sd: dict[str, torch.Tensor],
              optim_sds: list[dict[str, Any]]) -> None:
    """Give every rank its shards of a full model state and of full optimizer states (keyed by parameter
    name, as ``full_state`` writes them, or by index, as ``optimizer.state_dict()`` does)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=opts)
    for o, sd in zip(optimizers, optim_sds, strict=True):
        set_optimizer_state_dict(model, o, by_name(sd), options=opts)


def by_name(sd: dict[str, Any]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` keyed by index turned into one keyed by parameter name, through the
    ``param_names`` qklab's parameter groups carry; a state keyed by name is returned as it is."""
    if all(isinstance(k, str) for k in sd["state"]):
        return sd
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"], strict=True)}
    groups = [{**g, "params": list(g["param_names"])} for g in sd["param_groups"]]
    return {"state": {names[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def to_index(sd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The inverse of ``by_name`` for a plain (unsharded) optimizer: a state keyed by parameter name
    made loadable by ``optimizer.load_state_dict``."""
    if not any(isinstance(k, str) for k in sd["state"]) and not any(
            isinstance(p, str) for g in sd["param_groups"] for p in g["params"]):
        return sd
    index, groups, i = {}, [], 0
    for g_opt, g in zip(optimizer.param_groups, sd["param_groups"], strict=True):
        ids = list(range(i, i + len(g_opt["params"])))
        index.update(zip(g_opt["param_names"], ids, strict=True))
        groups.append({**g, "params": ids})
        i += len(ids)
    return {"state": {index[n]: s for n, s in sd["state"].items()}, "param_groups": groups}
