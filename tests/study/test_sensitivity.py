"""LR sensitivity (Wortsman et al. 2023), slopes across scale and the scale claims, against hand computations
on planted numbers."""

from __future__ import annotations

import math

import pytest
from scipy import stats as scipy_stats

from qklab.study.analyze import Group, RateOutcome
from qklab.study.catalogue import CATALOGUE
from qklab.study.sensitivity import (
    grid_final,
    group_sensitivity,
    group_size,
    lr_sensitivity,
    non_embedding,
    slope,
    trend,
)

L0 = math.log(4096)


def test_lr_sensitivity_by_hand():
    # capped at L0 = 8: [5, 4, 4.5, 8, 8]; best 4; mean of [1, 0, 0.5, 4, 4] = 1.9
    assert lr_sensitivity([5.0, 4.0, 4.5, 9.0, float("nan")], 8.0) == pytest.approx(1.9)
    assert lr_sensitivity([3.0, 3.0], 8.0) == 0.0
    assert math.isnan(lr_sensitivity([], 8.0))


def test_slope_and_size_by_hand():
    # x mean 2, y mean 13/3: cov sum 5, var sum 2
    assert slope([1, 2, 3], [2, 4, 7]) == pytest.approx(2.5)
    assert math.isnan(slope([1, 1], [2, 3])) and math.isnan(slope([1], [2]))
    assert non_embedding(475712, 4096, 64) == 213568  # ladder_english's width 64: 4 blocks of 213,568
    assert non_embedding(1000, 10, 10, tied=False) == 800


def test_trend_by_hand():
    # sizes 10, 100, 1000 (x = 1, 2, 3); seed 0: 1, 2, 3 (slope 1); seed 1: 1, 3, 5 (slope 2)
    t = trend([10, 100, 1000], [{0: 1.0, 1: 1.0}, {0: 2.0, 1: 3.0}, {0: 3.0, 1: 5.0}])
    assert t.by_seed == pytest.approx({0: 1.0, 1: 2.0})
    assert t.slope == pytest.approx(1.5) and t.intercept == pytest.approx(-0.5)  # means 1, 2.5, 4
    # the t-interval over the two seeds' slopes: 1.5 -+ t(0.975, 1) * sd / sqrt(2), sd = sqrt(0.5)
    t975 = scipy_stats.t.ppf(0.975, 1)  # 12.706
    assert (t.lo, t.hi) == pytest.approx((1.5 - t975 * 0.5, 1.5 + t975 * 0.5))
    # at 10^4 (x = 4): seed 0's fit 0 + 1 x = 4, seed 1's -1 + 2 x = 7; mean 5.5, sd 3 / sqrt(2)
    assert t.at(1e4) == pytest.approx((5.5, 5.5 - t975 * 1.5, 5.5 + t975 * 1.5))
    # the seeds every size has, alone: seed 2 at one size only changes nothing
    t3 = trend([10, 100, 1000], [{0: 1.0, 1: 1.0, 2: 9.0}, {0: 2.0, 1: 3.0}, {0: 3.0, 1: 5.0}])
    assert (t3.slope, t3.intercept, t3.lo, t3.hi) == pytest.approx((t.slope, t.intercept, t.lo, t.hi))
    one = trend([10, 100, 1000], [{0: 1.0}, {0: 2.0}, {0: 3.0}])
    assert one.slope == pytest.approx(1.0) and math.isnan(one.lo) and math.isnan(one.at(1e4)[1])
    tl = trend([10, 100, 1000], [{0: 10.0, 1: 10.0}, {0: 100.0, 1: 1000.0}, {0: 1e3, 1: 1e5}], log_y=True)
    assert tl.by_seed == pytest.approx({0: 1.0, 1: 2.0}) and tl.at(1e4)[0] == pytest.approx(10 ** 5.5)


def _group(variant: str, method: str, controller: str, i: int, losses, logits=None) -> Group:
    """A planted analysed group at width 64 * 2^i, non-embedding size 10^(5 + i), two rates 1e-3 and 2e-3;
    losses(seed) -> the report losses at those rates."""
    d = 64 * 2 ** i
    by_seed = [logits(s) if logits else (1.0, 1.0) for s in range(3)]  # seed -> (at 1e-3, at 2e-3)
    sweep = {m: RateOutcome(lr=lr, max_logit_by_seed={s: by_seed[s][k] for s in range(3)})
             for k, (m, lr) in enumerate(((1.0, 1e-3), (2.0, 2e-3)))}
    grid = {m: {s: losses(s)[k] for s in range(3)} for k, m in enumerate((1.0, 2.0))}
    return Group(study="planted", variant=variant, point=f"d_model={d}", attention="mha", method=method,
                 controller=controller, d_model=d, n_params=10 ** (5 + i) + 4096 * d, vocab_size=4096,
                 tie_embeddings=True, sweep=sweep, chosen=1.0, grid_final={"report_loss": grid})


def _planted() -> list[Group]:
    gs = []
    for i in range(3):
        # none: sensitivity (0 + 0.5 (i + 1) + 0.1 s) / 2, slope 0.25 per decade at every seed; max logit
        # 10 at 1e-3 and 10^(1.3 + 0.1 s + 0.1 i) at 2e-3: slope 0.3 + 0.1 s per doubling at width i
        gs.append(_group("none", "none", "none", i, lambda s, i=i: (4.0, 4.0 + 0.5 * (i + 1) + 0.1 * s),
                         lambda s, i=i: (10.0, 10 ** (1.3 + 0.1 * s + 0.1 * i))))
        # qknorm: sensitivity (0.2 + 0.1 s i) / 2 = 0.1 + 0.05 s i: slope 0.05 s
        gs.append(_group("qknorm", "qknorm", "none", i, lambda s, i=i: (4.0, 4.2 + 0.1 * s * i)))
        # quack: a diverged top rate (non-finite) counts as L0: sensitivity (L0 - 4) / 2 at every width
        gs.append(_group("quack-t1", "none", "quack", i, lambda s: (4.0, float("inf"))))
    return gs


def test_group_sensitivity_and_size():
    g = _planted()[0]
    assert group_size(g) == pytest.approx(1e5)
    assert group_sensitivity(g) == pytest.approx({0: 0.25, 1: 0.30, 2: 0.35})
    assert group_sensitivity(_planted()[2]) == pytest.approx({s: (L0 - 4.0) / 2 for s in range(3)})


def test_a_seed_counts_only_where_it_finished_every_registered_rate():
    """The window is the registered grid, not the rates run so far: while no seed has reached a registered
    rate, every seed is left out (rather than every seed's sensitivity taken over a narrower window)."""
    from dataclasses import replace

    from qklab.study.analyze import _registered_grid
    from qklab.study.sensitivity import rate_grid, tuned_by_seed

    g = _planted()[0]  # rates 1.0 and 2.0 run at every seed
    g = replace(g, grid_final={**g.grid_final, "val_loss": g.grid_final["report_loss"]})
    assert group_sensitivity(g) and tuned_by_seed(g)  # no grid recorded: the rates run
    wider = replace(g, grid=(1.0, 2.0, 4.0))  # 4.0 registered, not run yet
    assert rate_grid(wider) == [1.0, 2.0, 4.0]
    assert group_sensitivity(wider) == {} and tuned_by_seed(wider) == {}
    assert _measure("scale.control_logit_rate", [wider if x.variant == "none" and x.d_model == 64 else x
                                                  for x in _planted()]).verdict == "not measurable"
    assert group_sensitivity(replace(g, grid=(1.0, 2.0))) == group_sensitivity(g)
    # the positive control's width slope reads the highest registered rate every width shares: while one width
    # has not run it, not measurable (not a lower rate that every width happens to have run so far)
    short = replace(g, grid=(1.0, 2.0), sweep={1.0: g.sweep[1.0]})
    gs = [replace(x, grid=(1.0, 2.0)) for x in _planted()]
    assert "rate 0.002" in _measure("scale.control_logit_width", gs).measured
    gs = [short if x.variant == "none" and x.d_model == 64 else x for x in gs]
    assert _measure("scale.control_logit_width", gs).verdict == "not measurable"
    # a rate run beside the registered grid (one the study no longer registers) still counts
    assert rate_grid(replace(g, grid=(1.0,))) == [1.0, 2.0]
    # the registered grid: the variant's own lr_mults_for entry, else lr_mults; none recorded: ()
    proto = {"protocol": {"lr_mults": [2, 0.5, 1], "lr_mults_for": {"qkmap": [4, 1]}}}
    assert _registered_grid(proto, "none") == (0.5, 1.0, 2.0) and _registered_grid(proto, "qkmap") == (1.0, 4.0)
    assert _registered_grid({}, "none") == ()


def _measure(cid: str, groups: list[dict]):
    return CATALOGUE[cid].measure(groups, CATALOGUE[cid].params())


def test_scale_claims_by_hand():
    gs = _planted()
    # qknorm - none slopes: 0.05 s - 0.25 = -0.25, -0.20, -0.15; mean -0.2, sd 0.05, t = -0.2 / (0.05 / sqrt 3)
    m = _measure("scale.qknorm_sensitivity", gs)
    verdict, measured, st = m.verdict, m.measured, m.stats
    t = 0.2 / (0.05 / math.sqrt(3))
    assert st.mean == pytest.approx(-0.2) and st.n == 3
    assert st.p == pytest.approx(1 - t / math.sqrt(2 + t * t))  # the t distribution's cdf at 2 df, closed form
    assert verdict == "agree" and "-0.2" in measured
    # quack's sensitivity is flat: slope 0 against none's 0.25 at every seed (no spread): -0.25 each
    st = _measure("scale.quack_sensitivity", gs).stats
    assert st.mean == pytest.approx(-0.25) and st.p == 0.0
    # none's max logit per doubling: mean over widths of 0.3 + 0.1 s + 0.1 i = 0.4 + 0.1 s; claimed > 0
    m = _measure("scale.control_logit_rate", gs)
    verdict, measured, st = m.verdict, m.measured, m.stats
    assert st.mean == pytest.approx(-0.5) and verdict == "agree"  # statistics of the claimed-below form
    assert "+0.5" in measured
    # at the highest rate every width ran (2e-3): log10 max logit 1.3 + 0.1 s + 0.1 i, 0.1 per decade of size
    m = _measure("scale.control_logit_width", gs)
    verdict, measured, st = m.verdict, m.measured, m.stats
    assert st.mean == pytest.approx(-0.1) and "rate 0.002" in measured and verdict == "agree"
    # no method that ran nowhere: not measurable
    assert _measure("scale.quest_sensitivity", gs).verdict == "not measurable"


def test_scale_claims_listed_where_registered_and_holm_on_the_t_test(monkeypatch):
    from qklab.report import claims
    from qklab.report.claims import claims_table
    from qklab.study.plan import parse_plan

    # the scale claims alone (the papers' claims need fields these planted groups do not have)
    monkeypatch.setattr(claims, "CATALOGUE", {k: v for k, v in CATALOGUE.items() if k.startswith("scale.")})
    gs = _planted()
    plan = parse_plan({"scale.qknorm_sensitivity": {}, "scale.quack_sensitivity": {},
                       "scale.control_logit_rate": {}})
    assert all(p["test"] == "t" and p["family"] == "Scale" for p in plan.values())
    rows = {r.id: r for r in claims_table(gs, {"planted": {"plan": {"claims": plan}}})}
    assert "scale.qkmap_sensitivity" not in rows  # not registered: not listed
    # Holm over the three t-test p-values, by hand: quack 0 (no spread); the logit slope 0.4, 0.5, 0.6 (t = 5
    # sqrt 3 at 2 df); qknorm 0.0202 (above); sorted 0 < p_logit < p_qknorm: x3, x2, x1, running maximum
    t = 5 * math.sqrt(3)
    p_logit = 1 - t / math.sqrt(2 + t * t)
    p_qknorm = 1 - 4 * math.sqrt(3) / math.sqrt(2 + 48)
    assert rows["scale.control_logit_rate"].p_holm == pytest.approx(2 * p_logit)
    assert rows["scale.quack_sensitivity"].p_holm == 0.0
    assert rows["scale.qknorm_sensitivity"].p_holm == pytest.approx(max(2 * p_logit, p_qknorm))
    assert all(rows[c].verdict == "agree" for c in rows)  # every Holm p below 0.05, every interval one side
    none = [r for r in claims_table(gs, {"planted": {"plan": {"claims": {}}}}) if r.id.startswith("scale.")]
    assert none == []


def test_scale_tables_by_hand():
    from qklab.report.scale import method_scales, scale_sensitivity_table, trends_table

    gs = _planted()
    for g in gs:  # the selection split as the report split: the lower rate is every seed's tuned rate
        g.grid_final["val_loss"] = g.grid_final["report_loss"]
    rows = method_scales(gs)
    assert [r.variant for r in rows] == ["none", "qknorm", "quack-t1"]
    head, body = scale_sensitivity_table(rows)
    none = dict(zip(head, body[0], strict=True))
    assert none["width 64"].startswith("0.300 [") and none["width 64"].endswith("(n=3)")  # 0.25, 0.30, 0.35
    assert none["slope per decade of parameters (95% t over seeds)"].startswith("+0.250 [")
    assert "QuacK" in dict(zip(head, body[2], strict=True))["note"]  # the rate it is measured over
    head, body = trends_table(rows)
    none = dict(zip(head, body[0], strict=True))
    assert none["tuned rate (log-log)"].startswith("+0.000")  # 1e-3 at every width
    assert none["sizes (non-embedding parameters)"] == "0.1M, 1M, 10M"


def test_the_registered_design_is_read_with_its_own_rate_grid():
    """ladder_english's grid was amended from x0.5-x4 to x0.25-x8: read under its registered design, its cells
    of that design give LR sensitivity over the four registered rates (the amended grid's added rates never
    ran there, and would leave every seed out)."""
    from pathlib import Path

    from qklab.report.render import registered_groups
    from qklab.study.analyze import analyze, load_results
    from qklab.study.sensitivity import rate_grid

    root = Path(__file__).resolve().parents[2] / "docs/results/ladder_english"
    results, studies = load_results([root])
    first = registered_groups(results, studies)
    assert first, "ladder_english's design was amended"
    for g in first:
        assert rate_grid(g) == [0.5, 1.0, 2.0, 4.0], g.variant
        grid = grid_final(g)
        l0 = math.log(4096)
        want = {s: lr_sensitivity([grid[m][s] for m in (0.5, 1.0, 2.0, 4.0)], l0) for s in (0, 1)}
        assert group_sensitivity(g) == pytest.approx(want), g.variant
    assert all(rate_grid(g) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0] for g in analyze(results, studies).groups)
