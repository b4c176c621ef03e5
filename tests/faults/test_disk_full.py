"""A full disk (an injected ENOSPC): one line and exit 2, no temporary folder left to keep the disk full,
the previous checkpoint and the metrics intact, and the run resumes once there is space again."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

import qklab.atomic as files
import qklab.rundir.checkpoint as ck
from qklab.rundir.checkpoint import latest_checkpoint, remove_stale_temps
from qklab.rundir.metrics import MetricsLog
from tests.faults.common import LEDGER, child, cli, copy_run, same_as_reference, sets


def _disk_full(*_args, **_kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_during_a_checkpoint_then_resume(reference, root, monkeypatch):
    real = ck.save_model

    def save_model(model, path):  # at step 20 half the weights reach the disk, then it is full
        real(model, path)
        if "step_0000020" in path:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            _disk_full()

    monkeypatch.setattr(ck, "save_model", save_model)
    r = cli("train", "--config", "tiny", *sets(root, "full"))
    LEDGER.injected += 1
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert r.err_lines[0].startswith("qklab: error: No space left on device") and "--resume" in r.err_lines[0]
    ckpt = root / "runs" / "full" / "ckpt"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # nothing left filling the disk
    assert latest_checkpoint(ckpt).name == "step_0000010"
    monkeypatch.setattr(ck, "save_model", real)  # space again
    r = cli("train", "--config", "tiny", *sets(root, "full"), "--resume")
    assert r.code == 0, r.err
    assert same_as_reference(root / "runs" / "full", reference)


def test_temp_folders_of_dead_writers_are_removed_live_ones_kept(reference, root):
    run = copy_run(reference, root, "stale")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has ended
    junk = run / "ckpt" / f".tmp-step_0000040-{dead_pid}"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    (run / "ckpt" / f".latest.{dead_pid}.tmp").write_text("x")
    live = run / "ckpt" / f".tmp-step_0000050-{os.getppid()}"  # our parent is alive
    live.mkdir()
    LEDGER.injected += 1
    removed = remove_stale_temps(run / "ckpt")
    assert sorted(p.name for p in removed) == sorted([junk.name, f".latest.{dead_pid}.tmp"])
    assert not junk.exists() and live.exists()
    LEDGER.recovered += 1


def test_full_disk_while_truncating_the_metrics_keeps_them(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for s in range(1, 6):
        log.log(s, loss=float(s))
    log.close()
    before = path.read_bytes()
    monkeypatch.setattr(files.os, "replace", _disk_full)
    LEDGER.injected += 1
    with pytest.raises(OSError):
        MetricsLog(path, truncate_after=2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    LEDGER.recovered += 1


def test_a_line_torn_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    LEDGER.injected += 1
    MetricsLog(path, truncate_after=2).close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n'
    LEDGER.recovered += 1


# while a checkpoint is written, the file system refuses to write past ``{limit}`` bytes a file, as a full disk
# refuses any write: the writes of torch.save (state.pt) and safetensors (model.safetensors) fail inside those
# libraries, not in qklab's code (only there: git, run by the process, would leave a torn index.lock)
FILE_LIMIT = """
import resource, signal
from qklab.train.checkpointer import Checkpointer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_real = Checkpointer.save
def _limited(*a, **k):
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
    try:
        return _real(*a, **k)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
Checkpointer.save = _limited
"""


@pytest.mark.parametrize("limit, file, fmt", [(200_000, "model.safetensors", "full"), (700_000, "state.pt", "full"),
                                              (200_000, "dcp/", "sharded")])
def test_a_write_refused_inside_torch_or_safetensors_is_one_line(reference, root, limit, file, fmt):
    """A real refused write (RLIMIT_FSIZE) of the first checkpoint: one line naming the system's error and exit
    2, as for any full disk; torch.save, safetensors and DCP used to raise their own RuntimeError,
    SafetensorError and CheckpointException, reported as a bug in qklab with a traceback (exit 1)."""
    if fmt == "full":  # the file over the limit (the other fits)
        assert (reference / "ckpt" / "step_0000010" / file).stat().st_size > limit
    proc = child(["train", "--config", "tiny", *sets(root, "limit", f"train.ckpt_format={fmt}")],
                 prelude=FILE_LIMIT.format(limit=limit))
    _, err = proc.communicate(timeout=120)
    LEDGER.injected += 1
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"qklab: error: {os.strerror(errno.EFBIG)} ({root / 'runs' / 'limit' / 'ckpt'}"), err
    ckpt = root / "runs" / "limit" / "ckpt"
    assert not list(ckpt.iterdir()), list(ckpt.iterdir())  # nothing half-written left
