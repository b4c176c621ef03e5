"""The widest width held out: each trend across scale (``report.scale``) fitted again on every width of a
ladder but its widest, extrapolated to the widest and set against what the widest measured. A check, on a
study's own ladder, of the kind of extrapolation that the predictions for larger models rest on
(``report.predictions``): one step of 4x in size instead of 12x or 27x, in the same regime. Descriptive,
never a registered claim."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from qklab.report.scale import LOGIT_AT, MIN_WIDTHS, MethodScale, millions
from qklab.study.sensitivity import trend

Table = tuple[list[str], list[list[str]]]
INTRO = ("Each trend of the table above fitted again without the widest width, extrapolated to it, and set "
         "against what the widest width measured: a check of the extrapolation the predictions for larger models "
         "rest on, one step of the ladder (here) instead of many (there). Predicted: the fit at the widest size "
         "with its percentile bootstrap interval over seeds, which says what the fitted widths' seeds give, not "
         "how far the law holds: a miss says the trend bent at the widest width, or that the fitted widths have "
         "too few seeds to say. Measured: the seed mean, geometric for the log-log quantities, as the fit takes "
         "them. Exploratory: no claim rests on it.")


@dataclass(frozen=True)
class HeldOut:
    """One trend of one variant, fitted on ``fitted`` (sizes, narrowest first) and extrapolated to ``size``."""

    study: str
    variant: str
    quantity: str  # "LR sensitivity", "tuned rate", "max logit at x4 the tuned rate"
    log_y: bool  # fitted log-log (the ratio measured / predicted is the natural comparison) or log-linear
    fitted: tuple[float, ...]
    size: float
    predicted: float
    lo: float  # the bootstrap interval at ``size`` (nan: fewer than two seeds at some fitted size)
    hi: float
    measured: float
    n: int  # seeds measured at ``size``

    @property
    def outcome(self) -> str:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return "no interval"
        return "hit" if self.lo <= self.measured <= self.hi else "miss"

    @property
    def off_by(self) -> float:
        """measured / predicted (log-log), measured - predicted (log-linear)."""
        return self.measured / self.predicted if self.log_y else self.measured - self.predicted


def _seed_mean(values: dict[int, float], log_y: bool) -> tuple[float, int]:
    """The mean as the fit takes it (of log10 with ``log_y``, back on the y scale); non-finite values and,
    with ``log_y``, values <= 0 left out as ``trend`` leaves them out."""
    xs = [v for v in values.values() if math.isfinite(v) and (v > 0 or not log_y)]
    if not xs:
        return float("nan"), 0
    return (10 ** float(np.mean(np.log10(xs))) if log_y else float(np.mean(xs))), len(xs)


def _one(r: MethodScale, quantity: str, sizes: list[float], values: list[dict[int, float]],
         log_y: bool) -> HeldOut | None:
    """The trend of ``values`` over every size but the last, at the last; None with fewer than MIN_WIDTHS
    fitted sizes or nothing measured at the last."""
    if len(sizes) < MIN_WIDTHS + 1:
        return None
    measured, n = _seed_mean(values[-1], log_y)
    t = trend(sizes[:-1], values[:-1], log_y=log_y)
    if not n or not math.isfinite(t.slope):
        return None
    mid, lo, hi = t.at(sizes[-1])
    return HeldOut(r.study, r.variant, quantity, log_y, tuple(sizes[:-1]), sizes[-1], mid, lo, hi, measured, n)


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
    return f"{x:.3g}" if math.isfinite(x) else "-"


def held_out_table(rows: list[HeldOut]) -> Table:
    head = ["study", "variant", "quantity", "fitted on (non-embedding parameters)", "held out",
            "predicted (bootstrap 95%)",
            "measured (n)", "measured vs predicted (x: ratio, log-log; +/-: difference)", "outcome"]
    body = []
    for h in rows:
        interval = f"[{_num(h.lo)}, {_num(h.hi)}]" if h.outcome != "no interval" else "-"
        off = f"x{h.off_by:.2f}" if h.log_y else f"{h.off_by:+.3f}"
        body.append([h.study, h.variant, h.quantity, ", ".join(millions(s) for s in h.fitted),
                     millions(h.size), f"{_num(h.predicted)} {interval}", f"{_num(h.measured)} (n={h.n})", off,
                     h.outcome])
    return head, body


def held_out_data(rows: list[HeldOut]) -> list[dict[str, Any]]:
    """report.json's record: every field, with the outcome and the ratio (or difference)."""
    return [{**asdict(h), "fitted": list(h.fitted), "outcome": h.outcome, "off_by": h.off_by} for h in rows]
