"""``qklab study run|status FILE``: the command-line side of studies (the CLI module stays thin)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qklab.config import ConfigError, packaged, resolve_named_file
from qklab.study.runner import Outcome, cell_status, reusable, reuse_index, run_study
from qklab.study.spec import Study, load_study

STUDY_DIR = packaged("studies")


def resolve_study(spec: str) -> Path:
    """'demo', 'studies/demo.toml' or any path -> an existing study file."""
    return resolve_named_file(spec, STUDY_DIR, "study", "study")


def workers_for(study: Study, n: int | None) -> int:
    """--workers N, else the study's ``[study] workers``."""
    w = n if n is not None else study.workers
    if w < 0:
        raise ConfigError(f"--workers {w}: use 0 (in this process), 1 or more")
    return w


def run_and_report(study: Study, out: str | Path | None, results: str | Path | None, workers: int,
                   report: bool = True) -> tuple[Outcome, Path | None]:
    out = Path(out or Path("runs") / "studies" / study.name)
    results = Path(results) if results else out / "results"
    outcome = run_study(study, out, results, workers=workers)
    path = None
    if report and outcome.results:
        from qklab.report import write_report

        path = write_report([results], out=out / "report", title=f"qklab study: {study.name}")
        print(f"report: {path / 'report.html'}")
    return outcome, path


def study_command(args: argparse.Namespace) -> int:
    study = load_study(resolve_study(args.file))
    out = Path(args.out or Path("runs") / "studies" / study.name)
    results = Path(args.results) if args.results else out / "results"
    if args.action == "status":
        index = reuse_index(study.protocol.reuse)
        rows = [(c.id, cell_status(c, results)) for c in study.cells]
        n_reuse = 0
        for c, (cid, (status, res)) in zip(study.cells, rows, strict=True):
            detail = (res or {}).get("status", "") if status != "done" else res["status"]
            src = reusable(c, study, index) if status != "done" else None
            if src is not None:
                status, detail, n_reuse = "reuse", f"from {src[0]} ({src[1]['status']})", n_reuse + 1
            print(f"{cid:<40} {status:<6} {detail}")
        done = sum(s == "done" for _, (s, _) in rows)
        print(f"{study.name}: {done}/{len(rows)} cells done" + (f", {n_reuse} to reuse" if n_reuse else "")
              + f"; results in {results}")
        return 0
    outcome, _ = run_and_report(study, out, results, workers_for(study, args.workers), report=not args.no_report)
    if outcome.stopped:
        print(f"qklab: study {study.name} stopped: {len(outcome.stopped)} cell(s) stopped by a signal, "
              f"{len(outcome.not_started)} not started; run the same command to continue", file=sys.stderr)
        return 1
    return 1 if outcome.counts()["failed"] else 0
