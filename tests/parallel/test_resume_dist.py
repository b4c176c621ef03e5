"""A checkpoint written by 2 processes resumes in 1 and in 2, and one written by 1 resumes in 2 (DDP and
FSDP2, consolidated and sharded); each continues the loss curve of an uninterrupted single-process run at
the same global batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qklab.config import ConfigError
from qklab.model import GPT
from qklab.rundir.checkpoint import latest_checkpoint, load_weights, read_state, verify_checkpoint
from tests.parallel.common import CopyRun, TrainJob, assert_close_curves, losses, single, spawn

# a constant schedule: the lr does not depend on train.steps, so a 3-step run continued to 6 is one run
DDP = ["train.schedule=constant", "qk.controller=qkclip", "train.optimizer=muon"]
FSDP = ["train.schedule=constant", "qk.controller=quack", "train.optimizer=muon", "model.n_kv_heads=2"]
FULL = [*FSDP, "train.ckpt_format=full"]  # FSDP2 gathered into one safetensors file on rank 0
SHARDED = FSDP  # FSDP2 on 2 processes writes DCP shards by default (train.ckpt_format=auto)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_resume")
    single(tmp, "ref", DDP)  # 6 steps, batch 8, one process
    single(tmp, "fref", FSDP)
    single(tmp, "one", [*DDP, "train.steps=3"])  # written by 1 process, resumed by 2
    single(tmp, "fone", [*FULL, "train.steps=3"])
    single(tmp, "sone", [*SHARDED, "train.steps=3", "train.ckpt_format=sharded"])  # DCP in one process
    shutil.copytree(tmp / "runs" / "fone", tmp / "runs" / "fone-ddp", ignore=shutil.ignore_patterns(".lock"))
    spawn(tmp, [TrainJob("two", [*DDP, "train.steps=3", "train.parallel=ddp"]),
                CopyRun("two", "two-to-one"),
                TrainJob("two", [*DDP, "train.parallel=ddp"], resume=True),
                TrainJob("one", [*DDP, "train.parallel=ddp"], resume=True),
                TrainJob("ftwo", [*FULL, "train.steps=3", "train.parallel=fsdp"]),
                CopyRun("ftwo", "ftwo-to-one"),
                CopyRun("ftwo", "ftwo-to-ddp"),
                TrainJob("ftwo", [*FULL, "train.parallel=fsdp"], resume=True),
                TrainJob("fone", [*FULL, "train.parallel=fsdp"], resume=True),
                TrainJob("ftwo-to-ddp", [*FULL, "train.parallel=ddp"], resume=True),
                TrainJob("stwo", [*SHARDED, "train.steps=3", "train.parallel=fsdp"]),
                CopyRun("stwo", "stwo-to-one"),
                CopyRun("stwo", "stwo-to-ddp"),
                CopyRun("stwo", "stwo-kept"),  # the sharded checkpoint itself, for the file checks
                TrainJob("stwo", [*SHARDED, "train.parallel=fsdp"], resume=True),
                TrainJob("stwo-to-ddp", [*SHARDED, "train.parallel=ddp"], resume=True),
                TrainJob("sone", [*SHARDED, "train.parallel=fsdp"], resume=True)])
    single(tmp, "two-to-one", DDP, resume=True)
    single(tmp, "ftwo-to-one", FULL, resume=True)
    single(tmp, "stwo-to-one", SHARDED, resume=True)
    return tmp


@pytest.mark.parametrize("name, ref", [("two", "ref"), ("two-to-one", "ref"), ("one", "ref"), ("ftwo", "fref"),
                                       ("ftwo-to-one", "fref"), ("fone", "fref"), ("ftwo-to-ddp", "fref"),
                                       ("stwo", "fref"), ("stwo-to-one", "fref"), ("stwo-to-ddp", "fref"),
                                       ("sone", "fref")])
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
    state = read_state(ck)
    assert state["world"] == 2
    muon = state["optimizers"][0]["state"]
    assert muon and all(isinstance(k, str) for k in muon)  # keyed by parameter name, whole tensors
    assert all(not hasattr(s["momentum_buffer"], "to_local") for s in muon.values())


def test_resume_with_another_global_batch_is_refused_in_one_line(runs):
    with pytest.raises(ConfigError) as e:
        single(runs, "two", DDP, batch=4, resume=True)  # written by 2 processes at 4: global batch 8
    assert str(e.value) == ("--resume with a changed global batch: 2 process(es) x train.batch_size=4 -> 1 x 4; "
                            "keep processes x train.batch_size at 8")


def test_fsdp_checkpoint_is_sharded_by_default(runs):
    """Each rank wrote its own shard file; the manifest covers them; the weights read whole from the shards
    equal those of the single-process run, and its optimizer states live in the shards, not in state.pt."""
    ck = latest_checkpoint(runs / "runs" / "stwo-kept" / "ckpt")
    assert ck is not None and ck.name == "step_0000003" and verify_checkpoint(ck) is None
    assert not (ck / "model.safetensors").exists()
    assert sorted(p.name for p in (ck / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    listed = json.loads((ck / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "state.pt"]
    state = read_state(ck)
    assert state["world"] == 2 and state["optimizers"] is None
    ref = GPT(*_model_cfg(runs, "fone"))  # one process, step 3, same config
    load_weights(latest_checkpoint(runs / "runs" / "fone-ddp" / "ckpt"), ref)
    got = GPT(*_model_cfg(runs, "stwo-kept"))
    load_weights(ck, got)  # whole tensors from both ranks' shards, no process group
    for (k, a), b in zip(got.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-3, msg=k)


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(runs):
    run = runs / "runs" / "stwo-kept"
    ck = latest_checkpoint(run / "ckpt")
    with open(ck / "dcp" / "__1_0.distcp", "r+b") as f:  # one byte of rank 1's shard flipped
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    assert "dcp/__1_0.distcp does not match its sha256" in verify_checkpoint(ck)
    assert latest_checkpoint(run / "ckpt") is None  # the only checkpoint of this run: none usable


def _model_cfg(tmp, name):
    from qklab.rundir.load import Target, load_run_config

    cfg = load_run_config(Target(tmp / "runs" / name / "ckpt", tmp / "runs" / name))
    return cfg.model, cfg.qk
