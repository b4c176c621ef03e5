"""TensorBoard and W&B (offline) receive exactly what metrics.jsonl records, read back from their files."""

from __future__ import annotations

import json
import struct
import sys
import time

import pytest

from qklab.config import ConfigError, load_config
from qklab.rundir.metrics import flat_scalars, read_metrics
from qklab.train.trainer import Trainer


def _wandb_history(path) -> list[dict]:
    """History records of a W&B offline run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb2

    raw, pos, buf, out = path.read_bytes(), 7, b"", []  # 7-byte header ':W&B' + magic + version
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768  # records never straddle a 32 KiB block header
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + n > len(raw):  # a record still being written
            break
        buf, pos = buf + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return out


def test_flat_scalars():
    rec = {"step": 3, "time": 1.0, "loss": 2.5, "diag": {"max_logit_max": 7.0, "max_logit": [[1.0]]},
           "bad": float("nan"), "flag": True}
    assert flat_scalars(rec) == {"loss": 2.5, "diag/max_logit_max": 7.0}


def test_trackers_receive_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny", ["train.steps=10", "train.log_every=5", "train.eval_every=5", "train.diag_every=5",
                               "train.ckpt_every=0", "data.max_files=20", f"train.out_dir='{tmp_path}'",
                               f"data.cache_dir='{tmp_path}/c'", "train.trackers=['tensorboard', 'wandb']",
                               "train.progress=false", "train.name=tr"])
    Trainer(cfg, log=lambda s: None).run()
    run = tmp_path / "tr"
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == [5, 10]
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("loss")}
    assert tb == pytest.approx({r["step"]: r["loss"] for r in recs}, rel=1e-6)  # TB stores float32
    ml = {e.step: e.value for e in acc.Scalars("diag/max_logit_max")}
    assert sorted(ml) == [0, 5, 10]
    (wb,) = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.time() + 60  # W&B's service writes the run file behind the run's back
    while {5, 10} - {h["_step"] for h in _wandb_history(wb)} and time.time() < deadline:
        time.sleep(0.2)
    hist = {h["_step"]: h for h in _wandb_history(wb)}
    assert {s: hist[s]["loss"] for s in (5, 10)} == {r["step"]: r["loss"] for r in recs}
    assert hist[10]["val_loss"] == next(r["val_loss"] for r in recs if r["step"] == 10)


def test_missing_tracker_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    cfg = load_config("tiny", ["train.trackers=['wandb']", f"train.out_dir='{tmp_path}'", "data.max_files=20",
                               f"data.cache_dir='{tmp_path}/c'", "train.progress=false"])
    with pytest.raises(ConfigError, match="wandb package is missing"):
        Trainer(cfg, log=lambda s: None)
    with pytest.raises(ConfigError, match="train.trackers"):
        load_config("tiny", ["train.trackers=['mlflow']"])
