"""The fair protocol: the rate is chosen on the selection split only; report numbers at the chosen rate."""

from __future__ import annotations

import pytest

from qklab.study.analyze import analyze, select_rate
from tests.study.synthetic import result

STUDY = {"s": {"name": "s", "variants": {"std": {}, "map": {}}, "protocol": {"reference": {"*": "std"}}}}


class Watched(dict):
    """A result's ``final`` that records which keys were read."""

    reads: list[tuple[str, str]] = []

    def __init__(self, cell, d):
        super().__init__(d)
        self.cell = cell

    def __getitem__(self, k):
        Watched.reads.append((self.cell, k))
        return super().__getitem__(k)

    def get(self, k, default=None):
        Watched.reads.append((self.cell, k))
        return super().get(k, default)


def test_select_rate_rules():
    sel = {0.5: [5.0, 5.2], 1.0: [4.9, 5.0], 2.0: [4.0, 4.1]}
    assert select_rate(sel, {0.5: True, 1.0: True, 2.0: False}) == 1.0  # x2 had a diverged seed
    assert select_rate(sel, {0.5: True, 1.0: True, 2.0: True}) == 2.0
    assert select_rate({1.0: [5.0], 2.0: [5.0]}, {1.0: True, 2.0: True}) == 1.0  # tie: the lower rate
    assert select_rate(sel, {}) is None


def test_selection_never_reads_the_report_split():
    # selection prefers x1 for 'map'; the report split would prefer x2: the choice must follow selection
    rs = []
    for s in range(3):
        rs += [result("std", 1.0, s, 5.0 + 0.01 * s, 5.1 + 0.01 * s),
               result("map", 1.0, s, 4.8 + 0.01 * s, 5.3, method="qkmap"),
               result("map", 2.0, s, 4.9 + 0.01 * s, 4.0, method="qkmap")]
    Watched.reads = []
    for r in rs:
        r["final"] = Watched(r["cell"], r["final"])
    a = analyze(rs, STUDY)
    g = next(g for g in a.groups if g.variant == "map")
    assert g.chosen == 1.0 and g.stats["report_loss"].mean == pytest.approx(5.3)
    report_reads = {c for c, k in Watched.reads if k == "report_loss"}
    assert report_reads and all("_lr1_" in c for c in report_reads)  # never at the rate not chosen
    # paired against the reference on the same seeds: map - std = 5.3 - (5.1 + 0.01 s)
    d = g.paired["report_loss"]
    assert d.n == 3 and d.mean == pytest.approx(0.19) and d.seeds == (0, 1, 2)


def test_diverged_and_failed_cells_in_the_sweep():
    rs = [result("std", m, s, 5.0 / m, 5.0, diverged=(m == 4.0 and s == 1)) for m in (1.0, 2.0, 4.0) for s in (0, 1)]
    rs.append(result("std", 8.0, 0, 0, 0, failed=True))
    g = analyze(rs, STUDY).groups[0]
    assert g.chosen == 2.0  # x4 is better on average but a seed diverged; x8 failed
    assert g.highest_stable == 2.0
    assert g.sweep[4.0].diverged == 1 and g.sweep[8.0].failed == 1
    assert g.failed == [{"cell": "std_lr8_s0", "failure": "KeyError: planted", "log": "logs/std.log"}]


def test_grid_points_are_labelled_by_their_keys_and_ordered_by_value():
    """A width ladder's points read `d_model=64,n_heads=1` (not the override dict) and come out in
    numeric order, 64 before 128 before 256 (a string sort puts 64 last)."""
    rs = []
    for d, h in ((128, 2), (256, 4), (64, 1)):
        for s in (0, 1):
            r = result("none", 1.0, s, 4.0 + d / 1000, 4.0)
            r["point"] = {"shape": {"model.d_model": d, "model.n_heads": h}}
            rs.append(r)
    groups = analyze(rs, {}).groups
    assert [g.point for g in groups] == ["d_model=64,n_heads=1", "d_model=128,n_heads=2", "d_model=256,n_heads=4"]
    assert [round(g.sweep[1.0].select.mean, 3) for g in groups] == [4.064, 4.128, 4.256]
