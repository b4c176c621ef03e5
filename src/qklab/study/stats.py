"""Statistics of a study: mean +- std with a 95% t-interval, and paired differences over seeds.

Seeds are the unit of replication. A paired difference compares two methods on the same seeds (the same
initialisation stream and the same batches), so the seed-to-seed spread that both share cancels:
d_s = a_s - b_s, then a one-sample t-test of mean(d) = 0 (two-sided), its 95% t-interval, and a
percentile bootstrap interval of mean(d) (resampling seeds with a fixed generator, so it is reproducible;
from four seeds on), the exact sign-flip (permutation) test of mean(d) = 0 (two-sided, every one of the
2^n sign assignments of the differences enumerated), the degrees of freedom n - 1 and the effect size
mean(d) / sd(d) (the mean difference in units of its seed-to-seed spread).
With fewer than two values every spread, interval and t p-value is NaN: one seed gives no interval.
Across a family of claims: Holm's step-down adjustment (family-wise error) and Benjamini-Hochberg's
(false discovery rate) of a list of p-values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.95
N_BOOT = 10_000
MIN_BOOT = 4  # two seeds give 3 distinct resample means, three give 10: no interval from those
MAX_EXACT = 16  # sign-flip enumeration up to 2^16 assignments; above, N_FLIP seeded random assignments
N_FLIP = 1 << 16


NAN = float("nan")


@dataclass(frozen=True)
class Summary:
    """n, mean, sample std (ddof 1) and the t-interval (ci_lo, ci_hi) of the mean over seeds."""

    n: int = 0
    mean: float = NAN
    std: float = NAN
    ci_lo: float = NAN
    ci_hi: float = NAN


@dataclass(frozen=True)
class Difference(Summary):
    """The statistics of paired differences against mean 0: ``Summary``'s, the t statistic and its two-sided
    p-value, the degrees of freedom, the exact sign-flip p-value, the effect size mean / std, the percentile
    bootstrap interval, the differences, and the seeds they pair (``paired_difference``)."""

    t: float = NAN
    p: float = NAN
    df: int = 0
    p_flip: float = NAN
    effect: float = NAN
    boot_lo: float = NAN
    boot_hi: float = NAN
    diffs: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()


def _clean(xs: Sequence[float]) -> np.ndarray:
    return np.asarray([float(x) for x in xs if x is not None and math.isfinite(float(x))], dtype=np.float64)


def describe(xs: Sequence[float], confidence: float = CONFIDENCE) -> Summary:
    """n, mean, sample std (ddof 1) and the t-interval of the mean of the finite values of xs."""
    x = _clean(xs)
    n = int(x.size)
    if n == 0:
        return Summary()
    mean = float(x.mean())
    if n < 2:
        return Summary(1, mean)
    std = float(x.std(ddof=1))
    half = float(sps.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half)


def bootstrap_ci(d: np.ndarray, confidence: float = CONFIDENCE, n_boot: int = N_BOOT,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of d (resampling its entries with replacement); NaN
    below MIN_BOOT values, where resampling has too few distinct outcomes to mean anything."""
    if d.size < MIN_BOOT:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)  # (n_boot,)
    lo, hi = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
    return float(lo), float(hi)


def sign_flip_p(d: Sequence[float], max_exact: int = MAX_EXACT, seed: int = 0) -> float:
    """Two-sided p-value of the exact sign-flip test of mean(d) = 0: the share of the 2^n assignments of
    signs to |d_i| whose mean is at least as far from zero as the observed one (the observed assignment
    counts, so p >= 2 / 2^n when no difference is zero). Under the null each paired difference is as
    likely to have either sign (the two methods are exchangeable within a seed). NaN for no values.
    Above ``max_exact`` values, a seeded Monte Carlo estimate (count + 1) / (draws + 1) instead."""
    x = _clean(d)
    n = int(x.size)
    if n == 0:
        return float("nan")
    obs = abs(float(x.mean()))
    a = np.abs(x)
    if n <= max_exact:
        bits = (np.arange(1 << n, dtype=np.int64)[:, None] >> np.arange(n, dtype=np.int64)) & 1  # (2^n, n)
        signs = 1.0 - 2.0 * bits
        means = np.abs(signs @ a) / n  # (2^n,)
        draws = means.size
    else:
        rng = np.random.default_rng(seed)
        means = np.abs((1.0 - 2.0 * rng.integers(0, 2, size=(N_FLIP, n))) @ a) / n
        draws = means.size
    hit = int(np.count_nonzero(means >= obs - 1e-12 * max(1.0, obs)))  # ties in float count as "as extreme"
    return hit / draws if n <= max_exact else (hit + 1) / (draws + 1)


def min_sign_flip_p(n: int) -> float:
    """The smallest two-sided p-value the exact sign-flip test can give with n paired values: 2 / 2^n."""
    return 2.0 / 2.0 ** n if n >= 1 else float("nan")


def min_seeds(alpha: float) -> int:
    """The fewest paired seeds with which the exact sign-flip test can reach p < alpha (6 for 0.05)."""
    n = 1
    while min_sign_flip_p(n) >= alpha:
        n += 1
    return n


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sort the m finite p-values ascending,
    p~(i) = max over j <= i of min(1, (m - j + 1) p(j)). NaN entries stay NaN and do not count in m."""
    idx = [i for i, p in enumerate(ps) if p is not None and math.isfinite(p)]
    out = [float("nan")] * len(ps)
    m, run = len(idx), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: ps[i])):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        out[i] = run
    return out


def benjamini_hochberg(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values), in the order given: sort the m finite p-values
    ascending, q(i) = min over j >= i of min(1, m p(j) / j). NaN entries stay NaN and do not count in m."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None and math.isfinite(p)), key=lambda i: ps[i])
    out = [float("nan")] * len(ps)
    m, run = len(idx), 1.0
    for rank in range(m, 0, -1):
        i = idx[rank - 1]
        run = min(run, min(1.0, m * ps[i] / rank))
        out[i] = run
    return out


def difference_stats(d: Sequence[float], confidence: float = CONFIDENCE) -> Difference:
    """The statistics of paired differences d (finite values only) against mean(d) = 0: n, mean, std, the
    t statistic, its two-sided p-value, the t-interval (ci_lo, ci_hi), the bootstrap interval (boot_lo,
    boot_hi), the degrees of freedom (df = n - 1), the exact sign-flip p-value (p_flip), the effect size
    mean / std (effect) and the differences (diffs). To test mean(d) = m, pass d - m."""
    x = _clean(d)  # (n,)
    s = describe(x, confidence)
    t = p = effect = NAN
    if x.size >= 2:
        se = s.std / math.sqrt(x.size)
        if se > 0:
            t = s.mean / se
            p = float(2 * sps.t.sf(abs(t), x.size - 1))
            effect = s.mean / s.std
        else:  # identical differences: no spread, the sign is certain only if they are non-zero
            t = math.copysign(math.inf, s.mean) if s.mean != 0 else 0.0
            p = 0.0 if s.mean != 0 else 1.0
            effect = t
    boot_lo, boot_hi = bootstrap_ci(x, confidence)
    return Difference(s.n, s.mean, s.std, s.ci_lo, s.ci_hi, t=t, p=p, df=max(int(x.size) - 1, 0),
                      p_flip=sign_flip_p(x), effect=effect, boot_lo=boot_lo, boot_hi=boot_hi, diffs=tuple(x.tolist()))


def paired_difference(a: dict[int, float], b: dict[int, float], confidence: float = CONFIDENCE) -> Difference:
    """a - b over the seeds both have (finite values only). a, b: seed -> value.

    Returns the seeds and ``difference_stats`` of the differences: n, mean, std, t, its two-sided p-value,
    the t-interval (ci_lo, ci_hi), the bootstrap interval (boot_lo, boot_hi), df, p_flip, effect, diffs."""
    seeds = sorted(s for s in a.keys() & b.keys() if math.isfinite(a[s]) and math.isfinite(b[s]))
    return replace(difference_stats([a[s] - b[s] for s in seeds], confidence), seeds=tuple(seeds))


def fmt_mean_std(d: Summary, digits: int = 3) -> str:
    """'4.913 ± 0.065' (or '4.913' for one value, '-' for none)."""
    if d.n == 0:
        return "-"
    if not math.isfinite(d.std):
        return f"{d.mean:.{digits}f}"
    return f"{d.mean:.{digits}f} ± {d.std:.{digits}f}"


def fmt_ci(lo: float, hi: float, digits: int = 3) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "-"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"
