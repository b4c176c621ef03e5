"""Run a study's cells in worker processes; each cell is a plain training run in its own folder.

    runs/studies/<name>/            (--out)
        cells/<cell>/               the cell's run folder (config.json, metrics.jsonl, ckpt/)
        logs/<cell>.log             everything the cell printed, tracebacks included
    <results>/                      (--results; default <out>/results; commit it under docs/results/)
        study.json                  the study as run: grid, variants, protocol, cell ids
        <cell>/result.json          one per finished or failed cell

A cell whose result file exists, says ok or diverged and matches the cell's config hash is done and
skipped, so a study continues from committed results alone, on another machine. A cell with the same
config hash as a finished cell of another study listed in ``[protocol] reuse`` is copied, not rerun. A
failed cell is run again. An interrupted cell resumes from its last checkpoint. Each worker process gets
an equal share of the CPU threads. Data is prepared once per distinct ``data.*`` config, before any cell starts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from qklab.config import ConfigError, RunConfig
from qklab.rundir.folder import RunLock, RunLockError
from qklab.study.result import build_result, cell_header, failed_result, read_result, write_json_atomic
from qklab.study.spec import Cell, Study

DONE = ("ok", "diverged")
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a worker's exit codes after RunInterrupted
STOP_GRACE_S = 120  # seconds a stopped worker gets to reach its next step and checkpoint
BUSY = 75  # a worker's exit code when another process holds the cell's run folder (EX_TEMPFAIL)


@dataclass
class Outcome:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell id -> result
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)  # stopped by a signal after a checkpoint: resumable
    busy: list[str] = field(default_factory=list)  # another process held the run folder: not run, not failed
    not_started: list[str] = field(default_factory=list)  # queued when a cell was stopped

    def counts(self) -> Counter:
        return Counter(r["status"] for r in self.results.values())


def run_config(cell: Cell, out: Path, threads: int) -> RunConfig:
    """The config a cell trains with: its own, in its run folder ``<out>/cells/<id>``, quiet, on ``threads``
    threads (neutral keys: it still has the cell's hash). A copy: the trainer fills in the vocabulary size."""
    cfg = copy.deepcopy(cell.cfg)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out / "cells"), name=cell.id,
                                                              progress=False, threads=threads))


def run_cell(cell: Cell, study: str, out: Path, results: Path, threads: int, probe: int) -> dict[str, Any]:
    """Train one cell and write its result file; never raises for a failure of the cell itself.
    probe: 0 none; N > 0 attention probes up to N training lengths of context after training."""
    from qklab.data import prepare_data, unigram_entropy
    from qklab.diagnostics.stability import NonFiniteError
    from qklab.rundir.checkpoint import latest_checkpoint
    from qklab.rundir.metrics import read_metrics
    from qklab.train.signals import RunInterrupted
    from qklab.train.trainer import Trainer

    log_path = out / "logs" / f"{cell.id}.log"
    header = cell_header(cell, study, log_path)
    t0, cpu0, chash = time.time(), _cpu_seconds(), cell.hash
    try:
        cfg = run_config(cell, out, threads)
        run_dir = Path(cfg.train.out_dir) / cfg.train.name
        mark = run_dir / "cell.json"  # the config hash the run folder was started with
        started = read_result(mark) or {}
        resume = latest_checkpoint(run_dir / "ckpt") is not None and \
            started.get("cell_hash") in (chash, cell.legacy_hash)
        data = prepare_data(cfg.data)
        # not resumable (no checkpoint, or one of another config): the trainer replaces the cell's run
        # under its own lock, so two study processes never train the same cell at once
        trainer = Trainer(cfg, resume=resume, overwrite=not resume, data=data)
        # time spent on this cell by earlier, interrupted invocations (counted in seconds / cpu_seconds)
        before = {k: float(started.get(k, 0.0)) if resume else 0.0 for k in ("seconds", "cpu_seconds")}
        t0, cpu0 = t0 - before["seconds"], cpu0 - before["cpu_seconds"]
        write_json_atomic(mark, {"cell_hash": chash, **before})
        stopped = None
        try:
            trainer.run()
        except NonFiniteError as e:  # a diverged cell is a result, not a failure
            stopped = str(e)
        except RunInterrupted:
            write_json_atomic(mark, {"cell_hash": chash, "seconds": time.time() - t0,
                                     "cpu_seconds": _cpu_seconds() - cpu0})
            raise
        unigram = unigram_entropy(data.select_tokens(), data.vocab_size)
        res = build_result(header, run_dir, read_metrics(run_dir / "metrics.jsonl"), unigram, chash,
                           time.time() - t0, stopped)
        if probe and not res["diverged"]:
            res["probe"] = _probe(run_dir, probe)
    except (RunInterrupted, RunLockError):  # stopped by a signal after a checkpoint, or another process
        raise  # (a hand-started `qklab train`) is training this cell: not done, not failed; a re-run resumes
    except Exception as e:  # any failure of the cell is recorded and the study goes on
        traceback.print_exc()
        res = failed_result(header, f"{type(e).__name__}: {e}".splitlines()[0], chash, time.time() - t0)
    res["cpu_seconds"] = _cpu_seconds() - cpu0  # this process's CPU time (user + system) for the cell
    write_json_atomic(results / cell.id / "result.json", res)
    return res


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
    keep = ("length", "extrapolation", "mass", "uniform_mass", "log_contrast", "rank", "top1", "accuracy")
    return {"summary": probe_summary(full), "retrieval": [{k: r.get(k) for k in keep} for r in rows],
            "magnitude": {k: (full.get("magnitude") or {}).get(k) for k in ("scales", "js_mean")}}


def _worker(cell: Cell, study: str, out: Path, results: Path, threads: int, probe: int) -> None:
    """Entry point of a worker process: everything it prints goes to the cell's log."""
    log = out / "logs" / f"{cell.id}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from qklab.train.signals import RunInterrupted

    try:
        run_cell(cell, study, out, results, threads, probe)
    except RunInterrupted as e:
        print(f"stopped: {e}")
        sys.exit(e.exit_code)
    except RunLockError as e:
        print(f"not run: {e}")
        sys.exit(BUSY)


def _busy(cell: Cell, outcome: Outcome, log) -> None:
    """Another process holds the cell's run folder: no result is written, and the next run retries it."""
    outcome.ran.append(cell.id)
    outcome.busy.append(cell.id)
    log(f"  {cell.id}: not run: another process is training it in its run folder (see its log); "
        "run the same command again once that process has finished")


def _context():
    """A fresh process per cell. forkserver: forked from a server that has imported torch and qklab but
    run nothing (no threads, no torch state), so a cell starts in milliseconds; spawn where it is missing."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "qklab.study.runner", "qklab.train.trainer"])
        return ctx
    return mp.get_context("spawn")


def _last_step(run_dir: Path) -> int:
    """The step of the last record in a running cell's metrics.jsonl (0 if none yet)."""
    import json

    p = run_dir / "metrics.jsonl"
    try:
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - 4096))
            lines = f.read().decode(errors="replace").splitlines()
        for ln in reversed(lines):
            try:
                return int(json.loads(ln)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    except OSError:
        pass
    return 0


def cell_status(cell: Cell, results: Path) -> tuple[str, dict | None]:
    """'done' (a matching ok/diverged result exists), 'stale' (one exists for another config) or 'todo'."""
    res = read_result(results / cell.id / "result.json")
    if res is None or res.get("status") not in DONE:
        return "todo", res
    if res.get("cell_hash") == cell.hash:
        return "done", res
    if res.get("cell_hash") == cell.legacy_hash:  # written before hash version 2: upgraded in place
        res["cell_hash"] = cell.hash
        with contextlib.suppress(OSError):  # a read-only checkout keeps the old hash, which still matches
            write_json_atomic(results / cell.id / "result.json", res)
        return "done", res
    return "stale", res


def reuse_index(folders: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Finished (ok or diverged) results of other studies by config hash: a cell of this study with the same
    hash computes exactly what that cell computed, so its result is copied (under this study's name, cell
    id and grid point, with ``reused_from``) instead of being trained again."""
    index: dict[str, tuple[str, dict[str, Any]]] = {}
    for folder in folders:
        path = Path(folder)
        if not path.is_dir():
            raise ConfigError(f"[protocol] reuse: no result folder {folder} (relative to {Path.cwd()}); "
                              "fix the path or drop it from the list")
        for f in sorted(path.glob("*/result.json")):
            res = read_result(f)
            if res is not None and res.get("status") in DONE and res.get("cell_hash"):
                index.setdefault(res["cell_hash"], (f"{folder.rstrip('/')}/{f.parent.name}", res))
    return index


def reusable(cell: Cell, study: Study, index: dict) -> tuple[str, dict[str, Any]] | None:
    """The (source, result) in ``index`` that ``cell`` may take over, or None (with probes asked for,
    only a result that has them)."""
    src = index.get(cell.hash)
    return src if src is not None and (src[1].get("probe") or not study.protocol.probe) else None


def run_study(study: Study, out: Path, results: Path | None = None, workers: int = 1,
              log=print) -> Outcome:
    """Run every cell that is not done; ``workers`` processes at a time (0: in this process, serially)."""
    out, results = Path(out), Path(results or Path(out) / "results")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    lock = _study_lock(study, out)  # before anything is written: a second run of the study changes nothing
    try:
        return _run_study(study, out, results, workers, log)
    finally:
        lock.release()


def _study_lock(study: Study, out: Path):
    """An exclusive lock on the study's folder for the life of this process (dropped however it ends).
    Without it a second ``qklab study run`` of the same study would find the first one's cells in flight,
    fail to lock their run folders and record them as failed."""
    try:
        return RunLock(out)
    except RunLockError as e:
        pid = e.holder
        raise ConfigError(f"study {study.name} is already running in {out} (pid {pid}); wait for it to finish "
                          f"or stop it (kill -TERM {pid}: its cells resume from their checkpoints), "
                          "or give another --out") from None


def _run_study(study: Study, out: Path, results: Path, workers: int, log) -> Outcome:
    from qklab.data import prepare_data

    results.mkdir(parents=True, exist_ok=True)
    write_json_atomic(results / "study.json", study.to_dict())
    outcome = Outcome()
    todo: list[Cell] = []
    stale = reused = 0
    index = reuse_index(study.protocol.reuse)
    for cell in study.cells:
        status, res = cell_status(cell, results)
        src = reusable(cell, study, index) if status != "done" else None
        if src is not None:
            res = {**src[1], **cell_header(cell, study.name, Path(str(src[1].get("log")))), "reused_from": src[0]}
            write_json_atomic(results / cell.id / "result.json", res)
            status, reused = "done", reused + 1
        if status == "done":
            outcome.results[cell.id], _ = res, outcome.skipped.append(cell.id)
        else:
            stale += status == "stale"
            todo.append(cell)
    log(f"study {study.name}: {len(study.cells)} cells, {len(outcome.skipped)} done"
        + (f" ({reused} reused from {', '.join(study.protocol.reuse)})" if reused else "")
        + f", {len(todo)} to run" + (f" ({stale} with results of a changed config)" if stale else "")
        + f"; results in {results}")
    if not todo:
        return outcome
    # data: once per distinct data config, before any worker starts (workers then reuse the cache)
    by_data: dict[str, list[Cell]] = {}
    for cell in todo:
        by_data.setdefault(repr(cell.cfg.data), []).append(cell)
    runnable: list[Cell] = []
    for cells in by_data.values():
        try:
            prepare_data(cells[0].cfg.data, log=log)
            runnable += cells
        except Exception as e:  # every cell on this data fails, the others go on
            msg = f"data preparation failed: {type(e).__name__}: {e}".splitlines()[0]
            for cell in cells:
                res = failed_result(cell_header(cell, study.name, out / "logs" / f"{cell.id}.log"), msg, None, 0.0)
                write_json_atomic(results / cell.id / "result.json", res)
                outcome.results[cell.id] = res
                outcome.ran.append(cell.id)
            log(f"  {len(cells)} cell(s) failed: {msg}")
    runnable.sort(key=todo.index)
    for cell in runnable:  # an old result of a cell about to run must not be mistaken for its new one
        (results / cell.id / "result.json").unlink(missing_ok=True)
    threads = max(1, (os.cpu_count() or 1) // max(workers, 1))
    steps = {c.id: c.cfg.train.steps for c in runnable}
    bar = tqdm(total=sum(steps.values()), unit="step", desc=study.name, dynamic_ncols=True,
               disable=not sys.stderr.isatty() and not os.environ.get("QKLAB_PROGRESS"))
    try:
        if workers <= 0:
            for cell in runnable:
                try:
                    res = run_cell(cell, study.name, out, results, threads, study.protocol.probe)
                except RunLockError:
                    _busy(cell, outcome, log)
                    continue
                bar.update(steps[cell.id])
                _finish(cell, res, outcome, bar, steps, log)
        else:
            _pool(runnable, study, out, results, workers, threads, outcome, bar, steps, log)
    finally:
        bar.close()
    c = outcome.counts()
    log(f"study {study.name}: {c['ok']} ok, {c['diverged']} diverged, {c['failed']} failed "
        f"({len(outcome.ran)} run now, {len(outcome.skipped)} skipped"
        + (f", {len(outcome.busy)} busy in another process" if outcome.busy else "") + ")")
    return outcome


def _finish(cell: Cell, res: dict, outcome: Outcome, bar, steps: dict[str, int], log) -> None:
    outcome.results[cell.id] = res
    outcome.ran.append(cell.id)
    what = {"ok": "ok", "diverged": f"diverged ({res.get('divergence')})",
            "failed": f"FAILED: {res.get('failure')} (log: {res.get('log')})"}[res["status"]]
    extra = ""
    if res["status"] != "failed":
        f = res["final"]
        extra = f"  val {float(f['val_loss']):.4f}  report {float(f['report_loss']):.4f}  {res['seconds']:.0f} s"
    (bar.write if not bar.disable else log)(f"  {cell.id}: {what}{extra}")
    c = outcome.counts()
    bar.set_postfix_str(f"done {c['ok']} diverged {c['diverged']} failed {c['failed']}")


def _show_running(bar, running: int, outcome: Outcome, queued: int) -> None:
    c = outcome.counts()
    bar.set_postfix_str(f"running {running} queued {queued} | done {c['ok']} diverged {c['diverged']} "
                        f"failed {c['failed']}", refresh=False)


def _pool(cells: list[Cell], study: Study, out: Path, results: Path, workers: int, threads: int,
          outcome: Outcome, bar, steps: dict[str, int], log) -> None:
    ctx = _context()
    queue, running = list(cells), {}
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's SIGTERM: stop the workers too
    counted: dict[str, int] = {}
    progress = {"steps": 0}
    t_start = last_note = time.time()
    try:
        while queue or running:
            while queue and len(running) < workers:
                cell = queue.pop(0)
                p = ctx.Process(target=_worker, name=f"qklab-{cell.id}", daemon=False,
                                args=(cell, study.name, out, results, threads, study.protocol.probe))
                p.start()
                running[cell.id] = (cell, p)
            _show_running(bar, len(running), outcome, len(queue))
            time.sleep(0.5)
            for cid, (cell, p) in list(running.items()):
                done_steps = steps[cid] if not p.is_alive() else min(_last_step(out / "cells" / cid), steps[cid])
                bar.update(done_steps - counted.get(cid, 0))
                counted[cid] = done_steps
                progress["steps"] = sum(counted.values())
                if p.is_alive():
                    continue
                p.join()
                del running[cid]
                res = read_result(results / cid / "result.json")
                if res is None and p.exitcode in STOPPED:  # stopped by a signal after a checkpoint: not done,
                    log(f"  {cid}: stopped by a signal; the next run resumes it")  # not failed
                    outcome.ran.append(cid)
                    outcome.stopped.append(cid)
                    if queue:  # whoever stopped a cell is stopping the study: start nothing more
                        log(f"  {len(queue)} queued cell(s) not started; run the same command to continue")
                        outcome.not_started += [c.id for c in queue]
                        queue.clear()
                    continue
                if res is None and p.exitcode == BUSY:
                    _busy(cell, outcome, log)
                    continue
                if res is None or (p.exitcode != 0 and res.get("status") not in DONE + ("failed",)):
                    res = failed_result(cell_header(cell, study.name, out / "logs" / f"{cid}.log"),
                                        f"worker process exited with code {p.exitcode} before writing a result",
                                        None, 0.0)
                    write_json_atomic(results / cid / "result.json", res)
                _finish(cell, res, outcome, bar, steps, log)
            if bar.disable and time.time() - last_note > 60:  # no terminal: a line a minute, with an ETA
                c, done, total = outcome.counts(), progress["steps"], sum(steps.values())
                eta = (time.time() - t_start) * (total - done) / done if done else float("nan")
                log(f"  {done}/{total} steps; running {len(running)}, done {c['ok']}, diverged {c['diverged']}, "
                    f"failed {c['failed']}, queued {len(queue)}; ETA {eta / 60:.1f} min")
                last_note = time.time()
    except KeyboardInterrupt as e:
        if not isinstance(e, _Terminated):  # Ctrl-C reached the workers too (same process group): each
            for _, p in running.values():  # checkpoints at its next step and exits
                p.join(timeout=STOP_GRACE_S)
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for _, p in running.values():  # ask once (SIGTERM: checkpoint at the next step), then insist
            if p.is_alive():
                p.terminate()
        for _, p in running.values():
            p.join(timeout=STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()


class _Terminated(KeyboardInterrupt):
    """The study process itself got SIGTERM; its workers did not, and are asked in turn."""


def _raise_interrupt(signum, _frame) -> None:
    raise _Terminated(f"signal {signum}")
