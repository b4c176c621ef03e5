"""Run folders: two writers on one run, names that could reach other folders, --overwrite, and a run
that fails to start."""

from __future__ import annotations

import pytest

import qklab.train.trainer as trainer_mod
from qklab.config import load_config
from qklab.data import DataError
from qklab.rundir.folder import RunLockError
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer
from tests.faults.common import LEDGER, STEPS, child, cli, copy_run, same_as_reference, sets, wait_for_step


def test_a_second_writer_gets_one_line_and_the_first_is_untouched(reference, root):
    proc = child(["train", "--config", "tiny", *sets(root, "busy")])
    run = root / "runs" / "busy"
    wait_for_step(run, 3, proc)
    r = cli("train", "--config", "tiny", *sets(root, "busy"), "--overwrite")
    r2 = cli("train", "--config", "tiny", *sets(root, "busy"), "--resume")
    _, err = proc.communicate(timeout=120)
    LEDGER.injected += 1
    for x in (r, r2):
        assert x.code == 2 and len(x.err_lines) == 1 and "in use by another qklab process" in x.err_lines[0], x.err
    assert proc.returncode == 0, err
    assert same_as_reference(run, reference)  # no interleaved metrics, no foreign checkpoint


def test_two_trainers_in_one_process(root):
    cfg = load_config("tiny", sets(root, "twice")[1::2])
    first = Trainer(cfg, log=lambda s: None)
    with pytest.raises(RunLockError, match="in use"):
        Trainer(load_config("tiny", sets(root, "twice")[1::2]), log=lambda s: None)
    first.close()
    Trainer(load_config("tiny", sets(root, "twice")[1::2]), log=lambda s: None).close()  # free again


@pytest.mark.parametrize("name", [".", "..", "a/b", "/tmp", ".hidden", "x" * 200, "tab\tname"])
def test_run_names_are_plain_names(reference, root, name):
    keep = copy_run(reference, root, "other")
    r = cli("train", "--config", "tiny", *sets(root, "x"), "--set", f"train.name='{name}'", "--overwrite")
    assert r.code == 2 and len(r.err_lines) == 1 and "not a plain run name" in r.err_lines[0], r.err
    assert (keep / "ckpt").is_dir() and (root / "runs").is_dir()


def test_overwrite_refuses_a_folder_that_is_not_a_run(root):
    folder = root / "runs" / "mine"
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("precious")
    r = cli("train", "--config", "tiny", *sets(root, "mine"), "--overwrite")
    assert r.code == 2 and "refusing to delete" in r.err and "thesis.tex" in r.err
    assert (folder / "thesis.tex").read_text() == "precious"


def test_overwrite_replaces_a_run(reference, root):
    run = copy_run(reference, root, "again")
    (run / "tb").mkdir()  # a tracker's files and a study's mark belong to the run too
    (run / "cell.json").write_text("{}")
    r = cli("train", "--config", "tiny", *sets(root, "again"), "--overwrite")
    assert r.code == 0, r.err
    assert not (run / "tb").exists() and not (run / "cell.json").exists()
    assert [x["step"] for x in read_metrics(run / "metrics.jsonl") if "loss" in x] == list(range(1, STEPS + 1))


def _failing_data(*_a, **_k):
    raise DataError("data.source: injected failure")


def test_a_failed_data_preparation_leaves_no_folder_and_no_damage(reference, root, monkeypatch):
    monkeypatch.setattr(trainer_mod, "prepare_data", _failing_data)
    LEDGER.injected += 2
    r = cli("train", "--config", "tiny", *sets(root, "fresh"))
    assert r.code == 2 and "injected failure" in r.err
    assert not (root / "runs" / "fresh").exists()
    old = copy_run(reference, root, "old")
    r = cli("train", "--config", "tiny", *sets(root, "old"), "--overwrite")
    assert r.code == 2
    assert same_as_reference(old, reference)  # --overwrite deletes only once the new run is ready
    LEDGER.recovered += 1
