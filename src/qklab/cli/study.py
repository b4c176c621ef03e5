"""``qklab study run|status|cancel FILE``: the command-line side of studies (the CLI module stays thin; the
Slurm executor's side is ``cli/cluster.py``).

``qklab study run`` from a checkout with uncommitted changes to tracked files is refused (one line, exit 2)
unless ``--allow-dirty`` (or ``QKLAB_ALLOW_DIRTY=1``) is given; then the diff is stored with the results.
``qklab demo`` and ``qklab sweep`` (quick jobs) record the code version the same way but never refuse.
Outside a git checkout (an installed wheel) the commit is "unknown" and nothing is refused."""

from __future__ import annotations

import argparse
import signal
import sys
from collections import Counter
from pathlib import Path

from qklab.config import ConfigError, packaged, resolve_named_file
from qklab.rundir.checkpoint import complete_checkpoints, step_of
from qklab.rundir.folder import lock_holder
from qklab.rundir.metrics import last_step
from qklab.study.result import cell_outcome, read_result
from qklab.study.runner import cell_status, expected_cost, reusable, reuse_index, run_study
from qklab.study.spec import Cell, Study, group_id, load_study
from qklab.study.workers import Outcome
from qklab.version import allow_dirty_env

STUDY_DIR = packaged("studies")


def resolve_study(spec: str) -> Path:
    """'demo', 'studies/demo.toml' or any path -> an existing study file."""
    return resolve_named_file(spec, STUDY_DIR, "study", "study")


def warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def folder(path: str | Path, option: str) -> Path:
    """``path`` as a folder a study writes or reads; one line (exit 2) when a file stands there."""
    p = Path(path)
    for above in (p, *p.parents):
        if above.exists() and not above.is_dir():
            where = f"{option} {path} is" if above == p else f"{option} {path}: {above} is"
            raise ConfigError(f"{where} a file, not a folder; give the folder that holds (or will hold) the study's "
                              + ("runs" if option == "--out" else "<cell>/result.json files"))
    return p


def workers_for(study: Study, n: int | None) -> int:
    """--workers N, else the study's ``[study] workers``."""
    w = n if n is not None else study.workers
    if type(w) is not int or w < 0:
        raise ConfigError(f"--workers {w}: use 0 (in this process), 1 or more")
    return w


def run_and_report(study: Study, out: str | Path | None, results: str | Path | None, workers: int,
                   report: bool = True, threads: int | None = None,
                   allow_dirty: bool = True) -> tuple[Outcome, Path | None]:
    out = Path(out or Path("runs") / "studies" / study.name)
    results = Path(results) if results else out / "results"
    outcome = run_study(study, out, results, workers=workers, threads=threads, warn=warn, allow_dirty=allow_dirty)
    path = None
    if report and outcome.results and outcome.signal is None:
        from qklab.report import write_report

        path = write_report([results], out=out / "report", title=f"qklab study: {study.name}")
        print(f"report: {path / 'report.html'}")
    return outcome, path


def exit_code(study: Study, outcome: Outcome) -> int:
    """The exit code of a study run (README): 128 + N stopped by signal N; 2 cells held by another process
    (one line naming it); 1 a cell stopped on its own, or failed; 0 every cell done."""
    if outcome.signal is not None:
        print(f"qklab: study {study.name} stopped by {signal.Signals(outcome.signal).name}: "
              f"{len(outcome.stopped)} cell(s) stopped after a checkpoint, {len(outcome.not_started)} not started; "
              "run the same command to continue", file=sys.stderr)
        return 128 + outcome.signal
    if outcome.stopped:
        print(f"qklab: study {study.name} stopped: {len(outcome.stopped)} cell(s) stopped by a signal, "
              f"{len(outcome.not_started)} not started; run the same command to continue", file=sys.stderr)
        return 1
    if outcome.busy:
        held = ", ".join(f"{c} (pid {outcome.holders.get(c, 'unknown')})" for c in outcome.busy[:3])
        print(f"qklab: error: {len(outcome.busy)} cell(s) not run, their run folders are held by another process: "
              f"{held}{', ...' if len(outcome.busy) > 3 else ''}; run the same command once it has finished",
              file=sys.stderr)
        return 2
    return 1 if outcome.counts()["failed"] else 0


def time_left(spent: float, cost_done: float, cost_left: float, workers: int) -> str:
    """"; 3.1 h of cells so far, about 9.8 h left at that pace (2 at a time)": the finished cells' wall
    time (each measured while ``workers`` ran together) scaled by the cost (``expected_cost``) of the cells
    left; "" before a cell has finished or when none is left."""
    if cost_done <= 0 or cost_left <= 0:
        return ""
    left = spent / cost_done * cost_left / workers
    return (f"; {spent / 3600:.1f} h of cells so far, about {left / 3600:.1f} h left at that pace "
            f"({workers} at a time)")


def _status(study: Study, results: Path, out: Path, workers: int, summary: bool = False) -> int:
    from qklab.cli.cluster import slurm_view

    index = reuse_index(study.protocol.reuse, warn)
    done = n_reuse = 0
    pace = [0.0, 0.0, 0.0]  # seconds of the finished cells, their cost, the cost of the cells to train
    slurm = slurm_view(study, out)  # a study submitted to Slurm: its live tasks too
    if slurm is not None and slurm.problem:
        warn(f"warning: the Slurm state is unknown ({slurm.problem}); showing the results folder alone")
    groups: dict[str, Counter] = {}  # --summary: each variant and grid point, its cells by status
    for c in study.cells:
        status, res = cell_status(c, results, warn)
        detail = (res or {}).get("status", "") if status != "done" else str(cell_outcome(res))
        src = reusable(c, study, index) if status not in ("done",) else None
        if src is not None:
            status, detail, n_reuse = "reuse", f"from {src[0]} ({src[1]['status']})", n_reuse + 1
        seen = slurm.cell(c.id, status, res) if slurm is not None else local_progress(c, out, status)
        if seen is not None:
            status, detail = seen
        done += status == "done"
        seconds = res.get("seconds") if status == "done" and not res.get("reused_from") else None
        if isinstance(seconds, int | float) and seconds > 0:
            pace[0], pace[1] = pace[0] + seconds, pace[1] + expected_cost(c)
        elif status not in ("done", "reuse"):
            pace[2] += expected_cost(c)
        if summary:
            groups.setdefault(group_id(c.variant, c.point), Counter())[status] += 1
        else:
            print(f"{c.id:<40} {status:<6} {detail}")
    if summary:
        print_counts(groups)
    print(f"{study.name}: {done}/{len(study.cells)} cells done" + (f", {n_reuse} to reuse" if n_reuse else "")
          + f"; results in {results}" + time_left(*pace, max(workers, 1)))
    print(plan_status(study, results))
    return 0


def local_progress(c: Cell, out: Path, status: str) -> tuple[str, str] | None:
    """A cell not done, as its run folder in ``out`` shows it: ('running', 'pid N, step S of T') while a
    process holds the folder, ('todo', 'checkpoint at step S of T') when it has one of its own config (the
    next run resumes there); None otherwise."""
    if status != "todo":
        return None
    run, steps = out / "cells" / c.id, c.cfg.train.steps
    pid = lock_holder(run)
    if pid is not None:
        step = last_step(run / "metrics.jsonl")
        return "running", f"pid {pid}, " + (f"step {step} of {steps}" if step is not None else "starting")
    started = read_result(run / "cell.json") or {}
    ckpts = complete_checkpoints(run / "ckpt") if started.get("cell_hash") in (c.hash, c.legacy_hash) else []
    return ("todo", f"checkpoint at step {step_of(ckpts[-1])} of {steps}") if ckpts else None


def print_counts(groups: dict[str, Counter]) -> None:
    """One row per group (variant and grid point): its cells, then how many are in each status, done first."""
    states = sorted({s for n in groups.values() for s in n}, key=lambda s: (s != "done", s))
    width = max(len("group"), *(len(g) for g in groups))
    print(f"{'group':<{width}} {'cells':>5} " + " ".join(f"{s:>7}" for s in states))
    for g, n in groups.items():
        print(f"{g:<{width}} {n.total():>5} " + " ".join(f"{n[s]:>7}" for s in states))


def plan_status(study: Study, results: Path) -> str:
    """One line: the registered plan (hash, time, amendments) and design against the study file's."""
    from qklab.study.plan import design_drift, plan_hash, stored_plan
    from qklab.study.result import read_json
    from qklab.study.runner import n_results, recorded

    data, problem = read_json(results / "study.json")
    data = data if problem is None and isinstance(data, dict) else {}
    n = n_results(results)
    rec, file_hash = data.get("plan") or {}, plan_hash(study.plan)
    amended = len(data.get("plan_history") or [])
    if not rec and file_hash is None:
        return "plan: no claims registered (every claim of its report is exploratory)"
    if not rec:
        return ("plan: the file's [claims] are not registered yet; the next run registers them before its first "
                "cell" if n == 0 else "plan: the file registers claims after results; a run is "
                "refused until qklab study amend records it")
    same = plan_hash(stored_plan(data)) == file_hash
    moved = design_drift(data, recorded(study), n)
    return (f"plan: {len(rec.get('claims', {}))} claim(s) registered {rec.get('registered', '?')} "
            f"(sha256 {str(rec.get('sha256'))[:12]})" + (f", amended {amended} time(s)" if amended else "")
            + ("; the file's [claims] match it" if same else
               "; the file's [claims] differ: a run is refused until qklab study amend records the change")
            + (f"; the file's design differs ({', '.join(moved)}): a run is refused until qklab study amend "
               "records the change" if moved else ""))


def _verify(args: argparse.Namespace) -> int:
    """``qklab study verify DIR``: 0 every retrained cell identical, 1 one differs (each named, one line)."""
    from qklab.study.verify import verify_results

    verdicts = verify_results(Path(args.file), cells=getattr(args, "cells", 1), seed=getattr(args, "seed", None),
                              out=Path(args.out) if args.out else None, warn=warn,
                              variants=[v for v in (getattr(args, "variant", None) or "").split(",") if v] or None,
                              same_machine=getattr(args, "same_machine", False))
    bad = [v.cell for v in verdicts if not v.same]
    if bad:
        print(f"qklab: verify: {len(bad)} of {len(verdicts)} cell(s) differ from their committed result: "
              f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}", file=sys.stderr)
        return 1
    print(f"verified: {len(verdicts)} cell(s) of {args.file} retrained bit for bit")
    return 0


def _amend(study: Study, results: Path, why: str | None) -> int:
    from qklab.study.runner import amend_plan

    if why is None:
        raise ConfigError("amend needs --why \"...\": the reason the registered claims or design change")
    data = amend_plan(study, results, why)
    entry = data["plan_history"][-1]
    old, new = (entry.get(k) or {} for k in ("old", "new"))
    moved = (entry.get("design") or {}).get("changed")
    print(f"amended the plan of {study.name} in {results / 'study.json'}: {len(old.get('claims', {}))} -> "
          f"{len(new.get('claims', {}))} registered claim(s)"
          + (f", design changed ({', '.join(moved)})" if moved else "")
          + f", {len(data['plan_history'])} amendment(s) on record")
    return 0


def study_command(args: argparse.Namespace) -> int:
    if args.action == "verify":
        return _verify(args)
    study = load_study(resolve_study(args.file), note=warn)
    out = folder(args.out or Path("runs") / "studies" / study.name, "--out")
    results = folder(args.results, "--results") if args.results else folder(out / "results", "--out")
    if args.action == "status":
        return _status(study, results, out, workers_for(study, args.workers), getattr(args, "summary", False))
    if args.action == "amend":
        return _amend(study, results, getattr(args, "why", None))
    from qklab.cli import cluster

    if args.action == "cancel":
        return cluster.slurm_cancel(study, out)
    if getattr(args, "executor", "local") == "slurm":
        return cluster.slurm_run(study, out, results, args)
    cluster.refuse_local_if_live(study, out)
    allow_dirty = getattr(args, "allow_dirty", False) or allow_dirty_env()
    outcome, _ = run_and_report(study, out, results, workers_for(study, args.workers), report=not args.no_report,
                                threads=getattr(args, "threads", None), allow_dirty=allow_dirty)
    return exit_code(study, outcome)
