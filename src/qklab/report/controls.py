"""Positive controls: a registered check that a study's task is learned at all, read before its claims.

A control claim (kind "control", ``study.plan``) holds when the mean over seeds of a probe measure of one
method at its tuned rate (selection split) reaches the registered threshold: for ``control.retrieval_learned``
`none`'s retrieval accuracy at the registered context (0: the training length). When a study's registered
control fails, or cannot be read, every other claim that study registered is **not measurable** (the
control's reason given): a comparison of attention on the evidence between models that do not retrieve says
nothing about whether a method helps them find it. Its Holm adjustment is left as computed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qklab.study.plan import CATALOGUE
from qklab.study.stats import difference_stats, fmt_ci

HOLDS, FAILS = "holds", "fails"


def _accuracy(probe: dict[str, Any], context: int) -> float | None:
    """The retrieval accuracy of a cell's probe: at the training length (context 0) or at ``context`` tokens."""
    if not context:
        v = (probe.get("summary") or {}).get("retrieval_accuracy")
    else:
        v = next((r.get("accuracy") for r in probe.get("retrieval") or [] if int(r["length"]) == context), None)
    return None if v is None or not math.isfinite(float(v)) else float(v)


def accuracy_control(method: tuple[str, str, str]) -> Any:
    """The control: ``method`` (attention, method, controller) reaches the threshold of retrieval accuracy,
    mean over seeds at its tuned rate. -> test(groups, params) -> (verdict, measured, reason, None, cells)."""
    def test(groups: list[dict], p: dict) -> tuple:
        att, meth, ctrl = method
        gs = sorted((g for g in groups if (g["attention"], g["method"], g["controller"]) == method
                     and g["chosen"] is not None), key=lambda g: g["sweep"][g["chosen"]]["select"]["mean"])
        if not gs:
            return "not measurable", "-", f"no finished cells of {att.upper()} {meth} in these results", None, []
        g = gs[0]
        context, threshold = int(p.get("context", 0) or 0), float(p["threshold"])
        accs = {s: a for s, pr in g["probe_by_seed"].items() if (a := _accuracy(pr, context)) is not None}
        cells = [c["path"] for c in g.get("cells", {}).get(g["chosen"], []) if c.get("path")]
        where = f"{context} tokens" if context else "the training length"
        if not accs:
            return "not measurable", "-", f"the probes have no retrieval accuracy at {where}", None, cells
        vals = np.array(list(accs.values()))
        st = difference_stats(list(vals))
        meas = (f"{g['variant']} at x{g['chosen']:g}: mean accuracy {vals.mean():.3f}"
                + (f", 95% CI {fmt_ci(st['ci_lo'], st['ci_hi'])}" if len(vals) > 1 else "")
                + f", seeds from {vals.min():.3f} to {vals.max():.3f}, n={len(vals)}")
        if vals.mean() >= threshold:
            return HOLDS, meas, f"the mean accuracy at {where} is at least {threshold:g}", None, cells
        return FAILS, meas, f"the mean accuracy at {where} is below {threshold:g}", None, cells
    return test


def scope(p: dict) -> tuple[str, str]:
    """(what a control shows, what it does not)."""
    return ("Whether the task is learned at all: the mean over seeds at the tuned rate against the threshold.",
            "It tests no method against another; it decides whether the study's claims can be read.")


def _is_control(r: dict[str, Any]) -> bool:
    return CATALOGUE[r["id"]][1] == "control"


def gate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every confirmatory row of a study whose registered control does not hold: not measurable."""
    failed = {r["study"]: f"the registered positive control did not hold ({r['claim']}: {r['measured']}; "
                          f"{r['reason']}), so the claim cannot be read on these models"
              for r in rows if _is_control(r) and r["status"] == "confirmatory" and r["verdict"] != HOLDS}
    for r in rows:
        if r["study"] in failed and r["status"] == "confirmatory" and not _is_control(r):
            r["verdict"], r["reason"] = "not measurable", failed[r["study"]]
    return rows
