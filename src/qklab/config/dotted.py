"""Dotted config keys (``train.lr``, ``qk.softcap.cap``): setting one in a nested config dict, and a nested
dict as dotted keys (``flatten``). Used by loading (``--set``), resuming and study files alike."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from qklab.errors import ConfigError


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
