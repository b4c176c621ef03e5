"""The fair protocol: per variant, choose the learning rate on the selection split, report on the report
split, and compare each variant with its reference on the same seeds.

* A *group* is one variant at one grid point of one study; its cells differ in rate multiple and seed.
* A rate is *eligible* when every one of its seeds finished and none diverged. The chosen rate is the
  eligible rate with the lowest mean selection-split loss (ties: the lower rate). ``select_rate`` sees
  only selection losses; report losses are read afterwards, at the chosen rate only.
* The highest stable rate is the highest rate at which no seed diverged (failed cells do not count): the
  entropy rule, as a diverged run is one whose loss ends above the unigram entropy (``DIVERGENCE_RULE``).
  A rate's ``diverged`` counts every such seed, those that blew up and those that did not learn; its
  ``not_learned`` counts the latter (``result.CellOutcome``), for the tables to show them apart.
  Under the delta rule a rate holds when, besides, its mean selection loss is within ``delta`` nats of
  the variant's own best rate; ``near_best`` is the highest rate at which the variant is within ``delta``
  of the best variant of its study, grid point and attention type.
* Paired differences: the group's report loss minus its reference's (the variant named by
  ``[protocol] reference`` for this attention type, same study and grid point), each at its own chosen
  rate, over the seeds both have.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qklab.study.result import CellOutcome, cell_outcome, load_result, num, read_json
from qklab.study.stats import Difference, Summary, describe, paired_difference

BySeed = dict[int, float]


@dataclass(frozen=True)
class RateOutcome:
    """One rate multiple of a group: what its cells reached over the seeds. ``diverged`` counts every seed
    whose loss ended above the unigram entropy, those that blew up and those that did not learn;
    ``not_learned`` the latter (``result.CellOutcome``)."""

    lr: float = math.nan
    n: int = 0  # cells
    diverged: int = 0
    not_learned: int = 0
    failed: int = 0
    select: Summary = Summary()  # final selection-split loss of the seeds that did not diverge
    select_all: Summary = Summary()  # of every finished seed (the stability table)
    max_logit: Summary = Summary()
    max_logit_by_seed: BySeed = field(default_factory=dict)
    spikes: int = 0
    late_drop: Summary = Summary()  # how far the selection loss still fell over the last evaluation interval
    late_steps: list[int] | None = None  # the last evaluation interval


@dataclass(frozen=True)
class Group:
    """One variant at one grid point of one study: its cells by rate multiple and seed, the rate chosen on the
    selection split, the report-split numbers at that rate, and the paired differences to its reference.
    Built once by ``analyze`` and never changed after."""

    study: str
    variant: str
    point: str = ""  # the grid point's label
    attention: str = "mha"  # or "mla"
    method: str | None = "none"  # forward-side, with the model flags that change attention ("none+gate-head")
    controller: str | None = "none"  # optimizer-side ("muon-per-head-qk": per-head Muon on W_Q and W_K)
    qk_options: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"quack": {"tau": 0.1, ...}}
    seq_len: int | None = None
    d_model: int | None = None
    n_params: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool = True
    n_cells: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)  # {"cell", "failure", "log"} of each failed cell
    sweep: dict[float, RateOutcome] = field(default_factory=dict)  # rate multiple -> its seeds' outcomes
    grid: tuple[float, ...] = ()  # the rate multiples its study registered for it (() where none is recorded)
    cells: dict[float, list[dict[str, Any]]] = field(default_factory=dict)  # rate multiple -> its cells' files
    chosen: float | None = None  # the chosen rate multiple (None: no rate eligible)
    chosen_lr: float | None = None
    highest_stable: float | None = None  # the highest rate with no diverged seed
    at_chosen: dict[str, BySeed] = field(default_factory=dict)  # metric -> seed -> value at the chosen rate
    stats: dict[str, Summary] = field(default_factory=dict)  # metric -> its description over those seeds
    curves: list[dict[str, Any]] = field(default_factory=list)  # of the cells at the chosen rate
    heads: list[dict[str, Any]] = field(default_factory=list)
    head_series: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (seed, series) there
    probe_by_seed: dict[int, dict[str, Any]] = field(default_factory=dict)
    unigram_entropy: float = math.nan
    order: int = 0  # the variant's place in its study file
    reference: str | None = None  # the variant it is paired with
    paired: dict[str, Difference] = field(default_factory=dict)  # metric -> paired difference to it
    stable: dict[str, Any] = field(default_factory=dict)  # the highest holding rate by each rule (stability)
    multi: bool = False  # one of several studies in a report: named with its study
    # key -> rate multiple -> seed -> final[key] of every finished cell, read from the result files when
    # first asked (sensitivity.grid_final): a memo of what the files hold, not a change of the group
    grid_final: dict[str, dict[float, dict[int, float]]] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Analysis:
    groups: list[Group]
    studies: dict[str, dict[str, Any]]
    n_results: int


def grid_edge(mult: float, sweep: dict) -> str:
    """", top of grid" / ", bottom of grid" for a chosen rate at an end of its variant's grid (of 3 rates or
    more: its optimum may lie beyond); "" else."""
    if len(sweep) < 3:
        return ""
    return ", top of grid" if mult == max(sweep) else ", bottom of grid" if mult == min(sweep) else ""


def study_problem(s: Any) -> str | None:
    """None for a usable ``study.json``; otherwise what is wrong with it, in a few words."""
    if not isinstance(s, dict):
        return f"a JSON {type(s).__name__}, not a study object"
    if not isinstance(s.get("name"), str) or not s["name"]:
        return "no study name"
    kinds = {"protocol": dict, "variants": dict, "cells": list, "seeds": list}
    bad = [k for k, t in kinds.items() if s.get(k) is not None and not isinstance(s[k], t)]
    ref = s.get("protocol", {}).get("reference") if isinstance(s.get("protocol"), dict) else None
    if ref is not None and not isinstance(ref, str | dict):
        bad.append("protocol.reference")
    if isinstance(s.get("cells"), list) and not all(isinstance(c, str) for c in s["cells"]):
        bad.append("cells")
    return f"{', '.join(bad)} of the wrong type" if bad else None


def load_results(dirs: list[str | Path], problems: list[str] | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Every ``result.json`` under the given folders, and every ``study.json`` (name -> study).

    A damaged file (not UTF-8, not JSON, not an object, missing fields) is skipped and named in
    ``problems``. A cell is its study, cell id and config hash: a file found twice (the same folder given
    twice, a folder and its parent) is read once, and a copy of a cell already read (another folder) is
    counted once and named in ``problems``; so is a second result of the same cell with another hash."""
    problems = [] if problems is None else problems
    results, studies = [], {}
    seen_files: set[Path] = set()
    seen_cells: dict[tuple, tuple[Path, Any]] = {}  # (study, cell) -> (file, hash)
    folders = []
    for d in dirs:
        d = Path(d)
        if d.resolve() not in folders:
            folders.append(d.resolve())
    for d in dirs:
        d = Path(d)
        for p in sorted(d.rglob("study.json")):
            if p.resolve() in seen_files:
                continue
            seen_files.add(p.resolve())
            s, problem = read_json(p)
            problem = problem or study_problem(s)
            if problem:
                problems.append(f"{p}: damaged study file ({problem}); skipped")
            else:
                studies.setdefault(s["name"], s)
        for p in sorted(d.rglob("result.json")):
            if p.resolve() in seen_files:  # the same file through overlapping folders
                continue
            seen_files.add(p.resolve())
            r, problem = load_result(p)
            if problem:
                problems.append(f"damaged result file {problem}; skipped")
                continue
            if r is None:
                continue
            key = (r.get("study", ""), r["cell"])
            if key in seen_cells:
                first, h = seen_cells[key]
                what = "a copy of" if h == r.get("cell_hash") else "another config's result of"
                problems.append(f"{p}: {what} cell {key[1]} of study {key[0] or '?'} (already read from {first}); "
                                "counted once")
                continue
            seen_cells[key] = (p, r.get("cell_hash"))
            results.append({**r, "_path": str(p)})  # where it was read: the report links numbers to it
    return results, studies


def _late_drop(cell: dict) -> float:
    """How far the selection loss still fell over the last evaluation interval (the one before the last
    value minus the last; > 0: still falling at the end), NaN with fewer than two evaluations."""
    v = (cell.get("curves") or {}).get("val") or {}
    ys = v.get("val_loss") or []
    return num(ys[-2]) - num(ys[-1]) if len(ys) >= 2 else float("nan")


def _late_steps(cells: list[dict]) -> list[int] | None:
    """[first, last] step of the last evaluation interval (of the first cell with two evaluations)."""
    for c in cells:
        st = ((c.get("curves") or {}).get("val") or {}).get("step") or []
        if len(st) >= 2:
            return [int(st[-2]), int(st[-1])]
    return None


def select_rate(select: Mapping[float, list[float]], eligible: Mapping[float, bool]) -> float | None:
    """The eligible rate multiple with the lowest mean selection loss (ties: the lower rate)."""
    best = None
    for m in sorted(select):
        xs = select[m]
        if not eligible.get(m) or not xs or not all(math.isfinite(x) for x in xs):
            continue
        mean = sum(xs) / len(xs)
        if best is None or mean < best[1]:
            best = (m, mean)
    return None if best is None else best[0]


def _point_label(point: dict[str, Any]) -> str:
    """A grid point as a short label: {"shape": {"model.d_model": 64, "model.n_heads": 1}} -> "d_model=64,
    n_heads=1"; {"model.d_model": 64} -> "d_model=64" (each config key by its last part)."""
    items = []
    for k, v in sorted(point.items()):
        items += sorted(v.items()) if isinstance(v, dict) else [(k, v)]
    return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in items)


def natural_key(s: str) -> list:
    """Sort key that orders the numbers in a label by value (d_model=64 before d_model=128)."""
    return [(0, float(t), "") if t[:1].isdigit() else (1, 0.0, t) for t in re.split(r"(\d+(?:\.\d+)?)", s) if t]


def _key(r: dict) -> tuple[str, str, str]:
    return r.get("study", ""), r["variant"], _point_label(r.get("point", {}))


DELTA = 0.1  # nats: the delta rule's default (a study's registered plan may set its own)


def _mean_select(s: RateOutcome) -> float:
    m = s.select.mean if s.diverged == 0 and s.n > s.failed else float("nan")
    return m if m is not None else float("nan")


def best_select(g: Group) -> float:
    """The lowest mean selection loss over the variant's rates with no diverged seed (NaN: none)."""
    xs = [x for x in map(_mean_select, g.sweep.values()) if math.isfinite(x)]
    return min(xs) if xs else float("nan")


def highest_within(g: Group, delta: float, best: float | None = None) -> float | None:
    """The highest rate with no diverged seed whose mean selection loss is within ``delta`` of ``best``
    (default: the variant's own best), or None."""
    best = best_select(g) if best is None else best
    ok = [m for m, s in g.sweep.items() if math.isfinite(_mean_select(s)) and _mean_select(s) <= best + delta]
    return max(ok) if ok else None


def place(g: Group) -> tuple[str, str, str]:
    """Where a group's variants compete: its study, grid point and attention type."""
    return g.study, g.point, g.attention


def best_by_place(groups: list[Group]) -> dict[tuple, float]:
    """place -> the lowest best_select of its groups (places where no group holds anywhere are absent)."""
    best: dict[tuple, float] = {}
    for g in groups:
        if math.isfinite(b := best_select(g)):
            best[place(g)] = min(best.get(place(g), math.inf), b)
    return best


def stability(groups: list[Group], delta: float = DELTA) -> list[Group]:
    """The groups with their ``stable``: the highest holding rate by the entropy rule and by the delta rule,
    and ``near_best``, the highest rate within delta of the best variant at its place (study, point,
    attention)."""
    best = best_by_place(groups)
    return [replace(g, stable={"entropy": g.highest_stable, "delta": highest_within(g, delta), "delta_value": delta,
                               "near_best": highest_within(g, delta, b) if (b := best.get(place(g))) is not None
                               else None}) for g in groups]


def analyze(results: list[dict], studies: dict[str, dict], delta: float = DELTA) -> Analysis:
    """Groups with their rate sweep, chosen rate, report statistics and paired differences."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        cells[_key(r)].append(r)
    base = {key: _group(key, rs) for key, rs in cells.items()}
    groups = []
    for (study, _, point), g in base.items():
        names = list(studies.get(study, {}).get("variants", {}))
        ref = _reference(studies.get(study, {}), g.attention)
        rg = base.get((study, ref, point)) if ref else None
        paired = {}
        if rg is not None and rg is not g and g.chosen is not None and rg.chosen is not None:
            paired = {metric: paired_difference(g.at_chosen[metric], rg.at_chosen[metric])
                      for metric in ("report_loss", "train_loss", "max_logit", "first_token")}
        groups.append(replace(g, order=names.index(g.variant) if g.variant in names else len(names), reference=ref,
                              paired=paired, multi=len(studies) > 1,
                              grid=_registered_grid(studies.get(study, {}), g.variant)))
    ordered = sorted(groups, key=lambda g: (g.study, natural_key(g.point), g.attention, g.order))
    return Analysis(stability(ordered, delta), studies, len(results))


def _registered_grid(study: dict, variant: str) -> tuple[float, ...]:
    """The rate multiples a study's protocol registered for a variant (its own ``lr_mults_for`` entry, else
    ``lr_mults``); () where the study.json records none."""
    p = study.get("protocol", {})
    own = p.get("lr_mults_for") or {}
    mults = own[variant] if own.get(variant) else p.get("lr_mults")
    return tuple(sorted(float(m) for m in mults)) if mults else ()


def _reference(study: dict, attention: str) -> str | None:
    ref = study.get("protocol", {}).get("reference", {})
    if isinstance(ref, str):
        return ref
    return ref.get(attention, ref.get("*"))



def _method(method: str | None, model: dict[str, Any]) -> str | None:
    """The forward-side method a group stands for, with the model flags that change attention: a gated
    or sink variant of Standard attention is not Standard attention ("none+gate-head", "none+sink")."""
    flags = [f"gate-{model['attn_gate']}"] if model.get("attn_gate", "none") != "none" else []
    flags += ["sink"] if model.get("attn_sink") else []
    return "+".join([method, *flags]) if method is not None and flags else method

def _controller(controller: str | None, train: dict[str, Any]) -> str | None:
    """The optimizer-side intervention a group stands for: per-head Muon on W_Q and W_K
    (``train.muon_per_head``) changes the Q/K updates, so a run under it is not the plain reference even
    with no controller ("muon-per-head-qk"; on a controller: "compositional+muon-per-head-qk")."""
    per_head = train.get("muon_per_head", "none")
    if controller is None or train.get("optimizer") != "muon" or per_head == "none":
        return controller
    tag = f"muon-per-head-{per_head}"
    return tag if controller == "none" else f"{controller}+{tag}"


def _group(key: tuple, rs: list[dict]) -> Group:
    study, variant, point = key
    ok = [r for r in rs if r["status"] != "failed"]
    first = ok[0] if ok else rs[0]
    by_mult: dict[float, list[dict]] = defaultdict(list)
    for r in rs:
        by_mult[float(r["lr_mult"])].append(r)
    sweep, select, eligible = {}, {}, {}
    for m, cs in sorted(by_mult.items()):
        fin = [c for c in cs if c["status"] != "failed"]
        div = [c for c in fin if c["diverged"]]
        select[m] = [num(c["final"]["val_loss"]) for c in fin]
        eligible[m] = bool(fin) and not div and len(fin) == len(cs)
        sweep[m] = RateOutcome(
            lr=num(fin[0]["lr"]) if fin else float("nan"), n=len(cs), diverged=len(div),
            not_learned=sum(cell_outcome(c) is CellOutcome.NOT_LEARNED for c in div), failed=len(cs) - len(fin),
            select=describe([x for c, x in zip(fin, select[m], strict=True) if not c["diverged"]]),
            select_all=describe(select[m]), max_logit=describe([num(c["final"].get("max_logit")) for c in fin]),
            max_logit_by_seed={c["seed"]: num(c["final"].get("max_logit")) for c in fin},
            spikes=sum(int(c.get("spikes") or 0) for c in fin),
            late_drop=describe([_late_drop(c) for c in fin if not c["diverged"]]), late_steps=_late_steps(fin))
    chosen = select_rate(select, eligible)
    cells = {m: [{"seed": c["seed"], "cell": c["cell"], "path": c.get("_path")} for c in cs]
             for m, cs in sorted(by_mult.items())}
    stable = [m for m, s in sweep.items() if s.diverged == 0 and s.n > s.failed]
    at: dict[str, dict[int, float]] = {k: {} for k in ("report_loss", "val_loss", "train_loss", "max_logit",
                                                        "first_token", "logit_change", "tokens_per_s",
                                                        "cpu_seconds")}
    chosen_cells = [c for c in by_mult.get(chosen, []) if c["status"] != "failed"] if chosen is not None else []
    for c in chosen_cells:  # the report split is read here, after the choice, at the chosen rate only
        f = c["final"]
        for k in ("report_loss", "val_loss", "train_loss", "max_logit", "first_token", "logit_change"):
            at[k][c["seed"]] = num(f.get(k))
        at["tokens_per_s"][c["seed"]] = num(c.get("tokens_per_s"))
        at["cpu_seconds"][c["seed"]] = num(c.get("cpu_seconds"))
    cfg = first.get("config", {})
    return Group(
        study=study, variant=variant, point=point,
        attention=first.get("attention", cfg.get("model", {}).get("attention", "mha")),
        method=_method(first.get("method"), cfg.get("model", {})),
        controller=_controller(first.get("controller"), cfg.get("train", {})),
        qk_options=cfg.get("qk", {}).get("options", {}),
        seq_len=cfg.get("train", {}).get("seq_len"), d_model=cfg.get("model", {}).get("d_model"),
        n_params=first.get("n_params"), vocab_size=cfg.get("model", {}).get("vocab_size"),
        tie_embeddings=cfg.get("model", {}).get("tie_embeddings", True), n_cells=len(rs),
        failed=[{"cell": r["cell"], "failure": r.get("failure"), "log": r.get("log")}
                for r in rs if r["status"] == "failed"],
        sweep=sweep, cells=cells, chosen=chosen, chosen_lr=sweep[chosen].lr if chosen is not None else None,
        highest_stable=max(stable) if stable else None, at_chosen=at,
        stats={k: describe(list(v.values())) for k, v in at.items()},
        curves=[c["curves"] for c in chosen_cells], heads=[c.get("heads", {}) for c in chosen_cells],
        head_series=[(c["seed"], c["head_series"]) for c in chosen_cells if c.get("head_series")],
        probe_by_seed={c["seed"]: c["probe"] for c in chosen_cells if c.get("probe")},
        unigram_entropy=num(first.get("unigram_entropy")))
