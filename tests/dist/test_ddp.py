"""DDP on 2 gloo processes gives the loss curve of one process at the same global batch (fp32, 1e-5
relative), for every QK method family, with AdamW and Muon, MHA and MLA; weights equal on both ranks."""

from __future__ import annotations

import pytest
import torch

from tests.dist.common import TrainJob, assert_close_curves, losses, single, spawn

CASES = {
    f"{m}-{o}": [f"qk.method={m}", f"train.optimizer={o}"] for m in ("none", "qknorm", "qkmap") for o in ("adamw", "muon")
} | {
    f"{c}-{o}": [f"qk.controller={c}", f"train.optimizer={o}"] for c in ("quack", "qkclip") for o in ("adamw", "muon")
} | {
    "mla-quack-muon": ["model.attention=mla", "qk.controller=quack", "train.optimizer=muon"],
    "mla-qkclip-adamw": ["model.attention=mla", "qk.controller=qkclip"],
    "accum-qkclip": ["qk.controller=qkclip", "train.grad_accum=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    refs = {name: single(tmp, f"{name}-one", extra) for name, extra in CASES.items()}
    spawn(tmp, [TrainJob(f"{name}-ddp", [*extra, "train.parallel=ddp"]) for name, extra in CASES.items()])
    return tmp, refs


@pytest.mark.parametrize("name", list(CASES))
def test_ddp_matches_one_process(runs, name):
    tmp, refs = runs
    assert_close_curves(losses(tmp, f"{name}-one"), losses(tmp, f"{name}-ddp"))
    r0 = torch.load(tmp / f"{name}-ddp-rank0.pt")
    r1 = torch.load(tmp / f"{name}-ddp-rank1.pt")
    # torch's Muon orthogonalises in bf16 (torch/optim/_muon.py), which turns fp32 rounding differences of
    # the reduced gradient into bf16 ones in the weights; the loss curves above still agree to 1e-5
    atol = 2e-3 if "muon" in name else 1e-5
    for k, w in r0.items():
        assert torch.equal(w, r1[k]), f"{k} differs between ranks"
        torch.testing.assert_close(w, refs[name][k], rtol=1e-4, atol=atol, msg=f"{k} vs one process")
