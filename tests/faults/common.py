"""Shared pieces of the fault-injection suite: the run every fault is measured against, ways to run
``qklab train`` in this process or in a child, and the check that a recovered run lost nothing."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from qklab.cli import main
from qklab.rundir.checkpoint import latest_checkpoint
from qklab.rundir.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


@dataclass
class Ledger:
    """What the suite did, for its summary line."""

    injected: int = 0
    recovered: int = 0
    lost: int = 0
    fuzzed: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"faults: {self.injected} injected, {self.recovered} runs recovered, {self.lost} data lost; "
                f"{self.fuzzed} fuzzed configs and argument lists, each a valid run or one line with exit 2")


LEDGER = Ledger()


def sets(root: Path, name: str, *extra: str) -> list[str]:
    """``--set`` values of a short tiny run under ``root`` (one thread: bitwise equal across processes)."""
    vals = [f"train.out_dir='{root / 'runs'}'", f"train.name={name}", f"train.steps={STEPS}", "train.log_every=1",
            "train.eval_every=10", "train.ckpt_every=10", "train.keep_ckpts=3", "train.diag_every=0",
            "train.threads=1", "train.progress=false", f"data.cache_dir='{root.parent / 'cache'}'", *extra]
    return [a for v in vals for a in ("--set", v)]


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]


def cli(*argv: str) -> Result:
    """``qklab <argv>`` in this process, its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 2
    return Result(code, out.getvalue(), err.getvalue())


def child(argv: list[str], prelude: str = "") -> subprocess.Popen:
    """``qklab <argv>`` in a child process; ``prelude`` (Python) runs first, e.g. to plant a slow write."""
    code = f"import sys\n{prelude}\nfrom qklab.cli import main\nsys.exit(main({argv!r}))\n"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep PYTHONPATH=src
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,  # SIGINT handled as in a terminal, even
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # under `nohup &`


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Block until the run has logged ``step`` (or the child has ended)."""
    t0 = time.monotonic()
    path = run_dir / "metrics.jsonl"
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if path.exists() and any(r.get("step", -1) >= step for r in read_metrics(path)):
            return
        time.sleep(0.02)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ck = latest_checkpoint(run_dir / "ckpt")
    assert ck is not None and ck.name == f"step_{STEPS:07d}", ck
    return load_file(str(ck / "model.safetensors"))


def same_as_reference(run_dir: Path, ref: Path) -> bool:
    """The recovered run reads as if nothing had happened: every step's loss once and equal (bitwise), the
    same final weights. Counted in the ledger either way."""
    try:
        recs = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
        a, b = final_weights(run_dir), final_weights(ref)
        ok = (recs == list(range(1, STEPS + 1)) and losses(run_dir) == losses(ref) and a.keys() == b.keys()
              and all(torch.equal(a[k], b[k]) for k in a))
    except (AssertionError, OSError, KeyError):
        ok = False
    LEDGER.recovered += ok
    LEDGER.lost += not ok
    return ok


def copy_run(src: Path, root: Path, name: str) -> Path:
    dst = root / "runs" / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst
