"""`qklab study verify DIR`: a committed cell trained again from the config its result.json records gives the
same numbers bit for bit; a result with one number off by one ulp is found and named."""

from __future__ import annotations

import math

from qklab.cli import main
from qklab.study.result import read_result, write_json_atomic
from qklab.study.runner import run_study
from qklab.study.spec import parse_study
from tests.conftest import another_cpu_capability

SETS = {"train.steps": 6, "train.lr": 1e-2, "train.eval_every": 3, "train.ckpt_every": 3, "train.diag_every": 3,
        "data.max_files": 20}


def test_verify_passes_on_an_untouched_cell_and_fails_one_ulp_off(tmp_path, capsys):
    raw = {"study": {"config": "tiny", "seeds": [0], "set": {**SETS, "data.cache_dir": str(tmp_path / "cache")}},
           "variants": {"a": {"qk.method": "qknorm"}}}
    res_dir = tmp_path / "res"
    run_study(parse_study(raw, "v"), tmp_path / "o", res_dir, workers=0, threads=1, log=lambda s: None)
    path = res_dir / "a_lr1_s0" / "result.json"
    committed = path.read_bytes()
    assert main(["study", "verify", str(res_dir), "--cells", "3", "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "a_lr1_s0: identical, bit for bit" in out and "verified: 1 cell(s)" in out
    assert path.read_bytes() == committed  # verify never writes results
    res = read_result(path)
    res["final"]["report_loss"] = math.nextafter(res["final"]["report_loss"], math.inf)  # one ulp
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    cap = capsys.readouterr()
    assert "a_lr1_s0: DIFFERS in 1 value(s): final.report_loss:" in cap.out
    assert cap.err.strip() == "qklab: verify: 1 of 1 cell(s) differ from their committed result: a_lr1_s0"
    # where each ran: the same kind of machine here; the final losses one ulp apart
    gap = math.nextafter(res["final"]["report_loss"], -math.inf) - res["final"]["report_loss"]  # retrained - committed
    assert "where: the same kind of machine" in cap.out and f"committed ({gap:+.3g})" in cap.out
    res["machines"] = [{**res["machines"][0], "cpu_capability": another_cpu_capability()}]  # committed elsewhere
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    assert "float kernels differ between machines" in capsys.readouterr().out
    del res["machines"]  # a result from before the machine was recorded
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    assert "does not record its machine" in capsys.readouterr().out


def test_verify_without_results_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["study", "verify", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qklab: error:") and "no finished" in err and "\n" not in err


def _probed_cell(tmp_path):
    """One cell trained below the unigram entropy, with its attention probes: (results folder, result.json)."""
    sets = {**SETS, "train.steps": 40, "train.eval_every": 20, "train.ckpt_every": 20, "train.diag_every": 20,
            "train.lr": 3e-3, "data.cache_dir": str(tmp_path / "cache")}
    raw = {"study": {"config": "tiny", "seeds": [0], "set": sets},
           "variants": {"a": {"qk.method": "none"}}, "protocol": {"probe": 1}}
    res_dir = tmp_path / "res"
    run_study(parse_study(raw, "v"), tmp_path / "o", res_dir, workers=0, threads=1, log=lambda s: None)
    path = res_dir / "a_lr1_s0" / "result.json"
    return res_dir, path


def test_verify_compares_probes_and_rehashes_the_config(tmp_path, capsys):
    res_dir, path = _probed_cell(tmp_path)
    res = read_result(path)
    assert not res["diverged"] and res["probe"]["retrieval"]
    assert main(["study", "verify", str(res_dir)]) == 0
    res["probe"]["summary"]["first_token"] = math.nextafter(res["probe"]["summary"]["first_token"], 0.0)
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    assert "probe.summary.first_token:" in capsys.readouterr().out
    # the numbers restored, the config edited: its hash no longer matches the one the result names
    res = read_result(path)
    res["probe"]["summary"]["first_token"] = math.nextafter(res["probe"]["summary"]["first_token"], 1.0)
    res["config"]["train"]["grad_clip"] = 0.5
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    assert "cell_hash: the recorded config hashes to" in capsys.readouterr().out


def test_a_measurement_added_since_the_commit_is_named_not_a_difference(tmp_path, capsys):
    """A cell committed before the code measured a value (the retrieval probe's contrast, say) verifies: the
    values it holds are compared bit for bit, the new ones are named as not compared; a value the committed
    result holds and the retrained one lacks is still a difference."""
    res_dir, path = _probed_cell(tmp_path)
    res = read_result(path)
    retrieval = res["probe"]["retrieval"]
    assert all("contrast" in r for r in retrieval)
    for r in retrieval:  # as committed by code from before the contrast was measured
        del r["contrast"]
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 0
    out = capsys.readouterr().out
    assert "a_lr1_s0: identical, bit for bit" in out
    assert f"not compared: {len(retrieval)} value(s)" in out and "probe.retrieval[0].contrast" in out
    res["final"]["gone_since"] = 1.0  # a value the committed result holds that this code no longer writes
    write_json_atomic(path, res)
    assert main(["study", "verify", str(res_dir)]) == 1
    assert "final.gone_since: missing here" in capsys.readouterr().out


def test_verify_draws_among_each_named_variant(tmp_path, capsys):
    """--variant a,b: --cells of each variant's finished cells; a variant with none is one line, exit 2."""
    raw = {"study": {"config": "tiny", "seeds": [0, 1], "set": {**SETS, "data.cache_dir": str(tmp_path / "cache")}},
           "variants": {"a": {"qk.method": "qknorm"}, "b": {"qk.method": "none"}, "c": {"qk.method": "qkmap"}}}
    res_dir = tmp_path / "res"
    run_study(parse_study(raw, "v"), tmp_path / "o", res_dir, workers=0, threads=1, log=lambda s: None)
    capsys.readouterr()
    assert main(["study", "verify", str(res_dir), "--variant", "c,a", "--out", str(tmp_path / "again")]) == 0
    drawn = [line.split()[1].rstrip(":") for line in capsys.readouterr().out.splitlines()
             if line.startswith("verify ")]
    assert [d.split("_")[0] for d in drawn] == ["c", "a"]  # one of each, in the order named
    assert main(["study", "verify", str(res_dir), "--variant", "b,z"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"qklab: error: --variant z: no finished cell of it in {res_dir} (variants with finished "
                   "cells: a, b, c)")


def test_verify_same_machine_draws_only_cells_trained_on_this_kind(tmp_path, capsys):
    """--same-machine: cells recorded on another CPU kind, or recording no machine, are never drawn; a variant
    left with none is one line, exit 2."""
    raw = {"study": {"config": "tiny", "seeds": [0, 1], "set": {**SETS, "data.cache_dir": str(tmp_path / "cache")}},
           "variants": {"a": {"qk.method": "qknorm"}, "b": {"qk.method": "none"}}}
    res_dir = tmp_path / "res"
    run_study(parse_study(raw, "v"), tmp_path / "o", res_dir, workers=0, threads=1, log=lambda s: None)
    for cell, edit in [("a_lr1_s0", "other"), ("b_lr1_s0", "other"), ("b_lr1_s1", "none")]:
        path = res_dir / cell / "result.json"
        res = read_result(path)
        if edit == "other":  # trained on another kind from step 3 on
            other = {**res["machines"][0], "from_step": 3, "cpu_capability": another_cpu_capability()}
            res["machines"] = [res["machines"][0], other]
        else:
            del res["machines"]
        write_json_atomic(path, res)
    capsys.readouterr()
    for seed in range(4):  # whatever the draw, only a_lr1_s1 is of this kind
        assert main(["study", "verify", str(res_dir), "--same-machine", "--seed", str(seed), "--cells", "2",
                     "--out", str(tmp_path / f"again{seed}")]) == 0
        out = capsys.readouterr().out
        assert "drawing among the 1 of 4 finished cells trained on this kind of machine" in out
        assert [line.split()[1] for line in out.splitlines() if line.startswith("verify ")] == ["a_lr1_s1:"]
    assert main(["study", "verify", str(res_dir), "--same-machine", "--variant", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"qklab: error: --variant b: no finished cell of it trained on this kind of machine in {res_dir} "
                   "(variants with finished cells trained on this kind of machine: a)")
    res = read_result(res_dir / "a_lr1_s1" / "result.json")
    del res["machines"]
    write_json_atomic(res_dir / "a_lr1_s1" / "result.json", res)
    assert main(["study", "verify", str(res_dir), "--same-machine"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qklab: error: --same-machine: none of the 4 finished cells in {res_dir} was trained on "
                          "this kind of machine (") and err.endswith("; 2 record no machine (results from before "
                                                                    "`machines` was recorded)")
