"""Resuming with a changed config, quiet failures and bugs: each ends with one clear line (and the
right exit code); only a bug prints a traceback, with the run's log."""

from __future__ import annotations

import pytest
import torch

from qklab.train.trainer import Trainer
from tests.faults.common import LEDGER, STEPS, cli, copy_run, sets


@pytest.mark.parametrize("change, key", [
    ("model.d_model=128", "model.d_model 64 -> 128"),
    ("qk.method=qknorm", "qk.method 'none' -> 'qknorm'"),
    ("qk.controller=quack", "qk.controller 'none' -> 'quack'"),
    ("train.optimizer=muon", "train.optimizer 'adamw' -> 'muon'"),
])
def test_resume_with_a_changed_config_names_the_key(reference, root, change, key):
    copy_run(reference, root, "chg")
    r = cli("train", "--config", "tiny", *sets(root, "chg", change), "--resume")
    LEDGER.injected += 1
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert r.err_lines[0].startswith("qklab: error: --resume with a changed config") and key in r.err_lines[0]
    assert "prepared" not in r.out and "pystdlib" not in r.out  # refused before any work


def test_resume_may_change_length_cadence_and_lr(reference, root):
    copy_run(reference, root, "ok")
    r = cli("train", "--config", "tiny", *sets(root, "ok", "train.log_every=3", "train.eval_every=5", "train.lr=1e-3",
                                             "train.nonfinite=skip"), "--resume")
    assert r.code == 0, r.err
    assert f"at step {STEPS}" in r.out


def _poisoned_clip(skip_steps: set[int]):
    """clip_grad_norm_ that reports an infinite gradient norm at the given (1-based) calls."""
    real, calls = torch.nn.utils.clip_grad_norm_, [0]

    def clip(params, max_norm):
        calls[0] += 1
        norm = real(params, max_norm)
        return torch.tensor(float("inf")) if calls[0] in skip_steps else norm
    return clip


def test_a_run_that_skipped_most_steps_fails(root, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", _poisoned_clip(set(range(4, 28))))
    r = cli("train", "--config", "tiny", *sets(root, "skips", "train.nonfinite=skip"))
    LEDGER.injected += 1
    assert r.code == 1, r.err
    assert f"skipped 24 of {STEPS} steps" in r.out.splitlines()[-1]
    assert r.err_lines == [f"qklab: failed: 24 of {STEPS} steps were skipped as non-finite, more than "
                           "train.skip_limit=0.1 allows; lower train.lr"]


def test_a_few_skipped_steps_are_counted_and_allowed(root, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", _poisoned_clip({5, 17}))
    r = cli("train", "--config", "tiny", *sets(root, "few", "train.nonfinite=skip"))
    assert r.code == 0, r.err
    assert f"skipped 2 of {STEPS} steps" in r.out.splitlines()[-1]


def test_a_bug_prints_its_traceback_and_the_run_log(root, monkeypatch):
    def broken(self):
        return {}["val_loss"]  # a KeyError: a bug, not the user's doing
    monkeypatch.setattr(Trainer, "evaluate", broken)
    r = cli("train", "--config", "tiny", *sets(root, "bug"))
    log = root / "runs" / "bug" / "train.log"
    assert r.code == 1
    assert "Traceback" in r.err and r.err_lines[-1] == ("qklab: internal error (a bug in qklab, not in your input): "
                                                        f"KeyError; the run's log is {log}")
    assert "Traceback" in log.read_text() and "KeyError" in log.read_text()


def test_a_bug_while_setting_up_keeps_the_run_log(root, monkeypatch):
    import qklab.train.trainer as trainer_mod

    def broken(*_a, **_k):
        raise TypeError("injected bug")
    monkeypatch.setattr(trainer_mod, "GPT", broken)
    r = cli("train", "--config", "tiny", *sets(root, "bug0"))
    log = root / "runs" / "bug0" / "train.log"
    assert r.code == 1 and "Traceback" in r.err and r.err_lines[-1].endswith(f"TypeError; the run's log is {log}")
    assert "injected bug" in log.read_text() and "Traceback" in log.read_text()


def test_an_unwritable_output_folder_is_one_line(root):
    (root / "afile").write_text("")
    r = cli("train", "--config", "tiny", *sets(root, "w"), "--set", f"train.out_dir='{root / 'afile' / 'runs'}'")
    assert r.code == 2 and len(r.err_lines) == 1 and "choose a writable train.out_dir" in r.err_lines[0], r.err


def test_a_missing_config_file_and_bad_toml_are_one_line(root):
    bad = root / "bad.toml"
    bad.write_text("[model\nd_model = 3")
    for spec in (str(root / "nope.toml"), str(bad)):
        r = cli("train", "--config", spec)
        assert r.code == 2 and len(r.err_lines) == 1 and r.err_lines[0].startswith("qklab: error:"), r.err


def test_demo_rejects_an_unknown_method_before_training(root):
    r = cli("demo", "--methods", "none,bogus", "--out", str(root / "demo"))
    assert r.code == 2 and len(r.err_lines) == 1 and "bogus" in r.err_lines[0], r.err
    assert not (root / "demo").exists()
