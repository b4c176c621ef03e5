"""Which qklab this is: the package version, and the git commit where qklab runs from a checkout.

Kept free of torch so that ``qklab --version`` answers at once.
"""

from __future__ import annotations

import subprocess
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


def version_line() -> str:
    """``qklab 0.1.0 (git 54a9e63...)``, or ``qklab 0.1.0`` where the commit is not known."""
    sha = git_sha()
    return f"qklab {__version__}" + ("" if sha == "unknown" else f" (git {sha})")
