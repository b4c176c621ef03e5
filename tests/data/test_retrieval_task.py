"""The retrieval training task (data.retrieval): sequence layout, seen ids only, mixing share, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qklab.data import DataConfig, DataError, TokenLoader
from qklab.data.retrieval import N_PAIRS, ROUNDS, RetrievalLoader, seen_pool, training_sequence

TOKENS = np.random.default_rng(0).integers(0, 20, 20_000).astype(np.uint16)  # the text: ids 0..19
POOL = np.arange(20, 60)  # ids "seen in training" that the text stretches do not use


def test_seen_pool_drops_unseen_and_special_ids():
    pool = seen_pool(np.array([3, 5, 5, 9, 0]), vocab_size=12, special=(0,))
    assert pool.tolist() == [3, 5, 9]


def test_training_sequence_layout():
    pool = POOL
    window = TOKENS[:129].astype(np.int64)
    seq = training_sequence(window, pool, N_PAIRS, np.random.Generator(np.random.PCG64(1)))
    assert len(seq) == 129
    text = window[: 129 - (2 + 2 * ROUNDS) * N_PAIRS]
    asked = seq[-2 * N_PAIRS * ROUNDS :].reshape(ROUNDS, N_PAIRS, 2)  # every key again, each with its value
    rest = seq[: -2 * N_PAIRS * ROUNDS]
    d = next((i for i in range(len(text)) if rest[i] != text[i]), len(text))  # where the block starts
    block = rest[d : d + 2 * N_PAIRS].reshape(N_PAIRS, 2)
    assert np.array_equal(np.concatenate([rest[:d], rest[d + 2 * N_PAIRS :]]), text)  # text order kept
    for r in range(ROUNDS):
        assert sorted(map(tuple, asked[r].tolist())) == sorted(map(tuple, block.tolist()))
    ids = block.reshape(-1)
    assert len(set(ids.tolist())) == 2 * N_PAIRS and set(ids.tolist()) <= set(pool.tolist())
    assert not set(ids.tolist()) & set(text.tolist())


def test_share_zero_is_the_plain_loader_and_share_one_plants_every_sequence():
    pool = POOL
    plain = TokenLoader(TOKENS, 4, 64, seed=3)
    off = RetrievalLoader(TOKENS, 4, 64, seed=3, share=0.0, pool=pool)
    on = RetrievalLoader(TOKENS, 4, 64, seed=3, share=1.0, pool=pool)
    for _ in range(3):
        x, y = plain.next_batch()
        xo, yo = off.next_batch()
        xn, yn = on.next_batch()
        assert torch.equal(x, xo) and torch.equal(y, yo)
        assert torch.equal(xn[:, 1:], yn[:, :-1])  # still (input, next-token target) pairs
        n = 2 * N_PAIRS * ROUNDS
        keys = yn[:, -n::2]  # the last targets: keys and values asked again
        vals = yn[:, -n + 1 :: 2]
        for b in range(4):
            for k, v in zip(keys[b].tolist(), vals[b].tolist(), strict=True):
                pos = (xn[b, : -n] == k).nonzero().flatten().tolist()
                assert len(pos) == 1 and xn[b, pos[0] + 1].item() == v  # the pair earlier in the sequence


def test_share_is_the_expected_fraction_and_resume_is_exact():
    pool = POOL
    a = RetrievalLoader(TOKENS, 8, 64, seed=5, share=0.25, pool=pool)
    plain = TokenLoader(TOKENS, 8, 64, seed=5)
    changed = 0
    for _ in range(50):
        changed += int((a.next_batch()[0] != plain.next_batch()[0]).any(dim=1).sum())
    assert 0.15 < changed / 400 < 0.35
    state = a.state_dict()
    b = RetrievalLoader(TOKENS, 8, 64, seed=99, share=0.25, pool=pool)
    b.load_state_dict(state)
    for _ in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch(), strict=True))
    with pytest.raises(DataError, match="retrieval"):
        b.load_state_dict(TokenLoader(TOKENS, 8, 64, seed=5).state_dict())


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "x"])
def test_bad_share_is_a_data_error(bad):
    with pytest.raises(DataError, match="data.retrieval"):
        DataConfig(retrieval=bad).validate()


def test_a_text_using_every_id_falls_back_to_the_whole_pool():
    seq = training_sequence(np.arange(100) % 10, np.arange(10), 2, np.random.Generator(np.random.PCG64(0)))
    assert len(seq) == 100 and set(seq.tolist()) <= set(range(10))
    with pytest.raises(DataError, match="seen in training"):
        training_sequence(np.arange(100) % 10, np.arange(3), 2, np.random.Generator(np.random.PCG64(0)))


def test_too_short_sequences_are_refused():
    with pytest.raises(DataError, match="too short"):
        RetrievalLoader(TOKENS, 2, 40, seed=0, share=0.5, pool=np.arange(1, 40))


def test_the_trainer_uses_the_task_loader(tmp_path):
    from qklab.config import load_config
    from qklab.train.trainer import Trainer

    cfg = load_config("tiny", [f"train.out_dir='{tmp_path}'", "train.name=r", "train.steps=2", "train.progress=false",
                               "train.diag_every=0", "train.ckpt_every=0", "data.retrieval=0.5"])
    t = Trainer(cfg, log=lambda s: None)
    assert isinstance(t.loader, RetrievalLoader) and t.loader.share == 0.5
    assert t.data.eot_id not in t.loader.pool.tolist()
    t.run()
