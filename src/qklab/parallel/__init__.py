"""Data parallel training: process groups, DDP/FSDP2 wrapping, sharded checkpoints, collectives.

The trainer asks this package whether it is rank 0 and to reduce values over the ranks; ``methods/``
and ``model/`` never import it (controllers receive an optional reduce function instead).
"""

from qklab.parallel.context import DistContext, launched
from qklab.parallel.dcp import load_sharded, save_sharded
from qklab.parallel.fsdp import (
    all_finite,
    clip_grad_norm,
    full_state,
    load_full,
    set_grad_sync,
    shard_model,
    sync_replicated_grads,
    to_index,
)
from qklab.parallel.muon import ShardedMuon
from qklab.parallel.wrap import RankSlice, wrap_ddp

__all__ = ["DistContext", "RankSlice", "ShardedMuon", "all_finite", "clip_grad_norm", "full_state", "launched",
           "load_full", "load_sharded", "save_sharded",
           "set_grad_sync", "shard_model", "sync_replicated_grads", "to_index", "wrap_ddp"]
