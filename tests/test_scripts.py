"""scripts/run_studies.sh: studies in turn; failed cells (exit 1) do not hold up the next study, a stopped
or refused one (any other non-zero exit) ends the chain. run_study.sh is replaced by a stub that logs its
study and exits with the code planted for it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
echo "$1" >> "$LOG"
code=$(sed -n "s/^$1=//p" "$CODES")
exit "${code:-0}"
"""


def _chain(tmp_path: Path, codes: dict[str, int], studies: list[str]) -> tuple[int, list[str], str]:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(ROOT / "scripts" / "run_studies.sh", scripts)
    (scripts / "run_study.sh").write_text(STUB)
    (scripts / "run_study.sh").chmod(0o755)
    (tmp_path / "codes").write_text("".join(f"{k}={v}\n" for k, v in codes.items()))
    log = tmp_path / "log"
    p = subprocess.run(["bash", str(scripts / "run_studies.sh"), *studies], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "LOG": str(log), "CODES": str(tmp_path / "codes")})
    return p.returncode, log.read_text().split() if log.exists() else [], p.stderr


@pytest.mark.parametrize("codes, rc, ran", [
    ({}, 0, ["a", "b", "c"]),
    ({"a": 1}, 1, ["a", "b", "c"]),  # failed cells: listed in a's report, b and c still run
    ({"b": 130}, 130, ["a", "b"]),  # stopped by SIGINT: the chain ends with b's code
    ({"a": 2}, 2, ["a"]),  # refused (a changed plan, a dirty tree)
])
def test_studies_run_in_turn(tmp_path, codes, rc, ran):
    got_rc, got_ran, err = _chain(tmp_path, codes, ["a", "b", "c"])
    assert (got_rc, got_ran) == (rc, ran)
    if rc > 1:
        assert f"{ran[-1]} ended with {rc}; the studies after it did not start" in err


def test_no_study_is_a_usage_line(tmp_path):
    rc, ran, err = _chain(tmp_path, {}, [])
    assert rc == 2 and ran == [] and err.startswith("usage:")
