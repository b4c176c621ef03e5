"""A checkpoint whose pickles would run code when loaded (a run folder someone shared) is refused by every
reader, in one line naming the file and what it needs, and nothing of it runs: ``state.pt`` under probe,
export, ``train --resume`` and a study's resume of a cell, DCP's index and values under probe and resume.
``study verify`` trains its cells again in fresh run folders: a planted checkpoint there is removed unread."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qklab.cli import main
from qklab.config import load_config
from qklab.errors import CheckpointError, UnsafeCheckpoint
from qklab.parallel.dcp import DCP_DIR, _io, _state
from qklab.rundir.checkpoint import latest_checkpoint, read_state, write_manifest
from qklab.study.result import read_result
from qklab.study.runner import run_study
from qklab.study.spec import parse_study
from qklab.train.trainer import Trainer
from tests.faults.common import LEDGER, cli, copy_run, sets

SHORT = ("train.steps=4", "train.ckpt_every=2", "train.eval_every=2")
REFUSAL = "which qklab does not load (a checkpoint from elsewhere?); refused, nothing of it was run"


class WritesFile:
    """Unpickled, it creates the file ``path``: what a planted checkpoint might do instead."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class Executes:
    """Unpickled, it runs ``exec`` on code that creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


def _plant_state(ck: Path, payload: object) -> None:
    """Replace the checkpoint's state.pt by one holding ``payload``, its manifest rewritten to match (so
    only the unpickling policy stands between the payload and the reader)."""
    torch.save({"step": 4, "controller": payload}, ck / "state.pt")
    write_manifest(ck, 4)


@pytest.fixture(scope="module")
def trained(faults_root) -> Path:
    """A short tiny run (checkpoints at steps 2 and 4) and a sharded one, to copy and plant into."""
    root = faults_root / "unsafe"
    root.mkdir()
    assert main(["train", "--config", "tiny", *sets(root, "run", *SHORT)]) == 0
    assert main(["train", "--config", "tiny", *sets(root, "sharded", *SHORT, "train.ckpt_format=sharded")]) == 0
    return root / "runs"


READERS = {
    "probe": lambda root, run: ["probe", str(run), "--no-evidence", "--batch", "2", "--out", str(root / "p")],
    "probe-unverified": lambda root, run: ["probe", str(run / "ckpt" / "step_0000004"), "--allow-unverified",
                                           "--no-evidence", "--batch", "2", "--out", str(root / "p")],
    "export": lambda root, run: ["export", str(run), "--out", str(root / "x")],
    "resume": lambda root, run: ["train", "--config", "tiny", *sets(root, "run", *SHORT), "--resume"],
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_planted_state_is_refused_by_every_reader(trained, root, reader):
    run = copy_run(trained / "run", root, "run")
    ck, marker = run / "ckpt" / "step_0000004", root / "marker"
    _plant_state(ck, WritesFile(marker))
    if reader == "probe-unverified":  # no manifest at all: the unpickling policy still holds
        (ck / "manifest.json").unlink()
    LEDGER.injected += 1
    r = cli(*READERS[reader](root, run))
    assert r.code == 2 and r.err_lines == [f"qklab: error: checkpoint {ck}: state.pt needs io.open, {REFUSAL}"], r.err
    assert not marker.exists()
    assert sorted(p.name for p in (run / "ckpt").glob("step_*")) == ["step_0000002", "step_0000004"]
    LEDGER.recovered += 1


@pytest.mark.parametrize("payload, needs", [(WritesFile, "io.open"), (Executes, "builtins.exec")])
def test_read_state_names_what_a_planted_state_needs(trained, root, payload, needs):
    ck = copy_run(trained / "run", root, "run") / "ckpt" / "step_0000004"
    _plant_state(ck, payload(root / "marker"))
    with pytest.raises(UnsafeCheckpoint) as e:
        read_state(ck)
    assert str(e.value) == f"checkpoint {ck}: state.pt needs {needs}, {REFUSAL}"
    assert not (root / "marker").exists()


def test_damaged_and_unsafe_stay_apart(trained, root):
    """A state.pt that is not a pickle is damaged (an older checkpoint may be used instead); one that needs
    code is no damaged one (UnsafeCheckpoint, never skipped)."""
    ck = copy_run(trained / "run", root, "run") / "ckpt" / "step_0000004"
    (ck / "state.pt").write_bytes(b"not a pickle")
    write_manifest(ck, 4)
    with pytest.raises(CheckpointError) as e:
        read_state(ck)
    assert type(e.value) is CheckpointError
    assert str(e.value) == f"checkpoint {ck} is damaged: state.pt does not load (UnpicklingError)"


def test_a_planted_dcp_index_is_refused_by_probe(trained, root):
    run = copy_run(trained / "sharded", root, "sharded")
    ck, marker = run / "ckpt" / "step_0000004", root / "marker"
    (ck / DCP_DIR / ".metadata").write_bytes(pickle.dumps(WritesFile(marker)))
    write_manifest(ck, 4)
    LEDGER.injected += 1
    r = cli("probe", str(run), "--no-evidence", "--batch", "2", "--out", str(root / "p"))
    assert r.code == 2 and r.err_lines == [f"qklab: error: checkpoint {ck}: dcp/.metadata needs io.open, {REFUSAL}"]
    assert not marker.exists()
    LEDGER.recovered += 1


def test_a_planted_dcp_value_is_refused_on_resume(trained, root):
    """DCP keeps an optimizer's settings (lr, betas) as pickles beside the tensors: one that needs code is
    refused when the run resumes, naming the value."""
    run = copy_run(trained / "sharded", root, "sharded")
    ck, marker = run / "ckpt" / "step_0000004", root / "marker"
    argv = sets(root, "sharded", *SHORT, "train.ckpt_format=sharded")
    cfg = load_config("tiny", [v for v in argv if v != "--set"])
    t = Trainer(cfg, resume=True, log=lambda s: None)  # the shards as they are, to save again with one planted
    state = _state(t.model, t.optimizers)
    t.close()
    key = "param_groups.tok_emb.weight.lr"
    assert isinstance(state["optim0"][key], float)
    state["optim0"][key] = WritesFile(marker)
    shutil.rmtree(ck / DCP_DIR)
    with _io() as single:
        dcp.save(state, checkpoint_id=str(ck / DCP_DIR), no_dist=single)
    write_manifest(ck, 4)
    LEDGER.injected += 1
    r = cli("train", "--config", "tiny", *argv, "--resume")
    assert r.code == 2 and r.err_lines == [f"qklab: error: checkpoint {ck}: dcp/ item optim0.{key} needs io.open, "
                                           f"{REFUSAL}"], r.err
    assert not marker.exists()
    LEDGER.recovered += 1


STUDY_SETS = {"train.steps": 4, "train.eval_every": 2, "train.ckpt_every": 2, "train.diag_every": 0,
              "data.max_files": 20}


def _run_study(tmp: Path, cache: Path) -> None:
    """A one-cell study run into ``tmp``: its run folders in ``o/cells``, its results in ``res``."""
    raw = {"study": {"config": "tiny", "seeds": [0], "set": {**STUDY_SETS, "data.cache_dir": str(cache)}},
           "variants": {"a": {"qk.method": "none"}}}
    run_study(parse_study(raw, "u"), tmp / "o", tmp / "res", workers=0, threads=1, log=lambda s: None)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("unsafe_study")
    _run_study(tmp, tmp / "cache")
    return tmp


def test_a_study_refuses_to_resume_a_planted_cell(study, tmp_path, capsys):
    """The cell's result gone, its run folder resumes: the planted checkpoint fails the cell, naming it."""
    for d in ("o", "res"):
        shutil.copytree(study / d, tmp_path / d, ignore=shutil.ignore_patterns(".lock"))
    (tmp_path / "res" / "a_lr1_s0" / "result.json").unlink()
    ck, marker = latest_checkpoint(tmp_path / "o" / "cells" / "a_lr1_s0" / "ckpt"), tmp_path / "marker"
    _plant_state(ck, WritesFile(marker))
    _run_study(tmp_path, study / "cache")
    capsys.readouterr()  # the failed cell's traceback
    res = read_result(tmp_path / "res" / "a_lr1_s0" / "result.json")
    assert res["status"] == "failed"
    assert res["failure"] == f"UnsafeCheckpoint: checkpoint {ck}: state.pt needs io.open, {REFUSAL}"
    assert not marker.exists()


def test_verify_retrains_without_reading_a_planted_checkpoint(study, tmp_path, capsys):
    """``study verify --out`` trains each cell again from its result.json config in ``<out>/<cell>``, a run
    folder it starts afresh (--overwrite): a planted checkpoint there is deleted unread, and the probes
    read only the checkpoints it wrote."""
    again = tmp_path / "again"
    shutil.copytree(study / "o" / "cells" / "a_lr1_s0", again / "a_lr1_s0", ignore=shutil.ignore_patterns(".lock"))
    ck, marker = again / "a_lr1_s0" / "ckpt" / "step_0000004", tmp_path / "marker"
    _plant_state(ck, WritesFile(marker))
    assert main(["study", "verify", str(study / "res"), "--out", str(again)]) == 0
    assert "a_lr1_s0: identical, bit for bit" in capsys.readouterr().out
    assert not marker.exists()
    assert read_state(ck)["controller"] == {}  # what the retraining wrote in its place
