"""How a run is spread over processes: one ``Strategy`` per ``train.parallel`` mode, so the trainer asks
and never branches on the mode.

    Strategy   one process (also ddp or fsdp started without a launcher: data parallel over one rank)
    DDP        DistributedDataParallel: whole weights on every rank, gradients all-reduced in backward
    FSDP       FSDP2 (``fully_shard``): matrices sharded by rows, vectors and QK-method parameters whole

Each answers the same questions in the order of a run: ``prepare`` the model (before the optimizers are
built on its parameters), which Muon class those optimizers use, ``wrap`` it (a collective, once every
rank built), the batch stream of this rank, whether a micro-batch syncs its gradients, clipping, "are
all weights finite?", and the full (unsharded) state for checkpoints and diagnostics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qklab.parallel import fsdp
from qklab.parallel.context import DistContext
from qklab.parallel.muon import ShardedMuon
from qklab.parallel.wrap import RankSlice, wrap_ddp


class Strategy:
    """One process: the identity everywhere."""

    sharded = False  # parameters are DTensor shards (FSDP2); checkpoints then default to DCP shards
    muon: type[torch.optim.Optimizer] = torch.optim.Muon

    def __init__(self, dist: DistContext, empty_model: Callable[[], nn.Module]) -> None:
        self.dist = dist
        self.empty_model = empty_model  # an unsharded model of the run's config on CPU, weights uninitialised
        self.model: nn.Module | None = None
        self.wrapped: nn.Module | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Before the optimizers and the controller are built: they hold the parameters it leaves."""
        self.model = self.wrapped = model
        return model

    def wrap(self) -> nn.Module:
        """What the train step calls (a collective under DDP: every rank calls it once the build agreed)."""
        return self.wrapped

    def loader(self, loader: Any) -> Any:
        """This rank's batch stream: every rank draws the global micro-batch and keeps its own rows."""
        return RankSlice(loader, self.dist) if self.dist.active else loader

    def accumulating(self, more: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's backward; ``more``: micro-batches of this step follow it."""
        return contextlib.nullcontext()

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (inf: measure only); returns the total norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        """True on every rank when every weight on every rank is finite (a host sync)."""
        return all(bool(torch.isfinite(p).all()) for p in params)

    def full_state(self, optimizers: list[torch.optim.Optimizer]) -> tuple[nn.Module | None, list[dict] | None]:
        """The whole model and its optimizer states as one process holds them, on rank 0 (a collective
        under FSDP; None on the other ranks). Optimizers ``[]``: the model alone (diagnostics)."""
        return self.model, [o.state_dict() for o in optimizers]

    def load_full(self, optimizers: list[torch.optim.Optimizer], weights: dict[str, torch.Tensor] | None,
                  optim_states: list[dict]) -> None:
        """Load whole states (a consolidated checkpoint, keyed by index or by parameter name); ``weights``
        None: they are in the model already."""
        if weights is not None:
            self.model.load_state_dict(weights)
        for opt, sd in zip(optimizers, optim_states, strict=True):
            opt.load_state_dict(fsdp.to_index(sd, opt))  # an FSDP run's state is keyed by name


class DDP(Strategy):
    def wrap(self) -> nn.Module:
        device = next(self.model.parameters()).device
        self.wrapped = wrap_ddp(self.model, self.dist, device)
        return self.wrapped

    def accumulating(self, more: bool) -> contextlib.AbstractContextManager:
        return self.wrapped.no_sync() if more else contextlib.nullcontext()  # reduce on the last micro-batch


class FSDP(Strategy):
    sharded = True
    muon = ShardedMuon

    def prepare(self, model: nn.Module) -> nn.Module:
        fsdp.shard_model(model, self.dist)
        return super().prepare(model)

    def accumulating(self, more: bool) -> contextlib.AbstractContextManager:
        fsdp.set_grad_sync(self.model, not more)  # reduce-scatter on the last micro-batch only
        return contextlib.nullcontext()

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        # the whole (unsharded) parameters' gradients are averaged here, the sharded ones' in backward
        fsdp.sync_replicated_grads(params, self.dist)
        return fsdp.clip_grad_norm(params, max_norm, self.dist)

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        return fsdp.all_finite(params, self.dist)

    def full_state(self, optimizers: list[torch.optim.Optimizer]) -> tuple[nn.Module | None, list[dict] | None]:
        weights, optim = fsdp.full_state(self.model, optimizers)  # gathered into full CPU tensors on rank 0
        if not self.dist.is_main:
            return None, None
        whole = self.empty_model()
        whole.load_state_dict(weights)
        return whole, optim

    def load_full(self, optimizers: list[torch.optim.Optimizer], weights: dict[str, torch.Tensor] | None,
                  optim_states: list[dict]) -> None:
        fsdp.load_full(self.model, optimizers, weights, optim_states)  # every rank keeps its shards


def strategy(dist: DistContext, empty_model: Callable[[], nn.Module]) -> Strategy:
    """The strategy of ``dist``'s mode; a mode on one process is plain training."""
    if not dist.active:
        return Strategy(dist, empty_model)
    return {"ddp": DDP, "fsdp": FSDP}[dist.parallel](dist, empty_model)
