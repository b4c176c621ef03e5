"""A cell whose config runs data parallel (train.parallel = "ddp") trains under torchrun inside its Slurm
task: two gloo processes on the task's two CPUs, rank 0 alone writing the run folder and the result, which
follows one process at the same global batch to the data-parallel tests' tolerance."""

from __future__ import annotations

import json

import pytest

from qklab.study.runner import run_study
from qklab.study.spec import load_study
from tests.cluster.common import qklab, result, study_file
from tests.parallel.common import CURVE_RTOL


def test_a_two_process_cell_runs_under_torchrun_in_one_task(slurm, tmp_path):
    path = study_file(tmp_path, "ddp", 40, {"d": {"train.parallel": "ddp", "train.device": "cpu",
                                                         "train.batch_size": 4}})  # per process
    out = tmp_path / "o"
    p = qklab("study", "run", path, "--out", out, "--executor", "slurm", "--slurm", "cpus=2", "--slurm",
              "nproc_per_node=2", "--wait", timeout=300)
    assert p.returncode == 0 and "(torchrun in each task)" in p.stdout, p.stdout + p.stderr
    script = next((out / "slurm").glob("*.sh")).read_text()
    assert "-m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2 -m qklab.study.task" in script
    slurm_log = next((out / "slurm" / "logs").glob("*.log")).read_text()
    assert slurm_log.count("qklab: cell d_lr1_s0 of study ddp") == 2, slurm_log  # one line per rank
    two = result(out / "results", "d_lr1_s0")
    assert two["status"] == "ok" and two["config"]["train"]["parallel"] == "ddp"
    manifest = json.loads(next((out / "slurm").glob("*.json")).read_text())
    assert manifest["threads"] == 1  # the task's CPUs shared between its processes

    # one process at the same global batch (8, the tiny preset's)
    one = load_study(study_file(tmp_path / "one", "one", 40, {"d": {"train.device": "cpu", "train.batch_size": 8}}))
    run_study(one, tmp_path / "one" / "o", workers=0, threads=1, log=lambda s: None)
    ref = result(tmp_path / "one" / "o" / "results", "d_lr1_s0")
    assert ref["status"] == "ok" and two["curves"]["train"]["step"] == ref["curves"]["train"]["step"]
    assert two["curves"]["train"]["loss"] == pytest.approx(ref["curves"]["train"]["loss"], rel=CURVE_RTOL)
