"""Damaged study files and results folders: a type mistake in a study file, a study file that is not
UTF-8, a damaged result.json or study.json: one line (exit 2), or a named skip where the rest can go on;
a damaged result is never counted as done."""

from __future__ import annotations

import json

import pytest

from qklab.cli import main
from qklab.study.result import load_result, write_json_atomic
from qklab.study.runner import cell_status, queue_order
from qklab.study.spec import load_study, parse_study
from tests.study.synthetic import result

GOOD = '[study]\nconfig = "tiny"\nseeds = [0]\n[variants.a]\n"qk.method" = "none"\n'
MISTAKES = {
    "config-int": '[study]\nconfig = 5\n[variants.a]\n',
    "lr_key-int": '[study]\nconfig = "tiny"\n[variants.a]\n[protocol]\nlr_key = 5\n',
    "lr_mults_for-list": '[study]\nconfig = "tiny"\n[variants.a]\n[protocol]\nlr_mults_for = [1, 2]\n',
    "workers-str": '[study]\nconfig = "tiny"\nworkers = "two"\n[variants.a]\n',
    "lr_mults-inf": '[study]\nconfig = "tiny"\n[variants.a]\n[protocol]\nlr_mults = [1e400]\n',
    "not-a-table": 'study = 5\n',
}


def _err(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("qklab: error:"), err
    return err


@pytest.mark.parametrize("case", sorted(MISTAKES))
@pytest.mark.parametrize("cmd", ["run", "status", "demo"])
def test_study_file_mistakes_are_one_line(tmp_path, capsys, case, cmd):
    f = tmp_path / "s.toml"
    f.write_text(MISTAKES[case])
    argv = ["demo", "--study", str(f)] if cmd == "demo" else ["study", cmd, str(f)]
    _err(capsys, [*argv, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cmd", ["run", "status", "demo"])
def test_a_study_file_that_is_not_utf8_is_one_line(tmp_path, capsys, cmd):
    f = tmp_path / "s.toml"
    f.write_bytes(GOOD.encode() + b'# caf\xe9\n')
    argv = ["demo", "--study", str(f)] if cmd == "demo" else ["study", cmd, str(f)]
    assert "not UTF-8" in _err(capsys, [*argv, "--out", str(tmp_path / "o")])


DAMAGED = {
    "list": b"[1, 2]", "string": b'"ok"', "not-utf8": b'{"cell": "\xff"}', "not-json": b"{", "empty": b"",
    "missing-fields": b'{"cell": "a_lr1_s0", "status": "ok"}',
    "no-final": b'{"cell": "a_lr1_s0", "variant": "a", "lr_mult": 1, "seed": 0, "status": "ok", "diverged": false}',
}


@pytest.mark.parametrize("how", sorted(DAMAGED))
def test_a_damaged_result_is_named_and_not_done(tmp_path, capsys, how):
    f = tmp_path / "s.toml"
    f.write_text(GOOD)
    cell = load_study(f).cells[0]
    res = tmp_path / "res"
    (res / cell.id).mkdir(parents=True)
    (res / cell.id / "result.json").write_bytes(DAMAGED[how])
    r, problem = load_result(res / cell.id / "result.json")
    assert r is None and str(res / cell.id / "result.json") in problem
    warned = []
    assert cell_status(cell, res, warned.append) == ("damaged", None)
    assert len(warned) == 1 and "damaged result file" in warned[0] and "not done" in warned[0]
    assert main(["study", "status", str(f), "--results", str(res), "--out", str(tmp_path / "o")]) == 0
    cap = capsys.readouterr()
    assert "damaged" in cap.out.splitlines()[0] and "0/1 cells done" in cap.out
    assert "Traceback" not in cap.err and "damaged result file" in cap.err


def test_a_damaged_results_folder_reports_what_it_can(tmp_path, capsys):
    """A good result next to a list, a string, bytes that are not UTF-8, a stray notes/result.json and a
    study.json of []: the report is written from the good one, says how many files it skipped, and names
    each on stderr."""
    res = tmp_path / "res"
    write_json_atomic(res / "a_lr1_s0" / "result.json", result("a", 1.0, 0, 5.0, 5.1))
    (res / "b_lr1_s0").mkdir()
    (res / "b_lr1_s0" / "result.json").write_text("[]")
    (res / "c_lr1_s0").mkdir()
    (res / "c_lr1_s0" / "result.json").write_text('"x"')
    (res / "d_lr1_s0").mkdir()
    (res / "d_lr1_s0" / "result.json").write_bytes(b"\xff\xfe")
    (res / "notes").mkdir()
    (res / "notes" / "result.json").write_text('{"todo": "write up"}')
    (res / "study.json").write_text("[]")
    code = main(["report", str(res), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err and err.count("warning:") == 5, err
    for name in ("b_lr1_s0", "c_lr1_s0", "d_lr1_s0", "notes", "study.json"):
        assert name in err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Results: 1 cells" in md and "Skipped 5 damaged or duplicate file(s)" in md


def test_a_results_folder_of_damaged_files_only_is_one_line(tmp_path, capsys):
    (tmp_path / "r" / "x").mkdir(parents=True)
    (tmp_path / "r" / "x" / "result.json").write_text("{}")
    assert "1 damaged or duplicate file(s) skipped" in _err(capsys, ["report", str(tmp_path / "r")])
    assert "no such folder" in _err(capsys, ["report", str(tmp_path / "nope")])


def test_report_counts_each_cell_once(tmp_path, capsys):
    """The same folder twice, a folder and its parent, a folder and a copy of it: the same statistics as
    the folder alone, and each duplicate named."""
    import json
    import shutil

    res = tmp_path / "top" / "res"
    write_json_atomic(res / "study.json", {"name": "s", "variants": {"a": {}, "b": {}}, "protocol": {"reference": "a"}})
    for s in range(3):
        for v, base in (("a", 5.0), ("b", 4.9)):
            r = result(v, 1.0, s, base + 0.01 * s, base + 0.02 * s)
            write_json_atomic(res / r["cell"] / "result.json", r)
    shutil.copytree(res, tmp_path / "copy")

    def tables(*dirs):
        assert main(["report", *map(str, dirs), "--out", str(tmp_path / "rep")]) == 0
        data = json.loads((tmp_path / "rep" / "report.json").read_text())
        return data["tables"]["results"], len(data["cells"]), capsys.readouterr().err

    alone, n, err = tables(res)
    assert n == 6 and "warning" not in err
    for dirs, dups in (((res, res), 0), ((res, res.parent), 0), ((res, tmp_path / "copy"), 6)):
        got, n, err = tables(*dirs)
        assert got == alone and n == 6, dirs
        assert err.count("warning:") == dups, err  # files read twice are no duplicates; copies are, named
        if dups:
            assert "a copy of cell" in err and "counted once" in err


def test_queue_packs_a_ladder_costliest_first_within_each_seed():
    raw = {"study": {"config": "tiny", "seeds": [0, 1]},
           "grid": {"shape": [{"model.d_model": 32}, {"model.d_model": 128}, {"model.d_model": 64}]},
           "variants": {"a": {}}}
    s = parse_study(raw, "ladder")
    order = [(c.seed, c.cfg.model.d_model) for c in queue_order(list(s.cells), s)]
    assert order == [(0, 128), (0, 64), (0, 32), (1, 128), (1, 64), (1, 32)]


def test_a_ladders_cost_counts_the_output_head():
    """ladder_english's widths 64 and 256 (4 layers, 256 tokens, BPE 4096) cost about 1 : 8 a cell, as measured
    (studies/ladder_english.toml): blocks and attention alone would say 1 : 13, the head brings it to 8.5."""
    from qklab.study.runner import expected_cost

    raw = {"study": {"config": "tiny", "seeds": [0], "set": {"model.n_layers": 4, "model.n_heads": 1,
                                                             "train.seq_len": 256, "model.max_seq_len": 256,
                                                             "data.tokenizer": "bpe", "data.vocab_size": 4096}},
           "grid": {"shape": [{"model.d_model": 64}, {"model.d_model": 256}]}, "variants": {"a": {}}}
    narrow, wide = parse_study(raw, "ladder").cells
    assert expected_cost(wide) / expected_cost(narrow) == pytest.approx(8.5)


def test_progress_eta_weighs_the_cells_by_cost():
    """The progress lines' ETA: with the cheap cell done in 10 s and the one costing 8 times as much not
    started, 80 s are left (counting steps alone would say 10); halfway through the costly one, 40 s."""
    from qklab.study.workers import time_left_s

    steps, cost = {"narrow": 100, "wide": 100}, {"narrow": 1.0, "wide": 8.0}
    assert time_left_s(10.0, {"narrow": 100}, steps, cost) == pytest.approx(80.0)
    assert time_left_s(50.0, {"narrow": 100, "wide": 50}, steps, cost) == pytest.approx(50.0 * 4 / 5)
    assert time_left_s(10.0, {"narrow": 100}, steps, steps) == pytest.approx(10.0)  # no costs: by steps
    assert time_left_s(10.0, {}, steps, cost) != time_left_s(10.0, {}, steps, cost)  # nothing done yet: NaN


def test_a_large_study_says_how_many_cells_before_checking_them(monkeypatch):
    import qklab.study.spec as spec

    monkeypatch.setattr(spec, "LARGE", 3)
    said = []
    parse_study({"study": {"config": "tiny", "seeds": [0, 1]}, "grid": {"train.lr": [1e-3, 2e-3]},
                 "variants": {"a": {}}}, "big", note=said.append)
    assert said == ["study big: 4 cells; checking every cell's config (about 0 s) ..."]


@pytest.mark.parametrize("schema, shown", [(99, "99, which this qklab does not read (written by a newer qklab?)"),
                                           (0, "0, which this qklab does not read"),
                                           ("1", '"1", which this qklab does not read'),
                                           (1.5, "1.5, which this qklab does not read")])
def test_a_result_of_an_unknown_schema_is_named_and_not_done(tmp_path, capsys, schema, shown):
    """A result otherwise whole, of the cell's config, but of a schema this qklab does not read (a newer
    qklab's): one warning line naming it, never done (``qklab study status``), and skipped by the report."""
    f = tmp_path / "s.toml"
    f.write_text(GOOD)
    cell = load_study(f).cells[0]
    res = tmp_path / "res"
    write_json_atomic(res / cell.id / "result.json", {**result("a", 1.0, 0, 5.0, 5.1), "cell_hash": cell.hash})
    assert cell_status(cell, res) == ("done", load_result(res / cell.id / "result.json")[0])  # schema 1: done
    write_json_atomic(res / cell.id / "result.json",
                      {**result("a", 1.0, 0, 5.0, 5.1), "cell_hash": cell.hash, "schema": schema})
    path = res / cell.id / "result.json"
    assert load_result(path) == (None, f"{path}: schema {shown}")
    warned = []
    assert cell_status(cell, res, warned.append) == ("damaged", None)
    assert warned == [f"warning: damaged result file {path}: schema {shown}; cell {cell.id} counts as not done"]
    assert main(["study", "status", str(f), "--results", str(res), "--out", str(tmp_path / "o")]) == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines()[0].split() == [cell.id, "damaged"] and "0/1 cells done" in cap.out
    assert cap.err.strip().splitlines() == warned, cap.err
    write_json_atomic(res / "b_lr1_s0" / "result.json", result("b", 1.0, 0, 5.0, 5.1))
    assert main(["report", str(res), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and f"{path}: schema {shown}; skipped" in err, err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Results: 1 cells" in md and f"schema {shown}" in md


def test_a_run_keeps_a_result_of_an_unknown_schema_aside(tmp_path):
    """The runner names a newer qklab's result, trains the cell again and keeps that file, as
    result.schema-99.json, beside the result it writes; a failure does the same."""
    from qklab.study.cell import publish
    from qklab.study.runner import run_study

    set_ = {"train.steps": 4, "train.eval_every": 4, "train.ckpt_every": 4, "data.max_files": 20,
            "data.cache_dir": str(tmp_path / "cache")}
    study = parse_study({"study": {"config": "tiny", "seeds": [0], "set": set_}, "variants": {"a": {}}}, "s")
    cell = study.cells[0]
    path = tmp_path / "res" / cell.id / "result.json"
    newer = {**result("a", 1.0, 0, 5.0, 5.1), "cell_hash": cell.hash, "schema": 99}
    write_json_atomic(path, newer)
    lines: list[str] = []
    o = run_study(study, tmp_path / "runs", tmp_path / "res", workers=0, log=lines.append)
    assert o.ran == [cell.id] and o.damaged == [cell.id]
    assert sum("schema 99, which this qklab does not read" in ln for ln in lines) == 1, lines
    assert load_result(path)[0]["schema"] == 1
    kept = path.with_name("result.schema-99.json")
    assert load_result(kept)[0] is None and kept.read_text() == json.dumps(newer, indent=1) + "\n"
    kept.replace(path)
    publish(tmp_path / "res", cell.id, {**result("a", 1.0, 0, 0, 0, failed=True), "cell_hash": cell.hash})
    assert kept.is_file() and load_result(path)[0]["status"] == "failed"
