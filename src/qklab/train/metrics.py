"""One function records metrics: ``MetricsLog.log(step, **values)`` appends a JSON line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


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


class MetricsLog:
    def __init__(self, path: Path, truncate_after: int | None = None) -> None:
        """Open ``path`` for appending. On resume, ``truncate_after`` drops records logged after the
        checkpoint step, so the file reads as if the run had never been interrupted."""
        self.path = path
        if truncate_after is not None and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= truncate_after]
            path.write_text("".join(ln + "\n" for ln in keep))
        self._f = open(path, "a")

    def log(self, step: int, **values: Any) -> None:
        rec = {"step": step, "time": round(time.time(), 3), **_clean(values)}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
