"""Studies of tiny cells: ok, diverged, failed and data-overriding cells are recorded correctly; a re-run
skips finished cells, also from the result files alone; the sweep shorthand gives the same cells."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from qklab.cli.sweep import sweep_study
from qklab.config import ConfigError
from qklab.data import prepare_data
from qklab.study.result import read_result
from qklab.study.runner import run_study
from qklab.study.spec import parse_study

COMMON = {"train.steps": 40, "train.lr": 1e-2, "train.eval_every": 20, "train.ckpt_every": 20,
          "train.diag_every": 20, "data.max_files": 20}


def _study(tmp_path, variants, seeds=(0,), **protocol):
    raw = {"study": {"config": "tiny", "seeds": list(seeds),
                     "set": {**COMMON, "data.cache_dir": str(tmp_path / "cache")}},
           "variants": variants, "protocol": {"reference": next(iter(variants)), **protocol}}
    return parse_study(raw, "t")


def test_cells_recorded_and_rerun_skips(tmp_path):
    study = _study(tmp_path, {
        "std": {"qk.method": "none"},
        "boom": {"train.lr": 40.0},  # diverges: a result, not a failure
        "bad": {"model.vocab_size": 10},  # passes validation, raises in the worker
        "more": {"data.max_files": 25},  # its own prepared data
    })
    out, res_dir = tmp_path / "runs", tmp_path / "results"
    o = run_study(study, out, res_dir, workers=2, log=lambda s: None)
    r = {k.split("_")[0]: v for k, v in o.results.items()}
    assert r["std"]["status"] == "ok" and not r["std"]["diverged"]
    assert r["std"]["final"]["val_loss"] < r["std"]["unigram_entropy"]
    assert r["boom"]["status"] == "diverged" and r["boom"]["diverged"] and r["boom"]["divergence"]
    assert r["bad"]["status"] == "failed" and "vocab_size" in r["bad"]["failure"]
    log = (out / "logs" / "bad_lr1_s0.log").read_text()
    assert r["bad"]["log"].endswith("bad_lr1_s0.log") and "Traceback" in log
    # the data override: the cell's corpus is its own config's, not the first cell's
    more_cfg = study.cells[3].cfg
    assert r["more"]["corpus"]["sha256"] == prepare_data(more_cfg.data, log=lambda s: None).fingerprint["sha256"]
    assert r["more"]["corpus"]["files"] != r["std"]["corpus"]["files"]
    # results are data: the full config, the SHA, curves ending at the last step, per-head summaries
    std = read_result(res_dir / "std_lr1_s0" / "result.json")
    assert std["config"]["train"]["data_seed"] == 0 and std["git_sha"]
    assert std["curves"]["val"]["step"][-1] == 40 and std["final"]["step"] == 40
    assert len(std["heads"]["max_logit"]) == 2 and len(std["heads"]["max_logit"][0]) == 4  # (L, H)
    metrics = [json.loads(x) for x in (out / "cells" / "std_lr1_s0" / "metrics.jsonl").read_text().splitlines()]
    assert std["final"]["report_loss"] == pytest.approx(metrics[-1]["report_loss"])
    # re-run: only the failed cell runs again
    o2 = run_study(study, out, res_dir, workers=2, log=lambda s: None)
    assert o2.ran == ["bad_lr1_s0"] and len(o2.skipped) == 3
    # from the committed result files alone (no run folders): nothing done is retrained
    shutil.rmtree(out)
    o3 = run_study(study, tmp_path / "elsewhere", res_dir, workers=2, log=lambda s: None)
    assert o3.ran == ["bad_lr1_s0"] and sorted(o3.skipped) == sorted(o2.skipped)


def test_reuse_copies_cells_of_the_same_config_from_another_study(tmp_path, monkeypatch, capsys):
    """A width ladder whose middle width is another study's shape: those cells are copied (same config
    hash), named for this study, and not trained; the others are trained; a wrong folder is one line."""
    first = _study(tmp_path, {"std": {"qk.method": "none"}})
    run_study(first, tmp_path / "runs1", tmp_path / "res1", workers=0, log=lambda s: None)
    src = read_result(tmp_path / "res1" / "std_lr1_s0" / "result.json")
    monkeypatch.chdir(tmp_path)
    raw = {"study": {"config": "tiny", "seeds": [0], "set": {**COMMON, "data.cache_dir": str(tmp_path / "cache")}},
           "grid": {"shape": [{"model.d_model": 32}, {"model.d_model": 64}]},  # tiny is 64 wide
           "variants": {"none": {"qk.method": "none"}}, "protocol": {"reference": "none", "reuse": ["res1"]}}
    ladder = parse_study(raw, "ladder")
    copied_id = next(c.id for c in ladder.cells if dict(c.point)["shape"] == {"model.d_model": 64})
    (tmp_path / "ladder.toml").write_text(f"""[study]
config = "tiny"
seeds = [0]
[study.set]
{chr(10).join(f'"{k}" = {v!r}' for k, v in {**COMMON, "data.cache_dir": str(tmp_path / "cache")}.items())}
[grid]
shape = [{{ "model.d_model" = 32 }}, {{ "model.d_model" = 64 }}]
[variants.none]
"qk.method" = "none"
[protocol]
reference = "none"
reuse = ["res1"]
""")
    from qklab.cli import main

    assert main(["study", "status", str(tmp_path / "ladder.toml"), "--out", "runs2", "--results", "res2"]) == 0
    shown = capsys.readouterr().out
    assert f"{copied_id}" in shown and "reuse  from res1/std_lr1_s0 (ok)" in shown
    assert "ladder: 0/2 cells done, 1 to reuse" in shown
    lines: list[str] = []
    o = run_study(ladder, tmp_path / "runs2", tmp_path / "res2", workers=0, log=lines.append)
    trained_id = next(c.id for c in ladder.cells if c.id != copied_id)
    assert o.ran == [trained_id] and o.skipped == [copied_id]
    assert "1 done (1 reused from res1), 1 to run" in lines[0]
    assert not (tmp_path / "runs2" / "cells" / copied_id).exists()
    got = read_result(tmp_path / "res2" / copied_id / "result.json")
    assert got["study"] == "ladder" and got["cell"] == copied_id and got["reused_from"] == "res1/std_lr1_s0"
    assert got["point"] == {"shape": {"model.d_model": 64}} and got["variant"] == "none"
    assert got["final"] == src["final"] and got["curves"] == src["curves"] and got["cell_hash"] == src["cell_hash"]
    assert read_result(tmp_path / "res2" / trained_id / "result.json")["config"]["model"]["d_model"] == 32
    o2 = run_study(ladder, tmp_path / "runs2", tmp_path / "res2", workers=0, log=lambda s: None)
    assert o2.ran == [] and sorted(o2.skipped) == sorted([copied_id, trained_id])  # now simply done
    raw["protocol"]["reuse"] = ["res9"]
    with pytest.raises(ConfigError, match=r"\[protocol\] reuse: no result folder res9"):
        run_study(parse_study(raw, "ladder"), tmp_path / "runs3", tmp_path / "res3", workers=0, log=lambda s: None)


def test_a_second_run_of_a_running_study_is_refused_and_writes_nothing(tmp_path):
    """The first run holds the study folder's lock; a second run of the same study stops with one line
    naming the holder, before it writes any result (it used to record the first run's cells in flight as
    failed), and runs once the lock is gone."""
    from qklab.rundir.folder import RunLock

    study = _study(tmp_path, {"std": {"qk.method": "none"}})
    out, res_dir = tmp_path / "runs", tmp_path / "results"
    out.mkdir()
    held = RunLock(out)  # another process's run of this study, as the lock sees it
    with pytest.raises(ConfigError, match=rf"study t is already running in {out} \(pid {os.getpid()}\)"):
        run_study(study, out, res_dir, workers=0, log=lambda s: None)
    assert not res_dir.exists()
    held.release()
    o = run_study(study, out, res_dir, workers=0, log=lambda s: None)
    assert o.ran == ["std_lr1_s0"] and o.results["std_lr1_s0"]["status"] == "ok"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_cell_trained_by_another_process_is_busy_not_failed(tmp_path, workers):
    """A cell whose run folder another process holds (a hand-started `qklab train` there) is not run and
    gets no result, failed or other; the study goes on with the rest and a later run trains it."""
    from qklab.rundir.folder import RunLock

    study = _study(tmp_path, {"a": {"qk.method": "none"}, "b": {"qk.method": "qknorm"}})
    out, res_dir = tmp_path / "runs", tmp_path / "results"
    (out / "cells" / "a_lr1_s0").mkdir(parents=True)
    held = RunLock(out / "cells" / "a_lr1_s0")
    lines: list[str] = []
    o = run_study(study, out, res_dir, workers=workers, log=lines.append)
    assert o.busy == ["a_lr1_s0"] and list(o.results) == ["b_lr1_s0"] and o.results["b_lr1_s0"]["status"] == "ok"
    assert not (res_dir / "a_lr1_s0").exists()
    assert any(f"a_lr1_s0: not run: another process (pid {os.getpid()}) is training it" in ln for ln in lines)
    assert lines[-1].endswith("(2 run now, 0 skipped, 1 busy in another process)")
    held.release()
    o = run_study(study, out, res_dir, workers=workers, log=lines.append)
    assert o.ran == ["a_lr1_s0"] and o.results["a_lr1_s0"]["status"] == "ok" and o.skipped == ["b_lr1_s0"]


def test_a_probed_cell_whose_config_changed_runs_again(tmp_path):
    """A cell's run folder holds the study's probes of it (probe/); when the study file changes the cell's
    config, the next run replaces that folder and trains it again (it used to fail: 'holds files that are
    not from a qklab run (probe)')."""
    out, res_dir = tmp_path / "runs", tmp_path / "results"
    first = run_study(_study(tmp_path, {"std": {"qk.method": "none"}}, probe=1), out, res_dir, workers=0,
                      log=lambda s: None)
    assert first.results["std_lr1_s0"]["probe"] and (out / "cells" / "std_lr1_s0" / "probe" / "probes.json").exists()
    changed = _study(tmp_path, {"std": {"qk.method": "none", "model.qk_init_std": 0.05}}, probe=1)
    o = run_study(changed, out, res_dir, workers=0, log=lambda s: None)
    assert o.ran == ["std_lr1_s0"] and o.results["std_lr1_s0"]["status"] == "ok"
    assert o.results["std_lr1_s0"]["cell_hash"] != first.results["std_lr1_s0"]["cell_hash"]


def test_changed_config_reruns_and_any_exception_is_recorded(tmp_path, monkeypatch):
    from qklab.train import trainer as trainer_mod

    study = _study(tmp_path, {"a": {"qk.method": "none"}, "b": {"qk.method": "qknorm"}})
    out, res_dir = tmp_path / "runs", tmp_path / "res"
    real_run = trainer_mod.Trainer.run

    def run(self):
        if self.cfg.qk.method == "qknorm":
            raise ZeroDivisionError("planted")
        return real_run(self)

    monkeypatch.setattr(trainer_mod.Trainer, "run", run)
    o = run_study(study, out, res_dir, workers=0, log=lambda s: None)  # in-process
    assert o.results["b_lr1_s0"]["failure"] == "ZeroDivisionError: planted"
    assert o.results["a_lr1_s0"]["status"] == "ok"
    changed = _study(tmp_path, {"a": {"qk.method": "none", "train.steps": 30}})
    o2 = run_study(changed, out, res_dir, workers=0, log=lambda s: None)
    assert o2.ran == ["a_lr1_s0"] and o2.results["a_lr1_s0"]["final"]["step"] == 30


def test_same_tokens_in_every_cell(tmp_path):
    study = _study(tmp_path, {"a": {}, "b": {"qk.method": "softcap"}}, seeds=(0, 1))
    sets = {c.id: c.cfg.train for c in study.cells}
    assert {t.data_seed for t in sets.values()} == {0} and {t.seed for t in sets.values()} == {0, 1}


def test_study_file_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="variant 'x'.*qk.method='nope' is unknown"):
        _study(tmp_path, {"x": {"qk.method": "nope"}})
    with pytest.raises(ConfigError, match=r"\[protocol\] reference"):
        parse_study({"variants": {"a": {}}, "protocol": {"reference": "zzz"}}, "t")
    with pytest.raises(ConfigError, match="unknown section"):
        parse_study({"variant": {}}, "t")
    with pytest.raises(ConfigError, match="lr_mults"):
        parse_study({"variants": {"a": {}}, "protocol": {"lr_mults": [0]}}, "t")


def test_sweep_shorthand_is_a_study(tmp_path):
    s = sweep_study("tiny", ["std:qk.method=none", "cap:qk.method=softcap,qk.softcap.cap=5"], "0,1",
                    tmp_path / "sw", [f"data.cache_dir='{tmp_path}/c'"], lr_mults="0.5,1")
    assert [c.id for c in s.cells][:4] == ["std_lr0.5_s0", "std_lr1_s0", "cap_lr0.5_s0", "cap_lr1_s0"]
    cap = s.cells[3].cfg
    assert cap.qk.method == "softcap" and cap.qk.opts("softcap").cap == 5.0 and cap.train.lr == 3e-3
    assert s.cells[2].cfg.train.lr == pytest.approx(1.5e-3)
    with pytest.raises(ConfigError, match="label:key=value"):
        sweep_study("tiny", ["no-colon"], "0", tmp_path, [])
    with pytest.raises(ConfigError, match="--seeds 'a,b'"):
        sweep_study("tiny", ["a:qk.method=none"], "a,b", tmp_path, [])


def _study_process(tmp_path, steps: int, eval_every: int, variants: dict[str, str], sigint):
    """``qklab study run`` of a tiny study in its own session, SIGINT set to ``sigint`` (SIG_DFL: as in a
    terminal; SIG_IGN: as under `nohup ... &`). Returns the process and the command (to run it again)."""
    import os
    import signal
    import subprocess

    study_file = tmp_path / "s.toml"
    study_file.write_text(f"""
[study]
config = "tiny"
seeds = [0]
[study.set]
"train.steps" = {steps}
"train.lr" = 1e-2
"train.eval_every" = {eval_every}
"train.ckpt_every" = 20
"train.diag_every" = 0
"data.max_files" = 20
"data.cache_dir" = "{tmp_path}/cache"
""" + "".join(f'[variants.{k}]\n"qk.method" = "{m}"\n' for k, m in variants.items()))
    cmd = [sys.executable, "-m", "qklab", "study", "run", str(study_file), "--out", str(tmp_path / "o"),
           "--workers", "1", "--no-report"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    return proc, cmd, env


def test_background_study_ignores_sigint_and_a_stopped_cell_stops_it(tmp_path):
    """Started with Ctrl-C ignored (`nohup ... &`), neither the study nor its cell stops on SIGINT. When a
    cell is stopped by a signal (SIGTERM to the worker alone), the study starts none of its queued cells
    and says so in one line: whoever stopped a cell is stopping the study."""
    import os
    import signal
    import time

    from qklab.rundir.folder import LOCK
    from qklab.rundir.metrics import read_metrics

    proc, _, _ = _study_process(tmp_path, 2000, 1000, {"a": "none", "b": "qknorm"}, signal.SIG_IGN)
    cell = tmp_path / "o" / "cells" / "a_lr1_s0"

    def last_step() -> int:
        p = cell / "metrics.jsonl"
        return max((r["step"] for r in read_metrics(p) if "loss" in r), default=0) if p.exists() else 0

    def wait_past(step: int) -> int:
        deadline = time.time() + 600
        while (now := last_step()) <= step:
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        return now

    at = wait_past(20)
    os.killpg(proc.pid, signal.SIGINT)  # ignored by the study and by its cell
    wait_past(at + 30)
    assert proc.poll() is None
    os.kill(int((cell / LOCK).read_text()), signal.SIGTERM)  # the worker alone
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert "a_lr1_s0: stopped by a signal" in out and "1 queued cell(s) not started" in out
    assert err.strip().splitlines()[-1] == ("qklab: study s stopped: 1 cell(s) stopped by a signal, 1 not started; "
                                            "run the same command to continue")
    assert not (tmp_path / "o" / "cells" / "b_lr1_s0").exists()
    assert list((cell / "ckpt").glob("step_*"))


def test_interrupted_study_resumes_without_loss(tmp_path):
    """Ctrl-C (SIGINT to the process group) mid-cell: the cell checkpoints and stops, no result is written
    for it, and the next run resumes it to the same numbers as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import time

    proc, cmd, env = _study_process(tmp_path, 200, 50, {"a": "none"}, signal.SIG_DFL)
    ckpt = tmp_path / "o" / "cells" / "a_lr1_s0" / "ckpt"
    deadline = time.time() + 600
    while not list(ckpt.glob("step_*")):  # interrupt once the cell has its first checkpoint
        assert time.time() < deadline and proc.poll() is None, "the cell never reached its first checkpoint"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(proc.communicate(timeout=240))
    assert proc.returncode != 0, out
    assert not (tmp_path / "o" / "results" / "a_lr1_s0" / "result.json").exists()
    assert list((tmp_path / "o" / "cells" / "a_lr1_s0" / "ckpt").glob("step_*"))
    spent = read_result(tmp_path / "o" / "cells" / "a_lr1_s0" / "cell.json")  # the time so far, kept
    assert spent["seconds"] > 0 and spent["cpu_seconds"] > 0
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = read_result(tmp_path / "o" / "results" / "a_lr1_s0" / "result.json")
    assert "resumed" in (tmp_path / "o" / "logs" / "a_lr1_s0.log").read_text()
    # both invocations' time counts for the cell
    assert resumed["seconds"] > spent["seconds"] and resumed["cpu_seconds"] > spent["cpu_seconds"]
    ref = run_study(parse_study({"study": {"config": "tiny", "seeds": [0], "set": {
        "train.steps": 200, "train.lr": 1e-2, "train.eval_every": 50, "train.ckpt_every": 20, "train.diag_every": 0,
        "data.max_files": 20, "data.cache_dir": f"{tmp_path}/cache"}}, "variants": {"a": {"qk.method": "none"}}}, "r"),
        tmp_path / "ref", workers=0, log=lambda s: None).results["a_lr1_s0"]
    assert resumed["final"]["report_loss"] == ref["final"]["report_loss"]  # bitwise: nothing lost
    assert resumed["curves"]["train"] == ref["curves"]["train"]


def test_a_failure_moves_a_finished_result_of_another_config_aside(tmp_path):
    """A failed run is no successor: the committed result of the cell's earlier config is kept, moved
    aside to result.<its hash>.json, byte for byte."""
    study = _study(tmp_path, {"bad": {"model.vocab_size": 10}})  # passes validation, raises in the cell
    (cell,) = study.cells
    res_dir = tmp_path / "results"
    old = {"study": "t", "cell": cell.id, "variant": "bad", "lr_mult": 1.0, "seed": 0, "status": "ok", "lr": 1e-2,
           "diverged": False, "cell_hash": "0123456789abcdef", "final": {"val_loss": 3.0, "report_loss": 3.1}}
    (res_dir / cell.id).mkdir(parents=True)
    text = json.dumps(old, indent=1)
    (res_dir / cell.id / "result.json").write_text(text)
    run_study(study, tmp_path / "runs", res_dir, workers=0, log=lambda s: None)
    new = json.loads((res_dir / cell.id / "result.json").read_text())
    assert new["status"] == "failed" and new["cell_hash"] == cell.hash
    assert (res_dir / cell.id / "result.0123456789abcdef.json").read_text() == text


def test_a_corpus_not_installed_stops_the_study_before_any_cell(tmp_path, monkeypatch, capsys):
    """A missing corpus is this machine's setup, not the cells': one line, exit 2, no result written (each
    cell would otherwise be recorded as failed, and committed so), and the next run after `make corpus`
    finds every cell to do."""
    from qklab.cli import main
    from qklab.data import english

    monkeypatch.setenv(english.CORPUS_ENV, str(tmp_path / "nowhere"))
    f = tmp_path / "e.toml"
    f.write_text('[study]\nname = "e"\nconfig = "tiny"\nseeds = [0]\n[study.set]\n"data.source" = "english"\n'
                 f'"data.cache_dir" = "{tmp_path / "cache"}"\n"train.steps" = 2\n[variants.none]\n'
                 '"qk.method" = "none"\n[variants.qknorm]\n"qk.method" = "qknorm"\n')
    res = tmp_path / "o" / "results"
    assert main(["study", "run", str(f), "--out", str(tmp_path / "o"), "--workers", "0", "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qklab: error: data.source: the english corpus is not installed")
    assert "make corpus" in err[-1]
    assert not list(res.glob("*/result.json"))


def test_a_cell_stopped_during_its_probes_keeps_its_training_time(tmp_path, monkeypatch):
    """A signal while a trained cell is probed: no result; the next run resumes it at its last step and its
    result counts the time of both runs (the first one's training was lost from seconds and cpu_seconds)."""
    import time

    import qklab.study.cell as cell_mod
    from qklab.study.cell import run_cell
    from qklab.train.signals import RunInterrupted

    study = _study(tmp_path, {"a": {"qk.method": "none"}}, probe=1)
    cell, out, res = study.cells[0], tmp_path / "o", tmp_path / "res"
    (out / "logs").mkdir(parents=True)

    def stopped(*_a):
        raise RunInterrupted("stopped by SIGTERM", 15)

    monkeypatch.setattr(cell_mod, "_probe", stopped)
    t0, cpu0 = time.time(), cell_mod._cpu_seconds()
    with pytest.raises(RunInterrupted):
        run_cell(cell, "t", out, res, 1, 1)
    first, first_cpu = time.time() - t0, cell_mod._cpu_seconds() - cpu0  # all of it training and set-up
    assert not (res / cell.id / "result.json").exists()
    monkeypatch.setattr(cell_mod, "_probe", lambda *_a: {"summary": {}})
    t0, cpu0 = time.time(), cell_mod._cpu_seconds()
    r = run_cell(cell, "t", out, res, 1, 1)
    second, second_cpu = time.time() - t0, cell_mod._cpu_seconds() - cpu0
    assert r["status"] == "ok" and r["final"]["step"] == 40
    assert first < r["seconds"] <= first + second
    assert first_cpu < r["cpu_seconds"] <= first_cpu + second_cpu + 0.01
