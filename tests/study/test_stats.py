"""Study statistics against hand computations on fixed inputs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qklab.study.stats import bootstrap_ci, describe, paired_difference

T975 = {2: 4.302652729911275, 3: 3.182446305284263}  # Student t quantiles (0.975), from tables


def t3_cdf(t: float) -> float:
    """Closed form of Student's t CDF with 3 degrees of freedom."""
    x = t / math.sqrt(3)
    return 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi


def test_describe_by_hand():
    d = describe([1.0, 2.0, 4.0])
    mean, sd = 7 / 3, math.sqrt(7 / 3)  # sum of squares 42/9, over n-1 = 2
    assert d["n"] == 3 and d["mean"] == pytest.approx(mean) and d["std"] == pytest.approx(sd)
    half = T975[2] * sd / math.sqrt(3)
    assert d["ci_lo"] == pytest.approx(mean - half) and d["ci_hi"] == pytest.approx(mean + half)


def test_describe_ignores_non_finite_and_one_value_has_no_interval():
    d = describe([3.0, float("nan"), float("inf")])
    assert d["n"] == 1 and d["mean"] == 3.0 and math.isnan(d["std"]) and math.isnan(d["ci_lo"])
    assert describe([])["n"] == 0


def test_paired_difference_by_hand():
    a = {0: 5.0, 1: 5.2, 2: 4.9, 3: 5.1, 7: 1.0}  # seed 7 has no partner: left out
    b = {0: 5.1, 1: 5.25, 2: 5.0, 3: 5.3}
    d = np.array([-0.1, -0.05, -0.1, -0.2])
    mean, sd = d.mean(), d.std(ddof=1)
    t = mean / (sd / 2)
    out = paired_difference(a, b)
    assert out["n"] == 4 and out["seeds"] == [0, 1, 2, 3]
    assert out["mean"] == pytest.approx(mean) and out["std"] == pytest.approx(sd)
    assert out["t"] == pytest.approx(t)
    assert out["p"] == pytest.approx(2 * (1 - t3_cdf(abs(t))), rel=1e-9)
    assert out["ci_hi"] == pytest.approx(mean + T975[3] * sd / 2)
    # the percentile bootstrap against the exact distribution of all 4^4 resamples
    means = sorted(np.mean(c) for c in itertools.product(d, repeat=4))
    lo, hi = np.quantile(means, [0.025, 0.975])
    assert out["boot_lo"] == pytest.approx(lo, abs=0.006) and out["boot_hi"] == pytest.approx(hi, abs=0.006)


def test_bootstrap_degenerate_and_reproducible():
    assert bootstrap_ci(np.array([0.3, 0.3, 0.3, 0.3])) == pytest.approx((0.3, 0.3))
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([0.1, 0.2, 0.4])))  # too few seeds
    x = np.array([0.1, -0.4, 0.2, 0.5, -0.1])
    assert bootstrap_ci(x) == bootstrap_ci(x)  # fixed generator
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([1.0])))


def test_identical_differences():
    out = paired_difference({0: 2.0, 1: 3.0}, {0: 1.0, 1: 2.0})
    assert out["mean"] == 1.0 and out["std"] == 0.0 and out["p"] == 0.0 and out["t"] == math.inf
