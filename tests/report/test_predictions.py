"""Registered predictions against a larger run's results: hit, miss and not tested, on planted numbers."""

from __future__ import annotations

import math

import numpy as np
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
    """A measured max logit hits within value -+ t(df) sqrt(sd^2/n + s^2/k) on log10: sd the spread of the n
    seeds' fits at the target, s the pooled spread of seeds within one size, k the runs measured, df by
    Welch-Satterthwaite, never narrower than the mean's own interval; by hand against scipy."""
    from scipy import stats as scipy_stats

    from qklab.report.predictions import _predict, logit_hit_interval
    from qklab.study.sensitivity import run_interval, within_spread

    # three seeds at sizes 10, 100, 1000 (x = 1, 2, 3): log10 y = 1 + (1 + 0.02 s) x + e, e = +-0.2 by size
    # and seed: seed noise well above the spread of the seeds' slopes
    noise = {1: 0.2, 2: -0.2, 3: 0.2}
    vals = [{s: 10 ** (1 + (1 + 0.02 * s) * x + noise[x] * (1 if s != 1 else -1)) for s in range(3)}
            for x in (1, 2, 3)]
    # within each size the three log values: 1 + x + e, 1 + 1.02x - e, 1 + 1.04x + e (pooled over the sizes)
    ss, df = 0.0, 0
    for x in (1, 2, 3):
        y = [1 + x + noise[x], 1 + 1.02 * x - noise[x], 1 + 1.04 * x + noise[x]]
        ss, df = ss + sum((v - sum(y) / 3) ** 2 for v in y), df + 2
    assert within_spread(vals, log_y=True) == pytest.approx((math.sqrt(ss / df), 6))
    v = _predict([10, 100, 1000], vals, 1e4, log_y=True)
    fits = []  # each seed's own least-squares line at x = 4
    for s in range(3):
        b, a = np.polyfit([1, 2, 3], [math.log10(vals[k][s]) for k in range(3)], 1)
        fits.append(a + 4 * b)
    n, sd, mid = 3, float(np.std(fits, ddof=1)), float(np.mean(fits))
    assert (v["seeds"], v["sd"], math.log10(v["value"])) == pytest.approx((n, sd, mid))
    s2 = ss / df
    for k in (1, 4):
        v1, v2 = sd * sd / n, s2 / k
        dfw = (v1 + v2) ** 2 / (v1 ** 2 / (n - 1) + v2 ** 2 / 6)  # Welch-Satterthwaite
        half = max(scipy_stats.t.ppf(0.975, dfw) * math.sqrt(v1 + v2),  # never below the mean's own half-width
                   scipy_stats.t.ppf(0.975, n - 1) * math.sqrt(v1))
        lo, hi = logit_hit_interval(v, k)
        assert (math.log10(lo), math.log10(hi)) == pytest.approx((mid - half, mid + half))
    assert (v["run_lo"], v["run_hi"]) == pytest.approx(logit_hit_interval(v, 1))
    one = logit_hit_interval(v, 1)
    # the mean's interval alone is narrower: a run just outside it but inside one run's is a hit
    assert one[0] < v["lo"] and v["hi"] < one[1]
    x = math.sqrt(v["hi"] * one[1])
    pred = {"targets": {TARGET: {"max_logit": {"none": v}, "max_logit_order": [], "high_rate_loss_order": [],
                                 "sensitivity_order": []}}}
    got = check(pred, [_result("none", "none", x, 6.0)], TARGET, True)[0]
    assert got.outcome == "hit" and "1 run(s)" in got.why
    assert check(pred, [_result("none", "none", one[1] * 1.01, 6.0)], TARGET, True)[0].outcome == "miss"
    # two seeds: their geometric mean is read, within the two-run interval
    two = logit_hit_interval(v, 2)
    pair = [{**_result("none", "none", two[1] * 0.99 * 10, 6.0), "seed": 0},
            {**_result("none", "none", two[1] * 0.99 / 10, 6.0), "seed": 1}]
    got = check(pred, pair, TARGET, True)[0]
    assert got.outcome == "hit" and "geometric mean of 2 seeds" in got.measured
    # a file registered without the spread (scale_1.json) hits within its registered interval
    bare = {"targets": {TARGET: {**pred["targets"][TARGET], "max_logit": {"none": {
        "value": v["value"], "lo": v["lo"], "hi": v["hi"]}}}}}
    assert check(bare, [_result("none", "none", x, 6.0)], TARGET, True)[0].outcome == "miss"
    # the half-width never falls below the mean's: seed noise far below the fits' spread leaves the mean's
    lo, hi = run_interval(0.0, 3, 1.0, 1e-6, 100, 1)
    assert hi == pytest.approx(scipy_stats.t.ppf(0.975, 2) / math.sqrt(3)) and lo == -hi
    assert run_interval(2.0, 3, 0.0, 0.0, 6) == (2.0, 2.0)  # every seed alike at every size: zero width
    # too few seeds for an interval: not written, and a file with one anyway reads "not tested", not "miss"
    assert _predict([10, 100, 1000], [{0: 10.0}, {0: 100.0}, {0: 1000.0}], 1e4, log_y=True) is None
    # a bounded quantity (a loss at most L0) is held within its bounds, value and intervals alike
    capped = _predict([10, 100, 1000], vals, 1e4, log_y=False, bounds=(-math.inf, 1e4))
    assert all(capped[k] <= 1e4 for k in ("value", "lo", "hi", "run_lo", "run_hi")) and capped["run_hi"] == 1e4
    nan_file = {"targets": {TARGET: {**pred["targets"][TARGET], "max_logit": {"none": {**v, "seeds": 1}}}}}
    assert check(nan_file, [_result("none", "none", v["value"], 6.0)], TARGET, True)[0].outcome == "not tested"


def test_what_a_run_measured_reads_losses_as_the_predictions_do():
    """A blow-up counts as L0 in the measured loss too (so 'none above qknorm' is tested when none blows up),
    losses above L0 tie at L0, and a method run at several rates is not read (one rate per method)."""
    from qklab.report.predictions import _measured

    l0 = math.log(4096)

    def cell(method, loss, seed=0, mult=1.0, logit=10.0):
        return {**_result(method, "none", logit, loss), "seed": seed, "lr_mult": mult,
                "config": {"model": {"vocab_size": 4096}}}

    got = _measured([cell("none", "inf"), cell("qknorm", 5.0), cell("qkmap", 12.0), cell("quest", 9.0, logit="nan")])
    assert got["none"]["report_loss"] == l0 and got["qkmap"]["report_loss"] == l0 and got["quest"] == {
        "report_loss": l0, "loss_runs": 1, "logit_lost": 1}
    pred = {"targets": {TARGET: {"max_logit": {}, "max_logit_order": [], "sensitivity_order": [],
                                 "high_rate_loss_order": [{"upper": "none", "lower": "qknorm", "relation": "above"}]}}}
    c = {x.id.split(" @ ")[0]: x for x in check(pred, [cell("none", "inf"), cell("qknorm", 5.0)], TARGET, True)}
    assert c["high_rate_loss_order"].outcome == "hit"
    # several rates of one method: not read; several seeds at one rate: counted as seeds
    got = _measured([cell("none", 5.0, 0, 0.25, 10.0), cell("none", 5.0, 0, 1.0, 100.0), cell("qknorm", 5.0, 0),
                     cell("qknorm", 5.0, 1, logit=1000.0)])
    assert got["none"] == {"rates": 2}
    # two variants of one method at one rate (quack at two taus, say) are not merged seed by seed either
    assert _measured([{**cell("quack", 5.0), "variant": "quack-t1"},
                      {**cell("quack", 6.0), "variant": "quack-t2"}])["quack"] == {"rates": 2}
    assert got["qknorm"]["runs"] == 2 and got["qknorm"]["max_logit"] == pytest.approx(100.0)
    pred = {"targets": {TARGET: {"max_logit": {"none": {"value": 10.0, "lo": 5.0, "hi": 20.0}},
                                 "max_logit_order": [], "high_rate_loss_order": [], "sensitivity_order": []}}}
    c = check(pred, [cell("none", 5.0, 0, 0.25, 10.0), cell("none", 5.0, 0, 1.0, 100.0)], TARGET, True)[0]
    assert c.outcome == "not tested" and "2 rates" in c.why


def _grid_group(method: str, controller: str, losses: dict, logits: dict, chosen: float = 1.0):
    """A planted analysed group on the grid x0.25 .. x8 (rate multiple -> seed -> value)."""
    from qklab.study.analyze import Group, RateOutcome

    grid = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    return Group(study="gpu_scale", variant=controller if controller != "none" else method, method=method,
                 controller=controller, d_model=1024, vocab_size=4096, chosen=chosen, grid=grid,
                 sweep={m: RateOutcome(lr=m * 3.75e-4) for m in losses},
                 grid_final={"report_loss": losses, "max_logit": logits})


def test_a_rate_grid_is_read_as_the_fits_read_the_ladder():
    """A run on the whole rate grid gives, per method, LR sensitivity over the grid (Wortsman's mean of
    min(L, L0) - L*, over seeds) and the max logit (geometric mean) and loss (capped at L0) at 4x the chosen
    rate: each against a hand computation, then checked as values and orders; a grid with a rate missing is not
    read (a rate chosen from part of it is not the tuned one)."""
    from qklab.report.predictions import _measured_grid, hit_interval

    l0 = math.log(4096)
    mults = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    none_loss = {m: {0: v, 1: v + 0.1} for m, v in zip(mults, (5.0, 4.6, 4.4, 4.5, 5.2, float("inf")), strict=True)}
    none_logit = {m: {0: 10.0 * m, 1: 40.0 * m} for m in mults}
    qkn_loss = {m: {0: v, 1: v} for m, v in zip(mults, (4.9, 4.5, 4.4, 4.4, 4.5, 4.7), strict=True)}
    qkn_logit = {m: {0: 8.0, 1: 8.0} for m in mults}
    groups = [_grid_group("none", "none", none_loss, none_logit), _grid_group("qknorm", "none", qkn_loss, qkn_logit),
              _grid_group("none", "quack", {m: v for m, v in qkn_loss.items() if m != 8.0}, qkn_logit)]
    got = _measured_grid(groups)
    # none: per seed [0.6, 0.2, 0, 0.1, 0.8, L0 - 4.4] (seed 1 alike: its L* is 4.5 and its L0 term L0 - 4.5)
    s0 = (0.6 + 0.2 + 0 + 0.1 + 0.8 + (l0 - 4.4)) / 6
    s1 = (0.6 + 0.2 + 0 + 0.1 + 0.8 + (l0 - 4.5)) / 6
    assert got["none"]["sensitivity"] == pytest.approx((s0 + s1) / 2) and got["none"]["sensitivity_runs"] == 2
    assert got["none"]["max_logit"] == pytest.approx(math.sqrt(40.0 * 160.0))  # at x4: 40 and 160
    assert got["none"]["report_loss"] == pytest.approx(5.25) and got["none"]["loss_runs"] == 2
    assert got["qknorm"]["sensitivity"] == pytest.approx((0.5 + 0.1 + 0 + 0 + 0.1 + 0.3) / 6)
    assert got["quack"] == {"grid": "5 of 6 rates finished"}
    # the chosen rate at x4: x4 x4 = 16 is off the grid, so the high rate is not measured (sensitivity is)
    hi = _measured_grid([_grid_group("none", "none", none_loss, none_logit, chosen=4.0)])["none"]
    assert "max_logit" not in hi and "sensitivity" in hi
    one = {"targets": {TARGET: {"max_logit": {"none": {"value": 10.0, "lo": 5.0, "hi": 20.0}},
                                "max_logit_order": [], "high_rate_loss_order": [], "sensitivity_order": []}}}
    c4 = check(one, [], TARGET, True, [_grid_group("none", "none", none_loss, none_logit, chosen=4.0)])[0]
    assert c4.outcome == "not tested" and "4x its chosen rate (x4) is not on the grid" in c4.why
    c0 = check(one, [], TARGET, True, [_grid_group("none", "none", none_loss, none_logit, chosen=None)])[0]
    assert "no rate chosen" in c0.why
    # a blow-up at x4 is named as one, not as a rate off the grid; one seed of two blown up is left out, said so
    blown = {m: dict(v) for m, v in none_logit.items()} | {4.0: {0: math.nan, 1: math.inf}}
    cb = check(one, [], TARGET, True, [_grid_group("none", "none", none_loss, blown)])[0]
    assert cb.outcome == "not tested" and "every seed (2) blew up at 4x its chosen rate (x4)" in cb.why
    half = {m: dict(v) for m, v in none_logit.items()} | {4.0: {0: 16.0, 1: math.nan}}
    ch = check(one, [], TARGET, True, [_grid_group("none", "none", none_loss, half)])[0]
    assert ch.outcome == "hit" and ch.measured == "16 (1 more seed(s) blew up: no finite max logit, left out)"
    spread = {"seeds": 3, "sd": 0.05, "run_sd": 0.05, "run_df": 6}
    pred = {"targets": {TARGET: {
        "max_logit": {}, "max_logit_order": [],
        "high_rate_loss": {"none": {"value": 5.2, "lo": 5.0, "hi": 5.4, **spread},
                           "qknorm": {"value": 6.0, "lo": 5.9, "hi": 6.1, **spread}},
        "high_rate_loss_order": _order({"none": [5.2, 5.0, 5.4], "qknorm": [4.45, 4.3, 4.6]}),
        "sensitivity": {"none": {"value": 1.0, "lo": 0.8, "hi": 1.2, **spread}},
        "sensitivity_order": _order({"none": [1.0, 0.8, 1.2], "qknorm": [0.2, 0.1, 0.3]})}}}
    c = {x.id.split(" @ ")[0]: x for x in check(pred, [], TARGET, True, groups[:2])}
    lo, hi_ = hit_interval(pred["targets"][TARGET]["high_rate_loss"]["none"], 2, log_y=False)
    assert lo < 5.25 < hi_ and c["high_rate_loss none"].outcome == "hit" and "mean of 2 seeds" in c[
        "high_rate_loss none"].measured
    assert c["high_rate_loss qknorm"].outcome == "miss"  # 4.5 measured, 6.0 predicted
    # measured 0.928; predicted 1.0 -+ t sqrt(0.05^2 / 3 + 0.05^2 / 2) (about -+0.11) for two runs: a hit
    assert c["sensitivity none"].outcome == "hit" and (s0 + s1) / 2 == pytest.approx(0.928, abs=1e-3)
    far = {**pred["targets"][TARGET]["sensitivity"]["none"], "value": 1.2}
    assert check({"targets": {TARGET: {**pred["targets"][TARGET], "sensitivity": {"none": far}}}}, [], TARGET,
                 True, groups[:2])[2].outcome == "miss"
    assert c["sensitivity_order"].outcome == "hit" and c["high_rate_loss_order"].outcome == "hit"
    # another regime: the grid's orders are observations, its values not tested
    o = {x.id.split(" @ ")[0]: x for x in check(pred, [], TARGET, False, groups[:2])}
    assert o["sensitivity none"].outcome == "not tested" and "another regime" in o["sensitivity_order"].why


def test_each_target_is_checked_against_the_payload_that_measures_it(tmp_path):
    """The report checks a target against the run of the payload study its label (or, from schema 2 on, the
    file) names, in that payload's regime: values are tested only against gpu_scale."""
    import hashlib
    import json

    from qklab.report.predictions import TARGETS, LargerRun, first_target, payload_of, predictions_lines

    assert [payload_of(label, {}) for label in TARGETS] == ["gpu_scale", "gpu_payload", None]
    assert payload_of("x", {"payload": "gpu_scale"}) == "gpu_scale"
    # a check's default target: the first of TARGETS' order the file has (files are written with sorted keys)
    labels = list(TARGETS)
    assert first_target({"targets": {x: {} for x in sorted(labels)}}) == labels[0]
    assert first_target({"targets": {x: {} for x in sorted(labels)}}, "gpu_payload") == labels[1]
    assert first_target({"targets": {x: {} for x in labels[1:]}}) == labels[1]  # scale_1.json: 38M first
    assert first_target({"targets": {x: {} for x in labels[1:]}}, "gpu_scale") is None
    v = {"value": 100.0, "lo": 50.0, "hi": 200.0}
    t = {"max_logit": {"none": v}, "max_logit_order": [], "high_rate_loss_order": [], "sensitivity_order": []}
    pred = {"targets": {"51M (gpu_scale: w)": t, "38M (gpu_payload: w)": t, "124M (GPT-2 small)": t}}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(pred))
    rec = {"s": {"predictions": [{"file": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}]}}
    run = [_result("none", "none", 120.0, 5.0)]
    lines = predictions_lines(rec, {"gpu_scale": LargerRun("gpu_scale", run, [], True),
                                    "gpu_payload": LargerRun("gpu_payload", run, [], False)})
    logit = [ln for ln in lines if "max_logit none" in ln]
    assert logit[0].startswith("  - HIT ") and "@ 51M" in logit[0]
    assert logit[1].startswith("  - NOT TESTED") and "another regime" in logit[1]
    assert logit[2].startswith("  - NOT YET TESTED") and "@ 124M" in logit[2]
