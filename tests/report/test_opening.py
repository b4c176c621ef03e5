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


def test_variants_of_a_grid_are_ranked_within_each_grid_point(tmp_path):
    """A ladder of widths: one bullet per width, in the grid's order, each with its variants ranked by report
    loss and their numbers as computed directly from the planted results (not one ranking across widths)."""
    from tests.report.test_ladder import GAP, NOISE, _ladder  # planted: qkmap = none - GAP[width][seed]

    _ladder(tmp_path)
    md = (write_report([tmp_path / "ladder"], out=tmp_path / "rep") / "report.md").read_text()
    opening = md.split("## What these results say\n\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    assert not (tmp_path / "rep" / "scale_sensitivity.png").exists()  # no size known (no n_params): no figure
    points = [ln for ln in opening.splitlines() if ln.startswith("- at ")]
    assert points == [f"- at **shape={w}**:" for w in (64, 128, 256)]
    for w in (64, 128, 256):
        block = [ln for ln in opening.split(f"- at **shape={w}**:\n", 1)[1].split("\n- at ", 1)[0].splitlines()
                 if ln.startswith("  - ")]
        base = 5.0 + sum(NOISE) / len(NOISE) - 0.1 * (w // 64)  # none's mean report loss at x1
        gap = sum(GAP[w]) / len(GAP[w])
        assert [ln.split("**")[1] for ln in block] == ["qkmap", "none"]  # best first, the point not repeated
        assert f"report loss {base - gap:.3f}" in block[0] and f"; {-gap:+.3f} vs none" in block[0]
        assert f"report loss {base:.3f}" in block[1]


def test_a_report_of_one_grid_point_keeps_one_ranking(tmp_path):
    from tests.report.test_ladder import _ladder

    _ladder(tmp_path, widths=(128,))
    md = (write_report([tmp_path / "ladder"], out=tmp_path / "rep") / "report.md").read_text()
    opening = md.split("## What these results say\n\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    bullets = [ln for ln in opening.splitlines() if ln.startswith("- ")]
    assert [b.split("**")[1] for b in bullets] == ["qkmap \\[shape=128\\]", "none \\[shape=128\\]"]


def test_a_quantity_claimed_against_zero_is_answered_as_itself():
    """A claim "the slope is above zero" keeps the statistics of 0 - slope (claimed below zero, as every paired
    measure): its answer shows the slope, +0.45 [+0.30, +0.60], not "0 - slope: -0.45 [-0.60, -0.30]"; one
    claimed below zero shows its own numbers; a paired difference keeps "a - b"."""
    from qklab.report.sections import answers
    from qklab.study.measures import ClaimStats

    class NoLinks:
        def link(self, *_a, **_k):
            return ""

    def row(a, b, mean, lo, hi):
        st = ClaimStats(n=3, df=2, mean=mean, ci_lo=lo, ci_hi=hi, boot_lo=lo, boot_hi=hi, a=a, b=b, margin=0.0,
                        effect=1.0, p=0.01, p_flip=0.25)
        return dataclasses.replace(PLANTED[0], status="confirmatory", stats=st, amended=False)

    got = answers([row("0", "slope of log10 max logit", -0.45, -0.60, -0.30),
                   row("sensitivity slope, qknorm - none", "0", -0.088, -0.12, -0.05),
                   row("qkmap", "none", -0.03, -0.05, -0.01)], NoLinks())[2:]
    assert "slope of log10 max logit: +0.450, 95% CI [+0.300, +0.600], n=3" in got[0].replace("\\", "")
    assert "sensitivity slope, qknorm - none: -0.088, 95% CI [-0.120, -0.050], n=3" in got[1].replace("\\", "")
    assert "qkmap - none: -0.030, 95% CI [-0.050, -0.010], n=3" in got[2].replace("\\", "")
