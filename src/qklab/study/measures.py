"""How each claim of the catalogue (``study.catalogue``) is measured on a study's groups (``study.analyze``).

A measure is ``measure(groups, params) -> Measured``: the verdict by the interval rule (before the family's
Holm adjustment, which ``report.claims`` applies), what was measured, in one line, why the verdict, the
statistics of a paired claim (None for a grid reading or nothing to test) and the result files read.

Each loss comparison uses the methods' cells at their own chosen rates (selection split), report-split
losses, and seeds paired across methods; the logit claim compares the two at the same rate, since at the
tuned rate there is little for a control to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qklab.study.analyze import Group, best_by_place, highest_within, place
from qklab.study.stats import Difference, difference_stats, fmt_ci, paired_difference

NOT_MEASURABLE = "not measurable"
HOLDS, FAILS = "holds", "fails"  # a positive control's verdicts


@dataclass(frozen=True)
class ClaimStats:
    """The statistics of a paired claim a - b < margin: the interval of a - b (t and bootstrap), its n and
    df, and the tests of mean = margin (t, exact sign-flip) with the effect size (mean - margin) / sd.
    ``log_ratio``: a - b is of log10 values, read as the ratio a / b."""

    n: int
    df: int
    mean: float
    ci_lo: float
    ci_hi: float
    boot_lo: float
    boot_hi: float
    a: str | None
    b: str | None
    margin: float
    effect: float
    p: float
    p_flip: float
    log_ratio: bool = False


@dataclass(frozen=True)
class Pairing:
    """A paired difference a - b over seeds, with the names of a and b, a note on how they were paired and
    the study it was read in."""

    d: Difference
    a: str
    b: str
    note: str = ""
    study: str | None = None


@dataclass(frozen=True)
class Measured:
    """A claim as measured: ``verdict`` by the interval (or grid) rule, before the family's adjustment;
    ``stats`` the paired statistics of a - b claimed below the margin (None: not a test over seeds)."""

    verdict: str
    measured: str
    reason: str
    stats: ClaimStats | None = None
    cells: tuple[str, ...] = ()


Measure = Callable[[list[dict], dict[str, Any]], Measured]


def not_measurable(reason: str, cells: list[str] | tuple[str, ...] = ()) -> Measured:
    return Measured(NOT_MEASURABLE, "-", reason, None, tuple(cells))


def _name(kind: tuple) -> str:
    """(attention, method, controller) -> 'MLA quack', 'MHA qknorm', 'MHA none'."""
    att, method, ctrl = kind
    return f"{att.upper()} {ctrl if ctrl != 'none' else method}"


def _find(groups: list[Group], attention: str, method: str = "none", controller: str = "none") -> list[Group]:
    """Groups of one kind (several when, e.g., two taus were run): the best by selection loss first."""
    gs = [g for g in groups if g.attention == attention and g.method == method
          and g.controller == controller and g.chosen is not None]
    return sorted(gs, key=lambda g: g.sweep[g.chosen].select.mean)


def _option(g: Group, key: str):
    """The value of the group's controller option ``key`` (e.g. QuacK's tau), or None."""
    return (g.qk_options or {}).get(g.controller, {}).get(key)


def _places(groups: list[Group], a: tuple, b: tuple) -> tuple[list[tuple[Group, Group]], str]:
    """Pairs (x of kind a, y of kind b) that ran in the same study and grid point, so that they share the
    data, the shape and the optimizer: the pairs with the most paired seeds first (the study built to test
    the two, not a 2-seed width ladder that tunes them too), then the widest rate grids (not a ladder at
    two fixed rates; within a study, variants that tuned their own rate, not an ablation run at one rate
    borrowed from its family), then by selection loss. Else [] and why not."""
    ga, gb = _find(groups, *a), _find(groups, *b)
    if not ga or not gb:
        missing = [_name(x) for x, g in ((a, ga), (b, gb)) if not g]
        return [], f"no finished cells of {' and '.join(missing)} in these results"
    pairs = [(x, y) for x in ga for y in gb if x.study == y.study and x.point == y.point]
    if not pairs:
        return [], "the two methods never ran in the same study and grid point"
    width: dict[tuple, int] = {}  # (study, point) -> the most rates any group of either kind ran there
    for g in ga + gb:
        k = (g.study, g.point)  # the point is its label, a string
        width[k] = max(width.get(k, 0), len(g.sweep))
    def seeds(x: dict, y: dict) -> int:  # seeds with both at their chosen rate
        return len(x.at_chosen["report_loss"].keys() & y.at_chosen["report_loss"].keys())

    pairs.sort(key=lambda p: (-seeds(*p), -width[(p[0].study, p[0].point)],  # stable: selection order kept
                              -min(len(p[0].sweep), len(p[1].sweep))))
    return pairs, ""


def _pair(groups, a: tuple, b: tuple, metric: str, match: str | None = None) -> tuple[Pairing | None, str]:
    """Paired difference a - b of ``metric`` (same study and grid point), or None and why not. With
    ``match``, the best pair whose controllers share that option's value (QuacK against the multiplier
    at the same tau) comes first; without such a pair, the best of each, said in the measurement."""
    pairs, why = _places(groups, a, b)
    if not pairs:
        return None, why
    note = ""
    if match:
        same = [(x, y) for x, y in pairs if _option(x, match) is not None and _option(x, match) == _option(y, match)]
        if same:
            pairs, note = same, f" (same {match}: {_option(same[0][0], match):g})"
        else:
            note = f" (no pair at the same {match}: each at its best)"
    x, y = pairs[0]
    return Pairing(paired_difference(x.at_chosen[metric], y.at_chosen[metric]), x.variant, y.variant, note,
                   x.study), ""


def claim_stats(d: Difference, a: str | None, b: str | None, margin: float, log_ratio: bool = False) -> ClaimStats:
    """The statistics of a paired claim a < b + margin: the interval of a - b, the tests of mean = margin."""
    shifted = difference_stats([x - margin for x in d.diffs])
    return ClaimStats(d.n, d.df, d.mean, d.ci_lo, d.ci_hi, d.boot_lo, d.boot_hi, a, b, margin, shifted.effect,
                      shifted.p, shifted.p_flip, log_ratio)


def _verdict_less(pr: Pairing | None, why: str, what: str, margin: float = 0.0, cells: list[str] | None = None,
                  ratio: bool = False) -> Measured:
    """Claim: a < b + margin (pr.d = a - b), by the interval rule. ``ratio``: d is of log10 of a ratio, said
    of the ratio (the statistics marked ``log_ratio``)."""
    if pr is None:
        return not_measurable(why, cells or ())
    d = pr.d
    if d.n == 0:
        return not_measurable(f"no seed has a finite {what} for both", cells or ())
    meas = f"{pr.a} - {pr.b}: {d.mean:+.3f}, 95% CI {fmt_ci(d.ci_lo, d.ci_hi)}, n={d.n}" + (
        f", p={d.p:.3g}" if math.isfinite(d.p) else "") + pr.note
    verdict, reason = interval_rule(d, margin)
    return Measured(verdict, meas, as_ratio(reason) if ratio else reason, claim_stats(d, pr.a, pr.b, margin, ratio),
                    tuple(cells or ()))


def interval_rule(d: Difference, margin: float = 0.0, below: str = "below", above: str = "above") -> tuple[str, str]:
    """(verdict, reason) of a claim a - b < margin by its 95% t-interval (the rule before Holm). ``below``
    and ``above``: how the reason names the sides (a claim read in the negated form names them the other
    way round)."""
    if d.n < 2:
        return "inconclusive", "one seed: no interval"
    if d.ci_hi < margin:
        return "agree", f"the whole interval is {below} {margin:g}"
    if d.ci_lo > margin:
        return "disagree", f"the whole interval is {above} {margin:g}"
    return "inconclusive", "the interval contains " + (f"{margin:+g}" if margin else "0")


def less(a, b, metric, what):
    """Claim a < b + margin on ``metric``, each at its tuned rate; pairing "same-tau": a pair whose
    controllers share tau first (QuacK against the multiplier)."""
    def test(groups, p):
        d, why = _pair(groups, a, b, metric, "tau" if p.get("pairing") == "same-tau" else None)
        return _verdict_less(d, why, what, p.get("margin", 0.0), _used(groups, d, chosen=True))
    return test


def _used(groups: list[Group], d: Pairing | None, chosen: bool) -> list[str]:
    """The result files of the two variants a paired difference read (at their chosen rates, or all)."""
    if d is None:
        return []
    out = []
    for g in groups:
        if g.variant in (d.a, d.b) and (not d.study or g.study == d.study):
            rates = [g.chosen] if chosen and g.chosen is not None else list(g.cells)
            out += [c["path"] for m in rates for c in g.cells.get(m, []) if c.get("path")]
    return out


def stable_rate(a: tuple, b: tuple) -> Callable:
    """Claim: a tolerates a higher base rate than b: the highest rate that holds, each method at its best
    option (e.g. QuacK's best tau, QK-clip's best threshold) within one study and grid point. A rate holds
    by the registered rule: "entropy", no seed diverged (its final loss below the unigram entropy);
    "delta", besides, the mean selection loss within delta nats of the variant's own best rate; "near-best",
    within delta nats of the best variant of that study, grid point and attention type."""
    def test(groups, p):
        rule, delta = p.get("stable", "entropy"), p.get("delta", 0.1)

        top = best_by_place(groups)  # (study, point, attention) -> the best variant's selection loss

        def holds(g):
            if rule == "entropy":
                return g.highest_stable
            if rule == "near-best":
                return highest_within(g, delta, top.get(place(g)))
            return highest_within(g, delta)

        pairs, why = _places(groups, a, b)
        if not pairs:
            return not_measurable(why)
        x0, y0 = pairs[0]
        here = [g for g in groups if g.study == x0.study and g.point == x0.point]
        xs = [g for g in _find(here, *a) if len(g.sweep) >= 2]
        ys = [g for g in _find(here, *b) if len(g.sweep) >= 2]
        if not xs or not ys:
            return not_measurable("needs a learning-rate grid (one rate per method was run)")

        def best(gs):  # the variant that holds up to the highest rate (None: no rate holds for any variant)
            g = max(gs, key=lambda g: -math.inf if holds(g) is None else holds(g))
            return g, holds(g)

        (x, hx), (y, hy) = best(xs), best(ys)
        used = _all_cells(x, y)
        tops = {max(g.sweep) for g in xs + ys}
        rx, ry = (f"x{h:g}" if h is not None else "none" for h in (hx, hy))
        how = ("with no diverged seed" if rule == "entropy"
               else f"within {delta:g} nats of the best method there, no seed diverged" if rule == "near-best"
               else f"within {delta:g} nats of its own best, no seed diverged")
        meas = f"highest rate {how}: {x.variant} {rx}, {y.variant} {ry} (grid up to x{max(tops):g})"
        if hx is None or hy is None:
            return Measured("inconclusive", meas, "a method held at no rate", None, used)
        if hx == hy and hx in tops:
            return Measured("inconclusive", meas, "both held up to the top of the grid; extend it upward", None, used)
        if hx == hy:
            return Measured("inconclusive", meas, "both held up to the same rate: a tie", None, used)
        lo, g_lo = (hy, y) if hx > hy else (hx, x)
        if max(g_lo.sweep) <= lo:  # the less stable one never ran above the rate where it held
            return Measured("inconclusive", meas, f"{g_lo.variant} did not run above x{lo:g}", None, used)
        return (Measured("agree", meas, "holds at a higher rate", None, used) if hx > hy
                else Measured("disagree", meas, "does not hold at a higher rate", None, used))
    return test


def _all_cells(*gs: dict) -> tuple[str, ...]:
    """The result files of every rate and seed of the given groups."""
    return tuple(c["path"] for g in gs for cs in g.cells.values() for c in cs if c.get("path"))


def as_ratio(reason: str) -> str:
    """A reason about log10 of a ratio, said of the ratio."""
    return reason.replace("below 0", "below a ratio of 1").replace("above 0", "above a ratio of 1").replace(
        "contains 0", "contains a ratio of 1")


def logits_at_same_rate(a: tuple, b: tuple) -> Callable:
    """Claim: a keeps the max attention logit below b's. Rate "highest-shared-stable": read at the highest
    rate of the grid where both ran and no seed of either diverged (where the control has the most to do
    and both runs still train), as the paired ratio a / b over seeds (a difference of log10, since logits
    differ by decades across rates); the ratio at every shared stable rate is listed. Rate "tuned": each
    at its own chosen rate."""
    def test(groups, p):
        pairs, why = _places(groups, a, b)
        if not pairs:
            return not_measurable(why)
        x, y = pairs[0]
        if p.get("rate") == "tuned":
            lx, ly = ({s: math.log10(v) for s, v in g.at_chosen["max_logit"].items() if math.isfinite(v) and v > 0}
                      for g in (x, y))
            pr = Pairing(paired_difference(lx, ly), x.variant, y.variant, study=x.study)
            m = _verdict_less(pr, "", "max logit", cells=_used(groups, pr, chosen=True), ratio=True)
            d = pr.d
            meas = (f"{x.variant} / {y.variant} at their tuned rates (x{x.chosen:g}, x{y.chosen:g}): "
                    f"{10 ** d.mean:.3g}" + (f", 95% CI [{10 ** d.ci_lo:.3g}, {10 ** d.ci_hi:.3g}]"
                                              if d.n >= 2 else "") + f", n={d.n}") if d.n else "-"
            return replace(m, measured=meas)

        def logs(g, m):
            return {s: math.log10(v) for s, v in g.sweep[m].max_logit_by_seed.items()
                    if math.isfinite(v) and v > 0}

        shared = [m for m in sorted(x.sweep.keys() & y.sweep.keys())
                  if x.sweep[m].diverged == 0 and y.sweep[m].diverged == 0
                  and paired_difference(logs(x, m), logs(y, m)).n > 0]
        if not shared:
            return not_measurable("no rate at which both ran with no diverged seed and a finite max logit")
        by_rate = {m: paired_difference(logs(x, m), logs(y, m)) for m in shared}
        top = shared[-1]
        d = by_rate[top]
        meas = (f"{x.variant} / {y.variant} at x{top:g}: {10 ** d.mean:.3g}"
                + (f", 95% CI [{10 ** d.ci_lo:.3g}, {10 ** d.ci_hi:.3g}]" if d.n >= 2 else "")
                + f", n={d.n}; by rate: " + ", ".join(f"x{m:g} {10 ** by_rate[m].mean:.2g}" for m in shared))
        return replace(_verdict_less(Pairing(d, x.variant, y.variant), "", "max logit",
                                     cells=list(_all_cells(x, y)), ratio=True), measured=meas)
    return test


def elsewhere(reason: str) -> Callable:
    """A claim that study results cannot test; the reason says where it is measured instead."""
    return lambda groups, p: not_measurable(reason)


def _probe_value(probe: dict, key: str, context: int):
    """A probe's ``key``: from its summary (context 0: at the training length), else the retrieval entry at
    ``context`` tokens."""
    if context and key in ("log_contrast", "contrast"):
        return next((r.get(key) for r in probe.get("retrieval") or [] if int(r["length"]) == context), None)
    return probe["summary"].get(key)


def probe_claim(key: str, a: tuple, b: tuple, higher: bool) -> Callable:
    def test(groups, p):
        context = int(p.get("context", 0) or 0)
        pairs, why = _places(groups, a, b)
        if not pairs:
            return not_measurable(why)
        probed = [(x, y) for x, y in pairs if x.probe_by_seed and y.probe_by_seed]  # the study that probed
        x, y = (probed or pairs)[0]
        sa, sb = ({s: float(v) for s, pr in g.probe_by_seed.items()
                   if (v := _probe_value(pr, key, context)) is not None} for g in (x, y))
        if not sa or not sb:
            return not_measurable("no attention probes in these results (set [protocol] probe = 1 or more)"
                                  if not probed else f"the probes have no '{key}'"
                                  + (f" at {context} tokens" if context else ""))
        pr = (Pairing(paired_difference(sb, sa), y.variant, x.variant, study=x.study) if higher
              else Pairing(paired_difference(sa, sb), x.variant, y.variant, study=x.study))
        return _verdict_less(pr, "", key, p.get("margin", 0.0), _used(groups, pr, chosen=True))
    return test


def width_gap(a: tuple, b: tuple) -> Callable:
    """Claim: a's advantage over b (b - a, report loss, paired by seed, each at its chosen rate) is larger
    at the widest width of a study's grid than at the narrowest."""
    def test(groups, p):
        gaps: dict[str, dict[int, dict[int, float]]] = {}  # study -> width -> seed -> b - a
        for x in _find(groups, *a):
            for y in _find(groups, *b):
                if x.study == y.study and x.point == y.point and x.d_model:
                    ya, xa = y.at_chosen["report_loss"], x.at_chosen["report_loss"]
                    gaps.setdefault(x.study, {})[int(x.d_model)] = {s: ya[s] - xa[s] for s in xa.keys() & ya}
        study = max(gaps, key=lambda k: len(gaps[k]), default=None)
        if study is None or len(gaps[study]) < 2:
            return not_measurable(f"needs {_name(a)} and {_name(b)} at two or more widths in one study "
                                  "(studies/logit_control_width.toml)")
        by_w = gaps[study]
        lo, hi = min(by_w), max(by_w)
        # gap at the narrowest - gap at the widest: < 0 if it grows
        pr = Pairing(paired_difference(by_w[lo], by_w[hi]), f"gap at width {lo}", f"gap at width {hi}")
        m = _verdict_less(pr, "", "report loss")
        means = ", ".join(f"{w}: {np.mean(list(g.values())):+.3f}" if g else f"{w}: -" for w, g in sorted(by_w.items()))
        used = [c["path"] for g in groups if g.study == study and g in (*_find(groups, *a), *_find(groups, *b))
                for c in g.cells.get(g.chosen, []) if c.get("path")]
        return replace(m, measured=f"{m.measured}; mean gap ({_name(b)} - {_name(a)}) by width: {means}",
                       cells=tuple(used))
    return test


def _accuracy(probe: dict[str, Any], context: int) -> float | None:
    """The retrieval accuracy of a cell's probe: at the training length (context 0) or at ``context`` tokens."""
    if not context:
        v = (probe.get("summary") or {}).get("retrieval_accuracy")
    else:
        v = next((r.get("accuracy") for r in probe.get("retrieval") or [] if int(r["length"]) == context), None)
    return None if v is None or not math.isfinite(float(v)) else float(v)


def accuracy_control(method: tuple[str, str, str]) -> Any:
    """The control: ``method`` (attention, method, controller) reaches the threshold of retrieval accuracy,
    mean over seeds at its tuned rate: the verdict ``HOLDS`` or ``FAILS`` (a positive control, report.controls)."""
    def test(groups: list[Group], p: dict) -> Measured:
        att, meth, ctrl = method
        gs = sorted((g for g in groups if (g.attention, g.method, g.controller) == method
                     and g.chosen is not None), key=lambda g: g.sweep[g.chosen].select.mean)
        if not gs:
            return not_measurable(f"no finished cells of {att.upper()} {meth} in these results")
        g = gs[0]
        context, threshold = int(p.get("context", 0) or 0), float(p["threshold"])
        accs = {s: a for s, pr in g.probe_by_seed.items() if (a := _accuracy(pr, context)) is not None}
        cells = [c["path"] for c in g.cells.get(g.chosen, []) if c.get("path")]
        where = f"{context} tokens" if context else "the training length"
        if not accs:
            return not_measurable(f"the probes have no retrieval accuracy at {where}", cells)
        vals = np.array(list(accs.values()))
        st = difference_stats(list(vals))
        meas = (f"{g.variant} at x{g.chosen:g}: mean accuracy {vals.mean():.3f}"
                + (f", 95% CI {fmt_ci(st.ci_lo, st.ci_hi)}" if len(vals) > 1 else "")
                + f", seeds from {vals.min():.3f} to {vals.max():.3f}, n={len(vals)}")
        if vals.mean() >= threshold:
            return Measured(HOLDS, meas, f"the mean accuracy at {where} is at least {threshold:g}", None, tuple(cells))
        return Measured(FAILS, meas, f"the mean accuracy at {where} is below {threshold:g}", None, tuple(cells))
    return test
