"""Data pipeline: documents -> train/val split -> tokenizer -> cached uint16 token files -> batches."""

from __future__ import annotations

from .config import DataConfig, DataError
from .loader import TokenLoader
from .prepare import PreparedData, prepare_data
from .stats import bigram_cross_entropy, unigram_cross_entropy, unigram_entropy
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "PreparedData",
    "TokenLoader",
    "Tokenizer",
    "bigram_cross_entropy",
    "prepare_data",
    "unigram_cross_entropy",
    "unigram_entropy",
]
