"""Study files: a grid of config keys x variants x learning rates x seeds, expanded into cells.

    [study]
    name = "demo"                    # default: the file's stem
    config = "small"                 # base preset or TOML path of every cell
    seeds = [0, 1]
    workers = 2                      # default of --workers (0: in the calling process); default 1
    set = { "train.steps" = 150 }    # config keys applied to every cell

    [grid]                           # optional: every combination, crossed with the variants
    "model.d_model" = [64, 128]      # a value may set several keys together:
    shape = [{ "model.d_model" = 64, "model.n_heads" = 1 }, { "model.d_model" = 128, "model.n_heads" = 2 }]

    [variants.none]                  # one table per variant: config keys (dotted), and optionally
    "qk.method" = "none"             # config = "<preset>" to start from another preset
    [variants.quack]
    "qk.controller" = "quack"

    [claims."qkmap.val_vs_none"]     # optional: the pre-registered claims (qklab.study.plan)
    family = "QK-MAP"

    [protocol]
    reference = "none"               # paired differences against this variant ({mha = .., mla = ..} per attention)
    lr_mults = [0.5, 1, 2]           # each variant's own grid, in multiples of its own base rate
    lr_mults_for = { qkmap = [1, 2, 4] }
    lr_key = "train.lr"
    data_seed = 0                    # every cell sees the same batches in the same order; "seed": each
                                     # cell's batch order is its own seed's (train.data_seed = the seed)
    probe = 0                        # attention probes on each finished cell, contexts up to N training lengths

A cell is one plain training run. Its id names the variant, grid point, rate multiple and seed; its
config is built and validated once, here, and carried on the cell with its hash (``Cell.cfg``,
``Cell.hash``): the runner copies it, never parses it again.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qklab.config import (
    NEUTRAL,
    ConfigError,
    RunConfig,
    check_run_name,
    flatten,
    from_dict,
    from_table,
    read_preset,
    set_key,
)
from qklab.fields import at_least, option
from qklab.methods import CONTROLLERS, METHODS
from qklab.study.plan import parse_plan

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


SEED_ORDER = "seed"  # [protocol] data_seed: each cell's batch order follows its seed


def _positive(v: list[float]) -> bool:
    return bool(v) and all(x > 0 for x in v)


MULTS = (_positive, "a non-empty list of positive numbers, e.g. [0.5, 1, 2]")


@dataclass
class StudySection:
    """A study file's ``[study]`` table: each key a field, checked as the run config's are."""

    name: str = option("", "the study's name (default: the file's stem)",
                       ((lambda v: not v or bool(NAME_RE.match(v))), "a plain name (letters, digits, . _ -)"))
    config: str = option("small", "the base preset or TOML file of every cell",
                         ((lambda v: bool(v)), "a preset (e.g. \"tiny\") or a TOML file"))
    seeds: list[int] = option([0], "the seeds every cell runs with",
                              ((lambda v: bool(v) and min(v) >= 0 and len(set(v)) == len(v)),
                               "a non-empty list of distinct integers >= 0"))
    set: dict[str, Any] = option({}, "config keys applied to every cell, e.g. { \"train.steps\" = 100 }")
    workers: int = option(1, "the default of --workers", at_least(0, " (0: cells in the calling process)"))


@dataclass
class Protocol:
    """A study file's ``[protocol]`` table: how cells are compared and which rates they run."""

    # attention ('mha'/'mla', '*': any) -> variant; a study file may name one variant for all
    reference: dict[str, str] = option({}, "the variant paired differences are taken against")
    lr_mults: list[float] = option([1.0], "each variant's rate grid, in multiples of its own base rate", MULTS)
    lr_mults_for: dict[str, list[float]] = option({}, "a variant's own rate grid", (
        (lambda v: all(map(_positive, v.values()))), f"a table variant -> {MULTS[1]}"))
    lr_key: str = option("train.lr", "the float config key the multiples scale",
                         ((lambda v: "." in v), "a float config key, e.g. \"train.lr\""))
    data_seed: int | str = option(0, "the batch order's seed", (
        (lambda v: v == SEED_ORDER if isinstance(v, str) else v >= -1),
        f"a seed >= 0 (the same batches in every cell), -1 or \"{SEED_ORDER}\" (each seed its own order; "
        f"\"{SEED_ORDER}\" names it in the cell's config)"))
    probe: int = option(0, "attention probes on each finished cell",
                        at_least(0, " (N: contexts up to N training lengths)"))
    reuse: list[str] = option([], "other studies' result folders: cells of the same config are not rerun")

    def mults(self, variant: str) -> list[float]:
        return self.lr_mults_for.get(variant, self.lr_mults)

    def check(self, variants: dict[str, Any]) -> None:
        """The rules across the file that no field's range states: every variant named is one."""
        for key, names in (("reference", self.reference.values()), ("lr_mults_for", self.lr_mults_for)):
            for k in names:
                _need(k in variants, f"[protocol] {key}", f"'{k}' is not a variant; variants: {', '.join(variants)}")

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "lr_mults": self.lr_mults, "lr_mults_for": self.lr_mults_for,
                "lr_key": self.lr_key, "data_seed": self.data_seed, "probe": self.probe, "reuse": self.reuse}


def _section(cls: type, raw: Any, where: str) -> Any:
    """A study file's table as its dataclass (``config.from_table``), one line naming the key."""
    _need(isinstance(raw, dict), where, "must be a table")
    return from_table(cls, raw, where)



def group_id(variant: str, point: tuple[tuple[str, Any], ...]) -> str:
    """The cells of one variant at one grid point, as their ids begin: 'qkmap', 'qkmap_d_model128'."""
    return "_".join([variant, *(f"{k.rsplit('.', 1)[-1]}{_label(v)}" for k, v in point)])

@dataclass(frozen=True)
class Cell:
    """One training run of a study. Pickled to the worker process that trains it."""

    id: str
    variant: str
    point: tuple[tuple[str, Any], ...]  # grid values, (key, value)
    lr_mult: float
    seed: int
    # validated; out_dir, name, progress and threads as the preset has them (the runner trains a copy with
    # its own: neutral keys, so the copy has this hash). Never changed in place.
    cfg: RunConfig
    hash: str  # cell_hash(cfg): a result or run folder with another hash is another config's

    @property
    def legacy_hash(self) -> str:
        """The hash of results written before HASH_VERSION 2 (``cell_status`` upgrades them)."""
        return legacy_cell_hash(self.cfg)


@dataclass
class Study:
    name: str
    path: Path | None
    config: str  # [study] config: the base preset (a name or a TOML path) of every cell
    seeds: list[int]
    set: dict[str, Any]  # [study] set: config keys applied to every cell
    grid: dict[str, list[Any]]
    variants: dict[str, dict[str, Any]]
    protocol: Protocol
    workers: int = 1  # [study] workers: the default of --workers (0: in the calling process, serially)
    cells: list[Cell] = field(default_factory=list)
    plan: dict[str, dict[str, Any]] | None = None  # [claims]: claim id -> every parameter (study.plan)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "seeds": self.seeds, "set": self.set,
                "grid": self.grid, "variants": self.variants, "protocol": self.protocol.to_dict(),
                "cells": [c.id for c in self.cells]}


def _value(v: Any) -> Any:
    """A study file's value for a config key: what ``--set`` could give (a string, number, boolean or a
    list of them; not a TOML date or time)."""
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    raise ConfigError(f"value {v!r} cannot be set from a study file; use a string, number, boolean or list")


def _sets(d: dict[str, Any]) -> list[tuple[str, Any]]:
    """A study table's (key, value) settings; its keys are ``--set`` keys already (qk.<name>.<option>), so
    ``flatten`` lifts no section."""
    return [(k, _value(v)) for k, v in flatten(d).items()]


def _label(v: Any) -> str:
    if isinstance(v, dict):
        return "-".join(_label(x) for x in flatten(v).values())
    return re.sub(r"[^A-Za-z0-9.]+", "", str(v)) or "x"


def _point_sets(point: tuple[tuple[str, Any], ...]) -> list[tuple[str, Any]]:
    """(key, value) settings of a grid point; a table value sets each of its keys."""
    out: list[tuple[str, Any]] = []
    for k, v in point:
        out += _sets(v) if isinstance(v, dict) else [(k, _value(v))]
    return out


# The version of what cell_hash covers, hashed with it: bump it when a config default that changes what
# cells compute changes (every committed result then counts as another config's, and is run again).
# 1: every key, defaults included (legacy_cell_hash); 2: only the values that differ from the defaults.
HASH_VERSION = 2


def cell_hash(cfg: RunConfig) -> str:
    """Hash of what decides what a cell computes: every config value that differs from its default, not
    where it writes or its threads. A config key added later, at a default that keeps the old behaviour,
    leaves the results of earlier runs valid (a changed default must bump ``HASH_VERSION``)."""
    d, base = _computing(cfg), _computing(RunConfig())
    diff: dict[str, Any] = {}
    for sec, vals in d.items():
        ref = base.get(sec)
        if isinstance(vals, dict) and isinstance(ref, dict):
            vals = {k: v for k, v in vals.items() if k not in ref or ref[k] != v}
        if vals != ref and vals != {}:  # a section (or top-level value) all at its defaults says nothing
            diff[sec] = vals
    blob = json.dumps({"v": HASH_VERSION, **diff}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def legacy_cell_hash(cfg: RunConfig) -> str:
    """The hash of results written before HASH_VERSION 2: every key, defaults included."""
    return hashlib.sha256(json.dumps(_computing(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _computing(cfg: RunConfig) -> dict[str, Any]:
    d = json.loads(json.dumps(cfg.to_dict(), default=str))  # plain JSON values: tuples as lists
    for key in NEUTRAL:  # "train.out_dir": where it writes, how it shows progress, its threads
        sec, _, k = key.partition(".")
        d[sec].pop(k, None)
    for name, opts in d["qk"].get("options", {}).items():  # options added later count only when set
        cls = (METHODS.get(name) or CONTROLLERS.get(name)).Options
        for f in dataclasses.fields(cls):
            if f.metadata.get("late") and f.name in opts and opts[f.name] == f.default:
                del opts[f.name]
            if f.metadata.get("was") and f.name in opts:  # a renamed option hashes under its earlier name
                opts[f.metadata["was"]] = opts.pop(f.name)
    return d


def batch_order_seed(p: Protocol, seed: int) -> int:
    """A cell's ``train.data_seed``: the protocol's, or, for ``data_seed = "seed"``, the cell's own seed
    (set explicitly, so that seed 0's cells have the config, and hash, of a study fixing data_seed = 0)."""
    return seed if p.data_seed == SEED_ORDER else int(p.data_seed)


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


LARGE = 2000  # cells: more, and parse_study says how many before it checks them all


def parse_study(raw: dict[str, Any], name: str, path: Path | None = None, note=None) -> Study:
    """Build and validate a study from its parsed TOML; every cell's config is checked up front. ``note``
    (a print function) hears how many cells a large study has before they are checked."""
    _need(isinstance(raw, dict), "study file", "must be a TOML document of tables")
    known = {"study", "grid", "variants", "protocol", "claims"}
    extra = set(raw) - known
    _need(not extra, "study file", f"unknown section(s) {', '.join(sorted(extra))}; use {', '.join(sorted(known))}")
    s = _section(StudySection, raw.get("study", {}), "[study]")
    name, preset, seeds, every_cell, workers = s.name or name, s.config, s.seeds, s.set, s.workers
    _need(bool(NAME_RE.match(name)), "[study] name", f"{name!r} must be a plain name (letters, digits, . _ -)")
    grid = raw.get("grid", {})
    _need(isinstance(grid, dict), "[grid]", "must be a table of key = [values]")
    grid = flatten(grid)
    for k, v in grid.items():
        _need(isinstance(v, list) and bool(v), f"[grid] {k}", f"{v!r} must be a non-empty list of values")
    variants = raw.get("variants", {"default": {}})
    _need(isinstance(variants, dict) and bool(variants), "[variants]", "give at least one [variants.<label>] table")
    for label, v in variants.items():
        _need(bool(NAME_RE.match(label)), f"variant '{label}'", "labels must be plain names (letters, digits, . _ -)")
        _need(isinstance(v, dict), f"variant '{label}'", "must be a table of config keys")
    p = raw.get("protocol", {})
    if isinstance(p, dict) and isinstance(p.get("reference"), str):  # one variant for every attention
        p = {**p, "reference": {"*": p["reference"]}}
    proto = _section(Protocol, p, "[protocol]")
    proto.check(variants)
    study = Study(name, path, preset, list(seeds), every_cell, grid, variants, proto, workers,
                  plan=parse_plan(raw.get("claims")))
    n = len(seeds) * math.prod(len(v) for v in grid.values()) * sum(len(proto.mults(v)) for v in variants)
    if n > LARGE and note is not None:  # validating every cell takes a while: say so before the wait
        note(f"study {name}: {n:,} cells; checking every cell's config (about {n / 1500:.0f} s) ...")
    study.cells = expand(study)
    return study


def expand(study: Study) -> list[Cell]:
    """All cells, seed-major (a study cut short still has every variant at its first seeds). A variant at a
    grid point is parsed once (its preset, then [study] set, the grid values and its own keys, in that
    order); each of its cells is a copy at its rate (a multiple of the variant's own), seed and data seed,
    validated and hashed once."""
    cells: list[Cell] = []
    points = [tuple(zip(study.grid, combo, strict=True)) for combo in itertools.product(*study.grid.values())]
    p = study.protocol
    presets: dict[str, dict[str, Any]] = {}  # preset -> its raw TOML, read once
    bases: dict[tuple, RunConfig] = {}  # (variant, grid point) -> its config before rate, seed and data seed
    lr_sec, _, lr_field = p.lr_key.partition(".")  # "train.lr" -> cfg.train.lr
    for seed in study.seeds:
        for point in points:
            for label, raw in study.variants.items():
                where = f"variant '{label}'" + (f" at {dict(point)}" if point else "")
                key = (label, json.dumps(point, sort_keys=True, default=str))
                if key not in bases:
                    bases[key] = _variant_config(study, point, raw, presets, where)
                base = bases[key]
                rate = getattr(getattr(base, lr_sec, None), lr_field, None)
                _need(isinstance(rate, float), "[protocol] lr_key", f"'{p.lr_key}' is not a float config key")
                for mult in p.mults(label):
                    cid = f"{group_id(label, point)}_lr{mult:g}_s{seed}"
                    cfg = copy.deepcopy(base)
                    setattr(getattr(cfg, lr_sec), lr_field, rate * mult)
                    cfg.train.seed, cfg.train.data_seed = seed, batch_order_seed(p, seed)
                    try:
                        check_run_name(cid, "cell id")  # the name of the cell's run folder
                        cfg.validate()
                    except ConfigError as e:
                        raise ConfigError(f"{where}, lr x{mult:g}: {e}") from None
                    cells.append(Cell(cid, label, point, mult, seed, cfg, cell_hash(cfg)))
    ids = [c.id for c in cells]
    dup = {i for i in ids if ids.count(i) > 1}
    _need(not dup, "study", f"cells {sorted(dup)} share an id; make grid values or variant labels distinct")
    return cells


def _variant_config(study: Study, point: tuple, variant: dict[str, Any], presets: dict, where: str) -> RunConfig:
    """A variant's config at a grid point, parsed (keys and types checked), not yet validated."""
    variant = dict(variant)
    preset = variant.pop("config", study.config)
    _need(isinstance(preset, str), where, f"config = {preset!r} must name a preset or a TOML file")
    try:
        if preset not in presets:
            presets[preset] = read_preset(preset)
        raw = copy.deepcopy(presets[preset])
        for key, value in [*_sets(study.set), *_point_sets(point), *_sets(variant)]:
            set_key(raw, key.strip(), value)
        return from_dict(RunConfig, raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_study(path: str | Path) -> dict[str, Any]:
    """A study file's TOML, as ``parse_study`` takes it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"study file '{path}' not found; give a path such as studies/demo.toml")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save the study file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the study file ({e.strerror or e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML ({' '.join(str(e).split())})") from None


def load_study(path: str | Path, note=None) -> Study:
    return parse_study(read_study(path), Path(path).stem, Path(path), note=note)
