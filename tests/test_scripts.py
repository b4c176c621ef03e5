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


QKLAB_STUB = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
"""


def _results_tree(root: Path) -> Path:
    """demo and qkmap_cpu complete, logit_control_cpu half done, qkmap_english with one result, a stray
    folder without study.json."""
    import json

    r = root / "results"
    for study, cells, done in (("demo", ["a", "b"], 2), ("qkmap_cpu", ["a"], 1), ("logit_control_cpu", ["a", "b"], 1),
                               ("qkmap_english", ["a", "b", "c"], 1)):
        (r / study).mkdir(parents=True)
        (r / study / "study.json").write_text(json.dumps({"cells": cells}))
        for c in cells[:done]:
            (r / study / c).mkdir()
            (r / study / c / "result.json").write_text("{}")
    (r / "benchmarks").mkdir()
    return r


def test_rebuild_reports_leaves_running_studies_to_their_committer(tmp_path):
    """scripts/rebuild_reports.sh: a report for each complete study (the demo under its own title), the
    combined code report from every code study with results, the English one beside it; a study that is
    not complete is skipped by name."""
    results = _results_tree(tmp_path)
    stub = tmp_path / "qklab"
    stub.write_text(QKLAB_STUB)
    stub.chmod(0o755)
    log = tmp_path / "log"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "rebuild_reports.sh")], capture_output=True, text=True,
                       cwd=ROOT, env={"PATH": "/usr/bin:/bin", "LOG": str(log), "QKLAB": str(stub),
                                      "QKLAB_RESULTS": str(results)})
    assert p.returncode == 0, p.stderr
    r = str(results)
    calls = log.read_text().splitlines()
    assert calls == [
        f"report {r}/demo --out {r}/demo/report --title qklab demo",
        f"report {r}/qkmap_cpu --out {r}/qkmap_cpu/report --title qklab study: qkmap_cpu",
        f"report {r}/qkmap_cpu {r}/logit_control_cpu --out {r}/report --title qklab: both papers' claims at CPU scale",
        f"report {r}/qkmap_english --beside {r}/qkmap_cpu {r}/logit_control_cpu --out {r}/report_english --title "
        "qklab: both papers' claims on natural English, beside Python source",
    ]
    assert "skipped: logit_control_cpu (not complete" in p.stdout and "skipped: qkmap_english" in p.stdout
