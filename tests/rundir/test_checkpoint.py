"""Which checkpoint a run folder offers: the newest step that verifies, whatever the ``latest`` pointer says."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qklab.rundir.checkpoint import latest_checkpoint, newest_usable, save_checkpoint
from qklab.train.checkpointer import Checkpointer


def _save(ckpt: Path, step: int, keep: int = 5) -> Path:
    torch.manual_seed(step)
    return save_checkpoint(ckpt, step, nn.Linear(4, 3), {"marker": step}, keep=keep)


def test_a_stale_latest_pointer_does_not_win_over_a_newer_checkpoint(tmp_path):
    """A kill between the rename of step 20's folder and the pointer's leaves ``latest`` naming step 10:
    resume, probe and export still take step 20 (a resume from 10 would redo ten steps)."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 10)
    _save(ckpt, 20)
    (ckpt / "latest").write_text("step_0000010\n")
    path, state = newest_usable(ckpt)
    assert path.name == "step_0000020" and state["step"] == 20 and state["marker"] == 20
    assert Checkpointer.find(ckpt, warn=print)[0].name == "step_0000020"
    assert latest_checkpoint(ckpt).name == "step_0000020"


def test_a_pointer_to_a_damaged_checkpoint_falls_back_to_the_newest_good_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _save(ckpt, step)
    (ckpt / "step_0000030" / "state.pt").write_bytes(b"torn")
    (ckpt / "latest").write_text("step_0000010\n")
    warned: list[str] = []
    path, state = newest_usable(ckpt, warn=warned.append)
    assert path.name == "step_0000020" and state["step"] == 20
    assert len(warned) == 1 and "step_0000030 is damaged" in warned[0] and "using step_0000020" in warned[0]
