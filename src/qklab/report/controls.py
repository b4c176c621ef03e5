"""Positive controls: a registered check that a study's task is learned at all, read before its claims.

A control claim (kind "control", ``study.catalogue``; measured by ``study.measures.accuracy_control``) holds
when the mean over seeds of a probe measure of one method at its tuned rate (selection split) reaches the
registered threshold: for ``control.retrieval_learned``
`none`'s retrieval accuracy at the registered context (0: the training length). When a study's registered
control fails, or cannot be read, every other claim that study registered is **not measurable** (the
control's reason given): a comparison of attention on the evidence between models that do not retrieve says
nothing about whether a method helps them find it. Its Holm adjustment is left as computed.
"""

from __future__ import annotations

from dataclasses import replace

from qklab.report.claim_row import ClaimRow
from qklab.study.catalogue import CATALOGUE
from qklab.study.measures import HOLDS, NOT_MEASURABLE


def scope(p: dict) -> tuple[str, str]:
    """(what a control shows, what it does not)."""
    return ("Whether the task is learned at all: the mean over seeds at the tuned rate against the threshold.",
            "It tests no method against another; it decides whether the study's claims can be read.")


def _is_control(r: ClaimRow) -> bool:
    return CATALOGUE[r.id].kind == "control"


def gate(rows: list[ClaimRow]) -> list[ClaimRow]:
    """Every confirmatory row of a study whose registered control does not hold: not measurable."""
    failed = {r.study: f"the registered positive control did not hold ({r.claim}: {r.measured}; "
                       f"{r.reason}), so the claim cannot be read on these models"
              for r in rows if _is_control(r) and r.status == "confirmatory" and r.verdict != HOLDS}
    return [replace(r, verdict=NOT_MEASURABLE, reason=failed[r.study])
            if r.study in failed and r.status == "confirmatory" and not _is_control(r) else r for r in rows]
