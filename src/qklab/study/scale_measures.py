"""The scale claims (the catalogue's "scale" kind): per seed, a slope across a study's width ladder, tested
over seeds; each measure returns a ``measures.Measured``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from qklab.study.analyze import Group
from qklab.study.measures import ClaimStats, Measured, interval_rule, not_measurable
from qklab.study.sensitivity import group_sensitivity, group_size, rate_grid, slope, width_ladders
from qklab.study.stats import difference_stats, fmt_ci

REFERENCE = "none"  # the method every scale claim is read against (a variant whose method and controller are none)


def _plain(g: Group, method: str, controller: str = "none") -> bool:
    return g.attention == "mha" and g.method == method and g.controller == controller


def _ladder(groups: list[Group], method: str, controller: str = "none") -> tuple[str | None, dict[int, Group]]:
    """(study, width -> group) of the method's widest ladder (the most widths; ties: the most seeds)."""
    best: tuple[tuple, str | None, dict] = ((0, 0), None, {})
    for study, variants in width_ladders(groups).items():
        for by_w in variants.values():
            g0 = next(iter(by_w.values()))
            if not _plain(g0, method, controller):
                continue
            seeds = min(len(group_sensitivity(g)) for g in by_w.values())
            if (len(by_w), seeds) > best[0]:
                best = ((len(by_w), seeds), study, by_w)
    return best[1], best[2]


def _files(*ladders: dict[int, Group]) -> tuple[str, ...]:
    return tuple(c["path"] for by_w in ladders for g in by_w.values() for cs in g.cells.values()
                 for c in cs if c.get("path"))


def _verdict(values: dict[int, float], sign: int, what: str, cells: tuple[str, ...], margin: float = 0.0) -> Measured:
    """Claim sign * mean(values) > 0 over seeds, by the interval rule; the statistics those of the
    claimed-below-zero form (values * -sign), as every paired measure keeps them."""
    d = difference_stats([-sign * v for v in values.values()])
    if d.n == 0:
        return not_measurable(f"no seed has {what} at every width and rate", cells)
    shown = difference_stats(list(values.values()))
    meas = (f"{what}: {shown.mean:+.3g}, 95% CI {fmt_ci(shown.ci_lo, shown.ci_hi, 3)}, n={shown.n}"
            + (f", p (t) {shown.p:.3g}" if math.isfinite(shown.p) else "")
            + "; by seed " + ", ".join(f"{s}: {v:+.3g}" for s, v in sorted(values.items())))
    a, b = ("0", what) if sign > 0 else (what, "0")  # the statistics are of a - b, claimed below zero
    st = ClaimStats(d.n, d.df, d.mean, d.ci_lo, d.ci_hi, d.boot_lo, d.boot_hi, a, b, margin, d.effect, d.p, d.p_flip)
    verdict, reason = interval_rule(d, margin, *(("above", "below") if sign > 0 else ("below", "above")))
    return Measured(verdict, meas, reason, st, cells)


def logit_by_rate() -> Callable:
    """Positive control (a): `none`'s max logit grows with the rate: per seed, the slope of log10 max logit
    against log2 rate over each width's grid, averaged over the widths."""
    def test(groups: list[Group], p: dict) -> Measured:
        study, by_w = _ladder(groups, REFERENCE)
        if len(by_w) < 2:
            return not_measurable("needs `none` at two or more widths in one study")
        per_seed: dict[int, list[float]] = {}
        for g in by_w.values():
            rates = rate_grid(g)  # a seed counts where it finished every registered rate
            seeds = set.intersection(*(set(g.sweep[m].max_logit_by_seed) if m in g.sweep else set()
                                       for m in rates))
            for s in seeds:
                ys = [g.sweep[m].max_logit_by_seed[s] for m in rates]
                xs = [math.log2(g.sweep[m].lr) for m in rates]
                per_seed.setdefault(s, []).append(slope(xs, [math.log10(y) if y > 0 else math.nan for y in ys]))
        values = {s: float(np.mean(v)) for s, v in per_seed.items() if len(v) == len(by_w)
                  and all(math.isfinite(x) for x in v)}
        return _verdict(values, +1, "slope of log10 max logit per doubling of the rate", _files(by_w))
    return test


def _registered_rates(g: Group) -> dict[float, dict[int, float]]:
    """absolute rate (rounded to 12 decimal places) -> seed -> final max logit, over the group's whole rate grid
    (``rate_grid``: registered or run); a rate not yet run has no seeds. The rates of the grid's multiples
    follow from any rate run (rate = anchor x multiple), so the rate every width shares does not drift while
    a study runs."""
    anchor = next((s.lr / m for m, s in g.sweep.items() if math.isfinite(s.lr)), math.nan)
    return {round(anchor * m, 12): dict(g.sweep[m].max_logit_by_seed) if m in g.sweep else {} for m in rate_grid(g)}


def logit_by_width() -> Callable:
    """Positive control (a): `none`'s max logit grows with width, at the highest rate of the grid (registered,
    or run where none is recorded) that every width shares; not measurable until every width has run it."""
    def test(groups: list[Group], p: dict) -> Measured:
        study, by_w = _ladder(groups, REFERENCE)
        if len(by_w) < 2:
            return not_measurable("needs `none` at two or more widths in one study")
        rates = {w: _registered_rates(g) for w, g in by_w.items()}
        shared = set.intersection(*(set(r) for r in rates.values()))
        if not shared:
            return not_measurable("no rate of the grid that every width shares")
        lr = max(shared)
        at = {w: r[lr] for w, r in rates.items()}
        seeds = set.intersection(*(set(m) for m in at.values()))
        xs = [math.log10(group_size(by_w[w])) for w in sorted(by_w)]
        values = {s: slope(xs, [math.log10(at[w][s]) if at[w][s] > 0 else math.nan for w in sorted(by_w)])
                  for s in seeds}
        values = {s: v for s, v in values.items() if math.isfinite(v)}
        return _verdict(values, +1, f"slope of log10 max logit per decade of parameters at rate {lr:.3g}",
                        _files(by_w))
    return test


def sensitivity_slope(method: str, controller: str = "none") -> Callable:
    """The method's LR sensitivity grows less with size than `none`'s: per seed, its slope against log10
    non-embedding parameters minus `none`'s, below zero."""
    def test(groups: list[Group], p: dict) -> Measured:
        name = controller if controller != "none" else method
        _, ref = _ladder(groups, REFERENCE)
        _, own = _ladder(groups, method, controller)
        widths = sorted(ref.keys() & own.keys())
        if len(widths) < 2:
            return not_measurable(f"needs `none` and {name} at two or more widths in one study")

        def slopes(by_w: dict[int, Group]) -> dict[int, float]:  # each method against its own sizes
            xs = [math.log10(group_size(by_w[w])) for w in widths]
            sens = [group_sensitivity(by_w[w]) for w in widths]
            seeds = set.intersection(*(set(m) for m in sens))
            return {s: slope(xs, [m[s] for m in sens]) for s in seeds}

        a, b = slopes(own), slopes(ref)
        values = {s: a[s] - b[s] for s in a.keys() & b.keys() if math.isfinite(a[s] - b[s])}
        return _verdict(values, -1, f"sensitivity slope, {name} - none (nats per decade)", _files(ref, own))
    return test

