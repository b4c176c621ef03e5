"""A cell stopped by Slurm resumes from its own checkpoint and ends bit for bit where an uninterrupted run
ends (same machine): after ``scancel`` and the next ``study run``, after ``scontrol requeue`` (a
preemption), and at the warning a time limit brings (a checkpoint, the task requeueing itself).
Slurm holds a requeued task for ``cred_expire`` before it may start again (120 s by default; the test cluster
sets 10 s): releasing it sooner (``scontrol update StartTime=now``) races the node's cleanup of the previous
run, whose credential is still revoked, and Slurm then kills the new start."""

from __future__ import annotations

import pytest

from qklab.study.runner import run_study
from qklab.study.spec import load_study
from tests.cluster.common import qklab, result, same_numbers, squeue, study_file, wait_for

CELL = "a_lr1_s0"
STEPS = 600


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The cell trained in one go, locally (one thread, as each task)."""
    tmp = tmp_path_factory.mktemp("reference")
    study = load_study(study_file(tmp, "pre", STEPS, {"a": {"qk.method": "none"}}, every=100, ckpt_every=20))
    run_study(study, tmp / "o", workers=0, threads=1, log=lambda s: None)
    return result(tmp / "o" / "results", CELL)


def _checkpoints(out):
    return sorted(p.name for p in (out / "cells" / CELL / "ckpt").glob("step_*"))


def _running_past(cluster, out, after: list[str]) -> str:
    """Wait until the running task has written a checkpoint not in ``after``; its task id."""
    wait_for(lambda: set(_checkpoints(out)) - set(after), 120, "a new checkpoint of the running cell")
    return next(t[0] for t in squeue(cluster) if t[1] == "RUNNING")


def _held_after_requeue(cluster) -> bool:
    """Whether a task waits for its begin time, as a requeued one does."""
    return any(t[1] == "PENDING" and t[2] == "BeginTime" for t in squeue(cluster))


def test_scancel_then_run_again_and_a_requeue_resume_to_the_same_numbers(slurm, tmp_path, reference):
    path = study_file(tmp_path, "pre", STEPS, {"a": {"qk.method": "none"}}, every=100, ckpt_every=20)
    out = tmp_path / "o"
    assert qklab("study", "run", path, "--out", out, "--executor", "slurm").returncode == 0
    task = _running_past(slurm, out, [])
    slurm.run("scancel", task)
    wait_for(lambda: not squeue(slurm), 60, "the cancelled task to end")
    assert result(out / "results", CELL) is None
    kept = _checkpoints(out)
    assert kept and "stopped by SIGTERM at step" in (out / "logs" / f"{CELL}.log").read_text()
    status = qklab("study", "status", path, "--out", out).stdout
    assert "ended without a result" in status, status

    p = qklab("study", "run", path, "--out", out, "--executor", "slurm")
    assert p.returncode == 0 and "1 cell(s) submitted" in p.stdout, p.stdout + p.stderr
    task = _running_past(slurm, out, kept)  # resumed, and past its old checkpoints
    slurm.run("scontrol", "requeue", task)  # a preemption: Slurm signals the cell and queues the task again
    wait_for(lambda: _held_after_requeue(slurm), 60, "the requeued task to wait for its begin time")
    p = qklab("study", "run", path, "--out", out, "--executor", "slurm", "--wait", timeout=300)
    assert p.returncode == 0 and "nothing new to submit" in p.stdout and "1/1 cells done" in p.stdout, p.stdout
    log = (out / "logs" / f"{CELL}.log").read_text()
    assert log.count("stopped by SIGTERM at step") == 2 and log.count("resumed ") == 2, log
    same_numbers(result(out / "results", CELL), reference)


def test_the_time_limit_warning_checkpoints_requeues_and_resumes_to_the_same_numbers(slurm, tmp_path, reference):
    """The warning a time limit brings (``--signal=B:USR1@N``, sent to the batch shell): the cell checkpoints,
    the task requeues itself, and the next attempt resumes to the same numbers. Slurm sends the warning at its
    next periodic check (every 30 s), later than a tiny cell may take on a fast machine, so the test sends the
    same signal to the same shell itself (``scancel --batch --signal=USR1``) once the cell has a checkpoint."""
    path = study_file(tmp_path, "pre", STEPS, {"a": {"qk.method": "none"}}, every=100, ckpt_every=20)
    out = tmp_path / "o"
    p = qklab("study", "run", path, "--out", out, "--executor", "slurm", "--slurm", "time=10", "--slurm",
              "signal_before=59")
    assert p.returncode == 0, p.stdout + p.stderr
    (script,) = (out / "slurm").glob("*.sh")
    lines = script.read_text().splitlines()
    assert "#SBATCH --signal=B:USR1@59" in lines and "#SBATCH --time=10" in lines and "#SBATCH --requeue" in lines
    task = _running_past(slurm, out, [])
    slurm.run("scancel", "--batch", "--signal=USR1", task)
    done = lambda: result(out / "results", CELL) is not None and not squeue(slurm)  # noqa: E731
    wait_for(done, 300, "the cell's result", every=1.0)
    slurm_log = next((out / "slurm" / "logs").glob("*.log")).read_text()
    assert "requeueing this task" in slurm_log, slurm_log
    log = (out / "logs" / f"{CELL}.log").read_text()
    assert "resumed " in log and "stopped by SIGTERM at step" in log, log
    same_numbers(result(out / "results", CELL), reference)
