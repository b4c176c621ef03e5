"""Multi-query associative recall (MQAR; "Zoology", arXiv 2312.04927): a synthetic source that small
attention models learn, for measuring attention on the evidence where the model finds it (``data.source =
"mqar"``).

Vocabulary (``data.mqar_keys`` = n): keys 0 .. n-1, values n .. 2n-1, filler 2n .. 2n+FILLER-1. One
sequence of T tokens (the training length) with K = ``data.mqar_pairs`` pairs:

    f | k_1 v_1 .. k_K v_K | query region (T - 2K - 1 tokens)
    f: one filler token, so that no key stands at position 0 (where a causal model's first token is its
    own "previous token")
    query region: filler, with Q queries "k_j v_j" at even offsets 2g, the gaps g drawn without
    replacement from 0 .. (T - 2K - 1) / 2 - 1 with p(g) ~ (g + 1)^(a - 1), a = 0.01 (Zoology's power
    law: most queries near the block, a long tail); the keys asked in rounds, each round all K keys
    shuffled, the last cut short (``data.mqar_queries`` = Q; 0: Q = K, each key once, as in Zoology)

The target at a query (the position holding k_j) is v_j; every other position's target is IGNORE (no
loss). The value is shown after its query, as in the retrieval task of ``retrieval.py`` (measured there:
asked once, with nothing to copy from nearby, a CPU-sized model does not find the copy circuit; asked in
rounds it does), so a key's later queries can copy from its earlier ones. Its *first* query in the
sequence can copy only from the pair block: those are the queries the evidence test scores
(``Sequence.queries``). Keys in a sequence are distinct, values are drawn independently, filler never
uses a key or value id, so at its first query a key occurs exactly once before (in the block).

Longer contexts (the evidence test, ``qklab.diagnostics.mqar``): ``extra`` filler tokens between the
pair block and the query region, the region itself as in training, so every query sits ``extra`` tokens
further from its evidence; the number of pairs stays the trained one.

Splits: a sequence belongs to the split named by a hash of its pair block (keys and values in order):
1 in SHARE to *selection*, 1 in SHARE to *report*, the rest to *train*; each split's generator draws
until the draw is its own, so no pair block (hence no sequence) is in two splits, and each is a fixed
function of its seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .config import DataConfig, DataError

MQAR = "mqar"
FILLER = 32  # filler token ids
IGNORE = -100  # target of a position without loss (torch's cross-entropy ignore_index)
POWER_A = 0.01  # Zoology's query-gap power law
SHARE = 16  # 1 in SHARE pair blocks is selection, 1 in SHARE report
SPLITS = ("train", "selection", "report")
HELDOUT_SEED = 20260  # the held-out splits' generators (selection, report): fixed, whatever the run's seed


@dataclass(frozen=True)
class MQARSpec:
    n_keys: int  # key ids 0..n-1, value ids n..2n-1
    n_pairs: int  # K pairs per sequence
    n_queries: int = 0  # Q queries per sequence (0: K, each key once)

    @property
    def queries(self) -> int:
        return self.n_queries or self.n_pairs

    @property
    def vocab_size(self) -> int:
        return 2 * self.n_keys + FILLER

    def block(self) -> slice:
        """Where the pair block stands: positions 1 .. 2K."""
        return slice(1, 1 + 2 * self.n_pairs)

    def region(self, seq_len: int) -> int:
        """The query region's length at training length seq_len."""
        return seq_len - 1 - 2 * self.n_pairs

    def check(self, seq_len: int) -> None:
        if self.n_pairs > self.n_keys:
            raise DataError(f"data.mqar_pairs={self.n_pairs} > data.mqar_keys={self.n_keys}: keys in a sequence are "
                            "distinct; use fewer pairs or more keys")
        if self.region(seq_len) // 2 < self.queries:
            raise DataError(f"train.seq_len={seq_len} is too short for {self.n_pairs} MQAR pairs and {self.queries} "
                            f"queries (needs seq_len >= {2 * self.n_pairs + 2 * self.queries + 1})")


@dataclass
class Sequence:
    """One MQAR sequence: tokens (N,), targets (N,) (IGNORE but at the Q queries), and of each asked key's
    first query its position (<= K,) and its evidence (<= K,): where its value stands in the pair block."""

    tokens: np.ndarray
    targets: np.ndarray
    queries: np.ndarray
    evidence: np.ndarray


def split_of(block: np.ndarray) -> str:
    """The split a pair block (2K ids) belongs to, by its hash."""
    h = int.from_bytes(hashlib.sha256(np.asarray(block, dtype=np.int64).tobytes()).digest()[:8], "little") % SHARE
    return "selection" if h == 0 else "report" if h == 1 else "train"


def gap_probs(space: int) -> np.ndarray:
    """p(g) ~ (g + 1)^(a - 1) for g = 0 .. space - 1."""
    p = np.arange(1, space + 1, dtype=np.float64) ** (POWER_A - 1)
    return p / p.sum()


def draw(spec: MQARSpec, seq_len: int, rng: np.random.Generator, extra: int = 0) -> Sequence:
    """One sequence of seq_len + extra tokens (any split)."""
    K, Q, n = spec.n_pairs, spec.queries, spec.n_keys
    keys = rng.choice(n, size=K, replace=False)
    values = n + rng.integers(0, n, size=K)
    space = spec.region(seq_len) // 2
    gaps = rng.choice(space, size=Q, replace=False, p=gap_probs(space))
    order = np.concatenate([rng.permutation(K) for _ in range(-(-Q // K))])[:Q]  # pair order[i] is asked at gap i
    tokens = 2 * n + rng.integers(0, FILLER, size=seq_len + extra)
    tokens[1 : 1 + 2 * K : 2], tokens[2 : 2 + 2 * K : 2] = keys, values
    queries = 1 + 2 * K + extra + 2 * gaps
    tokens[queries], tokens[queries + 1] = keys[order], values[order]
    targets = np.full(seq_len + extra, IGNORE, dtype=np.int64)
    targets[queries] = values[order]
    by_pos = np.argsort(queries)
    first = by_pos[np.sort(np.unique(order[by_pos], return_index=True)[1])]  # each asked key's first query
    return Sequence(tokens.astype(np.int64), targets, queries[first].astype(np.int64),
                    (2 + 2 * order[first]).astype(np.int64))


def draw_in(split: str, spec: MQARSpec, seq_len: int, rng: np.random.Generator, extra: int = 0) -> Sequence:
    """One sequence of ``split``: draws until the pair block is that split's."""
    while True:
        s = draw(spec, seq_len, rng, extra)
        if split_of(s.tokens[spec.block()]) == split:
            return s


def heldout(split: str, spec: MQARSpec, seq_len: int, n: int, seed: int = HELDOUT_SEED, extra: int = 0,
            part: int = 0) -> list[Sequence]:
    """n sequences of the held-out ``split`` ("selection" or "report"), a fixed function of (seed, split,
    extra, part)."""
    rng = np.random.Generator(np.random.PCG64([seed, SPLITS.index(split), extra, part]))
    return [draw_in(split, spec, seq_len, rng, extra) for _ in range(n)]


def as_batch(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs (B, N) and targets (B, N), int64."""
    return (torch.from_numpy(np.stack([s.tokens for s in seqs])),
            torch.from_numpy(np.stack([s.targets for s in seqs])))


class MQARLoader:
    """Endless training batches of the train split, resumable exactly (its generator in ``state_dict``)."""

    def __init__(self, spec: MQARSpec, batch_size: int, seq_len: int, seed: int) -> None:
        spec.check(seq_len)
        self.spec, self.batch_size, self.seq_len = spec, batch_size, seq_len
        self._rng = np.random.Generator(np.random.PCG64([seed, SPLITS.index("train")]))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T) and y (B, T): y is IGNORE but at the queries, where it is the queried value."""
        return as_batch([draw_in("train", self.spec, self.seq_len, self._rng) for _ in range(self.batch_size)])

    def state_dict(self) -> dict[str, Any]:
        return {"bit_generator": self._rng.bit_generator.state, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "mqar": [self.spec.n_keys, self.spec.n_pairs, self.spec.n_queries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state.get("batch_size"), state.get("seq_len"), state.get("mqar"))
        if saved != (self.batch_size, self.seq_len, [self.spec.n_keys, self.spec.n_pairs, self.spec.n_queries]):
            raise DataError(f"loader state was saved with batch_size, seq_len, [mqar_keys, mqar_pairs, mqar_queries] = "
                            f"{saved}; "
                            "resume with the saved values")
        self._rng.bit_generator.state = state["bit_generator"]


@dataclass
class MQARData:
    """What the trainer, the study and the probe read of a data source (as ``PreparedData``), for MQAR:
    no files, the held-out sets generated on demand."""

    spec: MQARSpec
    fingerprint: dict[str, Any] = field(default_factory=dict)
    tokenizer: None = None  # ids are the task's own; nothing to save
    eot_id: int = -1  # no documents

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def train_loader(self, batch_size: int, seq_len: int, seed: int) -> MQARLoader:
        return MQARLoader(self.spec, batch_size, seq_len, seed)

    def eval_batches(self, part: str, batch_size: int, seq_len: int, n_batches: int):
        """n_batches fixed (x, y) batches of the held-out ``part`` ("selection" or "report")."""
        self.spec.check(seq_len)
        seqs = heldout(part, self.spec, seq_len, batch_size * n_batches)
        return [as_batch(seqs[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)]

    def _stream(self, part: str, what: str) -> np.ndarray:
        seqs = heldout(part, self.spec, 2 * self.spec.n_pairs + 2 * self.spec.queries + 65, 64)
        return np.concatenate([s.tokens if what == "tokens" else s.targets[s.queries] for s in seqs])

    def val_tokens(self) -> np.ndarray:
        """Selection-split sequences end to end (1-D): the attention monitor's and the probe's batch."""
        return self._stream("selection", "tokens")

    def select_tokens(self) -> np.ndarray:
        """The queried values of selection-split sequences (1-D): their unigram entropy is what a model
        that has not learned to retrieve is held against."""
        return self._stream("selection", "values")


def prepare(cfg: DataConfig) -> MQARData:
    spec = MQARSpec(cfg.mqar_keys, cfg.mqar_pairs, cfg.mqar_queries)
    return MQARData(spec, {"source": MQAR, "mqar_keys": spec.n_keys, "mqar_pairs": spec.n_pairs,
                           "mqar_queries": spec.queries, "filler": FILLER,
                           "power_a": POWER_A, "heldout_seed": HELDOUT_SEED, "vocab_size": spec.vocab_size})
