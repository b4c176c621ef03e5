"""Learning-rate sensitivity and trends across scale (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities", arXiv 2309.14322).

* LR sensitivity of a method at one width and seed: the mean over the rate grid of min(L(eta), L0) - L*,
  L(eta) the final report-split loss at rate eta, L0 the loss at initialisation, L* the best loss over the
  grid (min over eta of min(L(eta), L0)). Here L0 = ln(vocabulary): at initialisation the model's output
  logits are within a few hundredths of zero (init std 0.02, tied embeddings), so its loss is that of the
  uniform distribution; a cell that stopped non-finite counts as L0, one flagged diverged by its final loss
  (capped at L0, as every loss). A seed counts only where every rate of its grid finished.
* Size: non-embedding parameters (the count the result records less the token embedding, once if tied,
  twice if not), as Wortsman et al. count them.
* Trends: a least-squares slope per seed against log10 of that size, so that a method's slope minus
  ``none``'s is paired over seeds. LR sensitivity is fitted log-linear (nats against log10 N): it is a
  difference of losses that can be near zero, where a logarithm would blow its noise up; the max attention
  logit and the tuned rate are fitted log-log (both positive and spanning decades, and a power law in N is
  what a width ladder predicts for the tuned rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import t as scipy_t

from qklab.study.analyze import Group
from qklab.study.result import load_result, num
from qklab.study.stats import describe


def width_ladders(groups: list[Group]) -> dict[str, dict[str, dict[int, Group]]]:
    """study -> variant -> width -> group, for the studies whose groups of one variant sit at two or more
    widths, one grid point each (a grid over anything else beside the width is not a ladder)."""
    out: dict[str, dict[str, dict[int, list[Group]]]] = {}
    for g in groups:
        if g.d_model:
            out.setdefault(g.study, {}).setdefault(g.variant, {}).setdefault(int(g.d_model), []).append(g)
    return {s: {v: {w: gs[0] for w, gs in by_w.items()} for v, by_w in vs.items()}
            for s, vs in out.items()
            if all(len(gs) == 1 for by_w in vs.values() for gs in by_w.values())
            and max(len(by_w) for by_w in vs.values()) >= 2}


def capped_loss(x: float, l0: float) -> float:
    """A final loss as the scale analysis reads it: at most L0, the loss at initialisation; a non-finite one
    (a run that blew up) counts as L0."""
    return min(x, l0) if math.isfinite(x) else l0


def lr_sensitivity(losses: Sequence[float], l0: float) -> float:
    """Mean over the grid of min(L, L0) - L*, with L* = min over the grid of min(L, L0); a non-finite loss
    counts as L0 (``capped_loss``). NaN for an empty grid."""
    if not losses:
        return float("nan")
    capped = [capped_loss(x, l0) for x in losses]
    best = min(capped)
    return sum(x - best for x in capped) / len(capped)


def slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of y on x (NaN with fewer than two distinct x or a non-finite value)."""
    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xa.size < 2 or not (np.isfinite(xa).all() and np.isfinite(ya).all()) or np.ptp(xa) == 0:
        return float("nan")
    xc = xa - xa.mean()
    return float((xc * (ya - ya.mean())).sum() / (xc * xc).sum())


def non_embedding(n_params: float, vocab: float, d_model: float, tied: bool = True) -> float:
    """Parameters less the token embedding (and the output head when it is not tied to it)."""
    return float(n_params) - float(vocab) * float(d_model) * (1 if tied else 2)


def group_size(g: Group) -> float:
    """A group's non-embedding parameter count (NaN when its results do not say)."""
    n, v, d = g.n_params, g.vocab_size, g.d_model
    if not (n and v and d):
        return float("nan")
    return non_embedding(n, v, d, bool(g.tie_embeddings))


def grid_final(g: Group, key: str = "report_loss") -> dict[float, dict[int, float]]:
    """rate multiple -> seed -> ``final[key]`` of every finished cell of an analysed group
    (``analyze._group``), read from its result files after the rate was chosen (``analyze`` reads the report
    split at the chosen rate only); kept in the group's ``grid_final`` memo (given there, used as is)."""
    cache = g.grid_final
    if key not in cache:
        out: dict[float, dict[int, float]] = {}
        for m, cells in g.cells.items():
            for c in cells:
                res, _ = load_result(Path(c["path"])) if c.get("path") else (None, None)
                if res is not None and res.get("status") != "failed":
                    out.setdefault(float(m), {})[int(c["seed"])] = num((res.get("final") or {}).get(key))
        cache[key] = out
    return cache[key]


def rate_grid(g: Group) -> list[float]:
    """The rate multiples a seed must have finished to count: the grid its study registered for the group's
    variant, and every rate run beside it (a study that ran a rate it no longer registers still has those
    cells); only the rates run where the study.json records no grid. A rate not yet run by any seed thus
    leaves every seed out instead of narrowing the window of all of them."""
    return sorted(set(g.grid) | set(g.sweep))


def tuned_by_seed(g: Group) -> dict[int, float]:
    """seed -> the rate (not the multiple) with that seed's lowest final selection-split loss, for the seeds
    with a finished cell at every rate of the group's grid (``rate_grid``; a non-finite loss never wins)."""
    grid = grid_final(g, "val_loss")
    mults = rate_grid(g)
    seeds = set.intersection(*(set(grid.get(m, {})) for m in mults)) if mults else set()
    out = {}
    for s in sorted(seeds):
        finite = [(grid[m][s], m) for m in mults if math.isfinite(grid[m][s])]
        if finite:
            out[s] = float(g.sweep[min(finite)[1]].lr)
    return out


def group_sensitivity(g: Group) -> dict[int, float]:
    """seed -> LR sensitivity of an analysed group over its whole rate grid (``rate_grid``; ``grid_final``:
    report split), for the seeds with a finished cell at every rate; L0 = ln(vocab)."""
    grid = grid_final(g)
    if not grid or not g.vocab_size:
        return {}
    l0 = math.log(float(g.vocab_size))
    by_rate = [grid.get(m, {}) for m in rate_grid(g)]
    seeds = set.intersection(*(set(r) for r in by_rate)) if by_rate else set()
    return {s: lr_sensitivity([r[s] for r in by_rate], l0) for s in sorted(seeds)}


@dataclass(frozen=True)
class Trend:
    """A fit of y (log10 y with ``log_y``) against log10(size), per seed over the seeds every size has:
    ``fits`` seed -> (intercept, slope), ``by_seed`` seed -> slope; ``slope`` and ``intercept`` their means
    (the fit of those seeds' means: least squares is linear in y); ``lo``, ``hi`` the t-interval over seeds of
    the slope (NaN below two seeds). Seeds are the unit: a resample of each size's two or three seeds alone
    would give intervals far too narrow (it misses the seed-to-seed spread of the slope itself)."""

    by_seed: dict[int, float]
    slope: float
    intercept: float
    lo: float
    hi: float
    log_y: bool
    fits: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)

    def at(self, size: float, confidence: float = 0.95) -> tuple[float, float, float]:
        """(value, lo, hi) of the fit at ``size`` (back on the y scale with ``log_y``): the mean of the seeds'
        fits there and its t-interval over seeds. It says what these sizes' seeds give, not how far the law
        holds beyond them."""
        x = math.log10(size)
        d = describe([a + b * x for a, b in self.fits.values()], confidence)
        mid, lo, hi = (self.intercept + self.slope * x if self.fits else float("nan")), d.ci_lo, d.ci_hi
        return (10 ** mid, 10 ** lo, 10 ** hi) if self.log_y else (mid, lo, hi)

    def spread(self, size: float) -> tuple[int, float]:
        """(seeds, sample std of the seeds' fits at ``size``), on the fit's scale (log10 with ``log_y``): what
        ``run_interval`` needs, to be written beside a prediction."""
        x = math.log10(size)
        d = describe([a + b * x for a, b in self.fits.values()])
        return d.n, d.std


def within_spread(values: Sequence[Mapping[int, float]], log_y: bool = False) -> tuple[float, int]:
    """(pooled sample std, its degrees of freedom) of the seeds' values within each size (one seed -> value
    map per size), on the fit's scale: how far one run lies from another of the same size, the seed noise a
    single new run carries, pooled over the sizes with two seeds or more. (NaN, 0) where none has two."""
    tf = fit_scale(log_y)
    ss, df = 0.0, 0
    for m in values:
        x = [y for y in (tf(v) for v in m.values()) if math.isfinite(y)]
        if len(x) >= 2:
            mu = sum(x) / len(x)
            ss, df = ss + sum((y - mu) ** 2 for y in x), df + len(x) - 1
    return (math.sqrt(ss / df), df) if df else (float("nan"), 0)


def run_interval(mid: float, n: int, sd: float, run_sd: float, run_df: int, runs: int = 1, log_y: bool = False,
                 confidence: float = 0.95) -> tuple[float, float]:
    """Where the mean of ``runs`` new seeds' values at a size should fall if the fitted law held there: ``mid``
    (the mean of n seeds' fits there, on the fit's scale) -+ t(df) sqrt(sd^2 / n + run_sd^2 / runs). The first
    part is the uncertainty of the mean fit (``sd``: the spread of the seeds' fits at that size, which carries
    the extrapolation's leverage); the second the new runs' own seed noise (``run_sd``: ``within_spread``, with
    ``run_df`` degrees of freedom), which the interval of the mean alone (``Trend.at``) leaves out. The t
    quantile at Welch-Satterthwaite's df, the half-width never below the mean's own t(n - 1) sd / sqrt(n)
    (Welch-Satterthwaite's df can otherwise make it the narrower). (NaN, NaN) where a part is unknown; a
    zero-width interval where both are zero (every seed at every size alike, e.g. a loss at L0 throughout)."""
    v1, v2 = (sd * sd / n if n >= 2 else math.nan), (run_sd * run_sd / runs if runs >= 1 and run_df >= 1 else math.nan)
    if not (math.isfinite(v1) and math.isfinite(v2)):
        return float("nan"), float("nan")
    q = 0.5 + confidence / 2
    if v1 + v2 > 0:
        df = (v1 + v2) ** 2 / (v1 * v1 / (n - 1) + v2 * v2 / run_df)
        half = max(float(scipy_t.ppf(q, df)) * math.sqrt(v1 + v2), float(scipy_t.ppf(q, n - 1)) * math.sqrt(v1))
    else:
        half = 0.0
    lo, hi = mid - half, mid + half
    return (10 ** lo, 10 ** hi) if log_y else (lo, hi)


def fit_scale(log_y: bool) -> Callable[[float], float]:
    """The scale a fit takes its values on: log10 with ``log_y`` (NaN for a value <= 0), else as they are."""
    return (lambda v: math.log10(v) if v > 0 else float("nan")) if log_y else float


def trend(sizes: Sequence[float], values: Sequence[Mapping[int, float]], log_y: bool = False,
          confidence: float = 0.95) -> Trend:
    """The fit of ``values`` (one seed -> value map per size) against log10(size): each seed's own, over the
    seeds with a finite value at every size, and their mean with its t-interval over those seeds."""
    xs = np.log10(np.asarray(sizes, dtype=np.float64))
    tf = fit_scale(log_y)
    vals = [{s: tf(v) for s, v in m.items() if math.isfinite(tf(v))} for m in values]
    common = sorted(set.intersection(*(set(m) for m in vals))) if vals else []
    fits = {}
    for s in common:
        b = slope(xs, [m[s] for m in vals])
        if math.isfinite(b):
            fits[s] = (float(np.mean([m[s] for m in vals]) - b * xs.mean()), b)
    d = describe([b for _, b in fits.values()], confidence)
    a = float(np.mean([a for a, _ in fits.values()])) if fits else float("nan")
    return Trend({s: b for s, (_, b) in fits.items()}, d.mean if fits else float("nan"), a, d.ci_lo, d.ci_hi,
                 log_y, fits)
