"""``qklab study run --executor slurm`` against a real one-node Slurm (the ``slurm`` fixture): the same result
files as a local run, number for number; one submission per pending cell, even from two shells at once;
``study status`` and ``study cancel``; a failing cell and a task that ends without a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from qklab.study.runner import run_study
from qklab.study.spec import load_study
from tests.cluster.common import qklab, result, same_numbers, squeue, study_file, wait_for


def test_four_cells_through_slurm_equal_a_local_run(slurm, tmp_path):
    """Four tiny cells as one job array, followed with --wait: each result equals the local run's number for
    number; the registered study.json is the local one's whatever the cluster options; the submission time
    and the bytes each cell wrote are printed (docs/cluster.md quotes them)."""
    path = study_file(tmp_path, "four", 30, {"a": {"qk.method": "none"}, "b": {"qk.method": "qknorm"}}, seeds=(0, 1))
    profile = tmp_path / "cluster.toml"
    profile.write_text('cpus = 1\nmem = "2G"\ntime = "10"\nmax_running = 2\npartition = "main"\n'
                       'sbatch = ["--nice=0"]\nsetup = "export QKLAB_TEST_SETUP=1"\n')
    p = qklab("study", "run", path, "--out", tmp_path / "s", "--executor", "slurm", "--cluster", profile,
              "--slurm", "signal_before=60", "--wait", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 cell(s) submitted" in p.stdout and "4/4 cells done" in p.stdout
    script = next((tmp_path / "s" / "slurm").glob("*.sh")).read_text()
    for line in ("--array=0-3%2", "--mem=2G", "--time=10", "--partition=main", "--nice=0", "--signal=B:USR1@60",
                 "--cpus-per-task=1", "--requeue"):
        assert f"#SBATCH {line}\n" in script
    assert "export QKLAB_TEST_SETUP=1\n" in script

    study = load_study(path)
    run_study(study, tmp_path / "l", workers=1, threads=1, log=lambda s: None)
    for c in study.cells:
        same_numbers(result(tmp_path / "s" / "results", c.id), result(tmp_path / "l" / "results", c.id))
    slurm_json = json.loads((tmp_path / "s" / "results" / "study.json").read_text())
    local_json = json.loads((tmp_path / "l" / "results" / "study.json").read_text())
    assert {k: v for k, v in slurm_json.items() if k != "code"} == {k: v for k, v in local_json.items() if k != "code"}

    status = qklab("study", "status", path, "--out", tmp_path / "s")
    assert status.returncode == 0 and "four: 4/4 cells done" in status.stdout, status.stdout + status.stderr
    again = qklab("study", "run", path, "--out", tmp_path / "s", "--executor", "slurm")
    assert again.returncode == 0 and "nothing to submit; 4/4 cells done" in again.stdout
    sub = [json.loads(x) for x in (tmp_path / "s" / "slurm" / "submissions.jsonl").read_text().splitlines()]
    written = sum(f.stat().st_size for d in ("cells", "logs", "slurm/logs") for f in (tmp_path / "s" / d).rglob("*")
                  if f.is_file()) + sum(f.stat().st_size for f in (tmp_path / "s" / "results").glob("*/result.json"))
    print(json.dumps({"sbatch_seconds_per_cell": sub[0]["sbatch_seconds"] / 4, "bytes_per_cell": written / 4}))


def test_queued_study_is_submitted_once_shown_and_cancelled(slurm, tmp_path):
    """Two shells submit a held study at once: one array of 3 tasks in all. While it is queued a third run
    submits nothing; status shows each cell queued with its job; cancel empties the queue, leaves no
    result, and status then names each cell for the next run."""
    path = study_file(tmp_path, "held", 20, {"a": {"qk.method": "none"}}, seeds=(0, 1, 2))
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "qklab", "study", "run", str(path), "--out", str(out), "--executor", "slurm",
           "--slurm", "sbatch=--hold"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKLAB_ALLOW_DIRTY": "1"}
    shells = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for _ in range(2)]
    outs = [sh.communicate(timeout=120) for sh in shells]
    assert all(sh.returncode == 0 for sh in shells), outs
    tasks = squeue(slurm)
    assert len(tasks) == 3 and len({t[0].split("_")[0] for t in tasks}) == 1, tasks
    assert sorted(o[0].count("3 cell(s) submitted") for o in outs) == [0, 1], outs

    third = qklab("study", "run", path, "--out", out, "--executor", "slurm")
    assert third.returncode == 0 and "nothing new to submit; 3 cell(s) queued or running" in third.stdout
    assert len(squeue(slurm)) == 3

    status = qklab("study", "status", path, "--out", out)
    job = tasks[0][0].split("_")[0]
    for i, cell in enumerate(("a_lr1_s0", "a_lr1_s1", "a_lr1_s2")):
        line = next(x for x in status.stdout.splitlines() if x.startswith(cell))
        assert line.split()[1] == "queued" and f"job {job}_{i}" in line and "JobHeldUser" in line, status.stdout

    cancel = qklab("study", "cancel", path, "--out", out)
    assert cancel.returncode == 0 and "cancelled 3 task(s)" in cancel.stdout, cancel.stdout + cancel.stderr
    wait_for(lambda: not squeue(slurm), 30, "the cancelled tasks to leave the queue")
    assert not list((out / "results").glob("*/result.json"))
    after = qklab("study", "status", path, "--out", out)
    assert "held: 0/3 cells done" in after.stdout
    assert all("ended without a result; the next run resubmits it" in x for x in after.stdout.splitlines()
               if x.startswith("a_lr1"))


def test_a_failing_cell_and_a_task_that_ends_without_a_result(slurm, tmp_path):
    """A cell that raises is recorded as failed with its message, and status names its log and its Slurm
    log; a task whose setup line fails (as on a lost node) leaves no result: status says so, --wait exits 1,
    and the next run resubmits that cell alone."""
    path = study_file(tmp_path, "bad", 20, {"ok": {"qk.method": "none"}, "bad": {"model.vocab_size": 10}})
    out = tmp_path / "o"
    p = qklab("study", "run", path, "--out", out, "--executor", "slurm", "--wait", timeout=300)
    assert p.returncode == 1 and "1/2 cells done" in p.stdout, p.stdout + p.stderr
    bad = result(out / "results", "bad_lr1_s0")
    assert bad["status"] == "failed" and "vocab" in bad["failure"].lower()
    status = qklab("study", "status", path, "--out", out).stdout
    line = next(x for x in status.splitlines() if x.startswith("bad_lr1_s0"))
    sub = json.loads((out / "slurm" / "submissions.jsonl").read_text().splitlines()[0])
    assert line.split()[1] == "failed" and bad["failure"] in line and str(out / "logs" / "bad_lr1_s0.log") in line
    assert str(out / "slurm" / "logs" / f"{sub['job']}_{sub['cells'].index('bad_lr1_s0')}.log") in line, line

    lost = study_file(tmp_path, "lost", 20, {"a": {"qk.method": "none"}})
    p = qklab("study", "run", lost, "--out", tmp_path / "l", "--executor", "slurm", "--slurm", "setup=exit 3",
              "--wait", timeout=300)
    assert p.returncode == 1 and "0/1 cells done" in p.stdout, p.stdout + p.stderr
    status = qklab("study", "status", lost, "--out", tmp_path / "l").stdout
    assert "ended without a result; the next run resubmits it" in status, status
    p = qklab("study", "run", lost, "--out", tmp_path / "l", "--executor", "slurm", "--wait", timeout=300)
    assert p.returncode == 0 and "1 cell(s) submitted" in p.stdout and "1/1 cells done" in p.stdout
