from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from qklab.data import DataError, TokenLoader, unigram_entropy

N_TOKENS = 5000
B, T = 4, 16
Batches = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture
def ramp() -> np.ndarray:
    """Token i has id i, so every window reveals its own start offset."""
    return np.arange(N_TOKENS, dtype=np.uint16)


def take(loader: TokenLoader, n: int) -> Batches:
    return [loader.next_batch() for _ in range(n)]


def assert_same(a: Batches, b: Batches) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_batches_are_shifted_windows(ramp: np.ndarray) -> None:
    x, y = TokenLoader(ramp, B, T, seed=0).next_batch()
    assert x.shape == y.shape == (B, T)
    assert x.dtype == y.dtype == torch.int64
    starts = x[:, 0]
    offsets = torch.arange(T)
    assert torch.equal(x, starts[:, None] + offsets)
    assert torch.equal(y, starts[:, None] + offsets + 1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_starts_cover_the_whole_valid_range() -> None:
    tokens = np.arange(T + 3, dtype=np.uint16)  # valid starts: 0, 1, 2
    loader = TokenLoader(tokens, 8, T, seed=1)
    seen = {int(s) for _ in range(20) for s in loader.next_batch()[0][:, 0]}
    assert seen == {0, 1, 2}


def test_same_seed_same_batches_other_seed_differs(ramp: np.ndarray) -> None:
    assert_same(take(TokenLoader(ramp, B, T, seed=7), 3), take(TokenLoader(ramp, B, T, seed=7), 3))
    a = take(TokenLoader(ramp, B, T, seed=7), 3)
    b = take(TokenLoader(ramp, B, T, seed=8), 3)
    assert any(not torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b, strict=True))


def test_exact_resume_through_torch_save(ramp: np.ndarray) -> None:
    loader = TokenLoader(ramp, B, T, seed=3)
    take(loader, 3)
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    expected = take(loader, 2)

    buf.seek(0)
    resumed = TokenLoader(ramp, B, T, seed=999)  # the seed is overridden by the saved state
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert_same(take(resumed, 2), expected)

    uninterrupted = TokenLoader(ramp, B, T, seed=3)
    assert_same(take(uninterrupted, 5)[3:], expected)


def test_resume_with_other_shape_is_refused(ramp: np.ndarray) -> None:
    state = TokenLoader(ramp, B, T, seed=0).state_dict()
    with pytest.raises(DataError, match="batch_size"):
        TokenLoader(ramp, B + 1, T, seed=0).load_state_dict(state)


def test_too_short_split_raises() -> None:
    tokens = np.arange(T, dtype=np.uint16)  # needs T + 1
    with pytest.raises(DataError, match=r"too small for seq_len=16.*train\.seq_len"):
        TokenLoader(tokens, B, T, seed=0)
    with pytest.raises(DataError, match="val split"):
        TokenLoader.eval_batches(tokens, B, T, n_batches=2)
    TokenLoader(np.arange(T + 1, dtype=np.uint16), B, T, seed=0).next_batch()  # exactly enough


def test_eval_batches_fixed_and_evenly_spaced(ramp: np.ndarray) -> None:
    batches = TokenLoader.eval_batches(ramp, B, T, n_batches=3)
    again = TokenLoader.eval_batches(ramp, B, T, n_batches=3)
    assert_same(batches, again)
    assert len(batches) == 3
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    last = N_TOKENS - T - 1
    assert starts == [round(i * last / (3 * B - 1)) for i in range(3 * B)]
    for x, y in batches:
        assert x.shape == (B, T) and torch.equal(y, x + 1)


def test_unigram_entropy_by_hand() -> None:
    tokens = np.array([0, 0, 1, 2], dtype=np.uint16)  # p = 1/2, 1/4, 1/4
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert unigram_entropy(tokens, vocab_size=5) == pytest.approx(expected, rel=1e-12)
    assert unigram_entropy(np.arange(8, dtype=np.uint16), 8) == pytest.approx(math.log(8))
    assert unigram_entropy(np.zeros(10, dtype=np.uint16), 3) == 0.0
    with pytest.raises(DataError):
        unigram_entropy(np.array([3], dtype=np.uint16), vocab_size=3)
