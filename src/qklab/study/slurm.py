"""A study's cells as Slurm array tasks: submit the cells that are neither done nor queued nor running, find the
study's live tasks, cancel them, follow them to the end.

    <out>/slurm/
        <submission>.json       the manifest of one submission (study.task): its cells by array index
        <submission>.sh         its batch script (study.cluster.batch_script)
        logs/<job>_<index>.log  what Slurm and the task's shell printed (the cell's own log: <out>/logs/)
        submissions.jsonl       one line per submission: job id, manifest, cells, seconds it took
        submit.lock             held while one shell submits: a second waits, then sees the first's jobs

A study's jobs are found by their name, ``qklab.<study>.<8 hex of the --out folder>``, among the user's
jobs; each array's comment names its manifest, so a live task maps to its cell without any file of ours
being current. The results folder stays the one truth about finished cells: Slurm only says what is queued
or running, and a task that ended without a result (a node lost, a setup line failing) leaves its cell for
the next ``study run``.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from qklab.config import ConfigError
from qklab.study.cluster import SlurmOptions, batch_script, header
from qklab.study.result import read_result
from qklab.study.spec import Cell, Study
from qklab.study.task import Manifest, cell_ids, write_manifest
from qklab.study.workers import Outcome

ARRAY_MAX = 1000  # tasks per array: a larger study is submitted as several arrays
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING")


@dataclass(frozen=True)
class LiveTask:
    """A queued or running array task of the study, as squeue shows it."""

    cell: str
    job: str  # "<array job id>_<index>"
    state: str  # PENDING, RUNNING, ...
    node: str  # the node it runs on ("" while pending)
    reason: str  # why it waits (squeue's %r)

    def line(self) -> str:
        if self.state == "RUNNING":
            return f"running (job {self.job} on {self.node})"
        why = f", {self.reason}" if self.reason and self.reason not in ("None", "(null)") else ""
        return f"{self.state.lower()} (job {self.job}{why})"


@dataclass
class Submission:
    """What one ``study run --executor slurm`` did."""

    jobs: list[str] = field(default_factory=list)  # array job ids, one per array submitted
    cells: list[str] = field(default_factory=list)  # cells submitted now
    live: dict[str, LiveTask] = field(default_factory=dict)  # cells already queued or running: not submitted
    seconds: float = 0.0  # the sbatch calls' wall time
    outcome: Outcome = field(default_factory=Outcome)  # cells done (skipped) or failed before any task


def slurm_dir(out: Path) -> Path:
    return Path(out) / "slurm"


def job_name(study: Study, out: Path) -> str:
    key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:8]
    return f"qklab.{study.name}.{key}"


def _command(*cmd: str, timeout: float = 60) -> str:
    """A Slurm command's stdout; one line (ConfigError) when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"--executor slurm: no {cmd[0]} on PATH; run this on a Slurm login node (or use "
                          "--executor local)")
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{cmd[0]} did not answer within {timeout:.0f} s; is slurmctld up? (scontrol ping)") from None
    if p.returncode != 0:
        msg = " ".join((p.stderr or p.stdout).split()) or f"exit code {p.returncode}"
        raise ConfigError(f"{cmd[0]} failed: {msg}")
    return p.stdout


def live_tasks(study: Study, out: Path) -> dict[str, LiveTask]:
    """The study's queued and running array tasks (squeue), by cell id."""
    text = _command("squeue", "--noheader", "--array", f"--user={getpass.getuser()}",
                    f"--name={job_name(study, out)}", "--format=%F|%K|%T|%N|%r|%k")
    manifests: dict[str, list[str]] = {}
    tasks: dict[str, LiveTask] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 5)
        if len(parts) != 6 or parts[2] not in LIVE_STATES or not parts[1].isdigit():
            continue
        job, index, state, node, reason, comment = parts
        path = slurm_dir(out) / Path(comment).name
        if comment not in manifests:
            try:
                manifests[comment] = cell_ids(path)
            except (OSError, ValueError, KeyError):
                manifests[comment] = []
        ids = manifests[comment]
        if int(index) < len(ids):
            cell = ids[int(index)]
            tasks[cell] = LiveTask(cell, f"{job}_{index}", state, node, reason)
    return tasks


class SubmitLock:
    """``<out>/slurm/submit.lock``: one submitting shell at a time; a second waits (up to ``wait_s``)."""

    def __init__(self, out: Path, wait_s: float = 300) -> None:
        path = slurm_dir(out) / "submit.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        end = time.time() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.time() > end:
                    os.close(self.fd)
                    raise ConfigError(f"another qklab is submitting this study ({path}) for over {wait_s:.0f} s; "
                                      "try again when it is done") from None
                time.sleep(0.2)

    def __enter__(self) -> SubmitLock:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def submit_study(study: Study, out: Path, results: Path, opts: SlurmOptions, threads: int | None = None,
                 log=print, warn=print, code=None) -> Submission:
    """Submit every cell that is neither done nor queued nor running, one array task each (cells that run
    several processes in an array of their own). The study is registered first (study.json: design and
    plan, as a local run does); the data of each distinct data config is prepared here, once, before any
    task starts. ``code``: the code version the results record (default: this checkout's)."""
    from qklab.study.runner import pending, prepare_cells, record_code, study_locks
    from qklab.version import code_version

    out, results = Path(out), Path(results)
    sub = Submission()
    with SubmitLock(out), study_locks(study, out, results):
        (out / "logs").mkdir(parents=True, exist_ok=True)
        sub.outcome, todo = pending(study, results, log, warn)
        sub.live = live_tasks(study, out)
        todo = [c for c in todo if c.id not in sub.live]
        if sub.live:
            log(f"  {len(sub.live)} cell(s) queued or running on Slurm already: not submitted again")
        if not todo:
            return sub
        rec = record_code(code if code is not None else code_version(), results)
        runnable = prepare_cells(study, todo, out, results, sub.outcome, rec, log)
        groups = [[c for c in runnable if (c.cfg.train.parallel == "none") == plain] for plain in (True, False)]
        for cells, parallel in zip(groups, (False, True), strict=True):
            for i in range(0, len(cells), ARRAY_MAX):  # Slurm's MaxArraySize: 1001 by default
                _submit_array(study, out, results, opts, cells[i:i + ARRAY_MAX], parallel, threads, rec, sub, log)
    return sub


def _submit_array(study: Study, out: Path, results: Path, opts: SlurmOptions, cells: list[Cell], parallel: bool,
                  threads: int | None, code: dict, sub: Submission, log) -> None:
    folder = slurm_dir(out)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{len(sub.jobs)}"
    manifest = (folder / f"{name}.json").resolve()
    procs = opts.processes() if parallel else 1
    nodes = opts.nodes if parallel else 1
    write_manifest(manifest, Manifest(study.name, out.resolve(), results.resolve(),
                                      threads or max(1, opts.cpus // procs), study.protocol.probe, code, cells))
    lines = header(opts, job_name(study, out), len(cells), (folder / "logs" / "%A_%a.log").resolve(),
                   manifest.name, Path.cwd(), nodes)
    script = folder / f"{name}.sh"
    script.write_text(batch_script(opts, lines, manifest, parallel, nodes))
    t0 = time.perf_counter()
    job = _command("sbatch", "--parsable", str(script)).strip().split(";")[0]
    seconds = time.perf_counter() - t0
    sub.jobs.append(job)
    sub.cells += [c.id for c in cells]
    sub.seconds += seconds
    with open(folder / "submissions.jsonl", "a") as f:
        f.write(json.dumps({"job": job, "manifest": manifest.name, "cells": [c.id for c in cells],
                            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sbatch_seconds": seconds}) + "\n")
    log(f"  submitted {len(cells)} cell(s) as job array {job}" + (" (torchrun in each task)" if parallel else ""))


def last_tasks(out: Path) -> dict[str, str]:
    """Each cell's latest submitted task, "<job>_<index>", from submissions.jsonl."""
    found: dict[str, str] = {}
    try:
        lines = (slurm_dir(out) / "submissions.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            rec = json.loads(line)
            found.update({c: f"{rec['job']}_{i}" for i, c in enumerate(rec["cells"])})
        except (ValueError, KeyError, TypeError):
            continue
    return found


def task_log(out: Path, task: str) -> Path:
    return slurm_dir(out) / "logs" / f"{task}.log"


def cancel_study(study: Study, out: Path) -> dict[str, LiveTask]:
    """scancel every queued or running task of the study; each running cell gets SIGTERM (a checkpoint at
    its next step) and Slurm's KillWait before SIGKILL. Checkpoints and results stay."""
    live = live_tasks(study, out)
    if live:
        _command("scancel", f"--user={getpass.getuser()}", f"--name={job_name(study, out)}")
    return live


def follow(study: Study, out: Path, results: Path, log=print, poll_s: float = 1.0, most_s: float = 30.0) -> None:
    """Until the study has no queued or running task: a line whenever the counts change. squeue is asked
    every ``poll_s`` seconds at first, less often (up to ``most_s``) while nothing changes."""
    from qklab.study.runner import cell_status

    last, wait = None, poll_s
    while True:
        live = live_tasks(study, out)
        done = sum(cell_status(c, results)[0] == "done" for c in study.cells)
        failed = sum((read_result(results / c.id / "result.json") or {}).get("status") == "failed"
                     for c in study.cells if c.id not in live)
        running = sum(t.state == "RUNNING" for t in live.values())
        now = (done, failed, running, len(live) - running)
        if now != last:
            log(f"  {time.strftime('%H:%M:%S')} {study.name}: {done}/{len(study.cells)} done, {failed} failed, "
                f"{running} running, {len(live) - running} queued")
            last, wait = now, poll_s
        if not live:
            return
        time.sleep(wait)
        wait = min(wait * 1.5, most_s)
