"""Which checkpoint a run folder offers (the newest step that verifies, whatever the ``latest`` pointer says),
and what pruning removes (older intact ones beyond ``keep``, and every folder that lost files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qklab.rundir.checkpoint import (
    complete_checkpoints,
    latest_checkpoint,
    newest_intact,
    newest_usable,
    save_checkpoint,
    write_manifest,
)
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


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in ckpt.glob("step_*") if p.name[5:].isdigit())


def _cut(folder: Path, how: str) -> None:
    """What a deletion cut short (or a truncated write) leaves of a checkpoint folder."""
    if how == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
        return
    for name in how.split("+"):
        (folder / name).unlink()


HALF_DELETED = ["model.safetensors", "state.pt", "manifest.json+model.safetensors", "manifest.json+state.pt",
                "truncated"]


@pytest.mark.parametrize("how", HALF_DELETED)
def test_a_half_deleted_checkpoint_is_pruned_at_the_next_save(tmp_path, how):
    """Pruning killed while it deleted step 10 leaves a folder no resume can use: the next save removes it
    (it used to stay for good), keeping the two newest intact ones."""
    ckpt = tmp_path / "ckpt"
    for step in (10, 20):
        _save(ckpt, step, keep=2)
    _cut(ckpt / "step_0000010", how)
    _save(ckpt, 30, keep=2)
    assert _steps(ckpt) == [20, 30]


@pytest.mark.parametrize("how", HALF_DELETED)
def test_keep_counts_intact_checkpoints_only(tmp_path, how):
    """keep=3 with step 20 damaged: steps 10, 30 and 40 stay (a damaged one used to take a place and push out
    step 10, a good one)."""
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _save(ckpt, step, keep=3)
    _cut(ckpt / "step_0000020", how)
    _save(ckpt, 40, keep=3)
    assert _steps(ckpt) == [10, 30, 40]
    assert newest_usable(ckpt)[0].name == "step_0000040"


def test_a_damaged_later_folder_goes_once_its_run_writes_past_it(tmp_path):
    """A run resumed at step 20 past a half-deleted step 30 writes step 25: the folder of step 30, which it
    passed over, goes with it, as a later complete but damaged one did already."""
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _save(ckpt, step, keep=3)
    _cut(ckpt / "step_0000030", "manifest.json+state.pt")
    assert newest_usable(ckpt)[0].name == "step_0000020"
    _save(ckpt, 25, keep=3)
    assert _steps(ckpt) == [10, 20, 25]


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    """Every older folder damaged and keep=1: what stays is the one just written, and it is usable."""
    ckpt = tmp_path / "ckpt"
    for step in (10, 20):
        _save(ckpt, step, keep=3)
    for step, how in ((10, "state.pt"), (20, "truncated")):
        _cut(ckpt / f"step_{step:07d}", how)
    _save(ckpt, 30, keep=1)
    assert _steps(ckpt) == [30]
    path, state = newest_usable(ckpt)
    assert path.name == "step_0000030" and state["marker"] == 30


@pytest.mark.parametrize("lost", ["dcp/__0_0.distcp", "manifest.json"])
def test_a_half_deleted_sharded_checkpoint_is_pruned(tmp_path, lost):
    """A sharded checkpoint that lost a shard (its index still there) or its manifest (a sharded one always
    had one) is no checkpoint to keep: pruned at the next save, even while fewer than ``keep`` are kept."""
    ckpt = tmp_path / "ckpt"
    sharded = ckpt / "step_0000010"
    (sharded / "dcp").mkdir(parents=True)
    (sharded / "dcp" / ".metadata").write_bytes(b"index")
    (sharded / "dcp" / "__0_0.distcp").write_bytes(b"shard" * 100)
    torch.save({"step": 10}, sharded / "state.pt")
    write_manifest(sharded, 10)
    _save(ckpt, 20, keep=3)
    assert _steps(ckpt) == [10, 20]  # intact: kept
    (sharded / lost).unlink()
    _save(ckpt, 30, keep=3)
    assert _steps(ckpt) == [20, 30]


def test_checkpoints_order_by_step_not_by_name(tmp_path):
    """Past step 9,999,999 a folder's name has 8 digits, and ``step_10000000`` sorts before ``step_9999999`` by
    name: resume must still take the higher step, and pruning must remove the lower one."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 9_999_999)
    _save(ckpt, 10_000_000)
    (ckpt / "step_junk").mkdir()  # a folder no run wrote: not a checkpoint, and never an error
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_9999999", "step_10000000"]
    assert newest_intact(ckpt).name == "step_10000000"
    path, state = newest_usable(ckpt)
    assert path.name == "step_10000000" and state["marker"] == 10_000_000
    # pruning keeps the newest by step: by name, step_10000000 (just written) sorts before both older ones,
    # so no older checkpoint would count as kept and both would go
    ckpt = tmp_path / "prune"
    for step in (9_999_998, 9_999_999):
        _save(ckpt, step)
    _save(ckpt, 10_000_000, keep=2)
    assert _steps(ckpt) == [9_999_999, 10_000_000]
