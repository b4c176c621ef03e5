"""SIGKILL, SIGTERM and SIGINT at random steps and during checkpoint writes: every run resumes to the
same losses and weights as a run that was never interrupted, and SIGTERM/SIGINT lose no step."""

from __future__ import annotations

import random
import signal

import pytest

from qklab.rundir.checkpoint import latest_checkpoint, verify_checkpoint
from tests.faults.common import LEDGER, STEPS, child, cli, same_as_reference, sets, wait_for_step

RNG = random.Random(13)  # the random points, fixed so that a failure can be rerun
KILL_AT = sorted(RNG.sample(range(2, STEPS - 2), 2))
STOP_AT = RNG.randrange(2, STEPS - 2)

# the checkpoint of step 20 is written slowly; a signal sent meanwhile lands mid-write
SLOW_WRITE = """
import time
import qklab.rundir.checkpoint as ck
_real = ck.save_state
def _slow(obj, path):
    if obj.get("step") == 20:
        with open(path, "wb") as f:
            f.write(b"partial")
        print("WRITING", flush=True)
        time.sleep({pause})
    _real(obj, path)
ck.save_state = _slow
"""


def _wait_for_write(proc) -> None:
    for line in proc.stdout:
        if line.strip() == "WRITING":
            return
    raise AssertionError(f"the child ended before the checkpoint write: {proc.communicate()[1]}")


def _train(root, name, *extra):
    return ["train", "--config", "tiny", *sets(root, name, *extra)]


def _resume_and_check(root, name, reference) -> None:
    """Continue the run (start it again when it died before its first checkpoint, as the error says)."""
    again = ["--resume"] if latest_checkpoint(root / "runs" / name / "ckpt") is not None else []
    r = cli(*_train(root, name), *again)
    assert r.code == 0, r.err
    assert same_as_reference(root / "runs" / name, reference)


@pytest.mark.parametrize("at", KILL_AT)
def test_sigkill_at_a_random_step_resumes_bitwise(root, reference, at):
    proc = child(_train(root, "kill"))
    wait_for_step(root / "runs" / "kill", at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    LEDGER.injected += 1
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill; slow the run down"
    _resume_and_check(root, "kill", reference)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_sigint_checkpoint_at_the_next_step(root, reference, sig, code):
    proc = child(_train(root, "stop"))
    run = root / "runs" / "stop"
    wait_for_step(run, STOP_AT, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    LEDGER.injected += 1
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qklab: stopped by {sig.name} at step "), err
    stopped = int(lines[0].split(" at step ")[1].split(";")[0])
    assert STOP_AT <= stopped < STEPS
    ck = latest_checkpoint(run / "ckpt")
    assert ck.name == f"step_{stopped:07d}"  # nothing since the last periodic checkpoint is lost
    assert max(r for r in _logged_steps(run)) == stopped
    _resume_and_check(root, "stop", reference)


def _logged_steps(run):
    from qklab.rundir.metrics import read_metrics

    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_sigkill_during_a_checkpoint_write_falls_back_to_the_previous(root, reference):
    proc = child(_train(root, "killw"), prelude=SLOW_WRITE.replace("{pause}", "60"))
    _wait_for_write(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    LEDGER.injected += 1
    ckpt = root / "runs" / "killw" / "ckpt"
    assert latest_checkpoint(ckpt).name == "step_0000010"
    assert list(ckpt.glob(".tmp-*"))  # the dead writer's half-written folder ...
    _resume_and_check(root, "killw", reference)
    assert not list(ckpt.glob(".tmp-*"))  # ... is gone after the resume


def test_sigterm_during_a_checkpoint_write_finishes_it_then_stops(root, reference):
    proc = child(_train(root, "termw"), prelude=SLOW_WRITE.replace("{pause}", "1.0"))
    _wait_for_write(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    LEDGER.injected += 1
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM at step 20" in err and len(err.strip().splitlines()) == 1
    ck = latest_checkpoint(root / "runs" / "termw" / "ckpt")
    assert ck.name == "step_0000020" and verify_checkpoint(ck) is None
    _resume_and_check(root, "termw", reference)


SLOW_PREPARE = """
import time
import qklab.train.trainer as tr
_real = tr.prepare_data
def _slow(*a, **k):
    print("PREPARING", flush=True)
    time.sleep(60)
    return _real(*a, **k)
tr.prepare_data = _slow
"""


def test_sigterm_before_training_is_one_line_and_leaves_no_folder(root):
    proc = child(_train(root, "early"), prelude=SLOW_PREPARE)
    for line in proc.stdout:
        if line.strip() == "PREPARING":
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    LEDGER.injected += 1
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["qklab: stopped by SIGTERM; no checkpoint was written yet, so there is nothing "
                                        "to resume: run the command again without --resume"]
    assert not (root / "runs" / "early").exists()
