"""Dotted config keys (``train.lr``, ``qk.softcap.cap``): ``key=value`` items read (``parse_set``), one set
in a nested config dict (``set_key``), a nested dict as dotted keys (``flatten``). Used by loading
(``--set``), resuming, study files and the study commands alike."""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Iterable
from typing import Any

from qklab.errors import ConfigError


def parse_value(text: str) -> Any:
    """A value as ``--set`` reads it: TOML (1e-3, true, [1, 2], "x"), else the text itself, so that a bare
    word is a string (qk.method=qknorm)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def split_set(item: str, where: str = "--set", example: str = "train.lr=1e-3 or qk.method=qknorm") -> tuple[str, str]:
    """'train.lr=1e-3' -> ('train.lr', '1e-3'): the key and the value's text, both stripped; ``where`` (what
    the item came with: --set, a sweep's --variant, --slurm) starts the one line that refuses a malformed item."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{where}: '{item}' must look like key=value, e.g. {example}")
    return key.strip(), value.strip()


def parse_set(item: str, where: str = "--set") -> tuple[str, Any]:
    """'train.lr=1e-3' -> ('train.lr', 0.001): ``split_set``, the value read by ``parse_value``."""
    key, text = split_set(item, where)
    return key, parse_value(text)


def parse_sets(items: Iterable[str], where: str = "--set") -> dict[str, Any]:
    """['key=value', ...] -> {key: value}, each item read by ``parse_set``."""
    return dict(parse_set(item, where) for item in items)


def set_key(d: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` (``train.lr``, ``qk.softcap.cap``) in a raw nested config dict."""
    keys = key.split(".")
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: '{k}' is a value, not a section")
        d = nxt
    d[keys[-1]] = value


def flatten(d: dict[str, Any], prefix: str = "", *, lift: Collection[str] = ()) -> dict[str, Any]:
    """A nested dict as dotted keys: {'qk': {'method': 'x'}} and {'qk.method': 'x'} both -> {'qk.method': 'x'}.
    A section whose dotted key is in ``lift`` hands its keys to its parent: with lift={'qk.options'}, a saved
    config's {'qk': {'options': {'softcap': {'cap': 30.0}}}} -> {'qk.softcap.cap': 30.0}, the key ``--set``
    takes."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, prefix if key in lift else key + ".", lift=lift))
        else:
            out[key] = v
    return out
