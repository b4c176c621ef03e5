"""The fault-injection suite ends with one summary line: faults injected, runs recovered, data lost."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from qklab.cli import main
from tests.faults.common import LEDGER, STEPS, sets


@pytest.fixture(scope="session")
def faults_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def reference(faults_root) -> Path:
    """An uninterrupted run: what every recovered run must equal, step by step and bit by bit."""
    root = faults_root / "reference"
    assert main(["train", "--config", "tiny", *sets(root, "ref")]) == 0
    run = root / "runs" / "ref"
    assert (run / "ckpt" / f"step_{STEPS:07d}").is_dir()
    return run


_COUNT = itertools.count()


@pytest.fixture
def root(faults_root) -> Path:
    """A fresh folder per test, sharing the token cache of the session."""
    path = faults_root / f"t{next(_COUNT):03d}"
    path.mkdir()
    return path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if LEDGER.injected or LEDGER.fuzzed:
        terminalreporter.write_line(LEDGER.line())
