"""Interleaved timing with a paired estimator, shared by the benchmarks.

On a shared or throttled machine the speed drifts by several percent over a minute, so a ratio of two
medians taken over different moments is noisy. Here every round times each variant once, back to
back (alternating the order), and the estimate is the median over rounds of the per-round ratio:
both variants of a round saw nearly the same machine, so the drift cancels. The interquartile range
of the per-round ratios is reported with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(
    fns: dict[str, Callable[[], None]], rounds: int, steps: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each fn, one entry per round; the order alternates between rounds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[k]()
            sync(device)
            times[k].append((time.perf_counter() - t0) / steps)
    return times


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """Median and quartiles over rounds of num[r] / den[r]."""
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"median": round(statistics.median(ratios), 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}
