"""Faults against ``qklab study run``: SIGKILL and SIGTERM of the study process (no worker outlives it,
nothing committed is lost, a re-run completes), a config-hash change under SIGTERM (every committed result
kept until its successor replaces it), and two study processes on one results folder (the second refused
in one line, before it writes anything)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from qklab.rundir.folder import LOCK, RunLock
from qklab.study.result import read_result, write_json_atomic
from tests.faults.common import LEDGER, ROOT, cli

STEPS_LONG = 400  # long enough to be stopped twice, short enough to finish in seconds

STUDY = """
[study]
name = "{name}"
config = "tiny"
seeds = [0]
[study.set]
"train.steps" = {steps}
"train.log_every" = 1
"train.eval_every" = {steps}
"train.ckpt_every" = 10
"train.diag_every" = 0
"data.cache_dir" = "{cache}"
"""


def study_file(root: Path, cache: Path, variants: list[str], steps: int, name: str = "fs") -> Path:
    f = root / f"{name}.toml"
    f.write_text(STUDY.format(name=name, steps=steps, cache=cache) + "".join(
        f'[variants.{v}]\n"model.qk_init_std" = {0.02 + 0.001 * i}\n' for i, v in enumerate(variants)))
    return f


def study_child(argv: list[str]) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "qklab", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (workers, the fork server, the resource tracker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids: set[int]) -> set[int]:
    gone = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            gone.add(p)
            continue
        if state == "Z":
            gone.add(p)
    return pids - gone


def wait_gone(pids: set[int], timeout: float = 90.0) -> set[int]:
    t0 = time.monotonic()
    while alive(pids) and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    return alive(pids)


def wait_for(cond, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def logged(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in p.read_text().splitlines() if x.strip().startswith("{")]
    return max(steps, default=0)


def test_sigkill_of_the_study_leaves_no_worker_and_a_second_study_is_refused(root):
    """SIGKILL of the study process: its worker, fork server and resource tracker all end (the worker after
    a checkpoint); meanwhile a second study on the same results folder is refused in one line; a re-run
    resumes the cell and completes."""
    f = study_file(root, root.parent / "cache", ["a"], steps=STEPS_LONG)
    out, res = root / "o", root / "res"
    proc = study_child(["study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "1",
                        "--threads", "1", "--no-report"])
    cell = out / "cells" / "a_lr1_s0"
    wait_for(lambda: list((cell / "ckpt").glob("step_*")), proc)
    # a second study process on the same results folder (another --out): refused before it writes anything
    second = cli("study", "run", str(f), "--out", str(root / "o2"), "--results", str(res), "--workers", "0")
    assert second.code == 2 and len(second.err_lines) == 1, second.err
    assert f"results folder {res} is in use by another qklab study run (pid {proc.pid})" in second.err_lines[0]
    assert not (root / "o2" / "cells").exists()
    LEDGER.injected += 1
    below = descendants(proc.pid)
    worker = int((cell / LOCK).read_text())
    assert worker in below and len(below) >= 2, below  # the worker and at least the fork server
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = wait_gone(below)
    assert not left, f"processes outlived the study: {left}"
    RunLock(cell).release()  # nobody holds the cell any more
    LEDGER.injected += 1
    stopped_at = logged(cell)
    assert stopped_at < STEPS_LONG and "the study process is gone" in (out / "logs" / "a_lr1_s0.log").read_text()
    again = study_child(["study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "1",
                         "--threads", "1", "--no-report"])
    wait_for(lambda: logged(cell) > stopped_at + 5, again)
    again.send_signal(signal.SIGTERM)  # the rest of the proof: a SIGTERM'd study exits 143 with its own line
    _, err = again.communicate(timeout=120)
    assert again.returncode == 143, err
    assert err.strip().splitlines()[-1] == ("qklab: study fs stopped by SIGTERM: 1 cell(s) stopped after a "
                                            "checkpoint, 0 not started; run the same command to continue")
    assert "--resume" not in err
    assert not (res / "a_lr1_s0" / "result.json").exists()
    ok = cli("study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "0", "--no-report")
    # (in this process: the last steps only)
    assert ok.code == 0, ok.err
    r = read_result(res / "a_lr1_s0" / "result.json")
    assert r["status"] == "ok" and r["final"]["step"] == STEPS_LONG
    assert "resumed" in (out / "logs" / "a_lr1_s0.log").read_text() or "resumed" in ok.out
    LEDGER.recovered += 2


def test_a_hash_change_under_sigterm_loses_no_result(root):
    """Every committed result names another config (the hash rule changed); `study run` is stopped by
    SIGTERM while its first cells train: all six results are still there (the old ones, or a successor),
    no worker is left, and a re-run replaces them all."""
    variants = [f"v{i}" for i in range(6)]
    f = study_file(root, root.parent / "cache", variants, steps=40)
    out, res = root / "o", root / "res"
    first = cli("study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "0", "--threads", "1",
                "--no-report")
    assert first.code == 0, first.err
    ids = [f"{v}_lr1_s0" for v in variants]
    for cid in ids:
        r = read_result(res / cid / "result.json")
        r["cell_hash"] = "0" * 16
        write_json_atomic(res / cid / "result.json", r)
    import shutil

    shutil.rmtree(out)  # no checkpoints: every cell trains from the start
    proc = study_child(["study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "1",
                        "--threads", "1", "--no-report"])
    wait_for(lambda: logged(out / "cells" / ids[0]) >= 5 or logged(out / "cells" / ids[1]) >= 5, proc)
    below = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    LEDGER.injected += 1
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1] and "--resume" not in err
    assert not wait_gone(below)
    hashes = [read_result(res / cid / "result.json")["cell_hash"] for cid in ids]  # every one still there
    assert hashes.count("0" * 16) >= 4, hashes  # the cells not reached keep their committed result
    lost = sum(h is None for h in hashes)
    LEDGER.lost += lost
    assert not lost
    again = cli("study", "run", str(f), "--out", str(out), "--results", str(res), "--workers", "0", "--threads", "1",
                "--no-report")
    assert again.code == 0, again.err
    assert all(read_result(res / cid / "result.json")["cell_hash"] != "0" * 16 for cid in ids)
    LEDGER.recovered += 1


def test_a_study_of_another_name_is_refused_on_these_results(root):
    f = study_file(root, root.parent / "cache", ["a"], steps=2, name="other")
    res = root / "res"
    write_json_atomic(res / "study.json", {"name": "fs", "cells": ["a_lr1_s0"]})
    before = (res / "study.json").read_bytes()
    r = cli("study", "run", str(f), "--out", str(root / "o"), "--results", str(res), "--workers", "0")
    LEDGER.injected += 1
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert "holds the results of study 'fs'" in r.err_lines[0]
    assert (res / "study.json").read_bytes() == before and not (root / "o" / "cells").exists()
    LEDGER.recovered += 1
