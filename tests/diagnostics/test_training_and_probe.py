"""Diagnostics inside training (records, spikes, off = nothing) and ``qklab probe`` on a tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qklab.cli import main
from qklab.config import ConfigError, load_config
from qklab.train.metrics import read_metrics
from qklab.train.trainer import Trainer

SPIKE_STEP = 18


def _cfg(root: Path, name: str, *extra: str):
    return load_config("tiny", [f"train.out_dir='{root / 'runs'}'", f"train.name={name}", "train.steps=20",
                                "train.log_every=1", "train.ckpt_every=10", "train.eval_every=10",
                                "train.progress=false", f"data.cache_dir='{root / 'cache'}'", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Trainer:
    """20 steps with diagnostics every 5 steps and a loss spike forced at step 18 (logits scaled by 40)."""
    root = tmp_path_factory.mktemp("diagrun")
    t = Trainer(_cfg(root, "diag", "train.diag_every=5", "train.diag_batch=2"), log=lambda s: None)
    t.model.lm_head.register_forward_hook(
        lambda _m, _i, out: out * 40.0 if t.model.training and t.step == SPIKE_STEP - 1 else out)
    t.run()
    return t


def test_diagnostics_are_logged_every_n_steps(run):
    recs = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "diag" in r]
    assert [r["step"] for r in recs] == [0, 5, 10, 15, 20]
    L, H = run.cfg.model.n_layers, run.cfg.model.n_heads
    for r in recs:
        d = r["diag"]
        for key in ("max_logit", "q_norm", "k_norm", "wq_norm", "wk_norm", "entropy", "first_token"):
            assert len(d[key]) == L and all(len(row) == H for row in d[key]), key
        assert 0.0 <= d["sink_rate"] <= 1.0
    assert "logit_change" not in recs[0]["diag"]
    assert all(r["diag"]["logit_change_mean"] > 0 for r in recs[1:])


def test_a_forced_spike_is_logged_as_an_event(run):
    events = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "event" in r]
    assert [(e["step"], e["event"]) for e in events] == [(SPIKE_STEP, "loss_spike")]
    assert events[0]["sigmas"] > 6.0


def test_diagnostics_off_build_nothing(tmp_path):
    t = Trainer(_cfg(tmp_path, "off", "train.diag_every=0", "train.steps=2"), log=lambda s: None)
    assert t.monitor is None
    t.run()
    assert not any("diag" in r for r in read_metrics(t.run_dir / "metrics.jsonl"))


def test_bad_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="nonfinite"):
        _cfg(tmp_path, "x", "train.nonfinite=ignore")
    with pytest.raises(ConfigError, match="diag_every"):
        _cfg(tmp_path, "x", "train.diag_every=-1")


def test_probe_writes_its_files(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run's cache_dir is absolute: nothing depends on the cwd
    assert main(["probe", str(run.run_dir), "--samples", "2", "--max-mult", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "sink rate" in out and "evidence contrast" in out
    res = json.loads((run.run_dir / "probes.json").read_text())
    for f in ("probe_heads.png", "probe_magnitude.png", "probe_evidence.png"):
        assert (run.run_dir / f).stat().st_size > 1000
    assert res["step"] == 20 and res["logit_change_from_step"] == 10  # the older kept checkpoint
    assert len(res["heads"]["logit_change"]) == run.cfg.model.n_layers
    assert res["magnitude"]["scales"] == [0.25, 0.5, 1.0, 2.0, 4.0]
    ev = res["evidence"]
    assert ev["lengths"] == [64, 128] and len(ev["cells"]) == 6  # 128 > max_seq_len: measured on a copy


def test_probe_of_one_checkpoint_into_another_folder(run, tmp_path, capsys):
    ck = run.ckpt_dir / "step_0000010"
    assert main(["probe", str(ck), "--out", str(tmp_path / "p"), "--no-evidence", "--batch", "2"]) == 0
    res = json.loads((tmp_path / "p" / "probes.json").read_text())
    assert res["step"] == 10 and "evidence" not in res and res["logit_change_from_step"] is None
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png")) == ["probe_heads.png", "probe_magnitude.png"]


@pytest.mark.parametrize("make", ["missing", "empty", "file"])
def test_probe_bad_input_is_one_line_and_code_2(tmp_path, capsys, make):
    target = tmp_path / "thing"
    if make == "empty":
        target.mkdir()
    elif make == "file":
        target.write_text("x")
    assert main(["probe", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qklab: error:")
