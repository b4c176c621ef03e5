"""The sweep runner: every variant x seed trains, the table's mean/std match the runs, reruns are skipped."""

from __future__ import annotations

import statistics

import pytest

from qklab.config import ConfigError
from qklab.sweep import diverged, lr_grid_table, parse_variant, run_sweep


def test_sweep_table_and_resume(tmp_path, capsys):
    variants = [parse_variant("std:qk.method=none"), parse_variant("cap:qk.method=softcap,qk.softcap.cap=5")]
    common = ["train.steps=6", "train.eval_every=3", "train.ckpt_every=0", f"data.cache_dir='{tmp_path}/c'"]
    s = run_sweep("tiny", variants, [0, 1], tmp_path / "sw", common)
    runs = s["runs"]["cap"]
    row = next(r for r in s["table"] if r["variant"] == "cap")
    assert row["val_loss"] == pytest.approx(statistics.fmean(r["val_loss"] for r in runs))
    assert row["val_loss_std"] == pytest.approx(statistics.stdev(r["val_loss"] for r in runs))
    assert all(r["max_logit"] <= 5.0 for r in runs)  # the cap bounds the logits
    assert runs[0]["val_loss"] != runs[1]["val_loss"]  # seeds differ
    assert (tmp_path / "sw" / "summary.md").read_text().count("\n") == 4
    capsys.readouterr()
    run_sweep("tiny", variants, [0, 1], tmp_path / "sw", common)  # second time: nothing retrained
    assert "== " not in capsys.readouterr().out


def test_diverged_rule():
    assert diverged([{"step": 1, "loss": 5.0}, {"step": 2, "loss": "nan"}])
    assert diverged([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 6.0}])
    assert not diverged([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 3.0}])


def test_bad_variant():
    with pytest.raises(ConfigError, match="label:key=value"):
        parse_variant("no-colon")


def test_lr_grid_table_marks_divergence_and_stable_range():
    table = [{"variant": "a-x1", "val_loss": 5.00, "max_logit": 10.0, "diverged": 0},
             {"variant": "a-x4", "val_loss": 5.04, "max_logit": 50.0, "diverged": 0},
             {"variant": "a-x16", "val_loss": float("nan"), "max_logit": float("nan"), "diverged": 1},
             {"variant": "b-x1", "val_loss": 5.20, "max_logit": 5.0, "diverged": 0},
             {"variant": "b-x4", "val_loss": 5.10, "max_logit": 6.0, "diverged": 0}]
    out = lr_grid_table({"table": table}).splitlines()
    assert out[0] == "| method | lr x1 | lr x4 | lr x16 | stable range |"
    assert out[2] == "| a | 5.000 (10) | 5.040 (50) | **diverged** | x1, x4 |"
    assert out[3] == "| b | 5.200 (5) | 5.100 (6) | not run | x4 |"
