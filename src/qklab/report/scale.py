"""Behaviour across scale, for every study whose variants ran at three or more widths: each method's
learning-rate sensitivity by size (study.sensitivity: Wortsman et al. 2023's definition, report split), and
the trends of LR sensitivity, the tuned rate and the max attention logit at fixed multiples of the tuned rate
against non-embedding parameters, each fit per seed with the t-interval over seeds; one figure, sensitivity
against size, one line per method. Descriptive: the scale claims (study.scale_measures) test them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qklab.report.claim_row import ClaimRow
from qklab.study.analyze import Group
from qklab.study.sensitivity import Trend, group_sensitivity, group_size, trend, tuned_by_seed, width_ladders
from qklab.study.stats import describe, fmt_ci

Table = tuple[list[str], list[list[str]]]
MIN_WIDTHS = 3  # a trend needs three sizes
LOGIT_AT = (1.0, 4.0)  # max logit at these multiples of each width's tuned rate (where the grid has them)
# a method that changes what "learning rate" means: its sensitivity is over the base rate it was given
LIMITS = {"quack": "QuacK sets each head's Q/K rate by its own rule: the sensitivity is over the base rate, "
                   "not the rate its Q/K weights see",
          "qk_lr_multiplier": "the fixed multiplier scales the Q/K rate: the sensitivity is over the base rate",
          "muon-per-head": "per-head Muon normalises each head's update: the sensitivity is over the base rate"}
INTRO = ("LR sensitivity (Wortsman et al. 2023, arXiv 2309.14322) of a method at a size and seed: the mean over "
         "its rate grid of min(L(eta), L0) - L*, L the final report-split loss, L0 = ln(vocabulary) the loss at "
         "initialisation, L* the best over the grid; mean and 95% t-interval over seeds. It is blind to the "
         "loss level (read it beside the results table) and depends on the grid's window. Size: non-embedding "
         "parameters. Trends: least-squares fits against log10 size, LR sensitivity log-linear (a difference of "
         "losses, near zero at times), the tuned rate and the max logit log-log (positive, spanning decades); "
         "each seed is fitted on its own and the interval is the t-interval over seeds (the seeds every size "
         "has).")


@dataclass(frozen=True)
class MethodScale:
    """One variant of one study across its widths."""

    study: str
    variant: str
    widths: list[int]
    sizes: list[float]
    sensitivity: list[dict[int, float]]  # per width: seed -> LR sensitivity
    tuned: list[dict[int, float]]  # per width: seed -> that seed's tuned rate (selection split)
    logits: dict[float, tuple[list[int], list[float], list[dict[int, float]]]]  # multiple -> widths, sizes, values
    limit: str | None

    def sensitivity_trend(self) -> Trend:
        return trend(self.sizes, self.sensitivity)

    def tuned_trend(self) -> Trend:
        return trend(self.sizes, self.tuned, log_y=True)

    def logit_trend(self, k: float) -> Trend | None:
        ws, sizes, vals = self.logits.get(k, ([], [], []))
        return trend(sizes, vals, log_y=True) if len(ws) >= MIN_WIDTHS else None


def _limit(g: Group) -> str | None:
    ctrl = g.controller or "none"
    return next((v for k, v in LIMITS.items() if k in ctrl), None)


def method_scales(groups: list[Group]) -> list[MethodScale]:
    """Every variant of every study that ran it at MIN_WIDTHS widths or more, in the study's order."""
    out = []
    for study, variants in sorted(width_ladders(groups).items()):
        for variant, by_w in variants.items():
            widths = sorted(by_w)
            if len(widths) < MIN_WIDTHS:
                continue
            gs = [by_w[w] for w in widths]
            logits: dict[float, tuple[list[int], list[float], list[dict[int, float]]]] = {}
            for k in LOGIT_AT:
                for w, g in zip(widths, gs, strict=True):
                    m = g.chosen * k if g.chosen is not None else None
                    if m in g.sweep:
                        ws, sz, vals = logits.setdefault(k, ([], [], []))
                        ws.append(w)
                        sz.append(group_size(g))
                        vals.append(dict(g.sweep[m].max_logit_by_seed))
            out.append(MethodScale(study, variant, widths, [group_size(g) for g in gs],
                                   [group_sensitivity(g) for g in gs], [tuned_by_seed(g) for g in gs], logits,
                                   _limit(gs[0])))
    return out


def millions(n: float) -> str:
    """A parameter count in millions, two significant digits, whole millions where that would need an
    exponent: 0.21M, 13M, 124M, 100M (never 1.2e+02M); '-' when unknown."""
    if not math.isfinite(n):
        return "-"
    m = f"{n / 1e6:.2g}"
    return f"{n / 1e6:.0f}M" if "e" in m else f"{m}M"


def _fit(t: Trend | None, digits: int = 3) -> str:
    if t is None or not math.isfinite(t.slope):
        return "-"
    return f"{t.slope:+.{digits}f} {fmt_ci(t.lo, t.hi, digits)}"


def scale_sensitivity_table(rows: list[MethodScale]) -> Table:
    """LR sensitivity by width (mean [95% t-interval], n), its slope per decade of size with its t-interval
    interval, and the limit of a method that changes what the rate means."""
    widths = sorted({w for r in rows for w in r.widths})
    head = ["study", "variant", *(f"width {w}" for w in widths), "slope per decade of parameters (95% t over seeds)",
            "note"]
    body = []
    for r in rows:
        cells = []
        for w in widths:
            if w not in r.widths:
                cells.append("-")
                continue
            d = describe(list(r.sensitivity[r.widths.index(w)].values()))
            cells.append(f"{d.mean:.3f} {fmt_ci(d.ci_lo, d.ci_hi)} (n={d.n})" if d.n else "-")
        body.append([r.study, r.variant, *cells, _fit(r.sensitivity_trend()), r.limit or ""])
    return head, body


def trends_table(rows: list[MethodScale]) -> Table:
    """Each fit's slope against log10 non-embedding parameters, with its t-interval over seeds."""
    head = ["study", "variant", "sizes (non-embedding parameters)", "LR sensitivity (nats per decade)",
            "tuned rate (log-log)", *(f"max logit at x{k:g} the tuned rate (log-log)" for k in LOGIT_AT)]
    body = []
    for r in rows:
        sizes = ", ".join(millions(s) for s in r.sizes)
        body.append([r.study, r.variant, sizes, _fit(r.sensitivity_trend()), _fit(r.tuned_trend()),
                     *(_fit(r.logit_trend(k)) for k in LOGIT_AT)])
    return head, body


def scale_data(rows: list[MethodScale]) -> dict[str, Any]:
    """The figure's series: study -> variant -> size, mean sensitivity and its t-interval, the fit's slope."""
    out: dict[str, Any] = {}
    for r in rows:
        ds = [describe(list(m.values())) for m in r.sensitivity]
        t = r.sensitivity_trend()
        out.setdefault(r.study, {})[r.variant] = {
            "size": r.sizes, "mean": [d.mean for d in ds], "lo": [d.ci_lo for d in ds],
            "hi": [d.ci_hi for d in ds], "n": [d.n for d in ds], "slope": t.slope,
            "slope_lo": t.lo, "slope_hi": t.hi, "intercept": t.intercept}
    return out


def draw_scale(data: dict[str, Any], path: Path, colour: dict[str, str]) -> Path | None:
    """LR sensitivity against non-embedding parameters (log x), one line per method, one panel per study.
    A size the results do not give (NaN) or a sensitivity not measured is left out; a study with no point
    left has no panel, and no study with one no figure."""
    def drawn(s: dict[str, Any]) -> np.ndarray:
        x, y = np.array(s["size"], dtype=float), np.array(s["mean"], dtype=float)
        return np.isfinite(x) & (x > 0) & np.isfinite(y)

    data = {study: kept for study, series in data.items()
            if (kept := {label: s for label, s in series.items() if drawn(s).any()})}
    if not data:
        return None
    from qklab.report.figures import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4), squeeze=False)
    for ax, (study, series) in zip(axes.flat, sorted(data.items()), strict=True):
        for label, s in series.items():
            keep = drawn(s)
            x, y = np.array(s["size"], dtype=float)[keep], np.array(s["mean"], dtype=float)[keep]
            lo, hi = np.array(s["lo"], dtype=float)[keep], np.array(s["hi"], dtype=float)[keep]
            c = colour.get(label, "#333333")
            ax.plot(x, y, "o-", color=c, label=f"{label} (slope {s['slope']:+.3f}/decade)", gid=label)
            ok = np.isfinite(lo) & np.isfinite(hi)
            ax.fill_between(x[ok], lo[ok], hi[ok], color=c, alpha=0.15, gid=label)
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters")
        ax.set_ylabel("LR sensitivity (nats)")
        ax.set_title(f"learning-rate sensitivity against size: {study}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CONTROL = ("scale.control_logit_rate", "scale.control_logit_width", "scale.qknorm_sensitivity")


def control_lines(rows: list[ClaimRow]) -> list[str]:
    """The positive control's section, first in a report whose study registered it: each control claim's
    verdict, and, unless every one agrees, that the control failed, so that nothing after it reads as if
    the study could see the effect it was built to see."""
    ctl = [r for r in rows if r.id in CONTROL and r.status == "confirmatory"]
    if not ctl:
        return []
    lines = ["### Positive control", "",
             "Before any other claim: does this study see what is already known (Wortsman et al. 2023)? "
             "Registered before its first cell; verdicts by the claims table's rule.", ""]
    lines += [f"- {r.claim}: **{r.verdict}** ({r.measured}; {r.reason})" for r in ctl]
    verdicts = ", ".join(r.verdict for r in ctl)
    if all(r.verdict == "agree" for r in ctl):
        lines += ["", "The control holds: the study sees the known effects, so its other scale claims can be read."]
    elif any(r.verdict == "disagree" for r in ctl):
        lines += ["", f"**The control fails** ({verdicts}): the study sees the opposite of a known effect, so its "
                  "other scale claims cannot be read as evidence about the methods."]
    else:
        lines += ["", f"**The control is not established** ({verdicts}): until it is, a null or negative result "
                  "among the other scale claims says little about the methods."]
    return [*lines, ""]
