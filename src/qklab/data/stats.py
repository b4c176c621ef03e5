"""Simple statistics of token streams."""

from __future__ import annotations

import numpy as np

from .config import DataError


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequency distribution of tokens (N,).

    This is the loss of a model that ignores context and predicts the corpus-wide
    token frequencies; a language model should beat it.
    """
    counts = _counts(tokens, vocab_size, "unigram_entropy", 1)  # (V,)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _counts(tokens: np.ndarray, vocab_size: int, what: str, least: int = 2) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.size < least:
        raise DataError(f"{what}: a token stream needs at least {least} token{'s' if least > 1 else ''}")
    if int(tokens.max()) >= vocab_size:
        raise DataError(f"{what}: token id {int(tokens.max())} is outside vocab_size={vocab_size}")
    return np.bincount(tokens.ravel(), minlength=vocab_size)  # (V,)


def _unigram_probs(train: np.ndarray, vocab_size: int, what: str, least: int) -> np.ndarray:
    """train's (M,) token frequencies, add-1/2 smoothed: p(b) = (c(b) + 1/2) / (M + V/2), (V,)."""
    c = _counts(train, vocab_size, what, least).astype(np.float64)
    return (c + 0.5) / (c.sum() + 0.5 * vocab_size)


def unigram_cross_entropy(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy in nats of heldout (N,) under the token frequencies of train (M,), add-1/2 smoothed:
    p(b) = (c(b) + 1/2) / (M + V/2). The loss of a model that has learned train's frequencies and no context."""
    p = _unigram_probs(train, vocab_size, "unigram_cross_entropy", 1)
    _counts(heldout, vocab_size, "unigram_cross_entropy", 1)
    return float(-np.log(p[np.asarray(heldout, dtype=np.int64)]).mean())


def _bigram_table(train: np.ndarray, vocab_size: int) -> tuple[np.ndarray, ...]:
    """train's (M,) bigram counts, kept sparse (its distinct pairs, so a large vocabulary costs no V x V
    table): the sorted pair codes a*V+b (P,), their counts (P,), c(a) as a context (V,) and p(b) as
    `unigram_cross_entropy` (V,)."""
    v = vocab_size
    p = _unigram_probs(train, v, "bigram_cross_entropy", 2)
    t = np.asarray(train, dtype=np.int64)
    pairs, n = np.unique(t[:-1] * v + t[1:], return_counts=True)
    ctx = np.bincount(t[:-1], minlength=v).astype(np.float64)
    return pairs, n, ctx, p


def _bigram_counts(table: tuple[np.ndarray, ...], heldout: np.ndarray, vocab_size: int) -> tuple[np.ndarray, ...]:
    """For each next token b of heldout (N,) after a: c(a, b) and c(a) in the train table and p(b), each
    (N-1,)."""
    v = vocab_size
    pairs, n, ctx, p = table
    _counts(heldout, v, "bigram_cross_entropy")
    h = np.asarray(heldout, dtype=np.int64)
    a, b = h[:-1], h[1:]  # (N-1,)
    code = a * v + b
    at = np.minimum(np.searchsorted(pairs, code), pairs.size - 1)
    return np.where(pairs[at] == code, n[at], 0).astype(np.float64), ctx[a], p[b]


def _bigram_nll(counts: tuple[np.ndarray, ...], vocab_size: int, strength: float) -> float:
    if not strength > 0:
        raise DataError(f"bigram_cross_entropy: strength {strength!r} must be above 0")
    c_ab, c_a, p_b = counts
    s = strength * vocab_size
    return float(-np.log((c_ab + s * p_b) / (c_a + s)).mean())


def bigram_cross_entropy(train: np.ndarray, heldout: np.ndarray, vocab_size: int, strength: float) -> float:
    """Cross-entropy in nats of each next token of heldout (N,) given the one before it, under train's (M,)
    bigram counts smoothed toward its unigram frequencies p (as `unigram_cross_entropy`):
    p(b | a) = (c(a, b) + s p(b)) / (c(a) + s), with s = strength x V. The loss of a count model that
    sees one token of context: a language model trained on train should come in under it."""
    return _bigram_nll(_bigram_counts(_bigram_table(train, vocab_size), heldout, vocab_size), vocab_size, strength)


def count_baselines(train: np.ndarray, select: np.ndarray, report: np.ndarray, vocab_size: int,
                    strengths: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)) -> dict[str, float]:
    """The loss a language model should beat on a corpus, as a study reads it: the unigram and bigram count
    models of train, the bigram's smoothing strength chosen on the selection split and both read on the
    report split; and the entropy of the selection split's own token frequencies, a study's divergence line."""
    table = _bigram_table(train, vocab_size)  # counted once, read on both splits
    on_select = _bigram_counts(table, select, vocab_size)  # looked up once, read at every strength
    by_s = {s: _bigram_nll(on_select, vocab_size, s) for s in strengths}
    best = min(by_s, key=by_s.get)
    return {"unigram_entropy_select": unigram_entropy(select, vocab_size),
            "unigram_select": unigram_cross_entropy(train, select, vocab_size),
            "unigram_report": unigram_cross_entropy(train, report, vocab_size),
            "bigram_strength": best, "bigram_select": by_s[best],
            "bigram_report": _bigram_nll(_bigram_counts(table, report, vocab_size), vocab_size, best)}
