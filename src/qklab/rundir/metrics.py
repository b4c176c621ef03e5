"""One function records metrics: ``MetricsLog.log(step, **values)`` appends a JSON line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from qklab.atomic import atomic_write_text


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def flat_scalars(rec: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of a (nested) record, keyed 'a/b'; 'step' and 'time' left out, lists skipped."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        key = f"{prefix}{k}"
        if not prefix and k in ("step", "time"):
            continue
        if isinstance(v, dict):
            out.update(flat_scalars(v, key + "/"))
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


class MetricsLog:
    def __init__(self, path: Path, truncate_after: int | None = None, trackers: list | None = None) -> None:
        """Open ``path`` for appending. On resume, ``truncate_after`` drops records logged after the
        checkpoint step, so the file reads as if the run had never been interrupted. The rewrite is atomic,
        and a line torn by a kill mid-write is dropped with the rest."""
        self.path = path
        if truncate_after is not None and path.exists():
            steps = [(ln, _step(ln)) for ln in path.read_text().splitlines()]
            keep = [ln for ln, s in steps if s is not None and s <= truncate_after]
            atomic_write_text(path, "".join(ln + "\n" for ln in keep))
        self._f = open(path, "a")
        self.trackers = trackers or []  # optional TensorBoard / W&B sinks (qklab.train.trackers)

    def log(self, step: int, **values: Any) -> None:
        rec = {"step": step, "time": round(time.time(), 3), **_clean(values)}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self.trackers:
            scalars = flat_scalars(rec)
            for t in self.trackers:
                t.log(step, scalars)

    def close(self) -> None:
        self._f.close()
        for t in self.trackers:
            t.close()


def _step(line: str) -> int | None:
    """The step of a record, None for a line that is not one (torn by a kill mid-write)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec.get("step") if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


TAIL_BYTES = 65536  # last_step's first read from the end of the file; doubled while no whole record is in it


def last_step(path: Path) -> int | None:
    """The step of the last whole record of a metrics.jsonl, None when it has none. Read from its end (a long
    run's file is large), and further back while the part read holds no whole record: a record with every
    head's diagnostics can outgrow any fixed tail, and half a record is none."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            tail = TAIL_BYTES
            while True:
                f.seek(max(0, size - tail))
                lines = f.read(tail).decode(errors="replace").splitlines()
                step = next((s for s in map(_step, reversed(lines)) if s is not None), None)
                if step is not None or tail >= size:
                    return step
                tail *= 2
    except OSError:
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records; a last line torn by a kill mid-write is left out (any other bad line raises)."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if lines and _step(lines[-1]) is None:
        lines.pop()
    return [json.loads(ln) for ln in lines]


class NoMetrics:
    """Metrics of a rank other than 0: rank 0 writes the one metrics.jsonl."""

    def log(self, step: int, **record: Any) -> None:
        pass

    def close(self) -> None:
        pass
