"""Stability of a run (docs/diagnostics.md): loss spikes and divergence.

* spike: a loss more than ``sigma`` (6) population standard deviations above the mean of the previous
  ``window`` (128) finite losses; no verdict before ``min_history`` (16) losses are in the window.
* diverged: a loss was non-finite (or a non-finite step was recorded), or the last logged loss exceeds
  the first.

The stable rates of a learning-rate sweep are read from a study's results (``qklab.study.analyze`` and the
report's stability tables), not from one run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

SPIKE_WINDOW = 128
SPIKE_SIGMA = 6.0
SPIKE_MIN_HISTORY = 16


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss, gradient or weight and stopped (train.nonfinite=stop)."""


class SpikeDetector:
    """Feed one loss per step; ``update`` returns the spike's details, or None."""

    def __init__(self, window: int = SPIKE_WINDOW, sigma: float = SPIKE_SIGMA,
                 min_history: int = SPIKE_MIN_HISTORY) -> None:
        self.window, self.sigma, self.min_history = window, sigma, min_history
        self._hist: deque[float] = deque(maxlen=window)

    def update(self, loss: float) -> dict[str, float] | None:
        loss = float(loss)
        if not math.isfinite(loss):
            return None  # non-finite steps are handled by the non-finite policy, not counted here
        spike = None
        if len(self._hist) >= self.min_history:
            n = len(self._hist)
            mean = sum(self._hist) / n
            std = math.sqrt(sum((v - mean) ** 2 for v in self._hist) / n)
            if loss > mean + self.sigma * std and loss > mean:
                spike = {"loss": loss, "window_mean": mean, "window_std": std,
                         "sigmas": (loss - mean) / std if std > 0 else math.inf}
        self._hist.append(loss)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._hist)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._hist = deque(state.get("history", []), maxlen=self.window)


def find_spikes(losses: Iterable[tuple[int, float]], window: int = SPIKE_WINDOW, sigma: float = SPIKE_SIGMA,
                min_history: int = SPIKE_MIN_HISTORY) -> list[int]:
    """Steps of the spikes in a sequence of (step, loss); use every step's loss for the 128-step window."""
    det = SpikeDetector(window, sigma, min_history)
    return [step for step, loss in losses if det.update(loss) is not None]


def _losses(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["loss"])) for r in records if "loss" in r]  # "nan"/"inf" strings parse


def diverged(records: list[Mapping[str, Any]]) -> bool:
    """Item 7 on the records of metrics.jsonl (qklab.rundir.metrics.read_metrics)."""
    if any(str(r.get("event", "")).startswith("nonfinite") for r in records):
        return True
    vals = [v for _, v in _losses(records)]
    if not vals:
        return False
    return any(not math.isfinite(v) for v in vals) or vals[-1] > vals[0]


def stability_summary(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Diverged or not, spike steps (recorded events, else recomputed from the logged losses),
    non-finite steps."""
    events = [r for r in records if "event" in r]
    spikes = [int(r["step"]) for r in events if r["event"] == "loss_spike"]
    if not spikes:
        spikes = find_spikes(_losses(records))
    return {"diverged": diverged(records), "spikes": spikes,
            "nonfinite_steps": [int(r["step"]) for r in events if str(r["event"]).startswith("nonfinite")]}
