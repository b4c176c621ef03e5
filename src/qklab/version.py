"""Which qklab this is: the package version, and the git commit where qklab runs from a checkout.

Kept free of torch so that ``qklab --version`` answers at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qklab import __version__

_PACKAGE = Path(__file__).resolve().parent


def _checkout() -> Path | None:
    """The repository root when this package is its ``src/qklab`` (an editable install or PYTHONPATH=src);
    None for an installed wheel, even one inside some other repository (a user's project venv)."""
    root = _PACKAGE.parents[1]
    return root if _PACKAGE == root / "src" / "qklab" and (root / "pyproject.toml").is_file() else None


def git_sha() -> str:
    """HEAD of the checkout qklab runs from, with ``-dirty`` for uncommitted changes to tracked files;
    "unknown" for an installed wheel or without git."""
    root = _checkout()
    if root is None:
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


ALLOW_DIRTY_ENV = "QKLAB_ALLOW_DIRTY"  # "1": as --allow-dirty (scripts, test suites)


@dataclass(frozen=True)
class CodeVersion:
    """The code a process runs: the commit of its checkout and, when tracked files differ from it, their
    diff (``git diff HEAD``, binary-safe). ``commit`` is "unknown" outside a git checkout (a wheel)."""

    commit: str
    diff: bytes = b""
    root: Path | None = None

    @property
    def dirty(self) -> bool:
        return bool(self.diff)

    @property
    def diff_sha256(self) -> str | None:
        return hashlib.sha256(self.diff).hexdigest() if self.diff else None

    def record(self) -> dict[str, object]:
        """What result and study files hold: ``{"commit": ..., "dirty": bool, "diff_sha256": ... or None}``."""
        return {"commit": self.commit, "dirty": self.dirty, "diff_sha256": self.diff_sha256}


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)


def code_version(root: str | Path | None = None) -> CodeVersion:
    """The commit and uncommitted diff of tracked files of ``root`` (default: the checkout qklab is imported
    from); ``CodeVersion("unknown")`` for an installed wheel, a folder that is no git checkout, or without git."""
    root = Path(root) if root is not None else _checkout()
    if root is None:
        return CodeVersion("unknown")
    try:
        sha = _git(root, "rev-parse", "--verify", "HEAD")
        if sha.returncode != 0:
            return CodeVersion("unknown", root=root)
        # the same bytes whatever the user's git config: no external diff tools, colours or other prefixes
        diff = _git(root, "-c", "core.quotepath=on", "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff",
                    "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/", "--")
        if diff.returncode != 0:
            return CodeVersion("unknown", root=root)
        return CodeVersion(sha.stdout.decode().strip(), diff.stdout, root)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return CodeVersion("unknown", root=root)


def allow_dirty_env() -> bool:
    return os.environ.get(ALLOW_DIRTY_ENV, "") not in ("", "0")


def version_line() -> str:
    """``qklab 0.1.0 (git 54a9e63...)``, or ``qklab 0.1.0`` where the commit is not known."""
    sha = git_sha()
    return f"qklab {__version__}" + ("" if sha == "unknown" else f" (git {sha})")
