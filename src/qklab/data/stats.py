"""Simple statistics of token streams."""

from __future__ import annotations

import numpy as np

from .config import DataError


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequency distribution of tokens (N,).

    This is the loss of a model that ignores context and predicts the corpus-wide
    token frequencies; a language model should beat it.
    """
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        raise DataError("unigram_entropy: the token array is empty")
    counts = np.bincount(tokens.ravel(), minlength=vocab_size)  # (>= vocab_size,)
    if counts.size > vocab_size:
        raise DataError(f"unigram_entropy: token id {counts.size - 1} is outside vocab_size={vocab_size}")
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())
