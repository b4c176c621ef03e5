"""The worker processes of a study: one cell each, dying with the study (a pipe watchdog and a
parent-death signal), stopped after a checkpoint on SIGTERM / Ctrl-C; the outcome of a run."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qklab.rundir.folder import LOCK, RunLockError
from qklab.rundir.metrics import last_step
from qklab.study.cell import BUSY, DONE, STOP_GRACE_S, STOPPED, publish, run_cell
from qklab.study.result import (
    CellOutcome,
    cell_header,
    cell_outcome,
    failed_result,
    outcome_line,
    read_result,
    tally,
)
from qklab.study.spec import Cell, Study


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

    def tally(self) -> str:
        """'3 ok, 1 diverged, 2 not learned, 0 failed': the results by outcome (``result.CellOutcome``)."""
        return tally(map(cell_outcome, self.results.values()))


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


def worker_main(cell: Cell, study: str, out: Path, results: Path, threads: int, probe: int, alive=None,
            code: dict[str, Any] | None = None) -> None:
    """Entry point of a worker process (and of a Slurm task, ``study.task``): everything it prints goes to
    the cell's log."""
    _die_with_parent()
    if alive is not None:
        import threading

        threading.Thread(target=_watch_study, args=(alive,), name="qklab-watch-study", daemon=True).start()
    log = out / "logs" / f"{cell.id}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # less the umask
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


def note_busy(cell: Cell, outcome: Outcome, log, out: Path) -> None:
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
        ctx.set_forkserver_preload(["torch", "qklab.study.cell", "qklab.train.trainer"])
        return ctx
    return mp.get_context("spawn")


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now (inode, mtime, size): a worker's result is new when this changed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def note_finished(cell: Cell, res: dict, outcome: Outcome, bar, steps: dict[str, int], log) -> None:
    outcome.results[cell.id] = res
    outcome.ran.append(cell.id)
    how = cell_outcome(res)
    what = f"FAILED: {res.get('failure')} (log: {res.get('log')})" if how is CellOutcome.FAILED else outcome_line(res)
    extra = ""
    if how is not CellOutcome.FAILED:
        f = res["final"]
        extra = f"  val {float(f['val_loss']):.4f}  report {float(f['report_loss']):.4f}  {res['seconds']:.0f} s"
    (bar.write if not bar.disable else log)(f"  {cell.id}: {what}{extra}")
    bar.set_postfix_str(f"done: {outcome.tally()}")


def _show_running(bar, running: int, outcome: Outcome, queued: int) -> None:
    bar.set_postfix_str(f"running {running} queued {queued} | done: {outcome.tally()}", refresh=False)


def time_left_s(elapsed: float, done_steps: dict[str, int], steps: dict[str, int], cost: dict[str, float]) -> float:
    """Seconds left at the pace so far: ``elapsed`` x the cost left / the cost done, each cell's cost
    (``runner.expected_cost``: a ladder's widest cell costs several of its narrowest) spread evenly over its
    steps; NaN before a step is done."""
    done = sum(cost[c] * min(done_steps.get(c, 0), n) / n for c, n in steps.items() if n > 0)
    total = sum(cost[c] for c, n in steps.items() if n > 0)
    return elapsed * (total - done) / done if done > 0 else float("nan")


def run_pool(cells: list[Cell], study: Study, out: Path, results: Path, workers: int, threads: int,
          outcome: Outcome, bar, steps: dict[str, int], log, code: dict[str, Any] | None = None,
          cost: dict[str, float] | None = None) -> None:
    """Train ``cells``, ``workers`` at a time, each in a process of its own. ``cost``: each cell's relative
    cost, for the ETA of the progress lines (None: its steps)."""
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
                p = ctx.Process(target=worker_main, name=f"qklab-{cell.id}", daemon=False,
                                args=(cell, study.name, out, results, threads, study.protocol.probe, alive_r, code))
                p.start()
                running[cell.id] = (cell, p)
            _show_running(bar, len(running), outcome, len(queue))
            time.sleep(0.5)
            for cid, (cell, p) in list(running.items()):
                now = last_step(out / "cells" / cid / "metrics.jsonl") or 0  # a resumed run's file restarts at
                done_steps = steps[cid] if not p.is_alive() else min(now, steps[cid])  # its checkpoint's step
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
                    note_busy(cell, outcome, log, out)
                    continue
                if res is None or (p.exitcode != 0 and res.get("status") not in DONE + ("failed",)):
                    res = failed_result(cell_header(cell, study.name, out / "logs" / f"{cid}.log"),
                                        f"worker process exited with code {p.exitcode} before writing a result",
                                        None, 0.0)
                    res["code"] = code
                    publish(results, cid, res)
                note_finished(cell, res, outcome, bar, steps, log)
            if bar.disable and time.time() - last_note > 60:  # no terminal: a line a minute, with an ETA
                done, total = progress["steps"], sum(steps.values())
                eta = time_left_s(time.time() - t_start, counted, steps, cost or steps)
                log(f"  {done}/{total} steps; running {len(running)}, queued {len(queue)}, done: {outcome.tally()}; "
                    f"ETA {eta / 60:.1f} min")
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
            note_finished(cell, res, outcome, bar, steps, log)
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
