"""The width-ladder table: each variant's gap to its reference at each width, both at their own chosen rate
there, and the gap's change from the narrowest width to the widest, checked against a direct computation
(numpy means, scipy t-intervals) on planted results."""

from __future__ import annotations

import numpy as np
import scipy.stats as sps

from qklab.report.ladder import ladder_table
from qklab.study.analyze import analyze, load_results
from qklab.study.result import write_json_atomic
from tests.study.synthetic import result

SEEDS = (0, 1, 2, 3)
NOISE = (0.0, 0.011, -0.007, 0.019)
GAP = {64: (0.01, 0.03, 0.02, 0.00), 128: (0.05, 0.02, 0.06, 0.03), 256: (0.12, 0.08, 0.10, 0.15)}


def _ci(x) -> str:
    x = np.asarray(x, dtype=float)
    h = sps.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return f"{x.mean():+.3f} [{x.mean() - h:+.3f}, {x.mean() + h:+.3f}]"


def _ladder(tmp_path, widths=(64, 128, 256), point=lambda w: {"shape": w}):
    """none and qkmap at each width on x1 and x2: none best at x1 everywhere, qkmap best at x2 from width 128
    on (planted selection losses); qkmap's report loss is none's minus GAP[width][seed] at its chosen rate."""
    res = tmp_path / "ladder"
    write_json_atomic(res / "study.json", {"name": "l", "config": "tiny", "seeds": list(SEEDS),
                                           "variants": {"none": {}, "qkmap": {}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0, 2.0]}})
    for w in widths:
        for s in SEEDS:
            base = 5.0 + NOISE[s] - 0.1 * (w // 64)
            for v, m, sel, rep in (("none", 1.0, base, base), ("none", 2.0, base + 0.2, base + 0.2),
                                   ("qkmap", 1.0, base + (0.05 if w > 64 else -0.05), base - GAP[w][s]),
                                   ("qkmap", 2.0, base - (0.05 if w > 64 else -0.05), base - GAP[w][s])):
                c = result(v, m, s, sel, rep, method=v, study="l")
                c["cell"] = f"{v}_shape{w}_lr{m:g}_s{s}"
                c["point"], c["config"]["model"]["d_model"] = point(w), w
                write_json_atomic(res / c["cell"] / "result.json", c)
    return analyze(*load_results([res])).groups


def test_gap_by_width_and_its_change(tmp_path):
    head, rows = ladder_table(_ladder(tmp_path))
    assert head[3:6] == [f"gap at width {w} (95% CI; rates)" for w in (64, 128, 256)]
    assert len(rows) == 1  # the reference has no row of its own
    row = dict(zip(head, rows[0], strict=True))
    assert (row["study"], row["variant"], row["reference"]) == ("l", "qkmap", "none")
    assert row["gap at width 64 (95% CI; rates)"] == f"{_ci(GAP[64])}; x1 vs x1"
    assert row["gap at width 128 (95% CI; rates)"] == f"{_ci(GAP[128])}; x2 vs x1"
    assert row["gap at width 256 (95% CI; rates)"] == f"{_ci(GAP[256])}; x2 vs x1"
    assert row["change, widest - narrowest (95% CI)"] == _ci(np.subtract(GAP[256], GAP[64]))
    assert row["n"] == "4" and row["p (sign-flip)"] == f"{2 / 16:.3g}"  # every seed's gap grew


def test_no_ladder_without_two_widths_or_with_another_grid(tmp_path):
    assert ladder_table(_ladder(tmp_path / "one", widths=(128,)))[1] == []
    # two grid points at each width (a grid over something else too): not a ladder, no rows
    groups = _ladder(tmp_path / "two", widths=(64, 128, 256))
    extra = _ladder(tmp_path / "three", widths=(64, 128, 256), point=lambda w: {"shape": w, "other": 1})
    assert ladder_table(groups + extra)[1] == []


def test_a_missing_middle_width_leaves_its_columns_out(tmp_path):
    head, rows = ladder_table(_ladder(tmp_path, widths=(64, 256)))
    assert [h for h in head if h.startswith("gap at")] == ["gap at width 64 (95% CI; rates)",
                                                           "gap at width 256 (95% CI; rates)"]
    assert rows[0][-3] == _ci(np.subtract(GAP[256], GAP[64]))


def test_figures_give_each_width_its_own_panel(tmp_path, monkeypatch):
    """A ladder's figures draw each width in a panel of its own, where its variants compete; each series
    holds that width's cells (the planted selection losses), and a method keeps one colour at every width."""
    from qklab.report import figures

    data = figures.figure_data(_ladder(tmp_path))
    sens = data["lr_sensitivity"]
    assert sorted(sens) == sorted(f"mha [shape={w}]" for w in (64, 128, 256))
    for w in (64, 128, 256):
        base = 5.0 + np.mean(NOISE) - 0.1 * (w // 64)  # mean over seeds of the planted selection losses
        panel = sens[f"mha [shape={w}]"]
        assert set(panel) == {"none", "qkmap"}
        np.testing.assert_allclose(panel["none"]["mean"], [base, base + 0.2])
        np.testing.assert_allclose(panel["qkmap"]["mean"], base + np.array([0.05, -0.05]) * (1 if w > 64 else -1))
    assert set(figures.colours(data)) == {"none", "qkmap"}  # one colour per method, not per method and width
    drawn = []
    monkeypatch.setattr(figures._plt(), "close", drawn.append)
    names = list(figures.draw(data, tmp_path / "out"))
    titles = [ax.get_title() for ax in drawn[names.index("lr_sensitivity")].axes if ax.get_visible()]
    assert titles == [f"learning-rate sensitivity: MHA\n[shape={w}] (x: a seed diverged)" for w in (64, 128, 256)]
