"""Stable train/validation split and content hashing of document lists."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from .sources import Document


def split_value(relpath: str) -> float:
    """A number in [0, 1) fixed by the relative path: first 32 bits of its SHA-256."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def content_sha256(docs: Iterable[Document]) -> str:
    """SHA-256 over the (relpath, bytes) pairs of docs, in order.

    Each document contributes f"{relpath}\\0{len(bytes)}\\0" followed by its UTF-8 bytes,
    so neither paths nor contents can run into each other.
    """
    h = hashlib.sha256()
    for doc in docs:
        h.update(f"{doc.relpath}\0{doc.nbytes}\0".encode())
        h.update(doc.text.encode("utf-8"))
    return h.hexdigest()


@dataclass
class Split:
    train: list[Document]
    val: list[Document]


def split_documents(docs: list[Document], val_fraction: float) -> Split:
    """Send a document to val iff split_value(relpath) < val_fraction, keeping both sides non-empty.

    If the rule puts no document in val, the one with the smallest value goes there;
    if it puts every document in val, the one with the largest value stays in train.
    A single document is cut in two at a line break near the (1 - val_fraction) mark.
    """
    if not docs:
        raise ValueError("split_documents needs at least one document")
    if len(docs) == 1:
        return _split_single(docs[0], val_fraction)
    values = {d.relpath: split_value(d.relpath) for d in docs}
    val_ids = {r for r, v in values.items() if v < val_fraction}
    if not val_ids:
        val_ids = {min(values, key=lambda r: (values[r], r))}
    elif len(val_ids) == len(docs):
        val_ids.discard(max(values, key=lambda r: (values[r], r)))
    return Split(
        train=[d for d in docs if d.relpath not in val_ids],
        val=[d for d in docs if d.relpath in val_ids],
    )


def _split_single(doc: Document, val_fraction: float) -> Split:
    text = doc.text
    if len(text) < 2:
        raise ValueError(f"document {doc.relpath!r} is too short to split into train and val")
    mark = min(max(int(len(text) * (1.0 - val_fraction)), 1), len(text) - 1)
    # prefer a line break at most 10% of the text before the mark; the break stays with train
    newline = text.rfind("\n", max(0, mark - len(text) // 10), mark)
    cut = newline + 1 if newline > 0 else mark
    head, tail = text[:cut], text[cut:]

    def part(suffix: str, body: str) -> Document:
        return Document(f"{doc.relpath}#{suffix}", body, len(body.encode("utf-8")))

    return Split(train=[part("train", head)], val=[part("val", tail)])


def heldout_parts(tokens, eot_id: int) -> tuple[slice, slice]:
    """Cut the held-out token stream into a *selection* part and a *report* part.

    The cut is the document boundary (the position just after an ``eot_id``) nearest the middle, so no
    document is in both parts; a stream with no boundary is cut at the middle. Hyperparameters (the
    learning rate of each method) are chosen on the selection part and results are read off the report
    part, so the numbers a study reports were never used to pick anything. Returns two slices of tokens.
    """
    import numpy as np

    n = len(tokens)
    if n < 2:
        raise ValueError(f"held-out split has {n} tokens; it needs at least 2 to cut into selection and report")
    mid = n // 2
    ends = np.flatnonzero(np.asarray(tokens) == eot_id) + 1  # a document ends after its eot
    ends = ends[(ends > 0) & (ends < n)]
    cut = int(ends[np.argmin(np.abs(ends - mid))]) if ends.size else mid
    return slice(0, cut), slice(cut, n)
