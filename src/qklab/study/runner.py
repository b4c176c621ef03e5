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
named and its cell run again, and so is one of a schema this qklab does not read (a newer qklab's, which
the run then keeps aside as ``result.schema-<n>.json``); a result of another config stays until its
successor replaces it (by rename).
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
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from qklab.config import ConfigError
from qklab.errors import CorpusMissing
from qklab.rundir.folder import RunLock, RunLockError
from qklab.study.cell import DONE, publish, run_cell
from qklab.study.plan import amend, check_design, check_plan, family_power, registration
from qklab.study.result import (
    cell_header,
    failed_result,
    load_result,
    read_json,
    read_result,
    write_json_atomic,
)
from qklab.study.spec import Cell, Study
from qklab.study.workers import Outcome, note_busy, note_finished, run_pool
from qklab.version import CodeVersion, code_version


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
    with study_locks(study, out, results):  # before anything is written: a second run changes nothing
        return _run_study(study, out, results, workers, log, threads, warn or log, code)


@contextlib.contextmanager
def study_locks(study: Study, out: Path, results: Path):
    """The study folder's and the results folder's locks, for the life of the block (one writer each)."""
    lock = _study_lock(study, out)
    try:
        rlock = _results_lock(study, out, results)
        try:
            yield
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


# study.json entries the runner keeps (not the study file's); predictions: a committed predictions file's hash
KEPT = ("code", "plan", "plan_history", "predictions")


def n_results(results: Path) -> int:
    """Cells with a result file in ``results`` (any status): after the first, the plan is fixed."""
    return sum(1 for _ in Path(results).glob("*/result.json"))


def recorded(study: Study) -> dict[str, Any]:
    """``study.to_dict()`` as study.json records it (JSON values: tuples as lists, paths as strings)."""
    return json.loads(json.dumps(study.to_dict(), default=str))


def _write_study_json(study: Study, results: Path, warn) -> None:
    """``study.json`` as run; an unchanged one is left alone (a committed file stays byte for byte), and the
    code versions it names (``code``) and its plan record are kept. The study file's ``[claims]`` are
    registered here, before any cell trains, with the design (seeds, grid, variants, protocol); either
    changed after results are in is refused (amend)."""
    path = results / "study.json"
    data, problem = read_json(path)
    data = data if problem is None and isinstance(data, dict) else None
    done = n_results(results)
    action = check_plan(data, study.plan, done)
    want = recorded(study)
    check_design(data, want, done)
    kept = {k: data[k] for k in KEPT if data is not None and k in data}
    if action == "register":
        kept.pop("plan", None)
        if study.plan is not None:
            kept["plan"] = registration(study.plan)
            for line in family_power(study.plan, len(study.seeds)):
                warn(f"warning: {line}")
    if data is not None and {k: v for k, v in data.items() if k not in KEPT} == want and action == "same":
        return
    if problem not in (None, "missing") or (problem is None and data is None):
        warn(f"warning: damaged {path} ({problem or 'not an object'}); written anew")
    write_json_atomic(path, {**study.to_dict(), **kept})


def amend_plan(study: Study, results: Path, why: str) -> dict[str, Any]:
    """``qklab study amend``: the study file's claims and design replace the ones its results folder
    registered; the old and new plan (and design, when it changed), the reason and the time go into
    ``plan_history``. Returns the new study.json."""
    path = Path(results) / "study.json"
    data, problem = read_json(path)
    if problem == "missing":
        raise ConfigError(f"amend: {path} not found; a study registers its claims when it first runs "
                          f"(qklab study run), so there is nothing to amend yet")
    if problem is not None or not isinstance(data, dict):
        raise ConfigError(f"amend: {path} is damaged ({problem or 'not an object'})")
    if data.get("name") != study.name:
        raise ConfigError(f"amend: {path} is study '{data.get('name')}', not '{study.name}'")
    out = amend(data, study.plan, why, recorded(study))
    write_json_atomic(path, out)
    return out


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


def expected_cost(cell: Cell) -> float:
    """The relative cost of a cell: tokens trained x (its blocks' parameters and attention per token, plus
    the output head's, which at a small width costs as much as the blocks): a ladder's widths differ."""
    from qklab.data.tokenizer import ByteTokenizer

    m, t, d = cell.cfg.model, cell.cfg.train, cell.cfg.data
    tokens = float(t.steps) * t.batch_size * getattr(t, "grad_accum", 1) * t.seq_len
    vocab = m.vocab_size or (d.vocab_size if d.tokenizer == "bpe" else ByteTokenizer().vocab_size)  # 0: the tokenizer's
    return tokens * (m.n_layers * (12 * m.d_model ** 2 + t.seq_len * m.d_model) + vocab * m.d_model)


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


def pending(study: Study, results: Path, log, warn) -> tuple[Outcome, list[Cell]]:
    """Register the study (study.json: its design and plan) and sort its cells: done ones (reused ones
    copied in) go into the outcome, the rest are returned, in the study's order."""
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
    return outcome, todo


def prepare_cells(study: Study, todo: list[Cell], out: Path, results: Path, outcome: Outcome, rec: dict,
                  log) -> list[Cell]:
    """Prepare each distinct data config once (before any cell starts: cells then read the cache); the
    cells whose data fails are recorded as failed. Returns the others, in queue order."""
    from qklab.data import prepare_data

    by_data: dict[str, list[Cell]] = {}
    for cell in todo:
        by_data.setdefault(repr(cell.cfg.data), []).append(cell)
    runnable: list[Cell] = []
    for cells in by_data.values():
        try:
            prepare_data(cells[0].cfg.data, log=log)
            runnable += cells
        except CorpusMissing:  # this machine's setup, not the cells': nothing is recorded (exit 2)
            raise
        except Exception as e:  # every cell on this data fails, the others go on
            msg = f"data preparation failed: {type(e).__name__}: {e}".splitlines()[0]
            for cell in cells:
                res = {**failed_result(cell_header(cell, study.name, out / "logs" / f"{cell.id}.log"), msg, None, 0.0),
                       "code": rec}
                publish(results, cell.id, res)
                outcome.results[cell.id] = res
                outcome.ran.append(cell.id)
            log(f"  {len(cells)} cell(s) failed: {msg}")
    return queue_order(runnable, study)


def _run_study(study: Study, out: Path, results: Path, workers: int, log, threads: int | None, warn,
               code: CodeVersion | None = None) -> Outcome:
    outcome, todo = pending(study, results, log, warn)
    if not todo:
        return outcome
    rec = record_code(code if code is not None else code_version(), results)
    runnable = prepare_cells(study, todo, out, results, outcome, rec, log)
    # an old result (another config's) stays until the cell's new result replaces it by rename; the pool
    # tells the new one from it by the file's identity
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
                    note_busy(cell, outcome, log, out)
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
                note_finished(cell, res, outcome, bar, steps, log)
        else:
            run_pool(runnable, study, out, results, workers, threads, outcome, bar, steps, log, rec,
                     {c.id: expected_cost(c) for c in runnable})
    finally:
        bar.close()
    log(f"study {study.name}: {outcome.tally()} "
        f"({len(outcome.ran)} run now, {len(outcome.skipped)} skipped"
        + (f", {len(outcome.busy)} busy in another process" if outcome.busy else "")
        + (f", {len(outcome.stopped)} stopped, {len(outcome.not_started)} not started" if outcome.signal else "")
        + ")")
    return outcome
