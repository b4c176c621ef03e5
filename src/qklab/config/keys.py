"""The keys of a run config as ``qklab config`` and docs/config.md show them, read off the fields of the
config dataclasses and of each method's ``Options``: type, default (or a preset's value), valid values,
meaning and flags."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal

from qklab.config.load import load_config
from qklab.config.run import RunConfig
from qklab.config.sections import QKConfig
from qklab.errors import ConfigError
from qklab.fields import field_types
from qklab.methods import CONTROLLERS, METHODS


@dataclass(frozen=True)
class KeyInfo:
    """One config key: its type, value, valid values and meaning, from its field's type and metadata."""

    key: str  # dotted, as --set takes it: model.d_model, qk.softcap.cap, preset
    section: str  # model, qk, qk.softcap, data, train; "" at the top level
    type: str  # int, float, bool, str, list[str]
    value: Any  # the default, or a preset's value
    default: Any
    allowed: str  # the valid values: "> 0", "auto | sdpa | eager"; "": any value of its type
    doc: str  # the meaning, one line
    neutral: bool = False
    resumable: bool = False


def config_keys(preset: str | None = None) -> list[KeyInfo]:
    """Every key of a run config, section by section (the options of each method and controller after
    ``qk``), with its default or, given a preset (name or TOML path), the preset's value."""
    keys = _keys_of("", RunConfig())
    if preset:
        keys = [dataclasses.replace(k, value=v.value) for k, v in zip(keys, _keys_of("", load_config(preset)),
                                                                      strict=True)]
    return keys


def _keys_of(section: str, obj: Any) -> list[KeyInfo]:
    out: list[KeyInfo] = []
    for f in dataclasses.fields(obj):
        key, tp, value = f"{section}.{f.name}".lstrip("."), field_types(type(obj))[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            out += _keys_of(key, value)
        elif isinstance(obj, QKConfig) and f.name == "options":  # the keys qk.<name>.<option>
            out += [k for name in {**METHODS, **CONTROLLERS} for k in _keys_of(f"qk.{name}", obj.opts(name))]
        else:
            m = f.metadata
            out.append(KeyInfo(key, section, _type_text(tp), value, value, _allowed_text(tp, m), m.get("doc", ""),
                               bool(m.get("neutral")), bool(m.get("resumable"))))
    return out


def _type_text(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return type(args[0]).__name__
    if typing.get_origin(tp) is list:
        return f"list[{_type_text(args[0])}]"
    return tp.__name__


def _allowed_text(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    if "range" in meta:
        return meta["range"][1]
    if "allowed" in meta:
        return meta["allowed"]
    if typing.get_origin(tp) is Literal:
        return " | ".join(typing.get_args(tp))
    if typing.get_origin(tp) is list and typing.get_origin(typing.get_args(tp)[0]) is Literal:
        return "distinct, from " + " | ".join(typing.get_args(typing.get_args(tp)[0]))
    return ""


def toml_value(v: Any) -> str:
    """A value as TOML writes it and ``--set`` reads it back: "runs", 0.003, true, ["wandb"]."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return f"[{', '.join(map(toml_value, v))}]"
    return repr(v)


def select_keys(keys: list[KeyInfo], prefixes: list[str]) -> list[KeyInfo]:
    """The keys that start with one of ``prefixes`` (all keys without any); a prefix that starts none is a
    ``ConfigError`` listing the sections."""
    for p in prefixes:
        if not any(k.key.startswith(p) for k in keys):
            sections = ", ".join(dict.fromkeys(k.section or k.key for k in keys))
            raise ConfigError(f"no config key starts with '{p}'; give a section ({sections}) or the start of a key, "
                              "e.g. qklab config train.lr")
    return [k for k in keys if not prefixes or any(k.key.startswith(p) for p in prefixes)]


def section_doc(section: str) -> str:
    """One line on a section: its dataclass's first sentence, or which method or controller it sets."""
    if not section:
        return "Keys outside any section."
    if section.startswith("qk."):
        name = section[3:]
        return f"Options of qk.{'method' if name in METHODS else 'controller'}={name}."
    doc = " ".join((field_types(RunConfig)[section].__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "."


def _flags(k: KeyInfo) -> str:
    return ", ".join(f for f, on in (("neutral", k.neutral), ("resumable", k.resumable)) if on)


def keys_text(keys: list[KeyInfo]) -> str:
    """What ``qklab config`` prints: a line per section, then a line per key: ``key = value``, its type,
    valid values and flags, its meaning (and its default, where a preset's value differs)."""
    lines: list[str] = []
    for section, group in itertools.groupby(keys, lambda k: k.section):
        rows = [(f"{k.key} = {toml_value(k.value)}",
                 ", ".join(filter(None, (k.type, k.allowed))) + (f"; {_flags(k)}" if _flags(k) else ""),
                 k.doc + (f" (default {toml_value(k.default)})" if k.value != k.default else ""))
                for k in group]
        w1, w2 = (min(max(len(r[i]) for r in rows), cap) for i, cap in ((0, 36), (1, 40)))
        lines += [*([""] if lines else []), f"[{section or 'top level'}] {section_doc(section)}"]
        lines += [f"  {a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in rows]
    return "\n".join(lines) + "\n"


REFERENCE = "docs/config.md"  # the page keys_markdown writes, kept in step by a test


def keys_markdown(keys: list[KeyInfo], preset: str | None = None) -> str:
    """docs/config.md: a table per section (key, type, default and a preset's value, valid values,
    meaning), then the neutral and the resumable keys."""
    made_by = "qklab config --markdown" + (f" --preset {preset}" if preset else "")
    prose = [f"Generated by `{made_by}` from the config dataclasses (`qklab/config/`, `DataConfig` in "
           "`qklab/data/config.py`, the `Options` of each method in `qklab/methods/`): their types and the "
           "metadata of their fields. Do not edit it by hand: change the fields, then run "
           f"`qklab config --markdown > {REFERENCE}`; `tests/test_config_keys.py` fails while this page is out "
           "of step with the code. In a terminal, `qklab config [PREFIX ...] [--preset NAME]` prints the same "
           "keys, e.g. `qklab config train` or `qklab config qk.softcap --preset tiny`.",
             "A key is set in a preset's TOML file under its section (`[train]` then `lr = 1e-3`; a method's "
           "options under `[qk.<method>]`) or with `--set`: `qklab train --set train.lr=1e-3`. Types and valid "
           "values are checked when a config loads; a wrong value is one line naming the key (exit code 2)."]
    prose += [f"The column `{preset}` holds the values of that preset."] if preset else []
    out = ["# Config keys", ""] + [line for text in prose for line in (_fill(text), "")]
    for section, group in itertools.groupby(keys, lambda k: k.section):
        out += [f"## {section or 'top level'}", "", _cell(section_doc(section)), "",
                f"| key | type | default |{f' {preset} |' if preset else ''} allowed | meaning |",
                f"| --- | --- | --- |{' --- |' if preset else ''} --- | --- |"]
        out += [f"| `{k.key}` | {_cell(k.type)} | {_code(toml_value(k.default))} |"
                + (f" {_code(toml_value(k.value))} |" if preset else "")
                + f" {_cell(k.allowed)} | {_cell(k.doc)} |" for k in group]
        out.append("")
    out += ["## Neutral and resumable keys", "",
            _fill("Neutral keys do not change what a run computes (where it writes, how it shows progress, "
                          "its threads): a study cell's hash leaves them out. Resumable keys may differ between a "
                          "run and its resumption (`qklab train --resume`); a change to any other key is refused on "
                          "resume."), ""]
    for flag in ("neutral", "resumable"):
        names = ", ".join(f"`{k.key}`" for k in keys if getattr(k, flag)) or "none"
        out += [_fill(f"{flag.capitalize()}: {names}."), ""]
    return "\n".join(out[:-1]) + "\n"


def _fill(text: str) -> str:
    """A paragraph wrapped at 110 columns, never inside a `code span`."""
    spans = re.sub(r"`[^`]*`", lambda m: m.group().replace(" ", "\0"), text)
    return textwrap.fill(spans, 110, break_on_hyphens=False).replace("\0", " ")


def _cell(text: str) -> str:
    """Text as Markdown shows it in a table cell: | and < escaped (not a column, not a tag)."""
    return text.replace("|", "\\|").replace("<", "\\<")


def _code(text: str) -> str:
    """Text as a code span in a table cell: only | escaped (a code span shows any other backslash)."""
    return "`" + text.replace("|", "\\|") + "`"
