"""Per-head Muon and Compositional Muon's QK rule on FSDP2 shards (2 gloo processes) compute what one
process computes: the sharded per-head Newton-Schulz (heads split between ranks, uneven shards) against
the single-process HeadMuon, and whole training runs (GQA and MLA) against one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qklab.parallel.muon import HeadMuon
from tests.parallel.common import assert_ranks_equal, check_against_one, run_cases, spawn

SHAPES = ((6, 2), (9, 3), (8, 4))  # (rows, rows per head): head 1 split 3 + 3; 5 + 4 rows; heads on one rank each


def _grads(rows: int, step: int) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(100 * rows + step))


def _muon(params: list, rows: int, cls: type) -> torch.optim.Optimizer:
    return cls([{"params": params, "head_rows": [rows]}], lr=0.02, weight_decay=0.1, momentum=0.95,
               adjust_lr_fn="match_rms_adamw")


class ShardedHeadMuonJob:
    def __call__(self, tmp: Path, rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from qklab.parallel.muon import ShardedMuon

        mesh = init_device_mesh("cpu", (2,))
        out = {}
        for n, rows in SHAPES:
            full = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
            p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
            opt = _muon([p], rows, ShardedMuon)
            for step in range(2):
                p.grad = distribute_tensor(_grads(n, step), mesh, [Shard(0)])
                opt.step()
            out[(n, rows)] = p.full_tensor()
        if rank == 0:
            torch.save(out, tmp / "muon.pt")


def test_sharded_per_head_muon_equals_one_process(tmp_path):
    spawn(tmp_path, [ShardedHeadMuonJob()])
    got = torch.load(tmp_path / "muon.pt")
    for n, rows in SHAPES:
        p = torch.nn.Parameter(torch.randn(n, 8, generator=torch.Generator().manual_seed(n)))
        opt = _muon([p], rows, HeadMuon)
        for step in range(2):
            p.grad = _grads(n, step)
            opt.step()
        torch.testing.assert_close(got[(n, rows)], p.detach(), rtol=1e-5, atol=1e-6)


CASES = {
    "gqa-compositional-muon-perhead": ["qk.controller=compositional", "train.optimizer=muon",
                                       "train.muon_per_head=qkv", "model.n_kv_heads=2"],
    "mla-compositional-muon-perhead": ["model.attention=mla", "qk.controller=compositional",
                                       "train.optimizer=muon", "train.muon_per_head=qk"],
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, run_cases(tmp, CASES, "fsdp")


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_matches_one_process(fsdp_runs, name):
    tmp, refs = fsdp_runs
    check_against_one(tmp, refs, name, "fsdp")
    assert_ranks_equal(tmp, f"{name}-fsdp", "fsdp")
