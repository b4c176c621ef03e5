"""Every error qklab raises for something the user can fix: one line, printed without a traceback, exit 2.

    UserError
        ConfigError       a config value, a study file, a command-line option (config/, study/)
            ProbeError    a bad option or input of ``qklab probe``
            ReportError   nothing to report
        DataError         the data settings or the data itself (data/)
            CorpusMissing a corpus this machine has not installed (``make corpus``)
        CheckpointError   a checkpoint that cannot be used: damaged, incomplete, not this model's (rundir/)
            UnsafeCheckpoint  one whose pickles need code qklab does not load (rundir/, parallel/dcp_read.py)
        RunFolderError    a path that is no run folder or checkpoint, or a run that does not load (rundir/)
        RunLockError      another process is writing this run folder (rundir/)

What is not here is not the user's: a non-finite stop (``diagnostics.stability.NonFiniteError``, exit 1),
a signal (``train.signals.RunInterrupted``, exit 128 + N), and anything else, which is a bug in qklab.

Under a launcher (torchrun) every process exits 2 on such an error, and rank 0 prints its line. Another rank
prints its own, marked ``(rank N)``, unless the error is known to be rank 0's too (``alike``): compared at an
agreement (``parallel.context.DistContext.agree``), or one that the command line alone decides, which every
process one launcher started hits alike. A collective that fails on one process because another is gone
(``parallel.context.peer_lost``: it stopped on its own error, which it printed, or was killed) is a stop,
exit 1, said once by the first survivor to get there (``parallel.context.first_to_say``; rank 0 may be the
one lost), and no bug.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake or a damaged input the user can fix; the message is one line."""


class ConfigError(UserError, ValueError):
    """A user mistake in a config; the message is one line, printed without a traceback."""


class ProbeError(ConfigError):
    """Bad input to ``qklab probe``."""


class ReportError(ConfigError):
    """Nothing to report (no result files)."""


class DataError(UserError, ValueError):
    """A problem with the data settings or the data itself, explained in one line."""


class CorpusMissing(DataError):
    """A corpus that is not installed on this machine: a study stops before its first cell instead of
    recording every cell on it as failed."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used (damaged, incomplete, or not matching the model)."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file whose pickle names globals (functions, classes) qklab does not unpickle: refused
    before any of it is built, and never taken for damage (nothing older is tried in its place)."""

    @classmethod
    def needing(cls, ckpt: object, file: str, names: list[str]) -> UnsafeCheckpoint:
        """The refusal of the checkpoint ``ckpt`` (a folder) whose ``file`` names the globals ``names``."""
        return cls(f"checkpoint {ckpt}: {file} needs {', '.join(names)}, which qklab does not load "
                   "(a checkpoint from elsewhere?); refused, nothing of it was run")


class RunFolderError(UserError):
    """A path that is no run folder or checkpoint, or a run whose config or weights do not load."""


class RunLockError(UserError):
    """Another process is writing this run folder; ``holder`` is its pid as the lock file names it."""

    def __init__(self, msg: str, holder: str = "unknown") -> None:
        super().__init__(msg)
        self.holder = holder


RANK_0_SAYS = "rank 0 says it"  # rank 0 raised this same error (compared), or names the rank that failed
LOCAL_RANK_0_SAYS = "local rank 0 says it"  # decided by the command line and its files alone (the config)


def alike(e: BaseException, how: str) -> BaseException:
    """Mark ``e`` as one that another process of a launched run prints (``RANK_0_SAYS``, ``LOCAL_RANK_0_SAYS``);
    returns ``e``."""
    e.qklab_alike = how  # type: ignore[attr-defined]
    return e


def alike_how(e: BaseException) -> str | None:
    """What ``alike`` marked ``e`` with; None: not known to be any other process's error."""
    return getattr(e, "qklab_alike", None)
