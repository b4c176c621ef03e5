"""What `qklab train` says when a run stops early: --resume only where a checkpoint is there to resume from;
a run stopped before its first checkpoint is told to start again, and `--resume` on it is one line, exit 2."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import qklab.rundir.checkpoint as ck
import qklab.train.trainer as tr
from qklab.cli import main
from qklab.diagnostics.stability import NonFiniteError
from qklab.train.signals import RunInterrupted

AGAIN = "no checkpoint was written yet, so there is nothing to resume: run the command again without --resume"
RESUME = "the last checkpoint is intact (continue with --resume)"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _train(tmp: Path, cache: Path, *flags: str, steps: int = 12) -> list[str]:
    vals = [f"train.out_dir='{tmp / 'runs'}'", "train.name=r", f"train.steps={steps}", "train.ckpt_every=10",
            "train.eval_every=10", "train.log_every=1", "train.diag_every=0", "train.progress=false",
            "train.threads=1", f"data.cache_dir='{cache}'"]
    return ["train", "--config", "tiny", *[a for v in vals for a in ("--set", v)], *flags]


def _cli(argv: list[str]) -> tuple[int, list[str], str]:
    """``qklab <argv>`` here: its exit code, its stderr lines and its stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, [ln for ln in err.getvalue().splitlines() if ln.strip()], out.getvalue()


def _interrupt_at(monkeypatch, at: int) -> None:
    """A second Ctrl-C (KeyboardInterrupt at once) once the run has taken ``at`` steps."""
    real = tr.Trainer.train_step

    def train_step(self):
        if self.step == at:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(tr.Trainer, "train_step", train_step)


def test_interrupted_before_the_first_checkpoint_is_told_to_start_again(tmp_path, cache, monkeypatch):
    _interrupt_at(monkeypatch, 3)
    code, err, _ = _cli(_train(tmp_path, cache))
    assert (code, err) == (130, [f"qklab: interrupted; {AGAIN}"])
    monkeypatch.undo()
    code, err, _ = _cli(_train(tmp_path, cache, "--resume"))  # what the hint used to offer: one line, exit 2
    ckpt = tmp_path / "runs" / "r" / "ckpt"
    assert (code, err) == (2, [f"qklab: error: --resume: no usable checkpoint in {ckpt}; start the run without "
                               "--resume"])
    code, err, out = _cli(_train(tmp_path, cache))  # what it says now: the same command starts the run again
    assert code == 0 and out.splitlines()[-1].startswith(f"done: {tmp_path / 'runs' / 'r'}"), err


def test_interrupted_after_a_checkpoint_is_told_to_resume(tmp_path, cache, monkeypatch):
    _interrupt_at(monkeypatch, 11)
    code, err, _ = _cli(_train(tmp_path, cache))
    assert (code, err) == (130, [f"qklab: interrupted; {RESUME}"])
    monkeypatch.undo()
    code, err, out = _cli(_train(tmp_path, cache, "--resume"))
    assert code == 0 and f"resumed {tmp_path / 'runs' / 'r'} at step 10 from step_0000010" in out, err


def _sigterm_while_preparing(monkeypatch) -> None:
    """SIGTERM while the data is prepared: outside the training loop (TermRaises)."""
    def prepare_data(*_a, **_k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(tr, "prepare_data", prepare_data)


def test_sigterm_before_training_offers_resume_only_with_a_checkpoint(tmp_path, cache, monkeypatch):
    _sigterm_while_preparing(monkeypatch)
    code, err, _ = _cli(_train(tmp_path, cache))
    assert (code, err) == (143, [f"qklab: stopped by SIGTERM; {AGAIN}"])
    monkeypatch.undo()
    assert _cli(_train(tmp_path, cache))[0] == 0  # a run with checkpoints, then stopped as it resumes
    _sigterm_while_preparing(monkeypatch)
    code, err, _ = _cli(_train(tmp_path, cache, "--resume", steps=14))
    assert (code, err) == (143, [f"qklab: stopped by SIGTERM; {RESUME}"])


def test_an_overwrite_stopped_before_it_cleared_the_earlier_run_is_not_told_to_resume_it(tmp_path, cache,
                                                                                       monkeypatch):
    """--overwrite stopped while its data is prepared, before it cleared the earlier run: that run's intact
    checkpoint is not this command's, so the hint is the same command again, not --resume of the run it was
    asked to replace; once the new run wrote a checkpoint of its own, --resume is offered again."""
    assert _cli(_train(tmp_path, cache))[0] == 0  # the earlier run, with its checkpoints
    _sigterm_while_preparing(monkeypatch)
    code, err, _ = _cli(_train(tmp_path, cache, "--overwrite"))
    run = tmp_path / "runs" / "r"
    assert (code, err) == (143, [f"qklab: stopped by SIGTERM; {run} still holds the earlier run (--overwrite had "
                                 "not cleared it yet): run the same command again"])
    monkeypatch.undo()
    _interrupt_at(monkeypatch, 11)  # the new run, stopped after its own checkpoint at step 10
    code, err, _ = _cli(_train(tmp_path, cache, "--overwrite"))
    assert (code, err) == (130, [f"qklab: interrupted; {RESUME}"])


def test_a_full_disk_at_the_first_checkpoint_is_not_told_to_resume(tmp_path, cache, monkeypatch):
    def save_model(model, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck, "save_model", save_model)
    code, err, _ = _cli(_train(tmp_path, cache))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("qklab: error: No space left on device (") and err[0].endswith(
        f"; free some space; {AGAIN}"), err


def test_a_non_finite_stop_before_the_first_checkpoint_is_not_told_to_resume(tmp_path, cache, monkeypatch):
    real = tr.Trainer.train_step

    def train_step(self):  # step 3's loss is NaN
        mean, gnorm = real(self)
        if self.step == 3:
            self._pending[-1] = (3, torch.tensor(float("nan"), dtype=torch.float64), gnorm)
        return mean, gnorm

    monkeypatch.setattr(tr.Trainer, "train_step", train_step)
    code, err, _ = _cli(_train(tmp_path, cache))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("qklab: stopped: non-finite loss at step 3") and "--resume" in err[0]
    assert err[0].endswith("Last good checkpoint: none; lower train.lr or set train.nonfinite=skip, then run it "
                           "again without --resume (none to resume)"), err


@pytest.mark.parametrize("stop, code", [
    (RunInterrupted("stopped by SIGTERM at step 3; checkpoint c written; continue with --resume", 15, Path("c")), 143),
    (KeyboardInterrupt(), 130),
    (NonFiniteError("non-finite loss at step 3"), 1),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_under_a_launcher_rank_0_alone_prints_the_stop_line(monkeypatch, stop, code, rank):
    """Every rank of a torchrun run stops at the same step with the same exit code; one line, rank 0's
    (tests/parallel/test_launch.py stops a real two-process run)."""
    import qklab.cli.commands as commands

    def stopped(_args):
        raise stop

    monkeypatch.setattr(commands, "_train", stopped)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    got, err, _ = _cli(["train"])
    assert got == code and len(err) == (1 if rank == 0 else 0), err


def test_a_run_whose_only_checkpoint_is_cut_short_is_not_told_to_resume(tmp_path, cache, monkeypatch):
    """The hint asks what resume asks, as far as the files' sizes tell (no hashes at a stop): a checkpoint
    whose weights were cut short is none to resume; --overwrite starts the run again."""
    assert _cli(_train(tmp_path, cache, steps=10))[0] == 0
    ckpt = tmp_path / "runs" / "r" / "ckpt"
    (only,) = ckpt.glob("step_*")
    weights = only / ck.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])
    _sigterm_while_preparing(monkeypatch)
    code, err, _ = _cli(_train(tmp_path, cache, "--overwrite"))
    assert (code, err) == (143, [f"qklab: stopped by SIGTERM; no checkpoint in {ckpt} is intact (files missing or "
                                 "cut short), so there is nothing to resume: run the command again with --overwrite, "
                                 "without --resume"])
    monkeypatch.undo()
    code, err, _ = _cli(_train(tmp_path, cache, "--resume"))  # what the hint used to offer
    assert code == 2 and err[-1] == (f"qklab: error: --resume: no usable checkpoint in {ckpt}; start the run "
                                     "again with --overwrite (its checkpoints are all unusable)"), err
    code, err, out = _cli(_train(tmp_path, cache, "--overwrite"))  # what it offers now
    assert code == 0 and out.splitlines()[-1].startswith(f"done: {tmp_path / 'runs' / 'r'}"), err
