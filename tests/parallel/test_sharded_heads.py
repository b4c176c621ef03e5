"""Controllers on row-sharded matrices (FSDP2 DTensors) compute what they compute on the whole matrix,
also when a head's rows are split between two ranks and the shards are uneven."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as tdist

from qklab.methods.headwise import HeadMatrix, HeadScaledUpdate
from tests.parallel.common import spawn


class ShardedHeadsJob:
    def __call__(self, tmp: Path, rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        results = {}
        for n_heads, rows in ((3, 2), (3, 3), (1, 5)):  # 6 rows: head 1 split; 9 rows: 5 + 4; one shared head
            torch.manual_seed(0)
            full = torch.randn(n_heads * rows, 4)
            sharded = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
            m = HeadMatrix("w", sharded, n_heads)
            sq = m.head_sq()
            tdist.all_reduce(sq)
            f = torch.linspace(0.5, 2.0, n_heads)
            m.scale_heads(f)
            scaled = sharded.full_tensor()
            upd = HeadScaledUpdate([m])
            upd.snapshot()
            with torch.no_grad():
                sharded.add_(distribute_tensor(torch.ones_like(full), mesh, [Shard(0)]))  # "the optimizer step"
            upd.apply([f])
            results[(n_heads, rows)] = (full, sq.sqrt(), scaled, sharded.full_tensor())
        if rank == 0:
            torch.save(results, tmp / "heads.pt")


def test_sharded_heads_match_whole_matrix(tmp_path):
    spawn(tmp_path, [ShardedHeadsJob()])
    for (n_heads, rows), (full, norms, scaled, stepped) in torch.load(tmp_path / "heads.pt").items():
        whole = HeadMatrix("w", torch.nn.Parameter(full.clone()), n_heads)
        torch.testing.assert_close(norms, whole.head_norms())
        f = torch.linspace(0.5, 2.0, n_heads)
        want = full.view(n_heads, rows, -1) * f.view(-1, 1, 1)
        torch.testing.assert_close(scaled, want.reshape(full.shape))
        # the head-scaled update: old + f_h (old + 1 - old) = old + f_h, per head
        torch.testing.assert_close(stepped, (want + f.view(-1, 1, 1)).reshape(full.shape))
