"""A reader that leaves: ``qklab ... | head`` closes stdout's pipe before qklab is done writing."""

from __future__ import annotations

import os
import signal
import sys


def closed_pipe() -> int:
    """The reader of stdout left (`qklab ... | head`): stop quietly, as a pipe's writer does (141)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    return 128 + signal.SIGPIPE
