"""The widest width held out of each trend across scale, against hand computations on planted ladders."""

from __future__ import annotations

import math

import pytest

from qklab.report.holdout import held_out, held_out_data, held_out_table
from qklab.report.scale import MethodScale

SIZES = [1e5, 1e6, 1e7, 1e8]  # log10: 5, 6, 7, 8
WIDTHS = [64, 128, 256, 512]


def _ladder(variant: str, sens_at_widest: dict[int, float], logit_at_widest: dict[int, float] | None,
            seeds: tuple[int, ...] = (0, 1)) -> MethodScale:
    """LR sensitivity 0.1 + 0.1 (x - 5) + 0.01 s at the fitted widths (x = log10 size, s the seed); max logit
    at x4 the tuned rate 10^(1 + 0.5 (x - 5) + 0.02 s); tuned rate 1e-3 halving per width."""
    xs = [math.log10(s) for s in SIZES]
    sens = [{s: 0.1 + 0.1 * (x - 5) + 0.01 * s for s in seeds} for x in xs[:3]] + [sens_at_widest]
    tuned = [{s: 1e-3 / 2 ** i for s in seeds} for i in range(4)]
    logit = [{s: 10 ** (1 + 0.5 * (x - 5) + 0.02 * s) for s in seeds} for x in xs[:3]]
    logits = ({4.0: (WIDTHS, SIZES, [*logit, logit_at_widest])} if logit_at_widest
              else {4.0: (WIDTHS[:3], SIZES[:3], logit)})
    return MethodScale("planted", variant, WIDTHS, SIZES, sens, tuned, logits, None)


def test_held_out_by_hand():
    bent = _ladder("bent", {0: 0.45, 1: 0.47}, {0: 10 ** 2.5, 1: 10 ** 2.52})
    rows = {(h.variant, h.quantity): h for h in held_out([bent, _ladder("straight", {0: 0.40, 1: 0.41}, None)])}
    # sensitivity: seed means 0.105, 0.205, 0.305 at x = 5, 6, 7: the line reaches 0.405 at x = 8; every
    # resample's means lie within 0.005 of them, so its line at x = 8 within 0.005 + 3 * 0.005 (leverage)
    h = rows[("bent", "LR sensitivity")]
    assert h.predicted == pytest.approx(0.405) and h.measured == pytest.approx(0.46) and h.n == 2
    assert 0.385 <= h.lo <= 0.405 <= h.hi <= 0.425
    assert h.outcome == "miss" and h.off_by == pytest.approx(0.055) and h.fitted == tuple(SIZES[:3])
    assert rows[("straight", "LR sensitivity")].outcome == "hit"  # 0.405 measured
    # max logit at x4 (log-log): log10 means 1.01, 1.51, 2.01 -> 2.51 at x = 8; measured: the geometric mean
    # of 10^2.5 and 10^2.52 is 10^2.51 (the arithmetic one would be 10^2.5103...)
    h = rows[("bent", "max logit at x4 the tuned rate")]
    assert h.predicted == pytest.approx(10 ** 2.51) and h.measured == pytest.approx(10 ** 2.51)
    assert h.outcome == "hit" and h.off_by == pytest.approx(1.0) and h.log_y
    # the widest width's grid lacks x4 its tuned rate: no such row
    assert ("straight", "max logit at x4 the tuned rate") not in rows
    # tuned rate: halving per width is a straight log-log line, extrapolated exactly
    h = rows[("bent", "tuned rate")]
    assert h.predicted == pytest.approx(1.25e-4) and h.measured == pytest.approx(1.25e-4) and h.outcome == "hit"
    head, body = held_out_table([rows[("bent", "LR sensitivity")], rows[("bent", "max logit at x4 the tuned rate")]])
    first = dict(zip(head, body[0], strict=True))
    assert first["fitted on (non-embedding parameters)"] == "0.1M, 1M, 10M" and first["held out"] == "100M"
    assert first["measured (n)"] == "0.46 (n=2)" and first["outcome"] == "miss"
    assert first["predicted (bootstrap 95%)"].startswith("0.405 [")
    second = dict(zip(head, body[1], strict=True))
    assert second["measured vs predicted (x: ratio, log-log; +/-: difference)"] == "x1.00"
    data = held_out_data([rows[("bent", "LR sensitivity")]])[0]
    assert data["outcome"] == "miss" and data["off_by"] == pytest.approx(0.055) and data["fitted"] == SIZES[:3]


def test_one_seed_per_width_has_no_interval_and_three_widths_no_row():
    one = _ladder("one", {0: 0.40}, {0: 10 ** 2.5}, seeds=(0,))
    rows = held_out([one])
    assert rows and all(h.outcome == "no interval" and math.isnan(h.lo) for h in rows)
    assert held_out_table(rows)[1][0][5] == "0.4 -"  # seed 0 alone: 0.1, 0.2, 0.3 -> 0.4
    short = MethodScale("planted", "short", WIDTHS[:3], SIZES[:3], one.sensitivity[:3], one.tuned[:3], {}, None)
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

    assert [millions(n) for n in (2.1357e5, 1.26e7, 8.5e7, 1.2386e8, 1.3e9)] == ["0.21M", "13M", "85M", "124M",
                                                                                 "1300M"]
