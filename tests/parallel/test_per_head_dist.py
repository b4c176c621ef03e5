"""Per-head Muon and Compositional Muon's QK rule on FSDP2 shards (2 gloo processes) compute what one
process computes: the sharded per-head Newton-Schulz (heads split between ranks, uneven shards) against
the single-process HeadMuon, and whole training runs (GQA and MLA) against one process."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.common import ShardedMuonJob, assert_ranks_equal, check_against_one, muon_steps, run_cases, spawn

SHAPES = ((6, 2), (9, 3), (8, 4))  # (rows, rows per head): head 1 split 3 + 3; 5 + 4 rows; heads on one rank each


def test_sharded_per_head_muon_equals_one_process(tmp_path):
    spawn(tmp_path, [ShardedMuonJob(SHAPES, "muon.pt")])
    got, want = torch.load(tmp_path / "muon.pt"), muon_steps(SHAPES)
    for shape in SHAPES:
        torch.testing.assert_close(got[shape], want[shape], rtol=1e-5, atol=1e-6)


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
