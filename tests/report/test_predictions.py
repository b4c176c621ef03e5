"""Registered predictions against a larger run's results: hit, miss and not tested, on planted numbers."""

from __future__ import annotations

import math

import pytest

from qklab.report.predictions import _order, check, method_key, order_text, ranking

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
        {"upper": "b", "lower": "a", "relation": "above"}, {"upper": "b", "lower": "c", "relation": "above"},
        {"upper": "a", "lower": "c", "relation": "tied"}]
    # a chain of overlapping neighbours still holds its two ends apart: every pair is predicted
    chain = _order({"a": [3.0, 2.0, 4.0], "b": [2.0, 1.0, 3.0], "c": [1.0, 0.0, 1.9]})
    assert [p["relation"] for p in chain] == ["tied", "above", "tied"]  # a~b, a>c, b~c
    assert ranking(chain) == ["a", "b", "c"]
    assert order_text(chain) == "ranking a, b, c; apart: a > c (2 other pair(s) tied)"
    # a file written with neighbours only (scale_1.json) ranks the same
    neighbours = [{"upper": "a", "lower": "b", "relation": "tied"}, {"upper": "b", "lower": "c", "relation": "tied"}]
    assert ranking(neighbours) == ["a", "b", "c"]
    assert order_text(_order({"a": [1.0, 0.0, 2.0], "b": [0.5, 0.0, 1.0]})) == "ranking a, b; no pair apart"
    assert method_key("none", "quack") == "quack" and method_key("qknorm", "none") == "qknorm"


def test_hits_misses_and_untested():
    pred = _pred()
    got = {c.id.split(" @ ")[0]: c for c in check(pred, [_result("none", "none", 300.0, 6.0),
                                                         _result("qknorm", "none", 7.0, 5.9)], TARGET, True)}
    assert got["max_logit none"].outcome == "miss"  # 300 above [50, 200]
    assert got["max_logit qknorm"].outcome == "hit"
    assert got["max_logit_order"].outcome == "hit"  # none 300 > qknorm 7, as predicted apart
    assert got["high_rate_loss_order"].outcome == "not tested"  # the only pair was predicted tied
    # a chain a ~ b ~ c with a > c: measured c above a is a miss, whatever b does
    pred3 = {"targets": {TARGET: {**pred["targets"][TARGET], "max_logit": {}, "high_rate_loss_order": _order(
        {"none": [3.0, 2.0, 4.0], "quack": [2.0, 1.0, 3.0], "qknorm": [1.0, 0.0, 1.9]})}}}
    runs = [_result("none", "none", 1.0, 1.0), _result("none", "quack", 1.0, 9.0), _result("qknorm", "none", 1.0, 2.0)]
    got3 = {c.id.split(" @ ")[0]: c for c in check(pred3, runs, TARGET, True)}
    assert got3["high_rate_loss_order"].outcome == "miss" and "0 of 1 pairs" in got3["high_rate_loss_order"].why
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


def test_a_blow_up_at_the_high_rate_counts_as_l0_in_the_loss_fits():
    """The high-rate loss is read as LR sensitivity reads it: capped at L0 = ln(vocab), non-finite at L0, so a
    seed that blew up stays in the fit, against its method."""
    from qklab.report.predictions import _high_rate
    from qklab.report.scale import MethodScale
    from qklab.study.analyze import Group, RateOutcome

    l0 = math.log(4096)
    loss = {1.0: {0: 4.0, 1: 4.0, 2: 4.0}, 4.0: {0: float("inf"), 1: 9.5, 2: 5.0}}
    logit = {1.0: {0: 10.0, 1: 10.0, 2: 10.0}, 4.0: {0: float("nan"), 1: 300.0, 2: 50.0}}
    g = Group(study="s", variant="none", d_model=64, vocab_size=4096, chosen=1.0,
              sweep={1.0: RateOutcome(lr=1e-3), 4.0: RateOutcome(lr=4e-3)},
              grid_final={"report_loss": loss, "max_logit": logit})
    r = MethodScale("s", "none", [64], [1e5], [], [], {}, None)
    assert _high_rate(r, {("s", "none", 64): g}, "report_loss") == ([1e5], [{0: l0, 1: l0, 2: 5.0}])
    assert _high_rate(r, {("s", "none", 64): g}, "max_logit") == ([1e5], [logit[4.0]])  # a logit as it is


def test_a_run_hits_within_the_fit_widened_by_its_own_seed_noise():
    """With the seeds' spread in the file, one run's max logit hits within value -+ t(n-1) sd sqrt(1/n + 1)
    (log10), k runs' geometric mean within sqrt(1/n + 1/k); by hand against scipy's t quantile."""
    from scipy import stats as scipy_stats

    from qklab.report.predictions import logit_hit_interval
    from qklab.study.sensitivity import trend

    # three seeds' log-log fits at sizes 10, 100, 1000: log10 y = 1 + x (seed 0), 1 + 1.1 x, 1 + 1.2 x
    t = trend([10, 100, 1000], [{s: 10 ** (1 + (1 + 0.1 * s) * x) for s in range(3)} for x in (1, 2, 3)], log_y=True)
    n, sd = t.spread(1e4)  # at x = 4: 5, 5.4, 5.8: sd 0.4
    assert n == 3 and sd == pytest.approx(0.4)
    q = scipy_stats.t.ppf(0.975, 2)
    value, lo, hi = t.at(1e4)
    assert math.log10(hi) - 5.4 == pytest.approx(q * 0.4 / math.sqrt(3))  # the mean's interval
    v = {"value": value, "lo": lo, "hi": hi, "seeds": n, "sd_log10": sd}
    one = logit_hit_interval(v, 1)
    assert math.log10(one[1]) - 5.4 == pytest.approx(q * 0.4 * math.sqrt(1 / 3 + 1))
    assert math.log10(one[0]) - 5.4 == pytest.approx(-q * 0.4 * math.sqrt(1 / 3 + 1))
    four = logit_hit_interval(v, 4)
    assert math.log10(four[1]) - 5.4 == pytest.approx(q * 0.4 * math.sqrt(1 / 3 + 1 / 4))
    # a run just outside the mean's interval but inside one run's: a hit; beyond one run's: a miss
    x = 10 ** (5.4 + q * 0.4 / math.sqrt(3) * 1.5)
    pred = {"targets": {TARGET: {"max_logit": {"none": v}, "max_logit_order": [], "high_rate_loss_order": [],
                                 "sensitivity_order": []}}}
    got = check(pred, [_result("none", "none", x, 6.0)], TARGET, True)[0]
    assert got.outcome == "hit" and "1 run(s)" in got.why
    got = check(pred, [_result("none", "none", one[1] * 1.01, 6.0)], TARGET, True)[0]
    assert got.outcome == "miss"
    # two runs: their geometric mean is what is read, within the two-run interval
    two = logit_hit_interval(v, 2)
    pair = [_result("none", "none", two[1] * 0.99 * 10, 6.0), _result("none", "none", two[1] * 0.99 / 10, 6.0)]
    got = check(pred, pair, TARGET, True)[0]
    assert got.outcome == "hit" and "geometric mean of 2" in got.measured
    # a file written without the spread (scale_1.json) hits within the mean's interval, as registered
    bare = {"targets": {TARGET: {**pred["targets"][TARGET], "max_logit": {"none": {"value": value, "lo": lo,
                                                                                    "hi": hi}}}}}
    assert check(bare, [_result("none", "none", x, 6.0)], TARGET, True)[0].outcome == "miss"


def test_tuned_rate_predictions_against_the_result_files(tmp_path):
    """The predicted tuned rate at each target, recomputed straight from ladder_english's result files: per
    seed and width the rate with the lowest selection-split loss, a least-squares line of log10 rate on
    log10 non-embedding parameters per seed, the mean of the seeds' lines at the target and its t-interval."""
    import json
    from collections import defaultdict
    from pathlib import Path

    import numpy as np
    from scipy import stats as scipy_stats

    from qklab.report.predictions import TARGETS, make_predictions
    from qklab.study.analyze import analyze, load_results

    root = Path(__file__).resolve().parents[2] / "docs/results/ladder_english"
    results, studies = load_results([root])
    pred = make_predictions(analyze(results, studies).groups, "x", "x")
    best: dict = defaultdict(dict)  # (variant, seed) -> width -> (val loss, lr)
    size: dict = {}
    for f in root.glob("*/result.json"):
        r = json.loads(f.read_text())
        d, v = r["config"]["model"]["d_model"], r["config"]["model"]["vocab_size"]
        size[(r["variant"], d)] = r["n_params"] - v * d  # tied embeddings
        key, got = (r["variant"], r["seed"]), (r["final"]["val_loss"], r["lr"])
        best[key][d] = min(best[key].get(d, got), got)
    key_of = {"none": "none", "qknorm": "qknorm", "qkmap": "qkmap", "quack-t1": "quack"}
    for label, n in TARGETS.items():
        for variant, m in key_of.items():
            at = []
            for seed in (0, 1):
                ws = sorted(best[(variant, seed)])
                x = np.log10([size[(variant, w)] for w in ws])
                y = np.log10([best[(variant, seed)][w][1] for w in ws])
                b, a = np.polyfit(x, y, 1)
                at.append(a + b * np.log10(n))
            half = scipy_stats.t.ppf(0.975, 1) * np.std(at, ddof=1) / np.sqrt(2)
            want = [10 ** np.mean(at), 10 ** (np.mean(at) - half), 10 ** (np.mean(at) + half)]
            got = pred["targets"][label]["tuned_rate"][m]
            assert [got["value"], got["lo"], got["hi"]] == pytest.approx(want, rel=1e-9), (label, m)
