"""One study cell: its run config, training it in this process, and publishing its ``result.json``
(a result is replaced only by its successor; a failure moves a finished result of another config aside)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from qklab.config import RunConfig
from qklab.rundir.folder import RunLockError
from qklab.study.result import (
    build_result,
    cell_header,
    failed_result,
    load_result,
    read_result,
    schema_problem,
    write_json_atomic,
)
from qklab.study.spec import Cell

DONE = ("ok", "diverged")


STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a worker's exit codes after RunInterrupted


STOP_GRACE_S = 120  # seconds a stopped worker gets to reach its next step and checkpoint


BUSY = 75  # a worker's exit code when another process holds the cell's run folder (EX_TEMPFAIL)


def run_config(cell: Cell, out: Path, threads: int) -> RunConfig:
    """The config a cell trains with: its own, in its run folder ``<out>/cells/<id>``, quiet, on ``threads``
    threads (neutral keys: it still has the cell's hash). A copy: the trainer fills in the vocabulary size."""
    cfg = copy.deepcopy(cell.cfg)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out / "cells"), name=cell.id,
                                                              progress=False, threads=threads))


def run_cell(cell: Cell, study: str, out: Path, results: Path, threads: int, probe: int,
             code: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one cell and write its result file; never raises for a failure of the cell itself.
    probe: 0 none; N > 0 attention probes up to N training lengths of context after training. code: the
    study process's ``CodeVersion.record()``, written into the result as ``code``."""
    from qklab.data import prepare_data, unigram_entropy
    from qklab.diagnostics.stability import NonFiniteError
    from qklab.rundir.checkpoint import latest_checkpoint
    from qklab.rundir.metrics import read_metrics
    from qklab.train.signals import RunInterrupted
    from qklab.train.trainer import Trainer

    log_path = out / "logs" / f"{cell.id}.log"
    header = cell_header(cell, study, log_path)
    main = os.environ.get("RANK", "0") == "0"  # under torchrun (a Slurm task's several processes) rank 0 writes
    t0, cpu0, chash = time.time(), _cpu_seconds(), cell.hash
    mark = None  # the run folder's cell.json, once this call has begun training there
    try:
        cfg = run_config(cell, out, threads)
        run_dir = Path(cfg.train.out_dir) / cfg.train.name
        started = read_result(run_dir / "cell.json") or {}  # the config hash the run folder was started with
        resume = latest_checkpoint(run_dir / "ckpt") is not None and \
            started.get("cell_hash") in (chash, cell.legacy_hash)
        data = prepare_data(cfg.data)
        # not resumable (no checkpoint, or one of another config): the trainer replaces the cell's run
        # under its own lock, so two study processes never train the same cell at once
        trainer = Trainer(cfg, resume=resume, overwrite=not resume, data=data)
        # time spent on this cell by earlier, interrupted invocations (counted in seconds / cpu_seconds)
        before = {k: float(started.get(k, 0.0)) if resume else 0.0 for k in ("seconds", "cpu_seconds")}
        t0, cpu0 = t0 - before["seconds"], cpu0 - before["cpu_seconds"]
        if main:
            mark = run_dir / "cell.json"
            write_json_atomic(mark, {"cell_hash": chash, **before})
        stopped = None
        try:
            trainer.run()
        except NonFiniteError as e:  # a diverged cell is a result, not a failure
            stopped = str(e)
        if not main:
            return {}
        unigram = unigram_entropy(data.select_tokens(), data.vocab_size)
        res = build_result(header, run_dir, read_metrics(run_dir / "metrics.jsonl"), unigram, chash,
                           time.time() - t0, stopped)
        if probe and not res["diverged"]:
            res["probe"] = _probe(run_dir, probe)
    except (RunInterrupted, RunLockError) as e:  # stopped by a signal after a checkpoint, or another process
        # (a hand-started `qklab train`) is training this cell: not done, not failed; a re-run resumes it and
        # counts the time spent so far, in training or in the probes after it
        if isinstance(e, RunInterrupted) and mark is not None:
            write_json_atomic(mark, {"cell_hash": chash, "seconds": time.time() - t0,
                                     "cpu_seconds": _cpu_seconds() - cpu0})
        raise
    except Exception as e:  # any failure of the cell is recorded and the study goes on
        traceback.print_exc()
        if not main:  # a failure on another rank: rank 0 records the cell's (its collectives fail with it)
            raise
        res = failed_result(header, f"{type(e).__name__}: {e}".splitlines()[0], chash, time.time() - t0)
    res["cpu_seconds"] = _cpu_seconds() - cpu0  # this process's CPU time (user + system) for the cell
    if code is not None:
        res["code"] = code
    publish(results, cell.id, res)
    return res


def publish(results: Path, cell_id: str, res: dict[str, Any]) -> None:
    """Write a cell's result.json atomically. A failure is no successor: a finished result of another
    config in its place is first moved aside to ``result.<its hash>.json`` (a damaged one to
    ``result.damaged.json``), never overwritten. Nor is any result the successor of one of a schema this
    qklab does not read (a newer qklab's): that one is moved aside to ``result.schema-<its schema>.json``."""
    path = results / cell_id / "result.json"
    old = read_result(path)
    if old is not None and schema_problem(old) is not None:
        schema = old.get("schema")
        with contextlib.suppress(OSError):
            os.replace(path, path.with_name(f"result.schema-{schema if type(schema) is int else 'unknown'}.json"))
    if res.get("status") == "failed" and path.is_file():
        old, problem = load_result(path)
        if problem is not None or (old.get("status") in DONE and old.get("cell_hash") != res.get("cell_hash")):
            aside = f"result.{old.get('cell_hash') or 'unhashed'}.json" if problem is None else "result.damaged.json"
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(aside))
    write_json_atomic(path, res)


def _cpu_seconds() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _probe(run_dir: Path, max_mult: int) -> dict[str, Any]:
    """Attention probes of the cell's last checkpoint (``qklab probe``): the headline numbers and the
    series against context length (retrieval) and input scale (magnitude); the full probes.json and its
    plots stay in the cell's run folder."""
    from qklab.diagnostics import probe_summary
    from qklab.diagnostics.probe import ProbeOptions, run_probe

    full = run_probe(run_dir, out=run_dir / "probe", opts=ProbeOptions(max_mult=max_mult))
    rows = (full.get("retrieval") or {}).get("lengths") or []
    keep = ("length", "extrapolation", "mass", "uniform_mass", "log_contrast", "contrast", "rank", "top1", "accuracy")
    return {"summary": probe_summary(full), "retrieval": [{k: r.get(k) for k in keep} for r in rows],
            "magnitude": {k: (full.get("magnitude") or {}).get(k) for k in ("scales", "js_mean")}}
