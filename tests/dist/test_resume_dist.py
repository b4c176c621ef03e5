"""A checkpoint written by 2 processes resumes in 1 and in 2, and one written by 1 resumes in 2; each
continues the loss curve of an uninterrupted single-process run at the same global batch."""

from __future__ import annotations

import pytest

from tests.dist.common import CopyRun, TrainJob, assert_close_curves, losses, single, spawn

# a constant schedule: the lr does not depend on train.steps, so a 3-step run continued to 6 is one run
EXTRA = ["train.schedule=constant", "qk.controller=qkclip", "train.optimizer=muon"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_resume")
    single(tmp, "ref", EXTRA)  # 6 steps, batch 8, one process
    single(tmp, "one", [*EXTRA, "train.steps=3"])  # written by 1 process, resumed by 2
    spawn(tmp, [TrainJob("two", [*EXTRA, "train.steps=3", "train.parallel=ddp"]),
                CopyRun("two", "two-to-one"),
                TrainJob("two", [*EXTRA, "train.parallel=ddp"], resume=True),
                TrainJob("one", [*EXTRA, "train.parallel=ddp"], resume=True)])
    single(tmp, "two-to-one", EXTRA, resume=True)
    return tmp


@pytest.mark.parametrize("name", ["two", "two-to-one", "one"])
def test_resume_across_process_counts_continues_the_curve(runs, name):
    ref = losses(runs, "ref")
    got = losses(runs, name)
    assert len(got) == 6  # steps 1-3 before the checkpoint, 4-6 after it
    assert_close_curves(ref, got)
