"""Run a study's cells in worker processes; each cell is a plain training run in its own folder.

    runs/studies/<name>/            (--out)
        cells/<cell>/               the cell's run folder (config.json, metrics.jsonl, ckpt/)
        logs/<cell>.log             everything the cell printed, tracebacks included
    <results>/                      (--results; default <out>/results; commit it under docs/results/)
        study.json                  the study as run: grid, variants, protocol, cell ids, and ``code``: the
                                    code version of every run that trained cells here
        provenance/<sha256>.diff    the uncommitted diff (``git diff HEAD``) of a run from a dirty checkout
        <cell>/result.json          one per finished or failed cell

Provenance: ``run_study`` reads the code version once, when it starts, from the checkout qklab is imported
from (``version.code_version``): the commit and, for a dirty tree, the diff of tracked files, stored by its
sha256. Every result.json it writes names it (``code: {"commit", "dirty", "diff_sha256"}``), and so does
study.json; ``git_sha`` (HEAD when the cell's run started) stays as it was. ``allow_dirty=False`` (the
command line without ``--allow-dirty``) refuses a dirty checkout before anything is written.

A cell whose result file exists, says ok or diverged and matches the cell's config hash is done and
skipped, so a study continues from committed results alone, on another machine. A damaged result file is
named and its cell run again; a result of another config stays until its successor replaces it (by rename).
A cell with the same config hash as a finished cell of another study listed in ``[protocol] reuse`` is
copied, not rerun. A failed cell is run again. An interrupted cell resumes from its last checkpoint. Each
worker process gets an equal share of the CPU threads (or ``threads``). Data is prepared once per distinct
``data.*`` config, before any cell starts; within a seed the costliest cells start first.

One writer per folder: the study process holds ``<out>/.lock`` and ``<results>/.lock`` (flock, dropped by
the kernel however the process ends); a second study on either is refused, and a results folder holding
another study's ``study.json`` is refused. Workers die with the study: each watches a pipe whose only
writer is the study process (and has a parent-death signal on Linux), and on its end stops as on SIGTERM,
after a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
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
from qklab.rundir.folder import LOCK, RunLock, RunLockError
from qklab.study.result import (
    build_result,
    cell_header,
    failed_result,
    load_result,
    read_json,
    read_result,
    write_json_atomic,
)
from qklab.study.spec import Cell, Study
from qklab.version import CodeVersion, code_version

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
    damaged: list[str] = field(default_factory=list)  # result files that could not be used (named, run again)
    holders: dict[str, str] = field(default_factory=dict)  # busy cell id -> the pid holding its run folder
    signal: int | None = None  # the study itself was stopped by this signal (its cells after a checkpoint)

    def counts(self) -> Counter:
        return Counter(r["status"] for r in self.results.values())


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
    if code is not None:
        res["code"] = code
    publish(results, cell.id, res)
    return res


def publish(results: Path, cell_id: str, res: dict[str, Any]) -> None:
    """Write a cell's result.json atomically. A failure is no successor: a finished result of another
    config in its place is first moved aside to ``result.<its hash>.json`` (a damaged one to
    ``result.damaged.json``), never overwritten."""
    path = results / cell_id / "result.json"
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
    keep = ("length", "extrapolation", "mass", "uniform_mass", "log_contrast", "rank", "top1", "accuracy")
    return {"summary": probe_summary(full), "retrieval": [{k: r.get(k) for k in keep} for r in rows],
            "magnitude": {k: (full.get("magnitude") or {}).get(k) for k in ("scales", "js_mean")}}


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGTERM to this process when its parent dies (a parent-death signal; the parent of a
    forkserver worker is the fork server, which lives as long as the study's workers)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _watch_study(alive) -> None:
    """Worker thread: ``alive`` is the read end of a pipe whose only writer is the study process; it reads
    end-of-file when the study is gone, however it ended (SIGKILL included). The worker then stops as on
    SIGTERM (a checkpoint at the next step), and exits for good after the grace period."""
    try:
        while True:
            alive.recv()
    except (EOFError, OSError):
        pass
    print("the study process is gone; stopping this cell after a checkpoint", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(128 + signal.SIGKILL)


def _worker(cell: Cell, study: str, out: Path, results: Path, threads: int, probe: int, alive=None,
            code: dict[str, Any] | None = None) -> None:
    """Entry point of a worker process: everything it prints goes to the cell's log."""
    _die_with_parent()
    if alive is not None:
        import threading

        threading.Thread(target=_watch_study, args=(alive,), name="qklab-watch-study", daemon=True).start()
    log = out / "logs" / f"{cell.id}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from qklab.train.signals import RunInterrupted, TermRaises

    try:
        with TermRaises():  # SIGTERM before the training loop (data, setup) stops the cell too, in one line
            run_cell(cell, study, out, results, threads, probe, code)
    except RunInterrupted as e:
        print(f"stopped: {e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the training loop: nothing to checkpoint yet
        print("stopped: SIGINT")
        sys.exit(128 + signal.SIGINT)
    except RunLockError as e:
        print(f"not run: {e}")
        sys.exit(BUSY)


def _busy(cell: Cell, outcome: Outcome, log, out: Path) -> None:
    """Another process holds the cell's run folder: no result is written, and the next run retries it."""
    outcome.ran.append(cell.id)
    outcome.busy.append(cell.id)
    run_dir = out / "cells" / cell.id
    try:
        holder = (run_dir / LOCK).read_text().strip() or "unknown"
    except (OSError, UnicodeDecodeError):
        holder = "unknown"
    outcome.holders[cell.id] = holder
    log(f"  {cell.id}: not run: another process (pid {holder}) is training it in {run_dir}; "
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


def cell_status(cell: Cell, results: Path, warn=None) -> tuple[str, dict | None]:
    """'done' (a matching ok/diverged result exists), 'stale' (one exists for another config), 'damaged'
    (a result file that cannot be used: named through ``warn``, never counted as done) or 'todo'."""
    res, problem = load_result(results / cell.id / "result.json")
    if problem is not None:
        if warn is not None:
            warn(f"warning: damaged result file {problem}; cell {cell.id} counts as not done")
        return "damaged", None
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


def reuse_index(folders: list[str], warn=None) -> dict[str, tuple[str, dict[str, Any]]]:
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
            res, problem = load_result(f)
            if problem is not None and warn is not None:
                warn(f"warning: [protocol] reuse: damaged result file {problem}; skipped")
            if res is not None and res.get("status") in DONE and res.get("cell_hash"):
                index.setdefault(res["cell_hash"], (f"{folder.rstrip('/')}/{f.parent.name}", res))
    return index


def reusable(cell: Cell, study: Study, index: dict) -> tuple[str, dict[str, Any]] | None:
    """The (source, result) in ``index`` that ``cell`` may take over, or None (with probes asked for,
    only a result that has them)."""
    src = index.get(cell.hash)
    return src if src is not None and (src[1].get("probe") or not study.protocol.probe) else None


def run_study(study: Study, out: Path, results: Path | None = None, workers: int = 1,
              log=print, threads: int | None = None, warn=None, allow_dirty: bool = True,
              repo: str | Path | None = None) -> Outcome:
    """Run every cell that is not done; ``workers`` processes at a time (0: in this process, serially), each
    on ``threads`` CPU threads (default: an equal share of the machine's). ``warn`` (default ``log``) hears
    about damaged files, one line each. ``repo``: the checkout whose code version the results record
    (default: the one qklab is imported from); ``allow_dirty=False`` refuses one with uncommitted changes."""
    out, results = Path(out), Path(results or Path(out) / "results")
    if threads is not None and (type(threads) is not int or threads < 1):
        raise ConfigError(f"--threads {threads}: use 1 or more threads per cell")
    code = code_version(repo)  # once, in this process: the code the workers import (not HEAD when a cell starts)
    if code.dirty and not allow_dirty:
        raise ConfigError(f"the checkout {code.root} has uncommitted changes to tracked files (git diff HEAD); "
                          "commit them, or pass --allow-dirty to record the diff with the results")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    lock = _study_lock(study, out)  # before anything is written: a second run of the study changes nothing
    try:
        rlock = _results_lock(study, out, results)
        try:
            return _run_study(study, out, results, workers, log, threads, warn or log, code)
        finally:
            rlock.release()
    finally:
        lock.release()


class _NoLock:
    def release(self) -> None:
        pass


def _results_lock(study: Study, out: Path, results: Path):
    """One writer per results folder: an exclusive lock on ``<results>/.lock`` (the study folder's lock
    when both are one folder), then the folder's ``study.json`` must be this study's (or absent)."""
    results.mkdir(parents=True, exist_ok=True)
    if results.resolve() == out.resolve():
        lock = _NoLock()
    else:
        try:
            lock = RunLock(results)
        except RunLockError as e:
            pid = e.holder
            raise ConfigError(f"results folder {results} is in use by another qklab study run (pid {pid}); wait for "
                              "it to finish, or give another --results") from None
    try:
        _check_owner(study, results)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_owner(study: Study, results: Path) -> None:
    data, problem = read_json(results / "study.json")
    if problem == "missing":
        return
    name = data.get("name") if isinstance(data, dict) else None
    if isinstance(name, str) and name != study.name:
        raise ConfigError(f"results folder {results} holds the results of study '{name}' (its study.json), not of "
                          f"'{study.name}'; give another --results")


def _write_study_json(study: Study, results: Path, warn) -> None:
    """``study.json`` as run; an unchanged one is left alone (a committed file stays byte for byte), and the
    code versions it names (``code``) are kept."""
    path = results / "study.json"
    data, problem = read_json(path)
    want = json.loads(json.dumps(study.to_dict(), default=str))
    codes = data.get("code") if isinstance(data, dict) and isinstance(data.get("code"), list) else []
    if problem is None and isinstance(data, dict) and {k: v for k, v in data.items() if k != "code"} == want:
        return
    if problem not in (None, "missing") or (problem is None and not isinstance(data, dict)):
        warn(f"warning: damaged {path} ({problem or 'not an object'}); written anew")
    write_json_atomic(path, {**study.to_dict(), **({"code": codes} if codes else {})})


def provenance_path(results: Path, diff_sha256: str) -> Path:
    return Path(results) / "provenance" / f"{diff_sha256}.diff"


def record_code(code: CodeVersion, results: Path) -> dict[str, Any]:
    """Before cells are trained: the diff of a dirty checkout in ``<results>/provenance/<sha256>.diff``
    (content-addressed: an existing one is left alone), and the code version in study.json's ``code`` list
    (once per distinct version). Returns the record each result.json gets."""
    from qklab.atomic import atomic_write_bytes

    rec = code.record()
    if code.dirty:
        path = provenance_path(results, code.diff_sha256)
        if not (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == code.diff_sha256):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, code.diff)
    path = results / "study.json"
    data = read_result(path)
    if data is not None:
        codes = data.get("code") if isinstance(data.get("code"), list) else []
        if rec not in codes:
            write_json_atomic(path, {**data, "code": [*codes, rec]})
    return rec


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now (inode, mtime, size): a worker's result is new when this changed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def expected_cost(cell: Cell) -> float:
    """The relative cost of a cell: tokens trained x parameters of its blocks (a ladder's widths differ)."""
    m, t = cell.cfg.model, cell.cfg.train
    tokens = float(t.steps) * t.batch_size * getattr(t, "grad_accum", 1) * t.seq_len
    return tokens * m.n_layers * (12 * m.d_model ** 2 + t.seq_len * m.d_model)


def queue_order(cells: list[Cell], study: Study) -> list[Cell]:
    """Seed by seed (a study cut short still has every variant at its first seeds), within a seed the
    costliest first, so that unequal cells pack the workers (ties: the study's order)."""
    pos = {c.id: i for i, c in enumerate(study.cells)}
    seeds = {s: i for i, s in enumerate(study.seeds)}
    return sorted(cells, key=lambda c: (seeds.get(c.seed, len(seeds)), -expected_cost(c), pos.get(c.id, 0)))


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


def _run_study(study: Study, out: Path, results: Path, workers: int, log, threads: int | None, warn,
               code: CodeVersion | None = None) -> Outcome:
    from qklab.data import prepare_data

    _write_study_json(study, results, warn)
    outcome = Outcome()
    todo: list[Cell] = []
    stale = reused = 0
    index = reuse_index(study.protocol.reuse, warn)
    for cell in study.cells:
        status, res = cell_status(cell, results, warn)
        if status == "damaged":
            outcome.damaged.append(cell.id)
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
        + (f" ({len(outcome.damaged)} with a damaged result file)" if outcome.damaged else "")
        + f"; results in {results}")
    if not todo:
        return outcome
    rec = record_code(code if code is not None else code_version(), results)
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
                res = {**failed_result(cell_header(cell, study.name, out / "logs" / f"{cell.id}.log"), msg, None, 0.0),
                       "code": rec}
                publish(results, cell.id, res)
                outcome.results[cell.id] = res
                outcome.ran.append(cell.id)
            log(f"  {len(cells)} cell(s) failed: {msg}")
    # an old result (another config's) stays until the cell's new result replaces it by rename; the pool
    # tells the new one from it by the file's identity
    runnable = queue_order(runnable, study)
    threads = threads or max(1, (os.cpu_count() or 1) // max(workers, 1))
    steps = {c.id: c.cfg.train.steps for c in runnable}
    bar = tqdm(total=sum(steps.values()), unit="step", desc=study.name, dynamic_ncols=True,
               disable=not sys.stderr.isatty() and not os.environ.get("QKLAB_PROGRESS"))
    try:
        if workers <= 0:
            from qklab.train.signals import RunInterrupted

            for i, cell in enumerate(runnable):
                try:
                    res = run_cell(cell, study.name, out, results, threads, study.protocol.probe, rec)
                except RunLockError:
                    _busy(cell, outcome, log, out)
                    continue
                except (RunInterrupted, KeyboardInterrupt) as e:  # stopped after a checkpoint: resumable
                    log(f"  {cell.id}: stopped by a signal; the next run resumes it")
                    outcome.ran.append(cell.id)
                    outcome.stopped.append(cell.id)
                    outcome.not_started += [c.id for c in runnable[i + 1:]]
                    code = getattr(e, "exit_code", 128 + signal.SIGINT)
                    outcome.signal = code - 128
                    break
                bar.update(steps[cell.id])
                _finish(cell, res, outcome, bar, steps, log)
        else:
            _pool(runnable, study, out, results, workers, threads, outcome, bar, steps, log, rec)
    finally:
        bar.close()
    c = outcome.counts()
    log(f"study {study.name}: {c['ok']} ok, {c['diverged']} diverged, {c['failed']} failed "
        f"({len(outcome.ran)} run now, {len(outcome.skipped)} skipped"
        + (f", {len(outcome.busy)} busy in another process" if outcome.busy else "")
        + (f", {len(outcome.stopped)} stopped, {len(outcome.not_started)} not started" if outcome.signal else "")
        + ")")
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
          outcome: Outcome, bar, steps: dict[str, int], log, code: dict[str, Any] | None = None) -> None:
    ctx = _context()
    queue, running = list(cells), {}
    before: dict[str, tuple | None] = {}  # cell id -> the result file there when its worker started
    alive_r, alive_w = ctx.Pipe(duplex=False)  # the study is the only writer: workers read EOF when it is gone
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's SIGTERM: stop the workers too
    counted: dict[str, int] = {}
    progress = {"steps": 0}
    t_start = last_note = time.time()
    stop: int | None = None

    def new_result(cid: str) -> dict | None:
        path = results / cid / "result.json"
        return read_result(path) if _stamp(path) != before.get(cid) else None

    try:
        while queue or running:
            while queue and len(running) < workers:
                cell = queue.pop(0)
                before[cell.id] = _stamp(results / cell.id / "result.json")
                p = ctx.Process(target=_worker, name=f"qklab-{cell.id}", daemon=False,
                                args=(cell, study.name, out, results, threads, study.protocol.probe, alive_r, code))
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
                res = new_result(cid)
                if res is None and _stopped_code(p.exitcode):  # stopped by a signal after a checkpoint: not done,
                    log(f"  {cid}: stopped by a signal; the next run resumes it")  # not failed
                    outcome.ran.append(cid)
                    outcome.stopped.append(cid)
                    if queue:  # whoever stopped a cell is stopping the study: start nothing more
                        log(f"  {len(queue)} queued cell(s) not started; run the same command to continue")
                        outcome.not_started += [c.id for c in queue]
                        queue.clear()
                    continue
                if res is None and p.exitcode == BUSY:
                    _busy(cell, outcome, log, out)
                    continue
                if res is None or (p.exitcode != 0 and res.get("status") not in DONE + ("failed",)):
                    res = failed_result(cell_header(cell, study.name, out / "logs" / f"{cid}.log"),
                                        f"worker process exited with code {p.exitcode} before writing a result",
                                        None, 0.0)
                    res["code"] = code
                    publish(results, cid, res)
                _finish(cell, res, outcome, bar, steps, log)
            if bar.disable and time.time() - last_note > 60:  # no terminal: a line a minute, with an ETA
                c, done, total = outcome.counts(), progress["steps"], sum(steps.values())
                eta = (time.time() - t_start) * (total - done) / done if done else float("nan")
                log(f"  {done}/{total} steps; running {len(running)}, done {c['ok']}, diverged {c['diverged']}, "
                    f"failed {c['failed']}, queued {len(queue)}; ETA {eta / 60:.1f} min")
                last_note = time.time()
    except KeyboardInterrupt as e:
        stop = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
        if not isinstance(e, _Terminated):  # Ctrl-C reached the workers too (same process group): each
            for _, p in running.values():  # checkpoints at its next step and exits
                p.join(timeout=STOP_GRACE_S)
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
        alive_w.close()
        alive_r.close()
    if stop is None:
        return
    outcome.signal = stop  # the study itself was stopped: what each running cell did, and what never started
    for cid, (cell, _p) in running.items():
        res = new_result(cid)
        if res is not None:  # it finished before it heard the signal
            _finish(cell, res, outcome, bar, steps, log)
        else:
            log(f"  {cid}: stopped by {signal.Signals(stop).name}; the next run resumes it")
            outcome.ran.append(cid)
            outcome.stopped.append(cid)
    outcome.not_started += [c.id for c in queue]


def _stopped_code(code: int | None) -> bool:
    """A worker's exit after a signal: RunInterrupted's 128 + N, or killed by SIGTERM/SIGINT itself."""
    return code in STOPPED or (code is not None and -code in (signal.SIGTERM, signal.SIGINT))


class _Terminated(KeyboardInterrupt):
    """The study process itself got SIGTERM; its workers did not, and are asked in turn."""


def _raise_interrupt(signum, _frame) -> None:
    raise _Terminated(f"signal {signum}")


# `qklab study verify`: retrain committed cells from the config their result.json records, compare bit for bit

VERIFIED_KEYS = ("status", "diverged", "divergence", "corpus", "n_params", "unigram_entropy", "final",
                 "best_val_loss", "curves", "heads", "head_series", "spikes", "nonfinite_steps")


@dataclass
class Verdict:
    cell: str
    same: bool
    differences: list[str] = field(default_factory=list)  # 'final.report_loss: 4.43 here, 4.4300000000000001 committed'


def _canonical(v: Any) -> str:
    from qklab.study.result import _finite

    return json.dumps(_finite(v), sort_keys=True)


def _differences(new: Any, old: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, by path (floats compared by their exact repr: bit for bit)."""
    if isinstance(new, dict) and isinstance(old, dict):
        out = []
        for k in sorted(set(new) | set(old), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in new or k not in old:
                out.append(f"{p}: {'missing here' if k not in new else 'not in the committed result'}")
            else:
                out += _differences(new[k], old[k], p)
        return out
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [d for i, (a, b) in enumerate(zip(new, old, strict=True)) for d in _differences(a, b, f"{path}[{i}]")]
    a, b = _canonical(new), _canonical(old)
    return [] if a == b else [f"{path}: {a[:60]} retrained, {b[:60]} committed"]


def verify_cell(res: dict[str, Any], out: Path, log=print) -> Verdict:
    """Train the cell of a committed result again from the config it records (its thread count included,
    in ``out``) and compare what the result holds, number for number."""
    from qklab.config import from_dict
    from qklab.data import prepare_data, unigram_entropy
    from qklab.diagnostics.stability import NonFiniteError
    from qklab.rundir.metrics import read_metrics
    from qklab.train.trainer import Trainer

    recorded = res.get("config")
    if not isinstance(recorded, dict):
        return Verdict(res["cell"], False, ["the result records no config"])
    raw = dict(recorded)
    if isinstance(raw.get("qk"), dict):  # saved as {"options": {name: {...}}}, read as [qk.<name>]
        raw["qk"] = {k: v for k, v in raw["qk"].items() if k != "options"} | (raw["qk"].get("options") or {})
    cfg = from_dict(RunConfig, raw).validate()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out), name=res["cell"],
                                                             progress=False))
    data = prepare_data(cfg.data, log=log)
    stopped = None
    try:
        Trainer(cfg, resume=False, overwrite=True, data=data).run()
    except NonFiniteError as e:
        stopped = str(e)
    run_dir = out / res["cell"]
    new = build_result({}, run_dir, read_metrics(run_dir / "metrics.jsonl"),
                       unigram_entropy(data.select_tokens(), data.vocab_size), res.get("cell_hash"), 0.0, stopped)
    diffs = _differences({k: new.get(k) for k in VERIFIED_KEYS if k in new or k in res},
                         {k: res.get(k) for k in VERIFIED_KEYS if k in new or k in res})
    return Verdict(res["cell"], not diffs, diffs)


def verify_results(results: Path, cells: int = 1, seed: int | None = None, out: Path | None = None,
                   log=print, warn=None) -> list[Verdict]:
    """Retrain ``cells`` finished (ok or diverged) cells of a results folder, drawn at random (``seed``), each
    in a fresh run folder under ``out`` (default: a temporary folder, removed after)."""
    import random
    import shutil
    import tempfile

    results = Path(results)
    if type(cells) is not int or cells < 1:
        raise ConfigError(f"--cells {cells}: verify 1 or more cells")
    if not results.is_dir():
        raise ConfigError(f"no results folder {results}; give a folder holding <cell>/result.json files")
    done = []
    for f in sorted(results.glob("*/result.json")):
        res, problem = load_result(f)
        if problem is not None and warn is not None:
            warn(f"warning: damaged result file {problem}; not verified")
        if res is not None and res.get("status") in DONE:
            done.append(res)
    if not done:
        raise ConfigError(f"{results} holds no finished (ok or diverged) result.json to verify")
    chosen = random.Random(seed).sample(done, min(cells, len(done)))
    tmp = Path(tempfile.mkdtemp(prefix="qklab-verify-")) if out is None else Path(out)
    try:
        verdicts = []
        for res in chosen:
            log(f"verify {res['cell']}: training it again from its result.json config")
            v = verify_cell(res, tmp, log=lambda s: None)
            log(f"  {v.cell}: " + ("identical, bit for bit" if v.same else
                                   f"DIFFERS in {len(v.differences)} value(s): " + "; ".join(v.differences[:3])))
            verdicts.append(v)
        return verdicts
    finally:
        if out is None:
            shutil.rmtree(tmp, ignore_errors=True)
