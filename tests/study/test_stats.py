"""Study statistics against hand computations on fixed inputs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qklab.study.stats import (
    benjamini_hochberg,
    bootstrap_ci,
    describe,
    holm,
    min_seeds,
    min_sign_flip_p,
    paired_difference,
    sign_flip_p,
)

T975 = {2: 4.302652729911275, 3: 3.182446305284263}  # Student t quantiles (0.975), from tables


def t3_cdf(t: float) -> float:
    """Closed form of Student's t CDF with 3 degrees of freedom."""
    x = t / math.sqrt(3)
    return 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi


def test_describe_by_hand():
    d = describe([1.0, 2.0, 4.0])
    mean, sd = 7 / 3, math.sqrt(7 / 3)  # sum of squares 42/9, over n-1 = 2
    assert d.n == 3 and d.mean == pytest.approx(mean) and d.std == pytest.approx(sd)
    half = T975[2] * sd / math.sqrt(3)
    assert d.ci_lo == pytest.approx(mean - half) and d.ci_hi == pytest.approx(mean + half)


def test_describe_ignores_non_finite_and_one_value_has_no_interval():
    d = describe([3.0, float("nan"), float("inf")])
    assert d.n == 1 and d.mean == 3.0 and math.isnan(d.std) and math.isnan(d.ci_lo)
    assert describe([]).n == 0


def test_paired_difference_by_hand():
    a = {0: 5.0, 1: 5.2, 2: 4.9, 3: 5.1, 7: 1.0}  # seed 7 has no partner: left out
    b = {0: 5.1, 1: 5.25, 2: 5.0, 3: 5.3}
    d = np.array([-0.1, -0.05, -0.1, -0.2])
    mean, sd = d.mean(), d.std(ddof=1)
    t = mean / (sd / 2)
    out = paired_difference(a, b)
    assert out.n == 4 and out.seeds == (0, 1, 2, 3)
    assert out.mean == pytest.approx(mean) and out.std == pytest.approx(sd)
    assert out.t == pytest.approx(t)
    assert out.p == pytest.approx(2 * (1 - t3_cdf(abs(t))), rel=1e-9)
    assert out.ci_hi == pytest.approx(mean + T975[3] * sd / 2)
    # the percentile bootstrap against the exact distribution of all 4^4 resamples
    means = sorted(np.mean(c) for c in itertools.product(d, repeat=4))
    lo, hi = np.quantile(means, [0.025, 0.975])
    assert out.boot_lo == pytest.approx(lo, abs=0.006) and out.boot_hi == pytest.approx(hi, abs=0.006)


def test_bootstrap_degenerate_and_reproducible():
    assert bootstrap_ci(np.array([0.3, 0.3, 0.3, 0.3])) == pytest.approx((0.3, 0.3))
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([0.1, 0.2, 0.4])))  # too few seeds
    x = np.array([0.1, -0.4, 0.2, 0.5, -0.1])
    assert bootstrap_ci(x) == bootstrap_ci(x)  # fixed generator
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([1.0])))


def test_identical_differences():
    out = paired_difference({0: 2.0, 1: 3.0}, {0: 1.0, 1: 2.0})
    assert out.mean == 1.0 and out.std == 0.0 and out.p == 0.0 and out.t == math.inf


def _flip_by_hand(d: list[float]) -> float:
    """Every one of the 2^n sign assignments written out: the share whose |mean| reaches the observed one."""
    obs = abs(sum(d) / len(d))
    hits = [abs(sum(s * abs(x) for s, x in zip(signs, d, strict=True)) / len(d)) >= obs - 1e-12
            for signs in itertools.product((1, -1), repeat=len(d))]
    return sum(hits) / len(hits)


def test_sign_flip_p_by_hand():
    # [0.3, -0.1, 0.2, 0.4]: mean 0.2; of the 16 assignments of signs to (0.3, 0.1, 0.2, 0.4), |sum| >= 0.8 for
    # (+,+,+,+) 1.0, (+,-,+,+) 0.8 and their negations: 4 of 16
    assert sign_flip_p([0.3, -0.1, 0.2, 0.4]) == pytest.approx(4 / 16)
    assert _flip_by_hand([0.3, -0.1, 0.2, 0.4]) == pytest.approx(4 / 16)
    for d in ([0.5, 0.1], [-0.2, 0.3, 0.1], [0.1, 0.2, 0.3, 0.4, 0.5], [0.3, -0.2, 0.25, 0.1, -0.05, 0.4]):
        assert sign_flip_p(d) == pytest.approx(_flip_by_hand(d)), d
    assert sign_flip_p([0.1] * 5) == pytest.approx(2 / 32) == min_sign_flip_p(5)  # all one sign: the floor
    assert sign_flip_p([0.0, 0.0]) == 1.0 and math.isnan(sign_flip_p([]))
    assert paired_difference({0: 1.3, 1: 0.9, 2: 1.2, 3: 1.4}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}).p_flip == (
        pytest.approx(4 / 16))


def test_min_seeds_for_alpha():
    assert min_sign_flip_p(5) == 0.0625 and min_sign_flip_p(6) == 0.03125
    assert min_seeds(0.05) == 6 and min_seeds(0.01) == 8  # 2/2^7 = 0.0156, 2/2^8 = 0.0078


def test_paired_difference_df_and_effect():
    out = paired_difference({0: 1.3, 1: 0.9, 2: 1.2, 3: 1.4}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    d = np.array([0.3, -0.1, 0.2, 0.4])
    assert out.df == 3 and out.effect == pytest.approx(d.mean() / d.std(ddof=1))
    assert out.diffs == pytest.approx(list(d))


def test_holm_by_hand():
    ps = [0.01, 0.04, 0.03, 0.005, float("nan")]  # NaN: not in the family, m = 4
    # ascending 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    got = holm(ps)
    assert got[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(got[4])
    assert holm([0.6, 0.4]) == pytest.approx([0.8, 0.8])  # 2 * 0.4 = 0.8, then max(0.8, 0.6)
    assert holm([0.9, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([]) == []


def test_benjamini_hochberg_by_hand():
    ps = [0.01, 0.04, 0.03, 0.005, float("nan")]
    # ascending 0.005, 0.01, 0.03, 0.04 times 4/1, 4/2, 4/3, 4/4 = 0.02, 0.02, 0.04, 0.04 -> min from the top
    got = benjamini_hochberg(ps)
    assert got[:4] == pytest.approx([0.02, 0.04, 0.04, 0.02]) and math.isnan(got[4])
    assert benjamini_hochberg([0.02, 0.5, 0.03]) == pytest.approx([0.045, 0.5, 0.045])  # 0.06, 0.045, 0.5
