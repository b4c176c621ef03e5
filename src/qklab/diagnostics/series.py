"""Per-head time series over a run, read back from its ``metrics.jsonl``.

The trainer logs the per-head diagnostics (``diag``: max logit, logit change, first-token attention, ...)
every ``train.diag_every`` steps and at the last step, and an optimizer-side controller's per-head
factors (``QKController.head_series_prefix``: QuacK's ``quack_<name>``, one L x H list per logged step)
with the other step metrics. This
gathers them into one array per quantity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qklab.methods import HEAD_SERIES

DIAG_SERIES = ("max_logit", "logit_change", "first_token")
CONTROLLER_PREFIXES = tuple(HEAD_SERIES)


def _is_grid(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(r, list) for r in v)


def head_series(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """{name: {"steps": (S,), "values": (S, L, H)}} for the diagnostics of ``DIAG_SERIES`` and every
    per-head controller factor; empty when the file is missing or holds none."""
    from qklab.rundir.metrics import read_metrics

    p = Path(path)
    if not p.is_file():
        return {}
    rows: dict[str, list[tuple[int, list]]] = {}
    for rec in read_metrics(p):
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        diag = rec.get("diag") or {}
        for key in DIAG_SERIES:
            if _is_grid(diag.get(key)):
                rows.setdefault(key, []).append((step, diag[key]))
        for key, v in rec.items():
            if key.startswith(CONTROLLER_PREFIXES) and _is_grid(v):
                rows.setdefault(key, []).append((step, v))
    out = {}
    for key, pts in rows.items():
        shapes = {np.shape(v) for _, v in pts}
        if len(shapes) != 1:  # a run whose shape changed (should not happen) is left out, not mixed
            continue
        last = {}
        for step, v in pts:  # a resumed run may log a step twice: keep the last record
            last[step] = v
        steps = sorted(last)
        out[key] = {"steps": np.asarray(steps), "values": np.asarray([last[s] for s in steps], dtype=float)}
    return out
