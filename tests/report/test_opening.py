"""The opening of a report, "What these results say": a registered positive control comes first, under a
heading of its own, before each variant's result and the registered questions."""

from __future__ import annotations

import dataclasses
import re

from qklab.report import render, write_report
from tests.report.test_html import PLANTED
from tests.report.test_report import _write


def _report(tmp_path, monkeypatch, rows) -> str:
    res = _write(tmp_path)
    monkeypatch.setattr(render, "claims_table", lambda groups, studies=None, registered_groups=None: list(rows))
    return (write_report([res], out=tmp_path / "rep") / "report.md").read_text()


def _headings(md: str) -> list[str]:
    """The headings of the opening, up to the first table section, as '##' / '###' lines."""
    opening = md.split("\n## What these results say\n", 1)[1].split("\n## ", 1)[0]
    return ["## What these results say"] + re.findall(r"^###? .*$", opening, flags=re.M)


def test_a_registered_control_opens_the_answer_under_its_own_heading(tmp_path, monkeypatch):
    control = dataclasses.replace(PLANTED[0], id="scale.control_logit_rate", paper="Scale",
                                  claim="positive control: the max logit grows with the rate", verdict="agree")
    md = _report(tmp_path, monkeypatch, [control, *PLANTED])
    assert _headings(md) == ["## What these results say", "### Positive control",
                             "### Each variant at its chosen rate", "### Registered questions"]
    section = md.split("### Positive control\n", 1)[1].split("\n### ", 1)[0]
    assert "- positive control: the max logit grows with the rate: **agree**" in section
    assert "The control is not established" not in section and "**The control fails**" not in section
    # each variant's line under its own heading, not under the control's
    variants = md.split("### Each variant at its chosen rate\n", 1)[1].split("\n### ", 1)[0]
    assert [ln for ln in variants.splitlines() if ln.startswith("- **")] and "control" not in variants


def test_without_a_control_the_variants_follow_the_heading_at_once(tmp_path, monkeypatch):
    md = _report(tmp_path, monkeypatch, PLANTED)
    assert _headings(md) == ["## What these results say", "### Registered questions"]
    first = md.split("## What these results say\n\n", 1)[1].splitlines()[0]
    assert first.startswith("- **"), first
