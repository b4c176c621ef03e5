"""The width ladder at tuned rates: for every study whose grid runs its variants at several widths, each
variant's report-loss gap to its reference at each width (reference minus variant: positive when the
variant is better), both at their own chosen rate there, and how that gap changes from the narrowest width
to the widest, paired over seeds. Descriptive: a verdict needs a registered claim (quack.width_gap)."""

from __future__ import annotations

from typing import Any

from qklab.study.analyze import Group, grid_edge
from qklab.study.sensitivity import width_ladders
from qklab.study.stats import fmt_ci, paired_difference

Table = tuple[list[str], list[list[str]]]


def _rate(g: Group) -> str:
    """A group's chosen rate multiple, marked at an end of its grid: 'x2', 'x4 top', 'none eligible'."""
    ch = g.chosen
    return "none eligible" if ch is None else f"x{ch:g}" + grid_edge(ch, g.sweep).replace(", ", " ").replace(
        " of grid", "")


def gaps(groups: list[Group]) -> list[dict[str, Any]]:
    """One entry per (study, variant other than its reference): width -> {seed: reference - variant report
    loss} with both chosen rates, and the change of the gap from the narrowest width to the widest
    (``paired_difference``: widest minus narrowest, over the seeds both have)."""
    rows = []
    for study, variants in sorted(width_ladders(groups).items()):
        for variant, by_w in variants.items():
            ref_name = next(iter(by_w.values())).reference
            ref = variants.get(ref_name or "")
            if not ref or variant == ref_name:
                continue
            widths = sorted(w for w in by_w if w in ref)
            per_w = {}
            for w in widths:
                a, b = ref[w].at_chosen["report_loss"], by_w[w].at_chosen["report_loss"]
                per_w[w] = {"gap": paired_difference(a, b), "by_seed": {s: a[s] - b[s] for s in a.keys() & b},
                            "rates": f"{_rate(by_w[w])} vs {_rate(ref[w])}"}
            change = (paired_difference(per_w[widths[-1]]["by_seed"], per_w[widths[0]]["by_seed"])
                      if len(widths) >= 2 else None)
            rows.append({"study": study, "variant": variant, "reference": ref_name, "widths": per_w,
                         "change": change})
    return rows


def ladder_table(groups: list[Group]) -> Table:
    """Rows of ``gaps``: the gap at each width (mean, 95% t-interval, the variant's and the reference's
    chosen rate multiples), then the change from the narrowest width to the widest with its interval, n
    and sign-flip p."""
    rows = gaps(groups)
    widths = sorted({w for r in rows for w in r["widths"]})
    head = ["study", "variant", "reference", *(f"gap at width {w} (95% CI; rates)" for w in widths),
            "change, widest - narrowest (95% CI)", "n", "p (sign-flip)"]
    body = []
    for r in rows:
        cells = []
        for w in widths:
            x = r["widths"].get(w)
            d = x["gap"] if x else None
            cells.append(f"{d.mean:+.3f} {fmt_ci(d.ci_lo, d.ci_hi)}; {x['rates']}" if d and d.n else "-")
        c = r["change"]
        body.append([r["study"], r["variant"], r["reference"], *cells,
                     f"{c.mean:+.3f} {fmt_ci(c.ci_lo, c.ci_hi)}" if c and c.n else "-",
                     str(c.n) if c else "0", f"{c.p_flip:.3g}" if c and c.n else "-"])
    return head, body


INTRO = ("For every study whose grid runs its variants at several widths: each variant's report-loss gap to its "
         "reference at each width (reference minus variant, paired over seeds: positive when the variant is "
         "better), both at their own chosen rate at that width (the multiples after the interval, 'top' or "
         "'bottom' at an end of a grid of three rates or more), and how the gap changes from the narrowest width "
         "to the widest (paired over seeds: positive when it grows). Descriptive: a verdict on it needs a "
         "registered claim.")
