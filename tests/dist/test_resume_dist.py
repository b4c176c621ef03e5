"""A checkpoint written by 2 processes resumes in 1 and in 2, and one written by 1 resumes in 2 (DDP and
FSDP2); each continues the loss curve of an uninterrupted single-process run at the same global batch."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from qklab.config import ConfigError
from qklab.train.checkpoint import latest_checkpoint, verify_checkpoint
from tests.dist.common import CopyRun, TrainJob, assert_close_curves, losses, single, spawn

# a constant schedule: the lr does not depend on train.steps, so a 3-step run continued to 6 is one run
DDP = ["train.schedule=constant", "qk.controller=qkclip", "train.optimizer=muon"]
FSDP = ["train.schedule=constant", "qk.controller=quack", "train.optimizer=muon", "model.n_kv_heads=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_resume")
    single(tmp, "ref", DDP)  # 6 steps, batch 8, one process
    single(tmp, "fref", FSDP)
    single(tmp, "one", [*DDP, "train.steps=3"])  # written by 1 process, resumed by 2
    single(tmp, "fone", [*FSDP, "train.steps=3"])
    shutil.copytree(tmp / "runs" / "fone", tmp / "runs" / "fone-ddp", ignore=shutil.ignore_patterns(".lock"))
    spawn(tmp, [TrainJob("two", [*DDP, "train.steps=3", "train.parallel=ddp"]),
                CopyRun("two", "two-to-one"),
                TrainJob("two", [*DDP, "train.parallel=ddp"], resume=True),
                TrainJob("one", [*DDP, "train.parallel=ddp"], resume=True),
                TrainJob("ftwo", [*FSDP, "train.steps=3", "train.parallel=fsdp"]),
                CopyRun("ftwo", "ftwo-to-one"),
                CopyRun("ftwo", "ftwo-to-ddp"),
                TrainJob("ftwo", [*FSDP, "train.parallel=fsdp"], resume=True),
                TrainJob("fone", [*FSDP, "train.parallel=fsdp"], resume=True),
                TrainJob("ftwo-to-ddp", [*FSDP, "train.parallel=ddp"], resume=True)])
    single(tmp, "two-to-one", DDP, resume=True)
    single(tmp, "ftwo-to-one", FSDP, resume=True)
    return tmp


@pytest.mark.parametrize("name, ref", [("two", "ref"), ("two-to-one", "ref"), ("one", "ref"), ("ftwo", "fref"),
                                       ("ftwo-to-one", "fref"), ("fone", "fref"), ("ftwo-to-ddp", "fref")])
def test_resume_across_process_counts_continues_the_curve(runs, name, ref):
    got = losses(runs, name)
    assert len(got) == 6  # steps 1-3 before the checkpoint, 4-6 after it
    assert_close_curves(losses(runs, ref), got)


def test_fsdp_checkpoint_is_consolidated_and_verified(runs):
    ck = latest_checkpoint(runs / "runs" / "ftwo" / "ckpt")
    assert ck is not None and verify_checkpoint(ck) is None  # manifest with sizes and sha256
    ref = latest_checkpoint(runs / "runs" / "fref" / "ckpt")
    a, b = load_file(str(ck / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys()  # the same file a single process writes (tied head stored once)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-3)
    state = torch.load(ck / "state.pt", weights_only=False)
    assert state["world"] == 2
    muon = state["optimizers"][0]["state"]
    assert muon and all(isinstance(k, str) for k in muon)  # keyed by parameter name, whole tensors
    assert all(not hasattr(s["momentum_buffer"], "to_local") for s in muon.values())


def test_resume_with_another_global_batch_is_refused_in_one_line(runs):
    with pytest.raises(ConfigError) as e:
        single(runs, "two", DDP, batch=4, resume=True)  # written by 2 processes at 4: global batch 8
    assert str(e.value) == ("--resume with a changed global batch: 2 process(es) x train.batch_size=4 -> 1 x 4; "
                            "keep processes x train.batch_size at 8")
