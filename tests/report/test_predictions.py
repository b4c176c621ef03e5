"""Registered predictions against a larger run's results: hit, miss and not tested, on planted numbers."""

from __future__ import annotations

import math

import pytest

from qklab.report.predictions import _order, check, method_key

TARGET = "38M"


def _pred() -> dict:
    return {"targets": {TARGET: {
        "max_logit": {"none": {"value": 100.0, "lo": 50.0, "hi": 200.0},
                      "qknorm": {"value": 8.0, "lo": 6.0, "hi": 9.0}},
        "max_logit_order": _order({"none": [100.0, 50.0, 200.0], "qknorm": [8.0, 6.0, 9.0]}),
        "high_rate_loss_order": _order({"none": [6.0, 5.9, 6.1], "qknorm": [5.95, 5.8, 6.0]}),  # intervals overlap
        "sensitivity_order": _order({"none": [0.7, 0.6, 0.8], "qknorm": [0.1, 0.0, 0.2]})}}}


def _result(method: str, controller: str, logit: float, loss: float) -> dict:
    return {"status": "ok", "method": method, "controller": controller,
            "final": {"max_logit": logit, "report_loss": loss}}


def test_order_marks_overlapping_intervals_tied():
    assert _order({"a": [1.0, 0.5, 1.5], "b": [2.0, 1.6, 2.4], "c": [0.0, -0.2, 0.6]}) == [
        {"upper": "b", "lower": "a", "relation": "above"}, {"upper": "a", "lower": "c", "relation": "tied"}]
    assert method_key("none", "quack") == "quack" and method_key("qknorm", "none") == "qknorm"


def test_hits_misses_and_untested():
    pred = _pred()
    got = {c.id.split(" @ ")[0]: c for c in check(pred, [_result("none", "none", 300.0, 6.0),
                                                         _result("qknorm", "none", 7.0, 5.9)], TARGET, True)}
    assert got["max_logit none"].outcome == "miss"  # 300 above [50, 200]
    assert got["max_logit qknorm"].outcome == "hit"
    assert got["max_logit_order"].outcome == "hit"  # none 300 > qknorm 7, as predicted apart
    assert got["high_rate_loss_order"].outcome == "not tested"  # the only pair was predicted tied
    assert got["sensitivity_order"].outcome == "not tested"  # one rate per method
    # another regime: values are not tested, orders still are; a reversed order is a miss
    other = {c.id.split(" @ ")[0]: c for c in check(pred, [_result("none", "none", 5.0, 6.0),
                                                           _result("qknorm", "none", 7.0, 5.9)], TARGET, False)}
    assert other["max_logit none"].outcome == "not tested" and other["max_logit_order"].outcome == "miss"
    assert other["max_logit_order"].why.endswith("another regime: an observation beside the prediction, not its test")
    assert "another regime" not in got["max_logit_order"].why


def test_write_reproduces_the_registered_values_with_t_intervals(tmp_path):
    """``scripts/predictions.py write`` from the ladder the registered file was written from
    (docs/results/ladder_english) gives its values again (to rounding), now with the t-interval over the
    seeds' own fits (wider than the registered bootstrap's, which missed the spread of the slopes), and
    records the new file's hash in the study.json it is given."""
    import hashlib
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reg = json.loads((root / "docs/results/predictions/scale_1.json").read_text())
    record = tmp_path / "study.json"
    shutil.copy(root / "docs/results/scale_english/study.json", record)
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(root / "scripts/predictions.py"), "write",
                        str(root / "docs/results/ladder_english"), str(out), "--regime", reg["regime"],
                        "--record", str(record)], capture_output=True, text=True, timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    new = json.loads(out.read_text())
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert json.loads(record.read_text())["predictions"][-1]["sha256"] == sha
    for target, t in reg["targets"].items():
        for m, v in t["max_logit"].items():
            w = new["targets"][target]["max_logit"][m]
            assert w["value"] == pytest.approx(v["value"], rel=1e-12)  # the fit itself is unchanged
            assert w["lo"] < v["lo"] and w["hi"] > v["hi"]  # two seeds: t(0.975, 1) = 12.7, not ~2
            # log10 scale: symmetric about the value (the t-interval of the seeds' fits at that size)
            half = math.log10(w["hi"]) - math.log10(w["value"])
            assert math.log10(w["value"]) - math.log10(w["lo"]) == pytest.approx(half)
            assert half > 0


def test_the_report_names_an_erratum_beside_the_file(tmp_path):
    """A registered file stays as it is; an erratum in the README beside it is named under it in the report."""
    import hashlib
    import json

    from qklab.report.predictions import predictions_lines

    f = tmp_path / "p.json"
    f.write_text(json.dumps(_pred()))
    rec = {"s": {"predictions": [{"file": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                                  "written": "then"}]}}
    lines = predictions_lines(rec)
    assert not any("Erratum" in ln for ln in lines) and "sha256 as recorded" in lines[2]
    (tmp_path / "README.md").write_text("# x\n\n## Erratum to other.json\n\n## Erratum to p.json (later)\n\ntext\n")
    lines = predictions_lines(rec)
    assert lines[3] == (f"  - **Erratum** (written after it, the file unchanged): `{tmp_path / 'README.md'}`, "
                        "section \"Erratum to p.json (later)\"")
    assert sum("not yet tested" in ln.lower() for ln in lines) >= 4
