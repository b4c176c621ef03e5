"""qklab.data.stats: the count models' cross-entropies, against direct formulas written out by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qklab.data import DataError, bigram_cross_entropy, unigram_cross_entropy, unigram_entropy
from qklab.data.stats import count_baselines


def _dense_bigram(train: np.ndarray, heldout: np.ndarray, v: int, strength: float) -> float:
    """The same smoothed bigram model as a full V x V table, one held-out pair at a time."""
    uni = np.array([(np.sum(train == b) + 0.5) / (len(train) + 0.5 * v) for b in range(v)])
    table = np.zeros((v, v))
    for a, b in itertools.pairwise(train):
        table[a, b] += 1
    s = strength * v
    nll = [-math.log((table[a, b] + s * uni[b]) / (table[a].sum() + s)) for a, b in itertools.pairwise(heldout)]
    return sum(nll) / len(nll)


def test_unigram_cross_entropy_by_hand() -> None:
    train = np.array([0, 0, 1, 2], dtype=np.uint16)  # V = 4: p = (2.5, 1.5, 1.5, 0.5) / 6
    heldout = np.array([0, 3], dtype=np.uint16)
    assert unigram_cross_entropy(train, heldout, 4) == pytest.approx(-(math.log(2.5 / 6) + math.log(0.5 / 6)) / 2)


@pytest.mark.parametrize("strength", [1e-3, 0.1, 3.0])
def test_bigram_cross_entropy_matches_a_dense_table(strength: float) -> None:
    rng = np.random.default_rng(0)
    v = 9
    train = rng.integers(0, v - 1, 400).astype(np.uint16)  # token 8 never in train: smoothing carries it
    heldout = np.concatenate([rng.integers(0, v, 150), [8, 8]]).astype(np.uint16)
    assert bigram_cross_entropy(train, heldout, v, strength) == pytest.approx(
        _dense_bigram(train, heldout, v, strength), rel=1e-12)


def test_bigram_cross_entropy_between_its_limits() -> None:
    """A stream where each token fixes the next: one token of context predicts it all but for the smoothing;
    a very strong smoothing is the unigram model (one token fewer predicted)."""
    train = np.tile(np.arange(5, dtype=np.uint16), 200)
    heldout = np.tile(np.arange(5, dtype=np.uint16), 20)
    assert bigram_cross_entropy(train, heldout, 5, 1e-6) < 1e-5
    assert bigram_cross_entropy(train, heldout, 5, 1e9) == pytest.approx(
        unigram_cross_entropy(train, heldout[1:], 5), rel=1e-6)


def test_count_models_refuse_what_they_cannot_read() -> None:
    ok = np.array([0, 1, 2], dtype=np.uint16)
    with pytest.raises(DataError, match="outside vocab_size=3"):
        bigram_cross_entropy(ok, np.array([0, 3], dtype=np.uint16), 3, 0.1)
    with pytest.raises(DataError, match="at least 2 tokens"):
        bigram_cross_entropy(ok, np.array([1], dtype=np.uint16), 3, 0.1)
    with pytest.raises(DataError, match="at least 1 token$"):
        unigram_cross_entropy(ok, np.array([], dtype=np.uint16), 3)
    with pytest.raises(DataError, match="above 0"):
        bigram_cross_entropy(ok, ok, 3, 0.0)


def test_count_baselines_choose_on_selection_and_read_on_report() -> None:
    rng = np.random.default_rng(1)
    v = 12
    train, select, report = (rng.integers(0, v, n).astype(np.uint16) for n in (3000, 300, 300))
    strengths = (0.01, 0.1, 1.0, 10.0)
    got = count_baselines(train, select, report, v, strengths)
    on_select = [_dense_bigram(train, select, v, s) for s in strengths]
    best = strengths[int(np.argmin(on_select))]
    assert got["bigram_strength"] == best
    assert got["bigram_report"] == pytest.approx(_dense_bigram(train, report, v, best), rel=1e-12)
    assert got["unigram_report"] == pytest.approx(unigram_cross_entropy(train, report, v))
    assert got["unigram_entropy_select"] == pytest.approx(unigram_entropy(select, v))
