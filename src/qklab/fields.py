"""Typed fields and their one validation, shared by every dataclass a user sets: each method's ``Options``
(``qklab.methods.options``), the run config's sections (``qklab.config``), ``DataConfig``
(``qklab.data.config``) and a study file's tables (``qklab.study``). It imports nothing of qklab but its
errors, so every room may use it.

What is known about a field sits on it: a ``typing.Literal`` type lists its choices, its metadata its
meaning (``doc``), its valid range (a ``Range``: a check and the text ``qklab config`` shows) and whether
it came late (``LATE``). ``check_fields`` checks a dataclass against them, one error line per broken rule
naming the key; the rules across fields a range cannot state stay with their dataclass.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Any, Literal

from qklab.errors import ConfigError

Range = tuple[Callable[[Any], bool], str]  # (is the value valid, what a valid value is: "> 0, e.g. 3e-3")


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, note: str = "") -> Range:
    """lo <= v <= hi, either end open on request: "in [0, 1)"."""
    text = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}{note}"
    return (lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)), text


def at_least(lo: float, note: str = "") -> Range:
    return (lambda v: v >= lo), f">= {lo}{note}"


def above(lo: float, note: str = "") -> Range:
    return (lambda v: v > lo), f"> {lo}{note}"


# metadata of an option added after study results were committed with its method: left out of a study
# cell's hash while at its default (which keeps the old behaviour), so those results stay valid
LATE = {"late": True}


def option(default: Any, doc: str, rng: Range | None = None, *, late: bool = False, was: str = "") -> Any:
    """A field and what ``qklab config`` shows of it, in its metadata: doc, its meaning in one line; rng, its
    valid values (``check_fields`` checks them; choices are a ``Literal`` type); late, see ``LATE``; was, the
    field's earlier name: still read (``config.from_dict``), and the name a study cell's hash keeps, so that
    results committed under it stay valid. A list or table default is copied for each instance."""
    meta = {"doc": doc, **({"range": rng} if rng else {}), **(LATE if late else {}), **({"was": was} if was else {})}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def earlier_names(cls: type) -> dict[str, str]:
    """A dataclass's renamed fields: earlier name -> name (``option(..., was=...)``)."""
    return {f.metadata["was"]: f.name for f in dataclasses.fields(cls) if f.metadata.get("was")}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved (the modules use ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def _holds(ok: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(ok(value))
    except (TypeError, ValueError):  # a value of another type than the range compares: out of range
        return False


def _is_a(value: Any, tp: Any) -> bool:
    """An int field holds an int, a float field an int or a float; never a bool (any other type: anything)."""
    if tp is int or tp is float:
        return isinstance(value, int | float if tp is float else int) and not isinstance(value, bool)
    return True


def check_fields(section: str, obj: Any, sep: str = ".", error: type[Exception] = ConfigError) -> None:
    """Each field's range (its metadata) and choices (its Literal type): ``model.d_model=0 is out of range:
    it must be > 0``, ``train.optimizer='sgd': use adamw or muon``. A key is ``section + sep + field``
    (a study file's: ``[protocol] probe``); a broken rule raises ``error`` (``DataError`` for data/)."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{section}{sep}{f.name}"
        if "range" in f.metadata:
            ok, want = f.metadata["range"]
            if not _is_a(value, hints[f.name]):
                kind = "an integer" if hints[f.name] is int else "a number"
                raise error(f"{key}={value!r} is not {kind}: it must be {want}")
            if not _holds(ok, value):
                raise error(f"{key}={value!r} is out of range: it must be {want}")
        if typing.get_origin(hints[f.name]) is Literal:
            *rest, last = choices = typing.get_args(hints[f.name])
            if value not in choices:
                raise error(f"{key}={value!r}: use {', '.join(rest) + ' or ' if rest else ''}{last}")
