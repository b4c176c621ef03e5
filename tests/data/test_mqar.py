"""The MQAR source: each sequence's structure, its splits (disjoint, a fixed function of the seed), the
training loader's resumption, and the loss on the queried values alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qklab.config import ModelConfig, QKConfig
from qklab.data import DataConfig, DataError, prepare_data
from qklab.data.mqar import FILLER, IGNORE, MQARLoader, MQARSpec, draw, heldout, split_of
from qklab.model import GPT

SPEC = MQARSpec(n_keys=16, n_pairs=4, n_queries=6)  # a round of 4 keys, then 2 asked again
Q, T = 6, 32


def blocks(seqs) -> set[bytes]:
    return {s.tokens[SPEC.block()].tobytes() for s in seqs}


def test_sequence_structure():  # the first query of each key is scored; its key occurs once before it
    rng = np.random.Generator(np.random.PCG64(3))
    for extra in (0, 32, 96):
        for _ in range(50):
            s = draw(SPEC, T, rng, extra)
            n, K = SPEC.n_keys, SPEC.n_pairs
            assert len(s.tokens) == len(s.targets) == T + extra
            keys, values = s.tokens[1 : 1 + 2 * K : 2], s.tokens[2 : 2 + 2 * K : 2]
            assert len(set(keys)) == K and (keys < n).all() and ((values >= n) & (values < 2 * n)).all()
            asked = np.flatnonzero(s.targets != IGNORE)
            rest = np.delete(s.tokens, np.r_[np.arange(1, 1 + 2 * K), asked, asked + 1])
            assert ((rest >= 2 * n) & (rest < 2 * n + FILLER)).all()  # everything else is filler
            assert (s.queries >= 1 + 2 * K + extra).all() and (s.queries < T + extra - 1).all()
            for q, e in zip(s.queries, s.evidence, strict=True):
                k = s.tokens[q]
                assert list(s.tokens[:q]).count(k) == 1 and s.tokens[e - 1] == k  # once before, just before e
                assert s.targets[q] == s.tokens[e]  # the value after the key's earlier occurrence
            asked = np.flatnonzero(s.targets != IGNORE)  # every query, its value shown after it
            assert (s.tokens[asked + 1] == s.targets[asked]).all() and set(s.queries) <= set(asked)
            assert len(asked) == Q and sorted(s.tokens[s.queries]) == sorted(set(s.tokens[asked]))  # one per key


def test_splits_are_disjoint_and_fixed_by_seed():
    sel, rep = heldout("selection", SPEC, T, 200), heldout("report", SPEC, T, 200)
    loader = MQARLoader(SPEC, batch_size=50, seq_len=T, seed=0)
    train = [loader.next_batch()[0] for _ in range(8)]  # 400 training sequences
    train_blocks = {x[SPEC.block()].numpy().tobytes() for b in train for x in b}
    assert {split_of(s.tokens[SPEC.block()]) for s in sel} == {"selection"}
    assert {split_of(s.tokens[SPEC.block()]) for s in rep} == {"report"}
    assert not blocks(sel) & blocks(rep) and not (blocks(sel) | blocks(rep)) & train_blocks
    assert len(blocks(sel)) == 200  # (16 x 15 x 14 x 13 key orders x 16^4 values: no repeats to speak of)
    again = heldout("selection", SPEC, T, 200)
    assert all((a.tokens == b.tokens).all() and (a.targets == b.targets).all() for a, b in zip(sel, again, strict=True))
    other = heldout("selection", SPEC, T, 200, seed=1)  # another seed, other sequences of the same split
    assert len(blocks(other) & blocks(sel)) < 5 and {split_of(s.tokens[SPEC.block()]) for s in other} == {"selection"}
    longer = heldout("report", SPEC, T, 20, extra=64)
    assert {len(s.tokens) for s in longer} == {T + 64}
    assert {split_of(s.tokens[SPEC.block()]) for s in longer} == {"report"}


def test_loader_is_seeded_and_resumes_exactly():
    a, b = MQARLoader(SPEC, 4, T, seed=5), MQARLoader(SPEC, 4, T, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.next_batch(), b.next_batch(), strict=True))
    assert not torch.equal(a.next_batch()[0], MQARLoader(SPEC, 4, T, seed=6).next_batch()[0])
    state = a.state_dict()
    want = a.next_batch()
    c = MQARLoader(SPEC, 4, T, seed=0)
    c.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(c.next_batch(), want, strict=True))
    with pytest.raises(DataError, match="saved with"):
        MQARLoader(SPEC, 8, T, seed=0).load_state_dict(state)


def test_prepare_and_config_errors():
    data = prepare_data(DataConfig(source="mqar", mqar_keys=16, mqar_pairs=4, mqar_queries=6), log=lambda s: None)
    assert data.vocab_size == 2 * 16 + FILLER and data.spec == SPEC
    (x, y), = data.eval_batches("report", 3, T, 1)
    assert x.shape == y.shape == (3, T) and ((y != IGNORE).sum(dim=1) == Q).all()
    with pytest.raises(DataError, match="mqar_pairs=5 > data.mqar_keys=4"):
        prepare_data(DataConfig(source="mqar", mqar_keys=4, mqar_pairs=5), log=print).eval_batches("report", 1, T, 1)
    with pytest.raises(DataError, match="too short"):
        MQARLoader(SPEC, 2, 12, seed=0)


def test_loss_is_on_the_queried_values_only():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=SPEC.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=T),
                QKConfig()).eval()
    x, y = MQARLoader(SPEC, 3, T, seed=1).next_batch()
    model.ignore_index = IGNORE
    logits, loss = model(x, y)
    keep = y != IGNORE
    logp = torch.log_softmax(logits.double(), dim=-1)[keep]  # (18, V)
    hand = -logp[torch.arange(keep.sum()), y[keep]].mean()  # the mean over the 18 queries
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    model.ignore_index = None  # the ordinary loss is unchanged: every position counts
    _, full = model(x, x.roll(-1, dims=1))
    assert full.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), x.roll(-1, dims=1).flatten()).item(),
                                        rel=1e-5)
