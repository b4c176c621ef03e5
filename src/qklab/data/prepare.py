"""Turn a DataConfig into cached uint16 token files for train and val."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from qklab.atomic import atomic_write_bytes

from . import mqar
from .config import DataConfig, DataError
from .loader import TokenLoader
from .sources import Document, load_documents
from .split import content_sha256, heldout_parts, split_documents
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

CACHE_FORMAT = "v1"  # bump when the layout of cached files changes
TOKEN_DTYPE = np.dtype("<u2")  # uint16, little-endian on every machine: token files and packs travel
_CHUNK_DOCS = 256  # documents per encode_batch call
_CHUNK_BYTES = 4 << 20  # or fewer documents once this much text is collected


@dataclass
class PreparedData:
    """Token files ready for training plus the tokenizer that produced them."""

    train_path: Path  # raw uint16 tokens, documents separated by eot_id
    val_path: Path
    vocab_size: int  # size of the tokenizer vocabulary, special token included
    eot_id: int
    tokenizer: Tokenizer
    fingerprint: dict[str, Any]

    def train_tokens(self) -> np.ndarray:
        """Read-only memmap of shape (n_train_tokens,), dtype uint16 (little-endian)."""
        return np.memmap(self.train_path, dtype=TOKEN_DTYPE, mode="r")

    def val_tokens(self) -> np.ndarray:
        """Read-only memmap of shape (n_val_tokens,), dtype uint16 (little-endian)."""
        return np.memmap(self.val_path, dtype=TOKEN_DTYPE, mode="r")

    def select_tokens(self) -> np.ndarray:
        """The selection part of the held-out tokens (first half, cut at a document boundary): the
        validation loss logged during training, and the split hyperparameters are chosen on."""
        val = self.val_tokens()
        return val[heldout_parts(val, self.eot_id)[0]]

    def eval_batches(self, part: str, batch_size: int, seq_len: int, n_batches: int):
        """n_batches fixed (x, y) batches of the held-out ``part``: "selection" or "report"."""
        tokens = self.select_tokens() if part == "selection" else self.report_tokens()
        return TokenLoader.eval_batches(tokens, batch_size, seq_len, n_batches, name=f"{part} (held-out)")

    def report_tokens(self) -> np.ndarray:
        """The report part of the held-out tokens (second half): read once at the end of a run, for the
        numbers a study reports; nothing is chosen on it."""
        val = self.val_tokens()
        return val[heldout_parts(val, self.eot_id)[1]]


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print) -> PreparedData | mqar.MQARData:
    """Read, split and tokenize cfg.source, reusing the tokenizer and tokens cached in cfg.cache_dir (the
    synthetic source mqar: its generator, nothing read or cached; with cfg.token_pack: the pack's tokens,
    the source not read)."""
    cfg.validate()
    if cfg.source == mqar.MQAR:
        return mqar.prepare(cfg)
    if cfg.token_pack:  # a machine without the source: the pack's tokens and tokenizer (data/pack.py)
        from .pack import load_pack

        return load_pack(cfg, log)
    source = load_documents(cfg)
    log(source.summary())
    if not source.docs:
        raise DataError(
            f"data.source: {cfg.source!r} has no usable text (every file was empty, binary or not UTF-8); "
            "point it at UTF-8 text files"
        )
    split = split_documents(source.docs, cfg.val_fraction)
    if len(source.docs) == 1:
        log("split: single document, cut into a train part and a val part")
    log(f"split: {len(split.train)} train docs, {len(split.val)} val docs (val_fraction={cfg.val_fraction})")

    cache = Path(cfg.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    train_sha = content_sha256(split.train)
    val_sha = content_sha256(split.val)
    tokenizer, tokenizer_id = _get_tokenizer(cfg, split.train, train_sha, cache, log)

    # the english corpus also keys on its parts' versions and licences: two corpus versions never share tokens
    corpus_id = [json.dumps(source.corpus_parts, sort_keys=True)] if source.corpus_parts else []
    key = _short_hash(CACHE_FORMAT, train_sha, val_sha, tokenizer_id, *corpus_id)
    train_path = cache / f"tokens-{key}-train.bin"
    val_path = cache / f"tokens-{key}-val.bin"
    if train_path.exists() and val_path.exists():
        log(f"tokens: reusing {train_path.name} and {val_path.name}")
    else:
        eot = tokenizer.eot_id
        n_train = _write_tokens(train_path, split.train, tokenizer, eot, "tokenize train")
        n_val = _write_tokens(val_path, split.val, tokenizer, eot, "tokenize val")
        log(f"tokens: wrote {n_train:,} train and {n_val:,} val tokens to {cache}")

    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    fingerprint: dict[str, Any] = {
        "source": cfg.source,
        "files": len(source.docs),
        "bytes": source.total_bytes,
        "sha256": content_sha256(source.docs),
        "train_files": len(split.train),
        "val_files": len(split.val),
        "skipped": source.skipped.as_dict(),
        "tokenizer": tokenizer.name,
        "train_tokens": train_path.stat().st_size // itemsize,
        "val_tokens": val_path.stat().st_size // itemsize,
    }
    if source.corpus_parts:  # english: package, registry, version, licence, text SHA-256 and cap of each part
        fingerprint["corpus_parts"] = source.corpus_parts
    return PreparedData(
        train_path=train_path,
        val_path=val_path,
        vocab_size=tokenizer.vocab_size,
        eot_id=tokenizer.eot_id,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
    )


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:16]


def _get_tokenizer(
    cfg: DataConfig, train: list[Document], train_sha: str, cache: Path, log: Callable[[str], None]
) -> tuple[Tokenizer, str]:
    """(tokenizer, id that changes whenever its encoding could change)."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer(), "bytes"
    path = cache / f"tok-{_short_hash(CACHE_FORMAT, train_sha, str(cfg.vocab_size), cfg.tokenizer)}.json"
    if path.exists():
        tok_json = path.read_text(encoding="utf-8")
        tokenizer = BPETokenizer.from_json(tok_json)
        log(f"tokenizer: reusing {path.name} ({tokenizer.vocab_size} tokens)")
    else:
        start = time.perf_counter()
        tokenizer = BPETokenizer.train((d.text for d in train), cfg.vocab_size)
        tok_json = tokenizer.to_json()
        atomic_write_bytes(path, tok_json.encode("utf-8"))
        log(
            f"tokenizer: trained BPE with {tokenizer.vocab_size} tokens "
            f"in {time.perf_counter() - start:.1f}s, saved {path.name}"
        )
    return tokenizer, "bpe:" + hashlib.sha256(tok_json.encode("utf-8")).hexdigest()


def _chunks(docs: list[Document]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += doc.nbytes
        if len(chunk) >= _CHUNK_DOCS or size >= _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_tokens(path: Path, docs: list[Document], tokenizer: Tokenizer, eot: int, desc: str) -> int:
    """Write docs as uint16 ids joined by eot, atomically; return the number of tokens."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    n_tokens = 0
    first = True
    try:
        with (
            open(tmp, "wb") as f,
            tqdm(
                total=sum(d.nbytes for d in docs),
                desc=desc,
                unit="B",
                unit_scale=True,
                disable=None,
                leave=False,
            ) as bar,
        ):
            for chunk in _chunks(docs):
                pieces: list[np.ndarray] = []
                for ids in tokenizer.encode_batch([d.text for d in chunk]):
                    if not first:
                        pieces.append(np.array([eot], dtype=TOKEN_DTYPE))
                    pieces.append(np.asarray(ids, dtype=TOKEN_DTYPE))  # (n_doc_tokens,)
                    first = False
                block = np.concatenate(pieces)  # (n_chunk_tokens,)
                f.write(block.tobytes())
                n_tokens += block.size
                bar.update(sum(d.nbytes for d in chunk))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n_tokens
