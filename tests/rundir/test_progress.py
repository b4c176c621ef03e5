"""What a run folder shows of a run in progress, read without disturbing it: the process that holds its
lock, and the step of its last metrics record."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from qklab.rundir import metrics
from qklab.rundir.folder import RunLock, lock_holder
from qklab.rundir.metrics import last_step, read_metrics

HOLD = ("import sys, time; from pathlib import Path; from qklab.rundir.folder import RunLock; "
        "lock = RunLock(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")


def hold(run_dir) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock, as a trainer does, until killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_holder_names_the_process_and_leaves_the_lock_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert lock_holder(run) is None  # no lock file yet
    p = hold(run)
    try:
        for _ in range(3):  # reading it never takes the lock: the holder keeps it, another writer is refused
            assert lock_holder(run) == p.pid
        try:
            RunLock(run)
            raise AssertionError("a second writer took a held lock")
        except Exception as e:  # RunLockError, naming the same pid the lock file records
            assert f"pid {p.pid}" in str(e)
    finally:
        p.kill()
        p.wait()
    deadline = time.time() + 10
    while lock_holder(run) is not None and time.time() < deadline:  # the kernel drops it with the process
        time.sleep(0.05)
    assert lock_holder(run) is None and (run / ".lock").read_text().strip() == str(p.pid)  # a stale pid: free
    mine = RunLock(run)
    assert lock_holder(run) is not None and lock_holder(tmp_path / "elsewhere") is None
    mine.release()


def test_last_step_reads_the_end_of_a_long_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "loss": 1.0 / s, "pad": "x" * 300} for s in range(1, 400)]  # about 130 KB
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert last_step(path) == read_metrics(path)[-1]["step"] == 399
    with open(path, "a") as f:  # a record torn by a kill mid-write is not one
        f.write('{"step": 400, "lo')
    assert last_step(path) == read_metrics(path)[-1]["step"] == 399
    path.write_text("")
    assert last_step(path) is None and last_step(tmp_path / "none.jsonl") is None


def test_last_step_finds_a_record_longer_than_the_tail_it_reads_first(tmp_path, monkeypatch):
    """A diagnostics record (every head of every layer) can outgrow the tail read first: the step is read
    from further back, not taken for "no step" (a study's progress fell back to 0 whenever such a record
    was last: seen at width 512, records of 9.7 KB against a 4 KB tail)."""
    monkeypatch.setattr(metrics, "TAIL_BYTES", 256)
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": 1, "loss": 2.0}, {"step": 2, "heads": [[0.123456789] * 8] * 40}]  # the last: ~4 KB
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert len(path.read_text().splitlines()[-1]) > 16 * metrics.TAIL_BYTES
    assert last_step(path) == 2
    with open(path, "a") as f:  # torn mid-write: the long record before it is the last whole one
        f.write('{"step": 3, "heads": [[0.1, 0.2')
    assert last_step(path) == 2
