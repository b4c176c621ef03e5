"""Data parallel wrapping: the model (DDP or FSDP2) and the batch stream (each rank its slice).

Global batch = per-rank batch x ranks x grad_accum. Every rank draws the same global micro-batch
(``train.batch_size`` x ranks rows, from one shared, seeded stream) and keeps rows
[rank * B, (rank + 1) * B). So N processes at batch B see exactly the rows one process sees at batch
N * B, in the same order, and the loader state is the same on every rank: a checkpoint resumes on any
number of processes with the same global batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from qklab.parallel.context import DistContext


class RankSlice:
    """A loader of global micro-batches (B * world rows) seen through one rank's B rows."""

    def __init__(self, loader, ctx: DistContext) -> None:
        self.loader, self.ctx = loader, ctx
        self.batch_size = loader.batch_size // ctx.world

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.loader.next_batch()  # (B * world, T) each
        lo = self.ctx.rank * self.batch_size
        return x[lo : lo + self.batch_size], y[lo : lo + self.batch_size]  # (B, T)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def wrap_ddp(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """DDP over every rank: gradients averaged in the backward pass (bucketed all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # the buffers (RoPE tables) are the same on every rank: no sync in each forward. torch 2.13 names
    # this forward_sync_buffers; before, broadcast_buffers=False (which also skips the init sync of them)
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=ids, **no_sync)
