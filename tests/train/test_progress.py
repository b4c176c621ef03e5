"""train.progress: a live bar on a terminal only; without one (a log file, a pipe, a batch job) a plain line
at most once a minute instead of carriage-return bar updates."""

from __future__ import annotations

from pathlib import Path

import qklab.train.progress as progress_module
from qklab.config import load_config
from qklab.train.trainer import Trainer


def _run(tmp_path: Path, name: str) -> None:
    cfg = load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", f"train.name={name}", "train.steps=20",
                               "train.log_every=5", "train.eval_every=20", "train.ckpt_every=0", "train.diag_every=0",
                               "train.progress=true", f"data.cache_dir='{tmp_path / 'cache'}'"])
    Trainer(cfg, log=lambda s: None).run()


def test_no_bar_updates_without_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QKLAB_PROGRESS", raising=False)
    _run(tmp_path, "quiet")  # under capsys stderr is no terminal; a 20-step run takes well under a minute
    cap = capsys.readouterr()
    assert cap.err == "" and "\r" not in cap.out
    assert [ln for ln in cap.out.splitlines() if ln.startswith("step ")] == [ln for ln in cap.out.splitlines()
                                                                            if "val_loss" in ln]  # eval lines only
    monkeypatch.setattr(progress_module, "PROGRESS_EVERY_S", 0.0)  # as if each logged step came a minute later
    _run(tmp_path, "lines")
    cap = capsys.readouterr()
    notes = [ln.split(":")[0] for ln in cap.out.splitlines() if "tokens/s" in ln]
    assert notes == ["step 5/20", "step 10/20", "step 15/20", "step 20/20"] and cap.err == ""


def test_the_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QKLAB_PROGRESS", "1")  # as a terminal would
    _run(tmp_path, "bar")
    cap = capsys.readouterr()
    assert "\r" in cap.err and "20/20" in cap.err and "tokens/s" not in cap.out
