from __future__ import annotations

import hashlib

from qklab.data.sources import Document
from qklab.data.split import split_documents


def rule_value(relpath: str) -> float:
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) / 2**32


def docs(n: int) -> list[Document]:
    return [Document(f"f{i}.txt", f"text {i}", len(f"text {i}")) for i in range(n)]


def test_empty_val_takes_the_smallest_hash() -> None:
    items = docs(10)
    split = split_documents(items, val_fraction=1e-9)  # the rule alone selects nothing here
    smallest = min(items, key=lambda d: rule_value(d.relpath))
    assert [d.relpath for d in split.val] == [smallest.relpath]
    assert [d.relpath for d in split.train] == [d.relpath for d in items if d is not smallest]


def test_all_in_val_keeps_the_largest_hash_for_train() -> None:
    items = docs(3)
    split = split_documents(items, val_fraction=0.999999)
    largest = max(items, key=lambda d: rule_value(d.relpath))
    assert all(rule_value(d.relpath) < 0.999999 for d in items)  # the rule alone sends all to val
    assert [d.relpath for d in split.train] == [largest.relpath]
    assert len(split.val) == 2


def test_rule_and_order() -> None:
    items = docs(200)
    split = split_documents(items, val_fraction=0.25)
    assert [d.relpath for d in split.val] == [d.relpath for d in items if rule_value(d.relpath) < 0.25]
    assert [d.relpath for d in split.train] == [d.relpath for d in items if rule_value(d.relpath) >= 0.25]
    assert 20 < len(split.val) < 80


def test_heldout_parts_cut_at_the_document_boundary_nearest_the_middle():
    import numpy as np

    from qklab.data.split import heldout_parts

    eot = 9
    toks = np.array([1, 2, eot, 3, 4, 5, eot, 6, eot, 7, 7, 7], dtype=np.uint16)  # boundaries after 2, 6, 8
    sel, rep = heldout_parts(toks, eot)
    assert (sel, rep) == (slice(0, 7), slice(7, 12))  # middle 6: the boundary at 7 is nearest
    assert heldout_parts(np.array([1, 2, 3, 4, 5]), eot) == (slice(0, 2), slice(2, 5))  # no boundary: the middle
