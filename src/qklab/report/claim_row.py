"""One row of the claims table (``report.claims.claims_table``), as the report's tables and sections read it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qklab.study.measures import ClaimStats


@dataclass(frozen=True)
class ClaimRow:
    """One claim of the claims table as these results read it. ``verdict_old``/``reason_old``: by the interval
    (or grid) rule alone; ``verdict``/``reason``: by VERDICT_RULE, with the family's Holm (``p_holm``) and BH
    (``q_bh``) adjustments; ``stats``: the paired statistics (None for a grid reading or nothing measured);
    ``cells``: the result files read; ``status``: "confirmatory" (registered) or "exploratory". Under an
    amended plan, ``amended`` and the verdict under the plan first registered."""

    id: str
    paper: str
    claim: str
    measurement: str
    measured: str = "-"
    verdict_old: str = ""
    reason_old: str = ""
    stats: ClaimStats | None = None
    params: dict[str, Any] = field(default_factory=dict)
    study: str | None = None
    family: str = ""
    alpha: float = 0.05  # the default level, claims.ALPHA
    status: str = "exploratory"
    cells: list[str] = field(default_factory=list)
    shows: str = ""
    not_shows: str = ""
    verdict: str = ""
    reason: str = ""
    p_holm: float = math.nan
    q_bh: float = math.nan
    also_registered_by: list[str] = field(default_factory=list)
    amended: bool = False
    verdict_registered: str | None = None
    reason_registered: str | None = None
    measured_registered: str | None = None
