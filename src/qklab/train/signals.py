"""SIGTERM and SIGINT end a run at the next step boundary, after a checkpoint.

Schedulers send SIGTERM before they kill a job, and Ctrl-C sends SIGINT. While ``StopSignals`` is
active the first of either only sets a flag; the training loop checks it after each step, writes a
checkpoint and raises ``RunInterrupted``. A second signal interrupts at once (KeyboardInterrupt): the
last checkpoint is intact either way, since checkpoints are written atomically. A process started with
SIGINT ignored (a background job, `nohup ... &`) keeps ignoring it, as Unix programs do; SIGTERM stops it.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType


class RunInterrupted(Exception):
    """A command stopped on a signal; ``exit_code`` is 128 + the signal number. ``checkpoint``: the one the
    training loop wrote before it stopped (None: stopped outside it, where the command says how to go on)."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
        self.checkpoint = checkpoint


class StopSignals:
    """Context manager: record SIGTERM/SIGINT instead of dying; ``received`` holds the first one's number."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.SIGNALS:
                if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                    continue  # started with Ctrl-C ignored (`nohup ... &`): keep ignoring it, as the shell asked
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _terminated(signum: int, _frame: FrameType | None) -> None:
    raise RunInterrupted(f"stopped by {signal.Signals(signum).name}", signum)


class TermRaises:
    """Context manager for a whole command: SIGTERM raises ``RunInterrupted`` (one line, exit 143) instead
    of killing the process silently. The training loop's ``StopSignals`` takes over while it runs."""

    def __enter__(self) -> TermRaises:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
