"""The study, report, sweep and demo commands: status output, and one-line errors before any training."""

from __future__ import annotations

from qklab.cli import main
from qklab.study.result import write_json_atomic
from tests.study.synthetic import result


def _one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qklab: error:") and needle in err and "\n" not in err


def test_errors_are_one_line_and_nothing_trains(tmp_path, capsys):
    _one_line_error(capsys, ["demo", "--methods", "none,bogus", "--out", str(tmp_path / "d")], "bogus not in demo.toml")
    assert not (tmp_path / "d").exists()
    _one_line_error(capsys, ["report", str(tmp_path)], "no result.json")
    _one_line_error(capsys, ["study", "run", "nosuch"], "study 'nosuch' not found")
    sweep = ["sweep", "--out", str(tmp_path / "s"), "--config", "tiny", "--variant"]
    _one_line_error(capsys, [*sweep, "a:qk.method=nope"], "qk.method='nope' is unknown")
    _one_line_error(capsys, ["sweep", "--out", str(tmp_path / "s"), "--variant", "a:", "--seeds", "x"], "--seeds 'x'")


def test_status_lists_done_and_todo(tmp_path, capsys):
    f = tmp_path / "st.toml"
    f.write_text('[study]\nconfig = "tiny"\nseeds = [0, 1]\n[variants.a]\n"qk.method" = "none"\n')
    res = tmp_path / "res"
    # a result for seed 0 with the right hash: computed the way the runner does
    from qklab.study.runner import _cell_cfg
    from qklab.study.spec import cell_hash, load_study

    cell = load_study(f).cells[0]
    r = result("a", 1.0, 0, 5.0, 5.0)
    r["cell_hash"] = cell_hash(_cell_cfg(cell, tmp_path / "o", 1))
    write_json_atomic(res / cell.id / "result.json", r)
    assert main(["study", "status", str(f), "--out", str(tmp_path / "o"), "--results", str(res)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["a_lr1_s0", "done"] and out[1].split()[:2] == ["a_lr1_s1", "todo"]
    assert out[-1].startswith("st: 1/2 cells done")
