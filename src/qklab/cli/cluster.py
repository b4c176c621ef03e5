"""The Slurm side of ``qklab study``: ``run --executor slurm [--cluster FILE] [--slurm KEY=VALUE] [--wait]``,
``cancel``, and what ``status`` adds for a study that has been submitted (its live tasks, the Slurm log
of a cell whose task ended without a result)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from qklab.config import ConfigError
from qklab.study.result import read_result
from qklab.study.spec import Study


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def slurm_run(study: Study, out: Path, results: Path, args) -> int:
    """Submit the study's pending cells; with ``--wait`` follow them to the end (exit 0 when every cell is
    done, 1 otherwise), else return at once and say how to follow."""
    from qklab.study.cluster import load_options
    from qklab.study.slurm import follow, submit_study
    from qklab.version import allow_dirty_env, code_version

    opts = load_options(args.cluster, args.slurm)
    code = code_version()
    if code.dirty and not (getattr(args, "allow_dirty", False) or allow_dirty_env()):
        raise ConfigError(f"the checkout {code.root} has uncommitted changes to tracked files (git diff HEAD); "
                          "commit them, or pass --allow-dirty to record the diff with the results")
    sub = submit_study(study, out, results, opts, threads=getattr(args, "threads", None), warn=_warn, code=code)
    where = _where(args)
    if not sub.cells and not sub.live:
        print(f"study {study.name}: nothing to submit; {len(sub.outcome.skipped)}/{len(study.cells)} cells done")
    elif not sub.cells:
        print(f"study {study.name}: nothing new to submit; {len(sub.live)} cell(s) queued or running")
    else:
        print(f"study {study.name}: {len(sub.cells)} cell(s) submitted (job {', '.join(sub.jobs)}; sbatch "
              f"{sub.seconds:.2f} s)")
    if not args.wait:
        print(f"follow: qklab study status {where}   (or --wait; cancel: qklab study cancel {where})")
        return 0
    follow(study, out, results)
    left = [c.id for c in study.cells if (read_result(results / c.id / "result.json") or {}).get("status")
            not in ("ok", "diverged")]
    print(f"study {study.name}: {len(study.cells) - len(left)}/{len(study.cells)} cells done; results in {results}"
          + (f"; not done: {', '.join(left[:5])}{', ...' if len(left) > 5 else ''} (qklab study status {where})"
             if left else ""))
    return 1 if left else 0


def _where(args) -> str:
    """The study file and folder options, as the user gave them (for the follow-up commands)."""
    parts = [args.file] + [x for opt in ("out", "results") if getattr(args, opt, None)
                           for x in (f"--{opt}", getattr(args, opt))]
    return " ".join(shlex.quote(str(p)) for p in parts)


def slurm_cancel(study: Study, out: Path) -> int:
    from qklab.study.slurm import cancel_study

    if not (out / "slurm").is_dir():
        print(f"study {study.name}: never submitted to Slurm from {out}; nothing to cancel")
        return 0
    gone = cancel_study(study, out)
    running = sum(t.state == "RUNNING" for t in gone.values())
    print(f"study {study.name}: cancelled {len(gone)} task(s) ({running} running: each stops after a checkpoint, "
          "queued ones never start); checkpoints and results are kept, and the next study run resubmits them")
    return 0


class SlurmView:
    """What ``study status`` adds for a submitted study: its live tasks and each cell's last task."""

    def __init__(self, study: Study, out: Path) -> None:
        from qklab.study.slurm import last_tasks, live_tasks

        self.out, self.live, self.last, self.problem = out, {}, last_tasks(out), None
        try:
            self.live = live_tasks(study, out)
        except ConfigError as e:
            self.problem = str(e)

    def cell(self, cell_id: str, status: str, res: dict | None) -> tuple[str, str] | None:
        """(status, detail) for a cell Slurm has a word on, else None."""
        from qklab.study.slurm import task_log

        if cell_id in self.live and status != "done":
            t = self.live[cell_id]
            return ("run" if t.state == "RUNNING" else "queued"), t.line()
        task = self.last.get(cell_id)
        if task is None or status == "done":
            return None
        log = task_log(self.out, task)
        if (res or {}).get("status") == "failed":
            return "failed", f"{res.get('failure')} (log: {res.get('log')}; Slurm log: {log})"
        return "todo", f"task {task} ended without a result; the next run resubmits it (Slurm log: {log})"


def slurm_view(study: Study, out: Path) -> SlurmView | None:
    return SlurmView(study, out) if (out / "slurm" / "submissions.jsonl").is_file() else None


def refuse_local_if_live(study: Study, out: Path) -> None:
    """A local run of a study whose cells are queued or running on Slurm would train them twice: refused."""
    view = slurm_view(study, out)
    if view is not None and view.live:
        raise ConfigError(f"study {study.name} has {len(view.live)} cell(s) queued or running on Slurm; wait for "
                          "them (qklab study status) or cancel them (qklab study cancel) before a local run")
