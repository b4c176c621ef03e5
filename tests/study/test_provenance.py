"""Provenance of study results: the commit qklab was imported from, read once when the study starts, and
for a dirty checkout the diff of its tracked files, stored by sha256 in the results folder and named in
study.json and in each result.json; `qklab study run` refuses a dirty checkout without --allow-dirty.

The functions take the repository root, so these tests point them at a git repository made here."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from qklab import version
from qklab.cli import main
from qklab.config import ConfigError
from qklab.study.result import read_result
from qklab.study.runner import provenance_path, run_study
from qklab.study.spec import parse_study
from qklab.version import code_version

SETS = {"train.steps": 4, "train.lr": 1e-2, "train.eval_every": 2, "train.ckpt_every": 2, "train.diag_every": 0,
        "data.max_files": 20}


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def _repo(tmp_path):
    """A git checkout with one committed file (clean), and its commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "model.py").write_text("width = 64\n")
    _git(repo, "add", "model.py")
    _git(repo, "commit", "-q", "-m", "first")
    return repo, _git(repo, "rev-parse", "HEAD").strip()


def _study(tmp_path, name="p"):
    raw = {"study": {"config": "tiny", "seeds": [0], "set": {**SETS, "data.cache_dir": str(tmp_path / "cache")}},
           "variants": {"a": {"qk.method": "none"}}}
    return parse_study(raw, name)


def _study_file(tmp_path):
    f = tmp_path / "p.toml"
    sets = "".join(f'"{k}" = {json.dumps(v)}\n' for k, v in {**SETS, "data.cache_dir": str(tmp_path / "cache")}.items())
    f.write_text(f'[study]\nconfig = "tiny"\nseeds = [0]\n[study.set]\n{sets}[variants.a]\n"qk.method" = "none"\n')
    return f


def test_code_version_of_a_clean_and_a_dirty_checkout(tmp_path):
    repo, sha = _repo(tmp_path)
    clean = code_version(repo)
    assert clean.commit == sha and not clean.dirty and clean.diff_sha256 is None
    assert clean.record() == {"commit": sha, "dirty": False, "diff_sha256": None}
    (repo / "notes.txt").write_text("untracked\n")  # untracked files are not the code's
    assert not code_version(repo).dirty
    (repo / "model.py").write_text("width = 128\n")
    dirty = code_version(repo)
    want = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=repo, capture_output=True, check=True).stdout
    assert dirty.commit == sha and dirty.dirty and dirty.diff == want and b"+width = 128" in dirty.diff
    assert dirty.diff_sha256 == hashlib.sha256(want).hexdigest()
    _git(repo, "add", "model.py")  # staged counts too: git diff HEAD
    assert code_version(repo).diff_sha256 == dirty.diff_sha256
    (tmp_path / "plain").mkdir()
    assert code_version(tmp_path / "plain").record() == {"commit": "unknown", "dirty": False, "diff_sha256": None}


def test_an_installed_wheel_has_no_commit(monkeypatch):
    monkeypatch.setattr(version, "_checkout", lambda: None)
    assert code_version().record() == {"commit": "unknown", "dirty": False, "diff_sha256": None}


def test_a_dirty_checkout_is_refused_without_allow_dirty(tmp_path, monkeypatch, capsys):
    repo, _ = _repo(tmp_path)
    (repo / "model.py").write_text("width = 128\n")
    with pytest.raises(ConfigError, match="uncommitted changes") as e:
        run_study(_study(tmp_path), tmp_path / "o", allow_dirty=False, repo=repo, log=lambda s: None)
    assert "\n" not in str(e.value) and "--allow-dirty" in str(e.value)
    assert not (tmp_path / "o").exists()
    # the command line: qklab imported from that checkout, no --allow-dirty -> one line, exit 2, nothing written
    monkeypatch.setattr(version, "_checkout", lambda: repo)
    monkeypatch.delenv(version.ALLOW_DIRTY_ENV, raising=False)
    argv = ["study", "run", str(_study_file(tmp_path)), "--out", str(tmp_path / "o"), "--workers", "0", "--no-report"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qklab: error: the checkout") and "--allow-dirty" in err and "\n" not in err
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv(version.ALLOW_DIRTY_ENV, "1")  # the environment's equivalent
    assert main(argv) == 0
    res = read_result(tmp_path / "o" / "results" / "a_lr1_s0" / "result.json")
    assert res["code"]["dirty"] and (tmp_path / "o" / "results" / "provenance").is_dir()


def test_a_wheel_is_not_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(version, "_checkout", lambda: None)
    monkeypatch.delenv(version.ALLOW_DIRTY_ENV, raising=False)
    argv = ["study", "run", str(_study_file(tmp_path)), "--out", str(tmp_path / "o"), "--workers", "0", "--no-report"]
    assert main(argv) == 0, capsys.readouterr().err
    res = read_result(tmp_path / "o" / "results" / "a_lr1_s0" / "result.json")
    assert res["code"] == {"commit": "unknown", "dirty": False, "diff_sha256": None}
    assert not (tmp_path / "o" / "results" / "provenance").exists()


def test_clean_run_records_the_commit_and_no_diff(tmp_path):
    repo, sha = _repo(tmp_path)
    res_dir = tmp_path / "res"
    o = run_study(_study(tmp_path), tmp_path / "o", res_dir, workers=0, allow_dirty=False, repo=repo,
                  log=lambda s: None)
    assert o.results["a_lr1_s0"]["status"] in ("ok", "diverged")
    rec = {"commit": sha, "dirty": False, "diff_sha256": None}
    assert read_result(res_dir / "a_lr1_s0" / "result.json")["code"] == rec
    assert read_result(res_dir / "study.json")["code"] == [rec]
    assert not (res_dir / "provenance").exists()


def test_dirty_run_stores_the_diff_and_each_result_names_it(tmp_path):
    """Through a worker process: the code version is the study process's, read when the study started."""
    repo, sha = _repo(tmp_path)
    (repo / "model.py").write_text("width = 128\n")
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=repo, capture_output=True, check=True).stdout
    digest = hashlib.sha256(diff).hexdigest()
    res_dir = tmp_path / "res"
    o = run_study(_study(tmp_path), tmp_path / "o", res_dir, workers=1, threads=1, repo=repo, log=lambda s: None)
    assert o.results["a_lr1_s0"]["status"] in ("ok", "diverged")
    stored = provenance_path(res_dir, digest)
    assert stored == res_dir / "provenance" / f"{digest}.diff" and stored.read_bytes() == diff
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == digest
    rec = {"commit": sha, "dirty": True, "diff_sha256": digest}
    res = read_result(res_dir / "a_lr1_s0" / "result.json")
    assert res["code"] == rec and res["git_sha"]  # the old field is still written
    assert read_result(res_dir / "study.json")["code"] == [rec]
    # a later run with nothing to train, from another commit, leaves the results folder as it was
    _git(repo, "commit", "-qam", "second")
    before = {p: p.read_bytes() for p in res_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    o2 = run_study(_study(tmp_path), tmp_path / "o", res_dir, workers=0, allow_dirty=False, repo=repo,
                   log=lambda s: None)
    assert o2.skipped == ["a_lr1_s0"]
    assert {p: p.read_bytes() for p in res_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_the_recorded_commit_is_the_one_at_the_start_not_at_the_cell(tmp_path, monkeypatch):
    """A commit made while the study runs (before its cell trains) does not change what the result names."""
    from qklab.train import trainer as trainer_mod

    repo, sha = _repo(tmp_path)
    (repo / "model.py").write_text("width = 128\n")
    digest = code_version(repo).diff_sha256
    real_run = trainer_mod.Trainer.run

    def run(self):
        _git(repo, "commit", "-qam", "meanwhile")
        return real_run(self)

    monkeypatch.setattr(trainer_mod.Trainer, "run", run)
    res_dir = tmp_path / "res"
    run_study(_study(tmp_path), tmp_path / "o", res_dir, workers=0, repo=repo, log=lambda s: None)
    assert _git(repo, "rev-parse", "HEAD").strip() != sha and not code_version(repo).dirty
    res = read_result(res_dir / "a_lr1_s0" / "result.json")
    assert res["code"] == {"commit": sha, "dirty": True, "diff_sha256": digest}
    assert provenance_path(res_dir, digest).is_file()
