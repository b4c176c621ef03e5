"""Which rows of a matrix live in this process: all of them, or an FSDP2 shard (a DTensor split on dim 0).

Controllers and the sharded Muon work on these rows; nothing here imports torch.distributed, so a plain
tensor and a DTensor go through the same code.
"""

from __future__ import annotations

import torch


def is_sharded(w: torch.Tensor) -> bool:
    """A DTensor (e.g. an FSDP2 parameter): only some of its rows live in this process."""
    return hasattr(w, "to_local")


def local_rows(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows held here (r, C), index of the first): the whole matrix at 0 when it is not sharded; the
    local shard of a DTensor split on dim 0 the way ``torch.chunk`` splits (FSDP2)."""
    if not is_sharded(w):
        return w, 0
    local = w.to_local()
    world, rank = w.device_mesh.size(), w.device_mesh.get_local_rank()
    n = w.shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    if local.shape[0] != min(chunk, n - start):
        raise ValueError(f"a {tuple(w.shape)} matrix sharded as {w.placements} is not split by rows; "
                         "QK controllers need row (dim 0) sharding")
    return local, start
