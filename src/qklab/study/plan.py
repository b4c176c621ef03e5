"""Pre-registered claims: a study's ``[claims]`` table, its hash in ``study.json`` before the first cell
trains, and amendments made in the open.

    [claims]                          # defaults of every registered claim below
    alpha = 0.05                      # the test's level
    test = "sign-flip"                # exact sign-flip test over paired seeds (grid claims: "grid")
    delta = 0.1                       # nats: "stable" = within delta of the method's own best rate
    [claims."qkmap.val_vs_none"]      # a claim of the catalogue, by id, with its own keys
    family = "QK-MAP"                 # the family its p-value is corrected within (Holm)
    [claims."quack.stable_mha"]
    stable = "near-best"              # "entropy": no seed ends above the unigram entropy; "delta": besides,
                                      # within delta of the variant's own best; "near-best": within delta of
                                      # the best variant at that place

A plan is the claims it registers, each with every parameter filled in (the catalogue's defaults, the
table's, the claim's own): the measurement, the rate rule, the context, the margin, the test, alpha and
the family. Its hash is of those parameters. A study whose results folder already holds cells cannot
change its plan without ``qklab study amend FILE --why``, which keeps the old plan, the new one, the
reason and the time in ``study.json`` (``plan_history``); the report marks every verdict read under an
amended plan and gives it under both. Claims a study did not register are exploratory.

The design is registered with a plan: the base config, seeds, settings, grid, variants, protocol (the
rate grid among them) and the cells they make, as ``study.json`` records them. Once results are in, a
changed design (one more rate, a dropped seed) is refused like a changed plan, and ``study amend`` keeps
the old design and the new one in the same history; the report then reads the registered plan on the
cells of the registered design too. A study that registers no claims may change its design freely (its
report is exploratory).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from qklab.config import ConfigError, from_table
from qklab.study.catalogue import CATALOGUE, KINDS, SIGN_FLIP

TABLE_KEYS = {"alpha", "test", "delta", "stable", "rate"}  # [claims] scalars: defaults for the claims below


def _params(cid: str, values: dict[str, Any]) -> dict[str, Any]:
    """A registered claim's parameters, checked as its kind's fields declare them (types, ranges, choices);
    numbers as their field's type (``alpha = 1`` -> 0.05's float), so equal plans hash equal."""
    return dataclasses.asdict(from_table(KINDS[CATALOGUE[cid].kind], values, f"[claims.\"{cid}\"]"))


def parse_plan(raw: Any) -> dict[str, dict[str, Any]] | None:
    """The ``[claims]`` table -> {claim id: every parameter}, or None when the study registers nothing."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("[claims] must be a table: defaults (alpha, test, delta, stable) and one table per claim id")
    table = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    bad = set(table) - TABLE_KEYS
    if bad:
        raise ConfigError(f"[claims]: unknown key(s) {', '.join(sorted(bad))}; defaults are "
                          f"{', '.join(sorted(TABLE_KEYS))}, and each registered claim is a table [claims.\"<id>\"]")
    plan: dict[str, dict[str, Any]] = {}
    for cid, own in raw.items():
        if not isinstance(own, dict):
            continue
        if cid not in CATALOGUE:
            raise ConfigError(f"[claims.\"{cid}\"]: no such claim; claims: {', '.join(CATALOGUE)}")
        kind = CATALOGUE[cid].kind
        params = CATALOGUE[cid].params()
        unknown = set(own) - set(params)
        if unknown:
            raise ConfigError(f"[claims.\"{cid}\"]: unknown key(s) {', '.join(sorted(unknown))}; a {kind} claim takes "
                              f"{', '.join(params) or 'no keys'}")
        plan[cid] = _params(cid, {**params, **{k: v for k, v in table.items() if k in params}, **own})
    if not plan:
        raise ConfigError("[claims] registers no claim; add a table [claims.\"<id>\"] per claim, e.g. "
                          "[claims.\"qkmap.val_vs_none\"]")
    return plan


def plan_hash(plan: dict[str, dict[str, Any]] | None) -> str | None:
    return None if plan is None else hashlib.sha256(
        json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def describe_plan(plan: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The plan as written into study.json: each claim's parameters with its paper, text and measurement."""
    return {cid: {"paper": CATALOGUE[cid].paper, "claim": CATALOGUE[cid].text,
                  "measurement": CATALOGUE[cid].measurement, **p} for cid, p in plan.items()}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def registration(plan: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """study.json's ``plan`` entry for a plan registered now."""
    return {"sha256": plan_hash(plan), "registered": _now(), "claims": describe_plan(plan or {})}


def stored_plan(study_json: dict[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """The plan a study.json records (its parameters only), or None."""
    rec = (study_json or {}).get("plan")
    if not isinstance(rec, dict) or not isinstance(rec.get("claims"), dict):
        return None
    return {cid: {k: v for k, v in p.items() if k not in ("paper", "claim", "measurement")}
            for cid, p in rec["claims"].items() if isinstance(p, dict)}


def registered_plan(study_json: dict[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """The plan first on record (before any amendment), or None."""
    hist = (study_json or {}).get("plan_history")
    for entry in hist if isinstance(hist, list) else []:
        for rec in (entry.get("old"), entry.get("new")) if isinstance(entry, dict) else ():
            if isinstance(rec, dict):  # the earliest plan on record (a first amendment may register one)
                return stored_plan({"plan": rec})
    return stored_plan(study_json)


DESIGN_KEYS = ("config", "seeds", "set", "grid", "variants", "protocol", "cells")


def design(study_dict: dict[str, Any] | None) -> dict[str, Any]:
    """The design a study.json (or ``Study.to_dict()``, as JSON) records: the entries of DESIGN_KEYS it has."""
    return {k: (study_dict or {})[k] for k in DESIGN_KEYS if k in (study_dict or {})}


def design_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The design entries (DESIGN_KEYS) whose values differ; for a protocol, its own keys (``protocol.lr_mults``)."""
    out = []
    for k in DESIGN_KEYS:
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if k == "protocol" and isinstance(a, dict) and isinstance(b, dict):
            out += [f"protocol.{p}" for p in dict.fromkeys([*a, *b]) if a.get(p) != b.get(p)]
        else:
            out.append(k)
    return out


def registered_design(study_json: dict[str, Any] | None) -> dict[str, Any]:
    """The design first on record (before any amendment of it)."""
    hist = (study_json or {}).get("plan_history")
    for entry in hist if isinstance(hist, list) else []:
        rec = entry.get("design") if isinstance(entry, dict) else None
        if isinstance(rec, dict) and isinstance(rec.get("old"), dict):
            return rec["old"]
    return design(study_json)


def design_drift(study_json: dict[str, Any] | None, want: dict[str, Any], n_results: int) -> list[str]:
    """The design entries the study file (``want``: ``Study.to_dict()`` as JSON) changes against the ones
    study.json records, where that counts: after results are in, for a study that registered claims (no
    claims registered, no design recorded, or no result yet: [], the file's design holds, and cells of a
    changed config train again)."""
    old = design(study_json)
    if not old or n_results == 0 or stored_plan(study_json) is None:
        return []
    return design_changes(old, design(want))


def check_design(study_json: dict[str, Any] | None, want: dict[str, Any], n_results: int) -> None:
    """A ConfigError when ``design_drift`` finds a change."""
    changed = design_drift(study_json, want, n_results)
    if changed:
        raise ConfigError(f"the study file changes its design ({', '.join(changed)}) after {n_results} cell(s) of "
                          "results; record the change in the open with qklab study amend FILE --why \"...\" "
                          "(the report then reads the registered claims on the registered design's cells too)")


def family_power(plan: dict[str, dict[str, Any]] | None, n_seeds: int) -> list[str]:
    """One line per family of registered sign-flip claims that ``n_seeds`` paired seeds cannot resolve: with
    n seeds the smallest two-sided sign-flip p is 2 / 2^n, and Holm's step-down multiplies the smallest p
    of a family of m by m, so no outcome is significant unless 2 / 2^n * m < alpha."""
    fams: dict[str, list[float]] = {}
    for p in (plan or {}).values():
        if p.get("test") == SIGN_FLIP:
            fams.setdefault(p["family"], []).append(p["alpha"])
    out = []
    for fam, alphas in fams.items():
        m, alpha = len(alphas), min(alphas)
        need = next(n for n in range(1, 64) if 2 / 2 ** n * m < alpha)
        if n_seeds < need:
            out.append(f"family {fam}: {m} registered sign-flip claim(s) at alpha {alpha:g} need {need} paired seeds "
                       f"to be resolvable after Holm's correction; the study has {n_seeds}, so they will read "
                       "'underpowered' or 'inconclusive' whatever the results")
    return out


def check_plan(study_json: dict[str, Any] | None, plan: dict[str, dict[str, Any]] | None, n_results: int) -> str:
    """What the runner does with the file's plan: "same", "register" (nothing recorded yet, or no cell has
    trained) or a ConfigError when the plan would change after results are in."""
    old = plan_hash(stored_plan(study_json))
    new = plan_hash(plan)
    if old == new:
        return "same"
    if n_results == 0:
        return "register"
    what = ("registers claims" if old is None else "changes its registered claims" if new
            else "drops its registered claims")
    raise ConfigError(f"the study file {what} after {n_results} cell(s) of results; record the change in the open with "
                      "qklab study amend FILE --why \"...\" (the report then shows the verdicts under both plans)")


def amend(study_json: dict[str, Any], plan: dict[str, dict[str, Any]] | None, why: str,
          new_design: dict[str, Any] | None = None) -> dict[str, Any]:
    """study.json with ``plan`` replacing the recorded one, and ``new_design`` (``Study.to_dict()`` as JSON;
    None: the design stays) the recorded design; the old plan, the new one, the reason, the time and a
    changed design's old and new entries appended to ``plan_history``."""
    if not isinstance(why, str) or not why.strip():
        raise ConfigError("amend: --why must say why the plan changes, e.g. --why \"the grid moved up one step\"")
    old_design = design(study_json)
    moved = new_design is not None and bool(design_changes(old_design, design(new_design)))
    same_plan = plan_hash(stored_plan(study_json)) == plan_hash(plan)
    if same_plan and not moved:
        raise ConfigError("amend: the study file's claims and design are the registered ones; nothing to amend")
    out = copy.deepcopy(study_json)
    old = out.get("plan")
    new = old if same_plan else registration(plan) if plan is not None else None
    entry: dict[str, Any] = {"at": _now(), "why": why.strip(), "old": old, "new": new}
    if moved:
        entry["design"] = {"old": old_design, "new": design(new_design),
                           "changed": design_changes(old_design, design(new_design))}
        out.update(design(new_design))
    hist = out.get("plan_history") if isinstance(out.get("plan_history"), list) else []
    out["plan_history"] = [*hist, entry]
    out["plan"] = new
    return out
