"""Diagnostics inside training (records, spikes, off = nothing) and ``qklab probe`` on a tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qklab.cli import main
from qklab.config import ConfigError, load_config
from qklab.diagnostics import head_series, probe_summary
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer

SPIKE_STEP = 18


def _cfg(root: Path, name: str, *extra: str):
    return load_config("tiny", [f"train.out_dir='{root / 'runs'}'", f"train.name={name}", "train.steps=20",
                                "train.log_every=1", "train.ckpt_every=10", "train.eval_every=10",
                                "train.progress=false", f"data.cache_dir='{root / 'cache'}'", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Trainer:
    """20 steps with diagnostics every 6 steps (and at the last) and a loss spike forced at step 18 (logits
    scaled by 40)."""
    root = tmp_path_factory.mktemp("diagrun")
    t = Trainer(_cfg(root, "diag", "train.diag_every=6", "train.diag_batch=2"), log=lambda s: None)
    t.model.lm_head.register_forward_hook(
        lambda _m, _i, out: out * 40.0 if t.model.training and t.step == SPIKE_STEP - 1 else out)
    t.run()
    return t


def test_diagnostics_are_logged_every_n_steps(run):
    recs = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "diag" in r]
    assert [r["step"] for r in recs] == [0, 6, 12, 18, 20]  # the last step is always measured
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


def test_probe_takes_the_previous_checkpoint_by_step(run, tmp_path, capsys):
    """Checkpoints past step 9,999,999 (folder names of 8 digits, which sort before 7-digit ones by name): the
    probe takes the newest by step and measures the logit change since the one before it by step."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run.run_dir, copy)
    (copy / "ckpt" / "step_0000010").rename(copy / "ckpt" / "step_9999999")  # the states keep steps 10 and 20
    (copy / "ckpt" / "step_0000020").rename(copy / "ckpt" / "step_10000000")
    assert main(["probe", str(copy), "--samples", "2", "--max-mult", "2"]) == 0
    capsys.readouterr()
    res = json.loads((copy / "probes" / "step_10000000" / "probes.json").read_text())
    assert res["checkpoint"].endswith("step_10000000") and res["logit_change_from_step"] == 10


def test_probe_writes_its_files(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run's cache_dir is absolute: nothing depends on the cwd
    assert main(["probe", str(run.run_dir), "--samples", "2", "--max-mult", "2"]) == 0
    out = capsys.readouterr().out
    assert "sink rate" in out and "retrieval" in out and "induction" in out and "(extrapolation)" in out
    folder = run.run_dir / "probes" / "step_0000020"  # step-tagged
    res = json.loads((folder / "probes.json").read_text())
    for f in ("probe_heads.png", "probe_magnitude.png", "probe_retrieval.png", "probe_induction.png",
              "probe_series.png"):
        assert (folder / f).stat().st_size > 1000
    assert res["schema"] == "qklab.probes/2"
    assert res["step"] == 20 and res["logit_change_from_step"] == 10  # the older kept checkpoint
    assert res["probe_batch"] == [2, 64]  # the run's train.diag_batch: the training diagnostics' batch
    assert len(res["heads"]["logit_change"]) == run.cfg.model.n_layers
    assert res["magnitude"]["scales"] == [0.25, 0.5, 1.0, 2.0, 4.0]
    rt, ind = res["retrieval"], res["induction"]
    assert [(r["length"], r["extrapolation"]) for r in rt["lengths"]] == [(32, False), (64, False), (128, True)]
    assert ind["lengths"] == [64, 128] and len(ind["cells"]) == 6
    assert rt["pool_size"] < run.cfg.model.vocab_size  # only ids seen in training, no end-of-text id


def test_final_step_diagnostics_equal_the_probe_of_the_last_checkpoint(run):
    last = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "diag" in r][-1]
    res = json.loads((run.run_dir / "probes" / "step_0000020" / "probes.json").read_text())
    assert last["step"] == res["step"] == 20
    for key in ("max_logit", "entropy", "first_token", "q_norm", "k_norm"):
        torch.testing.assert_close(torch.tensor(last["diag"][key]), torch.tensor(res["heads"][key]),
                                   rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(torch.tensor(last["diag"]["sink"]["first_token"]),
                               torch.tensor(res["heads"]["sink"]["first_token"]), rtol=1e-5, atol=1e-6)


def test_probe_summary_gives_the_headline_numbers(run):
    res = json.loads((run.run_dir / "probes" / "step_0000020" / "probes.json").read_text())
    s = probe_summary(res)
    T = 64
    assert s["step"] == 20
    assert s["first_token_baseline"] == pytest.approx(sum(1 / (i + 1) for i in range(1, T)) / (T - 1))
    assert s["first_token"] == pytest.approx(sum(sum(r) for r in res["heads"]["first_token"]) / 8)
    assert s["distance_baseline"] == T / 4
    assert s["distance"] == pytest.approx(sum(sum(r) for r in res["heads"]["distance"]) / 8)
    assert s["sink_rate"] == res["heads"]["sink"]["rate"]
    row = res["retrieval"]["lengths"][1]  # N = 64 = T, the longest N <= T (after N = 32)
    assert s["retrieval_length"] == 64 and s["evidence_mass"] == row["mass"]
    assert s["log_contrast"] == row["log_contrast"]
    assert s["top1_rank"] == row["rank"] and s["retrieval_accuracy"] == row["accuracy"]
    assert s["magnitude_js_a4"] == res["magnitude"]["js_mean"][4]
    empty = probe_summary({"step": 3})
    assert empty["step"] == 3 and empty["evidence_mass"] is None and empty["sink_rate"] is None
    assert empty["distance"] is None


def test_probe_of_an_older_checkpoint_does_not_overwrite_the_latest(run, tmp_path, capsys):
    latest = run.run_dir / "probes" / "step_0000020" / "probes.json"
    before = latest.read_text() if latest.exists() else None
    assert main(["probe", str(run.ckpt_dir / "step_0000010"), "--no-evidence"]) == 0
    res = json.loads((run.run_dir / "probes" / "step_0000010" / "probes.json").read_text())
    assert res["step"] == 10 and "retrieval" not in res and res["logit_change_from_step"] is None
    assert (latest.read_text() if latest.exists() else None) == before
    assert main(["probe", str(run.ckpt_dir / "step_0000010"), "--out", str(tmp_path / "p"), "--no-evidence"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png")) == ["probe_heads.png", "probe_magnitude.png",
                                                                      "probe_series.png"]


def test_compare_puts_runs_on_one_scale(run, tmp_path, capsys):
    assert main(["probe", "--compare", str(run.run_dir), str(run.run_dir), "--out", str(tmp_path / "c"),
                 "--samples", "2", "--max-mult", "2"]) == 0
    summary = json.loads((tmp_path / "c" / "compare.json").read_text())["runs"]
    assert list(summary) == ["diag", "diag'"] and summary["diag"]["step"] == 20
    assert (tmp_path / "c" / "compare_heads.png").stat().st_size > 1000


def test_compare_groups_seeds_with_their_spread(run, tmp_path, capsys):
    import shutil

    for seed in (0, 1):  # the same run under two seed names: a group of two with zero spread
        shutil.copytree(run.run_dir, tmp_path / f"m-s{seed}", ignore=shutil.ignore_patterns("probes", "*.lock"))
    assert main(["probe", "--compare", str(tmp_path / "m-s0"), str(tmp_path / "m-s1"), "--out",
                 str(tmp_path / "c"), "--samples", "2", "--max-mult", "2"]) == 0
    res = json.loads((tmp_path / "c" / "compare.json").read_text())
    g = res["groups"]["m"]
    assert g["n"] == 2 and g["evidence_mass"] == pytest.approx(res["runs"]["m-s0"]["evidence_mass"])
    assert g["evidence_mass_seed_std"] == pytest.approx(0.0, abs=1e-12)
    assert (tmp_path / "c" / "compare_seeds.png").stat().st_size > 1000


@pytest.mark.parametrize("args, says", [
    (["--samples", "0"], "--samples 0"),
    (["--max-mult", "0"], "--max-mult 0"),
    (["--seg-len", "40"], "--seg-len 40"),  # 4 x 40 > the training length 64
    (["--batch", "0"], "--batch 0"),
    (["--device", "tpu"], "--device 'tpu'"),
])
def test_probe_bad_options_are_one_line_and_code_2(run, capsys, args, says):
    assert main(["probe", str(run.run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qklab: error: " + says)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_probe_on_cuda_without_cuda_is_one_line(run, capsys):
    assert main(["probe", str(run.run_dir), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_per_head_series_include_controller_factors(tmp_path):
    t = Trainer(_cfg(tmp_path, "quack", "qk.controller=quack", "train.steps=4", "train.diag_every=2",
                     "train.ckpt_every=0"), log=lambda s: None)
    t.run()
    recs = read_metrics(t.run_dir / "metrics.jsonl")
    series = head_series(t.run_dir / "metrics.jsonl")
    diag = [r for r in recs if "diag" in r]
    assert series["max_logit"]["steps"].tolist() == [r["step"] for r in diag] == [0, 2, 4]
    assert series["first_token"]["values"].tolist() == [r["diag"]["first_token"] for r in diag]
    assert series["logit_change"]["steps"].tolist() == [2, 4]
    quack = [k for k in series if k.startswith("quack_")]
    assert quack and series[quack[0]]["values"].shape[1:] == (2, 4)
    assert series[quack[0]]["values"][-1].tolist() == [r for r in recs if quack[0] in r][-1][quack[0]]


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
