"""The study, report, sweep and demo commands: status output, and one-line errors before any training."""

from __future__ import annotations

import shutil
from pathlib import Path

from qklab.cli import main
from qklab.study.result import read_result, write_json_atomic
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


def test_a_file_where_a_folder_belongs_is_one_line(tmp_path, capsys):
    """--results or --out naming a file (or a path under one): one line, exit 2, before any cell is looked at."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, err in [(["study", "status", "demo", "--results", str(afile)],
                       f"qklab: error: --results {afile} is a file, not a folder; give the folder that holds (or will "
                       "hold) the study's <cell>/result.json files"),
                      (["study", "run", "demo", "--results", str(afile / "sub")],
                       f"qklab: error: --results {afile / 'sub'}: {afile} is a file, not a folder; give the folder "
                       "that holds (or will hold) the study's <cell>/result.json files"),
                      (["study", "status", "demo", "--out", str(afile)],
                       f"qklab: error: --out {afile} is a file, not a folder; give the folder that holds (or will "
                       "hold) the study's runs"),
                      (["study", "verify", str(afile)],
                       f"qklab: error: {afile}: is a file, not a results folder; give a folder holding "
                       "<cell>/result.json files")]:
        assert main(argv) == 2
        cap = capsys.readouterr()
        assert cap.err.strip() == err and cap.out == ""
    assert afile.read_text() == "x"


def test_status_lists_done_and_todo(tmp_path, capsys):
    f = tmp_path / "st.toml"
    f.write_text('[study]\nconfig = "tiny"\nseeds = [0, 1]\n[variants.a]\n"qk.method" = "none"\n')
    res = tmp_path / "res"
    # a result for seed 0 with the right hash: that of the config the runner trains
    from qklab.study.cell import run_config
    from qklab.study.spec import cell_hash, load_study

    cell = load_study(f).cells[0]
    r = result("a", 1.0, 0, 5.0, 5.0)
    r["cell_hash"] = cell_hash(run_config(cell, tmp_path / "o", 1))
    assert r["cell_hash"] == cell.hash
    write_json_atomic(res / cell.id / "result.json", r)
    assert main(["study", "status", str(f), "--out", str(tmp_path / "o"), "--results", str(res)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["a_lr1_s0", "done"] and out[1].split()[:2] == ["a_lr1_s1", "todo"]
    assert out[-2].startswith("st: 1/2 cells done")
    assert out[-1] == "plan: no claims registered (every claim of its report is exploratory)"
    # a cell that ended above the unigram entropy without blowing up is shown as not learned, not diverged
    r = result("a", 1.0, 0, 6.5, 6.5, not_learned=True)
    r["cell_hash"] = cell.hash
    write_json_atomic(res / cell.id / "result.json", r)
    assert main(["study", "status", str(f), "--out", str(tmp_path / "o"), "--results", str(res)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split(None, 2) == ["a_lr1_s0", "done", "not learned"]


def test_cell_hash_ignores_defaults_and_upgrades_legacy_results(tmp_path, monkeypatch):
    """A key set to its default hashes as unset, so a key added later at its default leaves committed
    results valid; a result with the hash of before (every key) counts as done and is upgraded."""
    from qklab.config import RunConfig, load_config
    from qklab.study.runner import cell_status
    from qklab.study.spec import cell_hash, legacy_cell_hash, load_study

    plain = load_config("tiny", [])
    assert cell_hash(load_config("tiny", ["train.nonfinite=stop"])) == cell_hash(plain)  # the default
    assert cell_hash(load_config("tiny", ["train.nonfinite=skip"])) != cell_hash(plain)
    assert cell_hash(load_config("tiny", ["train.out_dir=elsewhere", "train.threads=3"])) == cell_hash(plain)
    before = cell_hash(plain)
    to_dict = RunConfig.to_dict
    monkeypatch.setattr(RunConfig, "to_dict", lambda self: {**to_dict(self), "future": {"knob": 1}})
    assert cell_hash(plain) == before  # a new section, at its default everywhere
    monkeypatch.undo()

    f = tmp_path / "st.toml"
    f.write_text('[study]\nconfig = "tiny"\nseeds = [0]\n[variants.a]\n"qk.method" = "none"\n')
    cell = load_study(f).cells[0]
    assert cell.hash == cell_hash(cell.cfg) and cell.legacy_hash == legacy_cell_hash(cell.cfg)
    r = result("a", 1.0, 0, 5.0, 5.0)
    r["cell_hash"] = cell.legacy_hash
    assert r["cell_hash"] != cell.hash
    write_json_atomic(tmp_path / "res" / cell.id / "result.json", r)
    status, res = cell_status(cell, tmp_path / "res")
    assert status == "done"
    assert read_result(tmp_path / "res" / cell.id / "result.json")["cell_hash"] == cell.hash
    r["cell_hash"] = "0" * 16  # another config's
    write_json_atomic(tmp_path / "res" / cell.id / "result.json", r)
    assert cell_status(cell, tmp_path / "res")[0] == "stale"


def test_status_estimates_the_time_left_from_the_cells_finished():
    """Finished cells' wall time (each measured while `workers` ran together), scaled by the cost of the
    cells left: 2 cells of cost 10 took 1 h of cell time in all; 2 more of cost 10, 2 at a time -> 0.5 h."""
    from qklab.cli.study import time_left

    assert time_left(3600.0, 20.0, 20.0, 2) == "; 1.0 h of cells so far, about 0.5 h left at that pace (2 at a time)"
    assert time_left(3600.0, 20.0, 60.0, 1) == "; 1.0 h of cells so far, about 3.0 h left at that pace (1 at a time)"
    assert time_left(0.0, 0.0, 20.0, 2) == "" and time_left(3600.0, 20.0, 0.0, 2) == ""


def test_status_estimates_the_time_left_for_the_workers_given(tmp_path, capsys):
    """`study status --workers N` estimates the time left for N cells at a time (it used to read the study
    file's count alone, so a study run with more workers than its file names showed too long a time).
    Two committed cells of qkmap_cpu, the rest to run."""
    src = Path(__file__).resolve().parents[2] / "docs" / "results" / "qkmap_cpu"
    for cell in sorted(p.parent.name for p in src.glob("*/result.json"))[:2]:
        shutil.copytree(src / cell, tmp_path / "res" / cell)

    def hours(*extra: str) -> tuple[float, str]:
        assert main(["study", "status", "studies/qkmap_cpu.toml", "--results", str(tmp_path / "res"),
                     "--out", str(tmp_path / "out"), *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("qkmap_cpu: 2/"))
        return float(line.split("about ")[1].split(" h left")[0]), line

    one, two, four = hours("--workers", "1"), hours(), hours("--workers", "4")  # the file: workers = 2
    assert "(1 at a time)" in one[1] and "(2 at a time)" in two[1] and "(4 at a time)" in four[1]
    assert one[0] > 0.5 and abs(two[0] - one[0] / 2) <= 0.051 and abs(four[0] - one[0] / 4) <= 0.051, (one, four)


def test_status_summary_counts_each_group_as_the_listing_does(tmp_path, capsys):
    """`study status --summary`: one row per variant and grid point, its cells counted by status; the same
    counts as the per-cell listing, and the same closing lines. scale_english (20 groups of 18 cells) with
    three committed cells of one group copied in, the rest to reuse from ladder_english or to run."""
    src = Path(__file__).resolve().parents[2] / "docs" / "results" / "scale_english"
    copied = ["none_shape64-1-0.125-0.006_lr1_s0", "none_shape64-1-0.125-0.006_lr2_s0",
              "none_shape64-1-0.125-0.006_lr4_s0"]
    for cell in copied:
        shutil.copytree(src / cell, tmp_path / "res" / cell)
    argv = ["study", "status", "studies/scale_english.toml", "--results", str(tmp_path / "res"),
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    listing = capsys.readouterr().out.splitlines()
    assert main([*argv, "--summary"]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[-2:] == listing[-2:]
    expected: dict[str, dict[str, int]] = {}  # from the listing: cell id -> its group, and its status
    for line in listing[:-2]:
        cell, status = line.split()[:2]
        group = cell.rsplit("_lr", 1)[0]
        expected.setdefault(group, {}).setdefault(status, 0)
        expected[group][status] += 1
    head, rows = summary[0].split(), summary[1:-2]
    assert head[:2] == ["group", "cells"] and head[2] == "done" and len(rows) == len(expected) == 20
    for row in rows:
        group, cells, *counts = row.split()
        got = {s: int(n) for s, n in zip(head[2:], counts, strict=True) if int(n)}
        assert got == expected[group] and int(cells) == sum(got.values()) == 18, row
    assert expected["none_shape64-1-0.125-0.006"]["done"] == 3


def test_status_shows_a_running_cell_and_a_checkpoint_to_resume(tmp_path, capsys):
    """A local study's cells not done, as their run folders show them: the process training one (the holder
    of its folder's lock, never taken to find out) and its last logged step; a checkpoint of the cell's own
    config that the next run resumes from; a checkpoint of another config is not named (it is replaced)."""
    from qklab.study.spec import load_study
    from tests.rundir.test_progress import hold

    f = tmp_path / "st.toml"
    f.write_text('[study]\nconfig = "tiny"\nseeds = [0, 1, 2]\n[variants.a]\n"qk.method" = "none"\n')
    out, cells = tmp_path / "o", load_study(f).cells
    runs = [out / "cells" / c.id for c in cells]
    runs[0].mkdir(parents=True)
    (runs[0] / "metrics.jsonl").write_text('{"step": 10, "loss": 3.0}\n{"step": 20, "loss": 2.5}\n{"ste')
    for run, h in ((runs[1], cells[1].hash), (runs[2], "another config")):
        for step in (10, 20):
            (run / "ckpt" / f"step_{step:07d}").mkdir(parents=True)
            for name in ("model.safetensors", "state.pt"):
                (run / "ckpt" / f"step_{step:07d}" / name).write_bytes(b"x")
        write_json_atomic(run / "cell.json", {"cell_hash": h})
    p = hold(runs[0])
    try:
        assert main(["study", "status", str(f), "--out", str(out)]) == 0
    finally:
        p.kill()
        p.wait()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(None, 2) == [cells[0].id, "running", f"pid {p.pid}, step 20 of 30"]
    assert lines[1].split(None, 2) == [cells[1].id, "todo", "checkpoint at step 20 of 30"]
    assert lines[2].split() == [cells[2].id, "todo"]
