"""SIGTERM to one process of a DDP run stops both at the same step, after rank 0's checkpoint, and the
run resumes from it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from qklab.train.signals import RunInterrupted
from qklab.train.trainer import Trainer
from tests.parallel.common import TrainJob, cfg, losses, spawn


class SignalJob:
    """Rank 1 receives SIGTERM during step 3; each rank records where it stopped."""

    def __call__(self, tmp: Path, rank: int) -> None:
        t = Trainer(cfg(tmp, "sig", ["train.parallel=ddp", "train.schedule=constant"], batch=4), log=lambda s: None)
        step = t.train_step

        def train_step():
            if rank == 1 and t.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the step boundary
            return step()

        t.train_step = train_step
        try:
            t.run()
            code = 0
        except RunInterrupted as e:
            code = e.exit_code
        (tmp / f"sig-rank{rank}.json").write_text(json.dumps({"step": t.step, "code": code}))


def test_sigterm_on_one_rank_stops_all_after_a_checkpoint(tmp_path):
    spawn(tmp_path, [SignalJob(), TrainJob("sig", ["train.parallel=ddp", "train.schedule=constant"], resume=True)])
    stops = [json.loads((tmp_path / f"sig-rank{r}.json").read_text()) for r in (0, 1)]
    assert stops == [{"step": 3, "code": 143}] * 2
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "sig" / "ckpt").glob("step_*"))
    assert "step_0000003" in ckpts
    assert len(losses(tmp_path, "sig")) == 6  # resumed at step 3 and finished
