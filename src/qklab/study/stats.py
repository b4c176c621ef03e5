"""Statistics of a study: mean +- std with a 95% t-interval, and paired differences over seeds.

Seeds are the unit of replication. A paired difference compares two methods on the same seeds (the same
initialisation stream and the same batches), so the seed-to-seed spread that both share cancels:
d_s = a_s - b_s, then a one-sample t-test of mean(d) = 0 (two-sided), its 95% t-interval, and a
percentile bootstrap interval of mean(d) (resampling seeds with a fixed generator, so it is reproducible;
from four seeds on).
With fewer than two values every spread, interval and p-value is NaN: one seed gives no interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.95
N_BOOT = 10_000
MIN_BOOT = 4  # two seeds give 3 distinct resample means, three give 10: no interval from those


def _clean(xs: Sequence[float]) -> np.ndarray:
    return np.asarray([float(x) for x in xs if x is not None and math.isfinite(float(x))], dtype=np.float64)


def describe(xs: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, float]:
    """n, mean, sample std (ddof 1) and the t-interval of the mean of the finite values of xs."""
    x = _clean(xs)
    n = int(x.size)
    nan = float("nan")
    if n == 0:
        return {"n": 0, "mean": nan, "std": nan, "ci_lo": nan, "ci_hi": nan}
    mean = float(x.mean())
    if n < 2:
        return {"n": 1, "mean": mean, "std": nan, "ci_lo": nan, "ci_hi": nan}
    std = float(x.std(ddof=1))
    half = float(sps.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_lo": mean - half, "ci_hi": mean + half}


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


def paired_difference(a: dict[int, float], b: dict[int, float], confidence: float = CONFIDENCE) -> dict[str, float]:
    """a - b over the seeds both have (finite values only). a, b: seed -> value.

    Returns n, mean, std of the differences, the t statistic, its two-sided p-value, the t-interval
    (ci_lo, ci_hi) and the bootstrap interval (boot_lo, boot_hi)."""
    seeds = sorted(s for s in a.keys() & b.keys() if math.isfinite(a[s]) and math.isfinite(b[s]))
    d = np.asarray([a[s] - b[s] for s in seeds], dtype=np.float64)  # (n,)
    out = {**describe(d, confidence), "seeds": seeds, "t": float("nan"), "p": float("nan")}
    if d.size >= 2:
        se = out["std"] / math.sqrt(d.size)
        if se > 0:
            out["t"] = out["mean"] / se
            out["p"] = float(2 * sps.t.sf(abs(out["t"]), d.size - 1))
        else:  # identical differences: no spread, the sign is certain only if they are non-zero
            out["t"] = math.copysign(math.inf, out["mean"]) if out["mean"] != 0 else 0.0
            out["p"] = 0.0 if out["mean"] != 0 else 1.0
    out["boot_lo"], out["boot_hi"] = bootstrap_ci(d, confidence)
    return out


def fmt_mean_std(d: dict[str, float], digits: int = 3) -> str:
    """'4.913 ± 0.065' (or '4.913' for one value, '-' for none)."""
    if d["n"] == 0:
        return "-"
    if not math.isfinite(d["std"]):
        return f"{d['mean']:.{digits}f}"
    return f"{d['mean']:.{digits}f} ± {d['std']:.{digits}f}"


def fmt_ci(lo: float, hi: float, digits: int = 3) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "-"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"
