"""Random fixed-length windows of a token array, as (input, target) batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import DataError


def _check_length(tokens: np.ndarray, seq_len: int, name: str) -> None:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{name} split has {len(tokens):,} tokens, too small for seq_len={seq_len} "
            f"(needs at least {seq_len + 1}); use a smaller train.seq_len or more data"
        )


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"{key}: {value!r} must be a positive integer")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut windows of seq_len + 1 tokens at starts (B,) into x and y of shape (B, T), int64."""
    win = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    t = torch.from_numpy(win)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class TokenLoader:
    """Endless batches of windows at uniform random offsets, resumable exactly.

    Each batch draws batch_size start offsets in [0, len(tokens) - seq_len - 1]; x is the
    window's first seq_len tokens and y the same window shifted left by one.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, name: str = "train"
    ) -> None:
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        _check_length(tokens, seq_len, name)
        self.tokens = tokens  # (N,) token ids, any integer dtype (usually a uint16 memmap)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 tensors of shape (batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        n_starts = len(self.tokens) - self.seq_len  # valid starts are 0 .. n_starts - 1
        starts = self._rng.integers(0, n_starts, size=self.batch_size)  # (B,)
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python data (nested dicts, ints, strs), safe for torch.save and JSON."""
        return {
            "bit_generator": self._rng.bit_generator.state,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the loader that produced state stopped."""
        saved = (state.get("batch_size"), state.get("seq_len"))
        if saved != (self.batch_size, self.seq_len):
            raise DataError(
                f"loader state was saved with batch_size={saved[0]}, seq_len={saved[1]} but this loader has "
                f"batch_size={self.batch_size}, seq_len={self.seq_len}; resume with the saved values"
            )
        self._rng.bit_generator.state = state["bit_generator"]

    @staticmethod
    def eval_batches(
        tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int, name: str = "val"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed list of n_batches (x, y) pairs, each (batch_size, seq_len), from evenly spaced starts.

        Windows overlap only when the split holds fewer than batch_size * n_batches of them.
        """
        _check_positive(batch_size=batch_size, seq_len=seq_len, n_batches=n_batches)
        _check_length(tokens, seq_len, name)
        last_start = len(tokens) - seq_len - 1
        n_windows = batch_size * n_batches
        starts = np.linspace(0, last_start, num=n_windows).round().astype(np.int64)  # (n_batches * B,)
        return [
            _windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(n_batches)
        ]
