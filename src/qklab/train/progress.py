"""What a training run shows while it runs (``train.progress``): a live bar on a terminal only; without one
(a log file, a pipe, a batch job) a plain line at most once a minute instead of carriage-return bar updates.
It also keeps the tokens/s measured at each step whose loss was read, whose steady median the run reports."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from tqdm import tqdm

PROGRESS_EVERY_S = 60.0  # train.progress without a terminal: one progress line at most this often


class Progress:
    """The bar (or the line a minute) of one run() and its tokens/s readings; ``show`` False: nothing shown
    (train.progress off, or a data-parallel rank other than 0), the readings still kept."""

    def __init__(self, steps: int, step: int, name: str, show: bool) -> None:
        self.steps, self.show = steps, show
        self.live = show and (sys.stderr.isatty() or bool(os.environ.get("QKLAB_PROGRESS")))  # a bar on a terminal
        self.bar = tqdm(total=steps, initial=step, desc=name, disable=not self.live, dynamic_ncols=True, leave=True)
        self.noted = time.monotonic()  # without a terminal: a line a minute (at a logged step) instead of the bar
        self.rates: list[float] = []  # tokens/s at each step whose loss was read

    def update(self) -> None:
        """One step taken."""
        self.bar.update(1)

    def measured(self, step: int, loss: float, tokens_per_s: float) -> None:
        """A step whose loss was read: the bar's figures, or a line when a minute has passed without a bar."""
        self.rates.append(tokens_per_s)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        if self.show and not self.live and time.monotonic() - self.noted >= PROGRESS_EVERY_S:
            self.noted = time.monotonic()
            self.write(f"step {step}/{self.steps}: loss {loss:.3f}, {tokens_per_s:,.0f} tokens/s")

    def write(self, msg: str) -> None:
        """A line for the user printed above the bar, which it leaves whole."""
        self.bar.write(msg)

    def close(self) -> None:
        self.bar.close()

    def steady_tokens_per_s(self) -> float:
        """The median tokens/s past the first fifth of the readings (compilation and warm-up); 0 with none."""
        steady = self.rates[len(self.rates) // 5 :] or self.rates or [0.0]
        return float(np.median(steady))
