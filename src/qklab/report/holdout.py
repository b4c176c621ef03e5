"""The widest width held out: each trend across scale (``report.scale``) fitted again on every width of a
ladder but its widest, extrapolated to the widest and set against what the widest measured. A check, on a
study's own ladder, of the kind of extrapolation that the predictions for larger models rest on
(``report.predictions``): one step of 4x in size instead of 12x or 27x, in the same regime. Each seed's
own line and its error at the widest width, t-interval over seeds: calibrated where the law holds and seeds
are independent replicates. Descriptive, never a registered claim."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from qklab.report.scale import LOGIT_AT, MIN_WIDTHS, MethodScale, millions
from qklab.study.sensitivity import fit_scale, slope
from qklab.study.stats import describe

Table = tuple[list[str], list[list[str]]]
MIN_SEEDS = 3  # two seeds: t(0.975, 1) = 12.7 makes the interval so wide that "hit" would say almost nothing
INTRO = ("Each trend of the table above fitted again without the widest width, extrapolated to it, and set "
         "against what the widest width measured: a check of the extrapolation the predictions for larger models "
         "rest on, one step of the ladder (here) instead of many (there). Per seed measured at every width: its own "
         "line through the narrower widths, and its residual at the widest (measured minus extrapolated; in log10 "
         "for the log-log quantities, shown as a ratio); the interval is the t-interval of the mean residual over "
         "those seeds, so it holds the widest width's own seed noise as well as the fit's. Hit: the interval "
         "covers no error (0, or a ratio of 1); miss: the trend bent at the widest width, or the seeds are too "
         "few to tell it from noise (95% intervals miss 1 time in 20 where the law holds); no interval: fewer "
         "than two seeds at every width, or seeds that agree exactly (a tuned rate on a grid); too few seeds: "
         "two (with one degree of freedom the interval is too wide for a hit to say anything). Predicted and "
         "measured: over those seeds, geometric means for the log-log quantities. Exploratory: no claim rests "
         "on it.")


@dataclass(frozen=True)
class HeldOut:
    """One trend of one variant, fitted on ``fitted`` (sizes, narrowest first) and extrapolated to ``size``,
    over the ``n`` seeds measured at every width. ``error``, ``lo``, ``hi``: the mean residual at ``size``
    (measured minus extrapolated, per seed; log10 with ``log_y``) and its t-interval over the seeds."""

    study: str
    variant: str
    quantity: str  # "LR sensitivity", "tuned rate", "max logit at x4 the tuned rate"
    log_y: bool  # fitted log-log (errors are log10 ratios) or log-linear (differences)
    fitted: tuple[float, ...]
    size: float
    predicted: float  # the seed-mean line at ``size`` (back on the y scale)
    measured: float  # the seed mean at ``size`` (geometric with ``log_y``)
    n: int
    error: float
    lo: float  # nan with fewer than two seeds
    hi: float

    @property
    def outcome(self) -> str:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or self.lo == self.hi:
            return "no interval"
        if self.n < MIN_SEEDS:
            return "too few seeds"
        return "hit" if self.lo <= 0.0 <= self.hi else "miss"

    def shown(self, x: float) -> str:
        """An error as the table shows it: a ratio (log-log) or a signed difference."""
        return f"x{10 ** x:.2f}" if self.log_y else f"{x:+.3f}"


def _line(xs: np.ndarray, ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line of ys on xs."""
    b = slope(xs, ys)
    return float(np.mean(ys) - b * xs.mean()), b


def _one(r: MethodScale, quantity: str, sizes: list[float], values: list[dict[int, float]],
         log_y: bool) -> HeldOut | None:
    """The trend of ``values`` over every size but the last, extrapolated to the last, per seed measured at
    every size; None with fewer than MIN_WIDTHS fitted sizes or no such seed. Values the fit cannot take
    (non-finite; with ``log_y`` not positive) count as not measured."""
    if len(sizes) < MIN_WIDTHS + 1:
        return None
    tf = fit_scale(log_y)
    vals = [{s: tf(v) for s, v in m.items() if math.isfinite(v) and math.isfinite(tf(v))} for m in values]
    seeds = sorted(set.intersection(*(set(m) for m in vals)))
    if not seeds:
        return None
    xs = np.log10(np.asarray(sizes, dtype=np.float64))
    fit, at = xs[:-1], float(xs[-1])
    errors = []
    for s in seeds:  # each seed's own line through the narrower widths, and its error at the widest
        a, b = _line(fit, [m[s] for m in vals[:-1]])
        errors.append(vals[-1][s] - (a + b * at))
    a, b = _line(fit, [float(np.mean([m[s] for s in seeds])) for m in vals[:-1]])
    if not math.isfinite(b):
        return None
    back = (lambda y: 10 ** y) if log_y else (lambda y: y)
    d = describe(errors)
    return HeldOut(r.study, r.variant, quantity, log_y, tuple(sizes[:-1]), sizes[-1], back(a + b * at),
                   back(float(np.mean([vals[-1][s] for s in seeds]))), len(seeds), d.mean, d.ci_lo, d.ci_hi)


def held_out(rows: list[MethodScale]) -> list[HeldOut]:
    """For every variant run at MIN_WIDTHS + 1 widths or more: LR sensitivity, the tuned rate, and the max
    logit at each multiple of the tuned rate (where the widest width's grid has it), each held out at the
    widest width."""
    out = []
    for r in rows:
        found = [_one(r, "LR sensitivity", r.sizes, r.sensitivity, False),
                 _one(r, "tuned rate", r.sizes, r.tuned, True)]
        for k in LOGIT_AT:
            ws, sizes, vals = r.logits.get(k, ([], [], []))
            if ws and ws[-1] == r.widths[-1]:  # the widest width has this multiple of its tuned rate
                found.append(_one(r, f"max logit at x{k:g} the tuned rate", sizes, vals, True))
        out += [h for h in found if h is not None]
    return out


def _num(x: float) -> str:
    """Three significant digits, without an exponent from 1,000 up (1900, not 1.9e+03)."""
    return f"{float(f'{x:.3g}'):.0f}" if math.isfinite(x) and 1e3 <= abs(x) < 1e9 else f"{x:.3g}"


def held_out_table(rows: list[HeldOut]) -> Table:
    head = ["study", "variant", "quantity", "fitted on (non-embedding parameters)", "held out", "predicted",
            "measured", "seeds", "measured vs predicted (x: ratio, log-log; +/-: difference), 95% CI", "outcome"]
    body = []
    for h in rows:
        interval = f" [{h.shown(h.lo)}, {h.shown(h.hi)}]" if math.isfinite(h.lo) and math.isfinite(h.hi) else " -"
        body.append([h.study, h.variant, h.quantity, ", ".join(millions(s) for s in h.fitted), millions(h.size),
                     _num(h.predicted), _num(h.measured), str(h.n), h.shown(h.error) + interval, h.outcome])
    return head, body


def held_out_data(rows: list[HeldOut]) -> list[dict[str, Any]]:
    """report.json's record: every field, and the outcome."""
    return [{**asdict(h), "fitted": list(h.fitted), "outcome": h.outcome} for h in rows]
