"""Data parallel training: process groups, DDP/FSDP2 wrapping, sharded checkpoints, collectives.

The trainer asks this package whether it is rank 0 and to reduce values over the ranks; ``methods/``
and ``model/`` never import it (controllers receive an optional reduce function instead).
"""

from qklab.dist.context import DistContext, launched
from qklab.dist.wrap import RankSlice, wrap_ddp

__all__ = ["DistContext", "RankSlice", "launched", "wrap_ddp"]
