"""Command-line options of study, demo, sweep, probe and export: a mistake is one line and exit 2, before
anything trains or is measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qklab.cli import build_parser, main
from qklab.version import version_line

SWEEP = ["sweep", "--config", "tiny", "--variant", "a:qk.method=none"]


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--methods", ""], "--methods '' names no variant"),
    (["demo", "--methods", " , "], "names no variant"),
    (["demo", "--workers", "-1"], "--workers: -1: use 0"),
    (["demo", "--threads", "0"], "--threads: 0: use 1 or more"),
    (["study", "run", "demo", "--workers", "-1"], "--workers: -1: use 0"),
    (["study", "run", "demo", "--workers", "two"], "'two' is not an integer"),
    (["study", "run", "demo", "--threads", "-2"], "--threads: -2"),
    ([*SWEEP, "--workers", "-1"], "--workers: -1: use 0"),
    ([*SWEEP, "--threads", "0"], "--threads: 0"),
    (["probe", "runs/x", "--max-mult", "5"], "--max-mult 5: contexts are probed at 1, 2, 4, 8, 16 and 32"),
    (["probe", "runs/x", "--max-mult", "64"], "--max-mult 64"),
    (["probe", "runs/x", "--batch", "100000"], "--batch 100000: use 1 to 1024"),
    (["probe", "runs/x", "--batch", "0"], "--batch 0"),
    (["probe", "runs/x", "--samples", "0"], "--samples 0: use 1 to 1024"),
    (["probe", "runs/x", "--samples", "5000"], "--samples 5000"),
    (["probe", "--compare", "runs/x", "runs/y", "--max-mult", "3"], "--max-mult 3"),
])
def test_bad_options_are_one_line(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    if argv[0] == "sweep":
        argv = [*argv, "--out", str(tmp_path / "sw")]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: a bad option type
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qklab: error:") and needle in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sw" / "cells").exists()


def test_study_run_threads_reach_the_cells(tmp_path, capsys):
    import json

    f = tmp_path / "s.toml"
    f.write_text(f'[study]\nconfig = "tiny"\nseeds = [0]\n[study.set]\n"train.steps" = 2\n"train.eval_every" = 2\n'
                 f'"train.diag_every" = 0\n"data.cache_dir" = "{tmp_path}/cache"\n[variants.a]\n')
    assert main(["study", "run", str(f), "--out", str(tmp_path / "o"), "--workers", "0", "--threads", "1",
                 "--no-report"]) == 0
    cfg = json.loads((tmp_path / "o" / "cells" / "a_lr1_s0" / "config.json").read_text())
    assert cfg["train"]["threads"] == 1


def test_version_answers_without_importing_torch():
    """``qklab --version`` imports neither torch nor the parser's rooms (it took seconds), and says what
    the parser's --version says."""
    code = ("import sys\nfrom qklab.cli import main\nrc = main(['--version'])\n"
            "print(rc, sorted(m for m in ('torch', 'numpy', 'qklab.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [version_line(), "0 []"]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0


def test_a_bare_qklab_prints_what_it_can_do(capsys):
    """`qklab` alone printed 'error: the following arguments are required: cmd'; it now prints the help, the
    same text as `qklab --help`, and exits 0."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out == build_parser().format_help()
    for cmd in ("train", "tokens", "config", "demo", "study", "report", "sweep", "probe", "export"):
        assert f"\n    {cmd} " in out, cmd


@pytest.mark.parametrize("argv", [["--version"], ["config"], ["study", "status", "demo"]])
def test_a_closed_pipe_stops_quietly(argv):
    """`qklab ... | head`: the reader closes the pipe before qklab writes. qklab stops with 141 (128 + SIGPIPE),
    as a pipe's writer does, and says nothing: not `qklab: error: Broken pipe` (exit 2) while printing, nor
    a traceback or Python's `Exception ignored ... BrokenPipeError` at exit. `--version` is answered before
    the parser is built, the others after."""
    p = subprocess.Popen([sys.executable, "-m", "qklab", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before qklab's imports are done: its first write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
