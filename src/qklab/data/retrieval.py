"""Synthetic key-value retrieval planted in real text: the training task (``data.retrieval``) and the
contexts of the retrieval test (``qklab.diagnostics.retrieval``) are built here, by the same rule.

A block of K pairs ``k_1 v_1 .. k_K v_K`` (2K distinct token ids) is inserted at relative depth p of a
stretch of text; later a key is named again and the next token must be its value:

    test:      text[:d] | k_1 v_1 .. k_K v_K | text[d:] | k_j                  (predict v_j)
    training:  text[:d] | k_1 v_1 .. k_K v_K | text[d:] | k_a v_a k_b v_b ..   (all K keys, shuffled,
                                                                               ROUNDS times)

Keys and values are drawn from ``pool`` (ids seen in the training tokens, special ids removed), leaving
out every id of that stretch of text, so the named key occurs exactly once before the query (when the
text uses nearly the whole vocabulary, as bytes can, they come from the whole pool instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import DataError
from .loader import TokenLoader
from .mqar import MQARData, MQARLoader
from .prepare import PreparedData

N_PAIRS = 4  # key-value pairs per sequence
ROUNDS = 4  # training: how many times all keys are asked again; one round gives too few targets for a
# small model to find the copy circuit in a CPU-sized run (measured: none in 1,200 steps of `tiny`, where
# four rounds reach 98% on the test format in 800)


def seen_pool(tokens: np.ndarray, vocab_size: int, special: tuple[int, ...] = ()) -> np.ndarray:
    """Sorted ids that occur in ``tokens`` (the training split), without the special ids; int64."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)
    counts[list(special)] = 0
    return np.flatnonzero(counts).astype(np.int64)


def draw_pairs(pool: np.ndarray, avoid: np.ndarray, n_pairs: int, rng: np.random.Generator) -> np.ndarray:
    """2 * n_pairs distinct ids from pool, none of them in ``avoid`` when enough are left (a small vocabulary,
    e.g. bytes, may not leave enough: then from the whole pool); (n_pairs, 2) as (key, value) rows."""
    free = np.setdiff1d(pool, avoid, assume_unique=False)
    if len(free) < 2 * n_pairs:
        free = np.asarray(pool)
    if len(free) < 2 * n_pairs:
        raise DataError(f"retrieval task: only {len(free)} token ids were seen in training, fewer than the "
                        f"{2 * n_pairs} distinct ids of {n_pairs} key-value pairs")
    return rng.choice(free, size=2 * n_pairs, replace=False).reshape(n_pairs, 2)


@dataclass
class RetrievalContext:
    """One test context of length N: tokens (N,), the query pair index j, the control pair index, and
    where the pair block starts (pair i sits at d + 2i (key) and d + 2i + 1 (value))."""

    tokens: np.ndarray
    pairs: np.ndarray  # (K, 2)
    query: int
    control: int
    start: int

    def positions(self, i: int) -> tuple[int, int]:
        return self.start + 2 * i, self.start + 2 * i + 1


def query_context(text: np.ndarray, depth: float, pool: np.ndarray, n_pairs: int,
                 rng: np.random.Generator) -> RetrievalContext:
    """``text`` (N - 2K - 1 tokens) with the pair block at depth p and one query key at the end."""
    d = int(round(depth * len(text)))
    pairs = draw_pairs(pool, text, n_pairs, rng)
    j = int(rng.integers(n_pairs))
    control = int((j + 1 + rng.integers(n_pairs - 1)) % n_pairs)  # any other pair, uniformly
    toks = np.concatenate([text[:d], pairs.reshape(-1), text[d:], pairs[j, :1]]).astype(np.int64)
    return RetrievalContext(toks, pairs, j, control, d)


def training_sequence(window: np.ndarray, pool: np.ndarray, n_pairs: int, rng: np.random.Generator,
                      rounds: int = ROUNDS) -> np.ndarray:
    """A window of T + 1 tokens -> T + 1 tokens: its first T + 1 - (2 + 2 rounds) K as text, the pair
    block at a uniform random depth, and ``rounds`` times all K keys asked again (each round shuffled),
    each followed by its value."""
    text = np.asarray(window[: len(window) - (2 + 2 * rounds) * n_pairs], dtype=np.int64)
    pairs = draw_pairs(pool, text, n_pairs, rng)
    d = int(rng.integers(0, len(text) + 1))
    asked = np.concatenate([pairs[rng.permutation(n_pairs)].reshape(-1) for _ in range(rounds)])
    return np.concatenate([text[:d], pairs.reshape(-1), text[d:], asked])


class RetrievalLoader(TokenLoader):
    """A ``TokenLoader`` whose sequences each carry the retrieval task with probability ``share``
    (its own generator, saved in ``state_dict``, so a resumed run sees the same batches)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, share: float,
                 pool: np.ndarray, n_pairs: int = N_PAIRS, name: str = "train") -> None:
        super().__init__(tokens, batch_size, seq_len, seed, name)
        need = (2 + 2 * ROUNDS) * n_pairs + 8  # the task and some text
        if seq_len + 1 < need:
            raise DataError(f"data.retrieval: train.seq_len={seq_len} is too short for the retrieval task "
                            f"({n_pairs} key-value pairs asked {ROUNDS} times; needs seq_len >= {need - 1})")
        self.share, self.pool, self.n_pairs = float(share), pool, n_pairs
        self._task_rng = np.random.Generator(np.random.PCG64([seed, 7]))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().next_batch()  # (B, T) each
        win = torch.cat([x, y[:, -1:]], dim=1).numpy()  # (B, T + 1)
        for b in np.flatnonzero(self._task_rng.random(len(win)) < self.share):
            win[b] = training_sequence(win[b], self.pool, self.n_pairs, self._task_rng)
        t = torch.from_numpy(win)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "task_bit_generator": self._task_rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "task_bit_generator" not in state:
            raise DataError("loader state has no retrieval-task generator: the run was started without "
                            "data.retrieval; resume it with the same data settings")
        self._task_rng.bit_generator.state = state["task_bit_generator"]


def train_loader(data: PreparedData | MQARData, batch_size: int, seq_len: int, seed: int,
                 share: float) -> TokenLoader | MQARLoader:
    """The training loader: plain windows, or with ``share`` > 0 (``data.retrieval``) windows of which
    that share carry the retrieval task, keys and values drawn from the ids seen in training; for the
    synthetic source mqar, its own sequences."""
    if isinstance(data, MQARData):
        return data.train_loader(batch_size, seq_len, seed)
    tokens = data.train_tokens()
    if share <= 0:
        return TokenLoader(tokens, batch_size, seq_len, seed=seed)
    pool = seen_pool(tokens, data.vocab_size, (data.eot_id,))
    return RetrievalLoader(tokens, batch_size, seq_len, seed, share, pool)
