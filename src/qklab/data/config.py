"""Configuration of the data pipeline and the error type it raises."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from qklab.errors import DataError

from .english import ENGLISH

MQAR = "mqar"  # the synthetic recall task of data/mqar.py

PYSTDLIB = "pystdlib"
HF_PREFIX = "hf:"
TOKENIZER_KINDS = ("bpe", "bytes")
MIN_BPE_VOCAB = 260  # 256 byte symbols + the end-of-text token + a few merges
MAX_BPE_VOCAB = 65535  # token ids are stored as uint16


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and where caches live. Each field's metadata holds
    its meaning (doc) and its valid values as text (allowed, which ``validate`` checks): ``qklab config data``."""

    source: str = field(default=PYSTDLIB, metadata={
        "doc": "the text: pystdlib (the running Python's standard library .py files), english (the corpus of "
               "make corpus, docs/corpus.md), a local file, folder or glob of text files, hf:<path or hub name>, "
               "or mqar (synthetic multi-query associative recall, qklab.data.mqar: no text, no tokenizer)"})
    tokenizer: str = field(default="bpe", metadata={
        "doc": "bpe: byte-level BPE trained on the train split; bytes: one token per byte",
        "allowed": " | ".join(TOKENIZER_KINDS)})
    vocab_size: int = field(default=4096, metadata={
        "doc": "BPE only: the requested vocabulary size (tokens are stored as uint16)",
        "allowed": f"in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] (tokenizer bpe)"})
    val_fraction: float = field(default=0.05, metadata={
        "doc": "share of documents that go to validation, chosen by a hash of each document's relative path so "
               "the split never changes", "allowed": "in (0, 1), e.g. 0.05"})
    max_files: int = field(default=0, metadata={
        "doc": "0 keeps every document; N > 0 keeps a deterministic subset of N", "allowed": ">= 0"})
    text_field: str = field(default="text", metadata={"doc": "column holding the text in Hugging Face datasets"})
    hf_split: str = field(default="train", metadata={"doc": "split to load from Hugging Face datasets"})
    cache_dir: str = field(default=".cache/qklab", metadata={
        "doc": "folder for the trained tokenizer and the token files", "neutral": True, "resumable": True})
    retrieval: float = field(default=0.0, metadata={
        "doc": "share of training sequences that carry the synthetic key-value retrieval task (qklab.data.retrieval); "
               "0 trains on the text alone", "allowed": "in [0, 1]"})
    mqar_keys: int = field(default=64, metadata={
        "doc": "source mqar: key ids (as many value ids; the vocabulary is 2 x keys + 32 filler ids)",
        "allowed": "in [2, 16000]"})
    mqar_pairs: int = field(default=8, metadata={
        "doc": "source mqar: key-value pairs per sequence (at most mqar_keys)", "allowed": ">= 1"})
    mqar_queries: int = field(default=0, metadata={
        "doc": "source mqar: queries per sequence, the keys asked in shuffled rounds (0: each key once); at most "
               "the query slots of train.seq_len", "allowed": ">= 0"})

    def validate(self) -> None:
        """Raise DataError naming the first invalid setting and how to fix it."""
        if not isinstance(self.source, str) or not self.source.strip():
            raise DataError("data.source: empty; give 'pystdlib', a file, folder or glob, or 'hf:<name>'")
        if self.source.startswith(HF_PREFIX):
            if not self.source[len(HF_PREFIX) :].strip():
                raise DataError("data.source: 'hf:' needs a dataset after it, e.g. 'hf:data/train.jsonl'")
        elif self.source not in (PYSTDLIB, ENGLISH, MQAR) and not _local_source_exists(self.source):
            raise DataError(
                f"data.source: no such file, folder or glob {self.source!r}; "
                "give an existing path or 'pystdlib'"
            )
        if not _is_int(self.mqar_keys) or not 2 <= self.mqar_keys <= 16000:
            raise DataError(f"data.mqar_keys: {self.mqar_keys!r} is out of range; use an integer from 2 to 16000")
        if not _is_int(self.mqar_pairs) or self.mqar_pairs < 1:
            raise DataError(f"data.mqar_pairs: {self.mqar_pairs!r} is out of range; use 1 or more pairs (at most "
                            "data.mqar_keys)")
        if not _is_int(self.mqar_queries) or self.mqar_queries < 0:
            raise DataError(f"data.mqar_queries: {self.mqar_queries!r} is invalid; use 0 (each key once) or a "
                            "positive number of queries")
        if self.tokenizer not in TOKENIZER_KINDS:
            raise DataError(f"data.tokenizer: {self.tokenizer!r} is unknown; use 'bpe' or 'bytes'")
        if self.tokenizer == "bpe" and not (
            _is_int(self.vocab_size) and MIN_BPE_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB
        ):
            raise DataError(
                f"data.vocab_size: {self.vocab_size!r} is out of range; "
                f"use an integer from {MIN_BPE_VOCAB} to {MAX_BPE_VOCAB} (tokens are stored as uint16)"
            )
        if (
            not isinstance(self.val_fraction, (int, float))
            or isinstance(self.val_fraction, bool)
            or not (0.0 < self.val_fraction < 1.0)
        ):
            raise DataError(
                f"data.val_fraction: {self.val_fraction!r} is out of range; "
                "use a number between 0 and 1, e.g. 0.05"
            )
        if not _is_int(self.max_files) or self.max_files < 0:
            raise DataError(
                f"data.max_files: {self.max_files!r} is invalid; use 0 for all files or a positive integer"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise DataError(
                "data.text_field: empty; name the dataset column that holds the text, e.g. 'text'"
            )
        if not isinstance(self.hf_split, str) or not self.hf_split:
            raise DataError("data.hf_split: empty; name the dataset split to load, e.g. 'train'")
        if not isinstance(self.cache_dir, str) or not self.cache_dir:
            raise DataError("data.cache_dir: empty; give a folder for cached tokenizers and tokens")
        if (
            not isinstance(self.retrieval, (int, float))
            or isinstance(self.retrieval, bool)
            or not (0.0 <= self.retrieval <= 1.0)
        ):
            raise DataError(
                f"data.retrieval: {self.retrieval!r} is out of range; use the share of training sequences "
                "that carry the retrieval task, from 0 (off) to 1, e.g. 0.25"
            )


def _local_source_exists(source: str) -> bool:
    if glob.has_magic(source):
        return any(os.path.isfile(p) for p in glob.iglob(source, recursive=True))
    return os.path.exists(source)
