"""Configuration of the data pipeline and the error type it raises."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Literal

from qklab.errors import DataError
from qklab.fields import Range, at_least, between, check_fields, option

from .english import ENGLISH

MQAR = "mqar"  # the synthetic recall task of data/mqar.py

PYSTDLIB = "pystdlib"
HF_PREFIX = "hf:"
Tokenizer = Literal["bpe", "bytes"]
MIN_BPE_VOCAB = 260  # 256 byte symbols + the end-of-text token + a few merges
MAX_BPE_VOCAB = 65535  # token ids are stored as uint16
_NAMED: Range = (lambda v: isinstance(v, str) and bool(v), "non-empty")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and where caches live. Each field's metadata holds
    its meaning (doc) and its valid values (range, checked by ``qklab.fields.check_fields``; choices are a
    ``Literal`` type; allowed: text only, where ``validate`` checks a rule across fields): ``qklab config data``."""

    source: str = option(PYSTDLIB,
        "the text: pystdlib (the running Python's standard library .py files), english (the corpus of "
        "make corpus, docs/corpus.md), a local file, folder or glob of text files, hf:<path or hub name>, "
        "or mqar (synthetic multi-query associative recall, qklab.data.mqar: no text, no tokenizer)")
    tokenizer: Tokenizer = option("bpe", "bpe: byte-level BPE trained on the train split; bytes: one token per byte")
    vocab_size: int = field(default=4096, metadata={
        "doc": "BPE only: the requested vocabulary size (tokens are stored as uint16)",
        "allowed": f"in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] (tokenizer bpe)"})
    val_fraction: float = option(0.05,
        "share of documents that go to validation, chosen by a hash of each document's relative path so the "
        "split never changes", between(0, 1, lo_open=True, hi_open=True, note=", e.g. 0.05"))
    max_files: int = option(0, "0 keeps every document; N > 0 keeps a deterministic subset of N", at_least(0))
    text_field: str = option("text", "column holding the text in Hugging Face datasets", _NAMED)
    hf_split: str = option("train", "split to load from Hugging Face datasets", _NAMED)
    cache_dir: str = field(default=".cache/qklab", metadata={
        "doc": "folder for the trained tokenizer and the token files", "range": _NAMED, "neutral": True,
        "resumable": True})
    token_pack: str = field(default="", metadata={
        "doc": "a token pack (qklab tokens --out) to read instead of the source, on a machine without it: its tokens "
        "and tokenizer, checked against the data settings; empty: read the source", "neutral": True,
        "resumable": True})
    retrieval: float = option(0.0,
        "share of training sequences that carry the synthetic key-value retrieval task (qklab.data.retrieval); "
        "0 trains on the text alone", between(0, 1))
    mqar_keys: int = option(64,
        "source mqar: key ids (as many value ids; the vocabulary is 2 x keys + 32 filler ids)", between(2, 16000))
    mqar_pairs: int = option(8, "source mqar: key-value pairs per sequence (at most mqar_keys)", at_least(1))
    mqar_queries: int = option(0,
        "source mqar: queries per sequence, the keys asked in shuffled rounds (0: each key once); at most "
        "the query slots of train.seq_len", at_least(0))

    def validate(self) -> None:
        """Raise DataError, one line naming the first invalid setting: each field's range and choices
        (``check_fields``), then the rules across fields or on the file system."""
        check_fields("data", self, error=DataError)
        if not isinstance(self.source, str) or not self.source.strip():
            raise DataError("data.source: empty; give 'pystdlib', a file, folder or glob, or 'hf:<name>'")
        if self.source.startswith(HF_PREFIX) and not self.source[len(HF_PREFIX) :].strip():
            raise DataError("data.source: 'hf:' needs a dataset after it, e.g. 'hf:data/train.jsonl'")
        if self.token_pack:  # the source need not be on this machine
            if self.source == MQAR:
                raise DataError("data.token_pack: source mqar is generated, it reads no token pack; leave it empty")
            if not os.path.isfile(os.path.join(self.token_pack, "pack.json")):
                raise DataError(f"data.token_pack: {self.token_pack!r} is no token pack (a folder with pack.json); "
                                "write one with qklab tokens --out DIR on a machine with the source")
        elif (not self.source.startswith(HF_PREFIX) and self.source not in (PYSTDLIB, ENGLISH, MQAR)
              and not _local_source_exists(self.source)):
            raise DataError(
                f"data.source: no such file, folder or glob {self.source!r}; "
                "give an existing path or 'pystdlib'"
            )
        if self.tokenizer == "bpe" and not (
            _is_int(self.vocab_size) and MIN_BPE_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB
        ):
            raise DataError(
                f"data.vocab_size={self.vocab_size!r} is out of range for tokenizer bpe: it must be an integer "
                f"in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] (tokens are stored as uint16)"
            )


def _local_source_exists(source: str) -> bool:
    if glob.has_magic(source):
        return any(os.path.isfile(p) for p in glob.iglob(source, recursive=True))
    return os.path.exists(source)
