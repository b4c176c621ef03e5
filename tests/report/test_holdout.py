"""The widest width held out of each trend across scale, against hand computations on planted ladders."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import scipy.stats as sps

from qklab.report.holdout import held_out, held_out_data, held_out_table
from qklab.report.scale import MethodScale

SIZES = [1e5, 1e6, 1e7, 1e8]  # log10: 5, 6, 7, 8
WIDTHS = [64, 128, 256, 512]
SEEDS = (0, 1, 2)


def _ladder(variant: str, sens_at_widest: dict[int, float], logit_at_widest: dict[int, float] | None,
            seeds: tuple[int, ...] = SEEDS) -> MethodScale:
    """LR sensitivity 0.1 + 0.1 (x - 5) + 0.01 s at the fitted widths (x = log10 size, s the seed): seed s's
    own line reaches 0.4 + 0.01 s at x = 8; max logit at x4 the tuned rate 10^(1 + 0.5 (x - 5) + 0.02 s),
    reaching 10^(2.5 + 0.02 s); tuned rate 1e-3 halving per width, alike for every seed."""
    xs = [math.log10(s) for s in SIZES]
    sens = [{s: 0.1 + 0.1 * (x - 5) + 0.01 * s for s in seeds} for x in xs[:3]] + [sens_at_widest]
    tuned = [{s: 1e-3 / 2 ** i for s in seeds} for i in range(4)]
    logit = [{s: 10 ** (1 + 0.5 * (x - 5) + 0.02 * s) for s in seeds} for x in xs[:3]]
    logits = ({4.0: (WIDTHS, SIZES, [*logit, logit_at_widest])} if logit_at_widest
              else {4.0: (WIDTHS[:3], SIZES[:3], logit)})
    return MethodScale("planted", variant, WIDTHS, SIZES, sens, tuned, logits, None)


def _t(errors: list[float]) -> tuple[float, float, float]:
    """mean and 95% t-interval, directly from scipy"""
    e = np.asarray(errors)
    half = sps.t.ppf(0.975, e.size - 1) * e.std(ddof=1) / math.sqrt(e.size)
    return e.mean(), e.mean() - half, e.mean() + half


def test_held_out_by_hand():
    bent = _ladder("bent", {0: 0.45, 1: 0.47, 2: 0.47}, {s: 10 ** (2.5 + 0.02 * s + e) for s, e in
                                                         zip(SEEDS, (0.01, -0.01, 0.0), strict=True)})
    straight = _ladder("straight", {0: 0.40, 1: 0.415, 2: 0.418}, None)
    rows = {(h.variant, h.quantity): h for h in held_out([bent, straight])}
    # sensitivity: each seed's error at x = 8 is measured - (0.4 + 0.01 s): 0.05, 0.06, 0.05
    h = rows[("bent", "LR sensitivity")]
    mean, lo, hi = _t([0.05, 0.06, 0.05])
    assert (h.error, h.lo, h.hi) == pytest.approx((mean, lo, hi)) and lo > 0
    assert h.outcome == "miss" and h.n == 3 and h.fitted == tuple(SIZES[:3])
    assert h.predicted == pytest.approx(0.41) and h.measured == pytest.approx(1.39 / 3)  # seed means' line
    h = rows[("straight", "LR sensitivity")]  # errors 0, 0.005, -0.002
    assert h.error == pytest.approx(0.001) and h.lo < 0 < h.hi and h.outcome == "hit"
    # max logit at x4 (log-log): errors in log10 0.01, -0.01, 0; predicted and measured geometric means
    h = rows[("bent", "max logit at x4 the tuned rate")]
    assert (h.error, h.lo, h.hi) == pytest.approx(_t([0.01, -0.01, 0.0]), abs=1e-12)
    assert h.predicted == pytest.approx(10 ** 2.52) and h.measured == pytest.approx(10 ** 2.52)
    assert h.outcome == "hit" and h.log_y and h.shown(h.error) == "x1.00"
    # the widest width's grid lacks x4 its tuned rate: no such row
    assert ("straight", "max logit at x4 the tuned rate") not in rows
    # tuned rate: every seed alike, so no spread to judge an error by (a grid gives such ties)
    h = rows[("bent", "tuned rate")]
    assert h.predicted == pytest.approx(1.25e-4) and h.measured == pytest.approx(1.25e-4)
    assert h.outcome == "no interval"
    head, body = held_out_table([rows[("bent", "LR sensitivity")], rows[("bent", "max logit at x4 the tuned rate")]])
    first = dict(zip(head, body[0], strict=True))
    assert first["fitted on (non-embedding parameters)"] == "0.1M, 1M, 10M" and first["held out"] == "100M"
    assert (first["predicted"], first["measured"], first["seeds"], first["outcome"]) == ("0.41", "0.463", "3", "miss")
    assert first["measured vs predicted (x: ratio, log-log; +/-: difference), 95% CI"] == \
        f"+0.053 [{lo:+.3f}, {hi:+.3f}]"
    second = dict(zip(head, body[1], strict=True))
    assert second["measured vs predicted (x: ratio, log-log; +/-: difference), 95% CI"].startswith("x1.00 [x0.")
    assert second["predicted"] == "331" and held_out_table([replace(h, predicted=1898.4)])[1][0][5] == "1900"
    data = held_out_data([rows[("bent", "LR sensitivity")]])[0]
    assert data["outcome"] == "miss" and data["error"] == pytest.approx(mean) and data["fitted"] == SIZES[:3]


def test_seeds_not_measured_everywhere_and_too_few_widths():
    """Only seeds measured at every width count; one such seed gives no interval, two too few to judge by;
    three widths, no row."""
    partial = _ladder("partial", {0: 0.42}, {0: 10 ** 2.5, 1: 10 ** 2.52})  # seeds 1, 2 not yet at the widest
    rows = {h.quantity: h for h in held_out([partial])}
    assert rows["LR sensitivity"].n == 1 and rows["LR sensitivity"].outcome == "no interval"
    assert rows["LR sensitivity"].error == pytest.approx(0.02) and math.isnan(rows["LR sensitivity"].lo)
    assert rows["max logit at x4 the tuned rate"].n == 2  # seeds 0 and 1: an interval, but too wide to judge by
    assert math.isfinite(rows["max logit at x4 the tuned rate"].lo)
    assert rows["max logit at x4 the tuned rate"].outcome == "too few seeds"
    assert held_out_table([rows["LR sensitivity"]])[1][0][8] == "+0.020 -"
    short = MethodScale("planted", "short", WIDTHS[:3], SIZES[:3], partial.sensitivity[:3], partial.tuned[:3],
                        {}, None)
    assert held_out([short]) == []


def _sized(folder) -> None:
    """Give each planted result the sizes a trend needs: 64 embedding rows, 12 d^2 parameters a block."""
    import json

    for f in folder.glob("*/result.json"):
        r = json.loads(f.read_text())
        d = r["config"]["model"]["d_model"]
        r["config"]["model"]["vocab_size"], r["n_params"] = 64, 64 * d + 12 * d * d
        f.write_text(json.dumps(r))


def test_the_report_shows_it_at_four_widths_and_not_at_three(tmp_path, monkeypatch):
    """Through the whole report (figures left out): the section and report.json's ``held_out`` hold the rows
    held_out gives on the analysed groups; a ladder of three widths has neither."""
    import json

    from qklab.report import render
    from qklab.report.scale import method_scales
    from qklab.study.analyze import analyze, load_results
    from tests.report import test_ladder
    from tests.report.test_ladder import _ladder as planted

    monkeypatch.setitem(test_ladder.GAP, 512, (0.2, 0.1, 0.15, 0.3))
    monkeypatch.setattr(render, "draw", lambda data, out: {})
    monkeypatch.setattr(render, "draw_scale", lambda *a: None)
    planted(tmp_path, widths=(64, 128, 256, 512))
    _sized(tmp_path / "ladder")
    want = held_out(method_scales(analyze(*load_results([tmp_path / "ladder"])).groups))
    assert {h.variant for h in want} == {"none", "qkmap"}
    out = render.write_report([tmp_path / "ladder"], tmp_path / "report")
    md = (out / "report.md").read_text()
    assert "## The widest width held out" in md
    assert json.loads((out / "report.json").read_text())["held_out"] == json.loads(json.dumps(held_out_data(want)))
    for h in want:
        assert f"| {h.study} | {h.variant} | {h.quantity} |" in md
    planted(tmp_path / "three", widths=(64, 128, 256))
    _sized(tmp_path / "three" / "ladder")
    out = render.write_report([tmp_path / "three" / "ladder"], tmp_path / "report3")
    assert "held out" not in (out / "report.md").read_text()
    assert "held_out" not in json.loads((out / "report.json").read_text())


def test_sizes_read_in_millions_without_exponents():
    from qklab.report.scale import millions

    assert [millions(n) for n in (2.1357e5, 1.26e7, 8.5e7, 9.96e7, 1.2386e8, 1.3e9, float("nan"))] == [
        "0.21M", "13M", "85M", "100M", "124M", "1300M", "-"]
