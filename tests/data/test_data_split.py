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
