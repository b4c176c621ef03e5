"""Tiny studies for the cluster tests, the ``qklab`` command in a subprocess (with the test cluster's
SLURM_CONF), waiting on files and squeue, and comparing result files number for number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qklab.study.result import read_result

CELL = {"train.lr": 1e-2, "train.diag_every": 0, "data.max_files": 20}


def study_file(tmp: Path, name: str, steps: int, variants: dict[str, dict], seeds=(0,), every: int = 10,
               ckpt_every: int = 10) -> Path:
    sets = {**CELL, "train.steps": steps, "train.eval_every": every, "train.ckpt_every": ckpt_every,
            "data.cache_dir": str(tmp / "cache")}
    lines = ["[study]", f'name = "{name}"', 'config = "tiny"', f"seeds = {list(seeds)}", "[study.set]",
             *(f'"{k}" = {json.dumps(v)}' for k, v in sets.items())]
    for label, keys in variants.items():
        lines += [f"[variants.{label}]", *(f'"{k}" = {json.dumps(v)}' for k, v in keys.items())]
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def qklab(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKLAB_ALLOW_DIRTY": "1"}
    return subprocess.run([sys.executable, "-m", "qklab", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def wait_for(cond, timeout: float, what: str, every: float = 0.2):
    end = time.time() + timeout
    while time.time() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def squeue(cluster, *extra: str) -> list[list[str]]:
    """The cluster's array tasks: [job_index, state, reason] each."""
    out = cluster.run("squeue", "-h", "-r", "-o", "%i|%T|%r", *extra).stdout
    return [line.split("|") for line in out.split()]


def same_numbers(a: dict, b: dict) -> None:
    """Two results of one cell agree number for number: every final value and every curve."""
    assert a["status"] == b["status"] == "ok", (a.get("failure"), b.get("failure"))
    assert a["cell_hash"] == b["cell_hash"]
    for key in ("final", "curves"):  # as JSON: NaN (a measurement switched off) equals NaN, floats exactly
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key


def result(results: Path, cell: str) -> dict | None:
    return read_result(results / cell / "result.json")
