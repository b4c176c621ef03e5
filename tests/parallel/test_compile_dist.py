"""``train.compile`` under DDP and FSDP2: the compiled data-parallel run follows the eager single-process
loss curve (1e-5 relative) and leaves equal replicated weights on both ranks, with QK-clip's max-logit
tracking traced inside the graph.

The workers compile with the ``aot_eager`` backend (dynamo + AOT autograd, forward and backward traced,
no C++ compiler needed), the same graphs inductor would receive.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.parallel.common import TrainJob, assert_ranks_equal, check_against_one, single, spawn

CASES = {
    "ddp": {"qknorm-quack-adamw": ["qk.method=qknorm", "qk.controller=quack"],
            "none-qkclip-muon": ["qk.controller=qkclip", "train.optimizer=muon"]},
    "fsdp": {"qkmap-qkclip-adamw": ["qk.method=qkmap", "qk.controller=qkclip"],
             "mla-quack-muon": ["model.attention=mla", "qk.controller=quack", "train.optimizer=muon"]},
}


class CompiledJob(TrainJob):
    """A TrainJob with ``train.compile=true``, compiled by aot_eager; records dynamo's graph breaks."""

    def __call__(self, tmp: Path, rank: int) -> None:
        import torch._dynamo

        orig = torch.compile
        torch.compile = functools.partial(orig, backend="aot_eager")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            super().__call__(tmp, rank)
        finally:
            torch.compile = orig
        breaks = set(torch._dynamo.utils.counters["graph_break"])
        if "-ddp" in self.name:  # the breaks DDP's own forward causes, around a bare linear layer
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            torch.manual_seed(0)
            bare = torch.compile(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4)), backend="aot_eager")
            bare(torch.randn(2, 4)).sum().backward()
            breaks -= set(torch._dynamo.utils.counters["graph_break"])
        (tmp / f"{self.name}-breaks-rank{rank}.txt").write_text(json.dumps(sorted(breaks)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_dist")
    refs = {name: single(tmp, f"{name}-one", extra) for cases in CASES.values() for name, extra in cases.items()}
    spawn(tmp, [CompiledJob(f"{name}-{mode}", [*extra, f"train.parallel={mode}", "train.compile=true"])
                for mode, cases in CASES.items() for name, extra in cases.items()])
    return tmp, refs


@pytest.mark.parametrize("mode, name", [(m, n) for m in CASES for n in CASES[m]])
def test_compiled_data_parallel_matches_eager_one_process(runs, mode, name):
    tmp, refs = runs
    check_against_one(tmp, refs, name, mode)
    for rank in (0, 1):
        # no graph break in the model's forward and backward (DDP: beyond those DDP's own forward causes,
        # where dynamo compiles the model inside it and splits it at gradient buckets for overlap)
        assert json.loads((tmp / f"{name}-{mode}-breaks-rank{rank}.txt").read_text()) == []
    assert_ranks_equal(tmp, f"{name}-{mode}", mode)
