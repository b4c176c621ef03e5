"""``qklab config`` and docs/config.md: every key, read off the config dataclasses, with its type, default (or a
preset's value), valid values and meaning; the page in step with the code."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest

from qklab.cli import build_parser, main
from qklab.config import (
    NEUTRAL,
    REFERENCE,
    RESUMABLE,
    ConfigError,
    RunConfig,
    config_keys,
    keys_markdown,
    load_config,
    toml_value,
)
from qklab.methods import CONTROLLERS, METHODS

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {name: cls.Options for name, cls in {**METHODS, **CONTROLLERS}.items()}


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _walk() -> dict[str, tuple[dataclasses.Field, object]]:
    """dotted key -> (its field, the value at ``load_config('tiny')``), from ``dataclasses.fields`` alone:
    the sections of RunConfig, each method's and controller's Options (qk.<name>.<option>), the top level."""
    tiny, out = load_config("tiny"), {}
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if not dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = (f, getattr(tiny, f.name))
            continue
        for g in dataclasses.fields(hints[f.name]):
            if (f.name, g.name) != ("qk", "options"):
                out[f"{f.name}.{g.name}"] = (g, getattr(getattr(tiny, f.name), g.name))
    for name, cls in OPTIONS.items():
        out |= {f"qk.{name}.{g.name}": (g, getattr(tiny.qk.opts(name), g.name)) for g in dataclasses.fields(cls)}
    return out


def _listing(capsys, *args: str) -> dict[str, str]:
    """key -> its line in ``qklab config``'s output."""
    assert main(["config", *args]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]
    return {ln.split(" = ", 1)[0]: ln for ln in lines}


def test_every_field_of_every_section_is_listed_with_its_meaning(capsys):
    walked = _walk()
    keys = config_keys()
    assert [k.key for k in keys] == list(dict.fromkeys(k.key for k in keys))  # each once
    assert {k.key for k in keys} == set(walked)
    assert set(_listing(capsys)) == set(walked)
    without = [k for k, (f, _) in walked.items() if not f.metadata.get("doc")]
    qk_options = dataclasses.fields(RunConfig.__dataclass_fields__["qk"].default_factory())[-1]
    assert qk_options.name == "options" and qk_options.metadata.get("doc")
    assert not without, f"fields without a meaning line (metadata doc): {without}"
    assert all(k.doc and "\n" not in k.doc and k.doc == walked[k.key][0].metadata["doc"] for k in keys)
    assert {k.key for k in keys if k.neutral} == NEUTRAL and {k.key for k in keys if k.resumable} == RESUMABLE


def test_defaults_are_the_dataclass_defaults(capsys):
    walked, lines = _walk(), _listing(capsys)
    for k in config_keys():
        want = _default(walked[k.key][0])
        assert k.value == want and k.default == want and type(k.value) is type(want), k.key
        shown = toml_value(want)
        assert tomllib.loads(f"v = {shown}")["v"] == want, k.key  # what it prints, --set reads back
        assert lines[k.key].startswith(f"{k.key} = {shown}  "), lines[k.key]


def test_a_preset_shows_its_values(capsys):
    walked, lines = _walk(), _listing(capsys, "--preset", "tiny")
    for k in config_keys("tiny"):
        value = walked[k.key][1]
        assert k.value == value, k.key
        assert lines[k.key].startswith(f"{k.key} = {toml_value(value)}  "), lines[k.key]
        assert lines[k.key].endswith(f" (default {toml_value(k.default)})") == (value != k.default)
    assert lines["model.d_model"].startswith("model.d_model = 64  ") and lines["preset"].startswith('preset = "tiny"')


# a shown range that holds only beside another setting: the settings that make it apply
NEEDS = {"model.yarn_factor": ["model.rope_scaling=yarn"], "data.vocab_size": ["data.tokenizer=bpe"]}
NEEDS |= {f"model.{k}": ["model.rope_scaling=yarn", "model.yarn_factor=2"]
          for k in ("yarn_original_max_len", "yarn_beta_fast", "yarn_beta_slow")}
# values at a range's edge that another rule also constrains: the settings that let them pass
EDGE_NEEDS = {("model.max_seq_len", 2): ["train.seq_len=2"],
              ("model.yarn_beta_fast", 0.5): ["model.yarn_beta_slow=0.25"],
              ("model.d_model", 1): None}  # None: no shape has it (a head of width 1 is odd, RoPE needs even)
CHOICE_NEEDS = {("model.rope_scaling", "yarn"): ["model.yarn_factor=2"],
                ("qk.compositional.form", "exact"): ["qk.compositional.decay=base"]}
NUMBER = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"


def _edges(allowed: str, tp: str) -> tuple[list[float], list[float]] | None:
    """The values just inside and just outside a shown range (``> 0``, ``>= 1``, ``in [0, 1)``, ``0 (off) or
    >= 1``), None if the text shows no range."""
    num, step = (int, 1) if tp == "int" else (float, 0.5)
    if m := re.search(rf"in ([\[(]){NUMBER}, {NUMBER}([\])])", allowed):
        lo, hi, lo_in, hi_in = num(m[2]), num(m[3]), m[1] == "[", m[4] == "]"
        near = step if tp == "int" else (hi - lo) / 100
        return [lo if lo_in else lo + near, hi if hi_in else hi - near], [lo - step if lo_in else lo,
                                                                           hi + step if hi_in else hi]
    if m := re.search(rf"(>=|>) {NUMBER}", allowed):
        lo = num(m[2])
        return ([lo], [lo - step]) if m[1] == ">=" else ([lo + step], [lo])
    return None


def test_shown_ranges_and_choices_are_the_ones_load_config_enforces():
    """Every shown range and choice, against load_config (all defaults but the key): the values at its edges
    pass, those just outside are refused naming the key; every choice passes, another is refused."""
    checked = 0
    for k in config_keys():
        if not k.allowed:
            continue
        needs = NEEDS.get(k.key, [])
        load_config(None, [f"{k.key}={toml_value(k.value)}"])  # the default is valid (all defaults)
        if k.type == "list[str]":
            for choice in k.allowed.split("from ")[1].split(" | "):
                load_config(None, [f"{k.key}={toml_value([choice])}"])
            bad: list[object] = [["bogus"]]
        elif k.type == "str" and k.allowed == "non-empty":
            bad = [""]
        elif k.type == "str":
            for choice in k.allowed.split(" | "):
                load_config(None, [*needs, f"{k.key}={choice}", *CHOICE_NEEDS.get((k.key, choice), [])])
            bad = ["bogus"]
        else:
            edges = _edges(k.allowed, k.type)
            assert edges is not None, f"{k.key}: no range read from {k.allowed!r}"
            for value in edges[0]:
                more = EDGE_NEEDS.get((k.key, value), [])
                if more is not None:
                    load_config(None, [*needs, *more, f"{k.key}={toml_value(value)}"])
            bad = edges[1]
        for value in bad:
            with pytest.raises(ConfigError) as e:
                load_config(None, [*needs, f"{k.key}={toml_value(value)}"])
            assert k.key.rsplit(".", 1)[-1] in str(e.value), (k.key, value, str(e.value))
            checked += 1
    assert checked > 60


def test_the_reference_page_is_in_step_with_the_code(capsys):
    page = keys_markdown(config_keys())
    assert (ROOT / REFERENCE).read_text() == page, (
        f"{REFERENCE} is out of step with the config fields; regenerate it: qklab config --markdown > {REFERENCE}")
    assert main(["config", "--markdown"]) == 0 and capsys.readouterr().out == page
    assert f"`qklab config --markdown > {REFERENCE}`" in page.split("\n## ")[0].replace("\n", " ")
    for k in config_keys():
        assert f"| `{k.key}` | {k.type} | `{toml_value(k.value)}` |" in page, k.key
    assert "| `qk.qkmap.variant` | str | `\"post\"` | post \\| input \\| polar |" in page  # | escaped in cells


def test_a_filter_shows_what_starts_with_it_and_one_line_when_nothing_does(capsys):
    assert set(_listing(capsys, "qk.softcap")) == {"qk.softcap.cap"}
    assert set(_listing(capsys, "train.ckpt", "model.d_")) == {"train.ckpt_every", "train.ckpt_format",
                                                              "model.d_model", "model.d_ff"}
    assert main(["config", "qk.softcap", "bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("qklab: error: no config key starts with 'bogus'; give a section (model, qk, qk.qknorm")
    assert main(["config", "--preset", "nope"]) == 2
    assert capsys.readouterr().err.startswith("qklab: error: config 'nope' not found")


def test_train_help_points_to_qklab_config():
    helptext = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "qklab config" in " ".join(helptext.split())
