"""report.html is report.md rendered by a Markdown renderer; every number of the results and claims tables
links to the result.json files it came from; the report opens with one answer per registered question."""

from __future__ import annotations

import base64
import dataclasses
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

from qklab.report import render, write_report
from qklab.report.claim_row import ClaimRow
from qklab.study.measures import ClaimStats
from tests.report.test_report import _write

LINK = re.compile(r"(?<!\\)\[((?:\\.|[^\]\\])*)\]\(([^)\s]+)\)")


class Page(HTMLParser):
    """The visible text of a page (script and style left out), its tags, and its ids."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.tags, self.ids, self.skip = [], [], set(), 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.ids.update(v for k, v in attrs if k == "id")
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.skip:
            self.text.append(data)


def table(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The Markdown table under ``## heading``: head and rows, cells as written (links and all)."""
    part = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]] for ln in lines]
    return split[0], split[2:]


def targets(md: str, out: Path, cell: str) -> list[Path]:
    """The result.json files a table cell's link leads to: the file itself, or the files listed at its anchor
    in the section of cells."""
    m = LINK.fullmatch(cell)
    assert m, f"no link: {cell}"
    href = m.group(2)
    if href.startswith("#"):
        entry = next(ln for ln in md.splitlines() if f'<a id="{href[1:]}"></a>' in ln)
        hrefs = [h for _, h in LINK.findall(entry)]
    else:
        hrefs = [href]
    return [(out / unquote(h)).resolve() for h in hrefs]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    out = write_report([_write(tmp)], out=tmp / "rep")
    return tmp / "results", out, (out / "report.md").read_text(), (out / "report.html").read_text()


def test_html_is_the_markdown_rendered(report):
    _, out, md, page = report
    p = Page(page)
    tags = [t for t, _ in p.tags]
    text = "".join(p.text)
    # every Markdown table and heading became HTML, in the same order; no Markdown is left in the text
    assert tags.count("table") == md.count("\n|---|") and tags.count("table") == 8  # 8: the stable-rates table
    assert [ln[3:] for ln in md.splitlines() if ln.startswith("## ")] == re.findall(r"<h2>(.*?)</h2>", page)
    h2 = re.findall(r"<h2>(.*?)</h2>", page)
    assert h2[:2] == ["What these results say", "Results (report split)"]  # the answer first
    assert h2[-3:] == ['<a id="claims"></a>Claims', '<a id="verdict-rule"></a>The verdict rule',
                       "Cells behind the numbers"]  # the claims and how to read them last
    for bad in ("`", "**", "](", "\\["):
        assert bad not in text, bad
    assert not [ln for ln in text.splitlines() if ln.lstrip().startswith(("#", "|"))]
    assert "<code>s</code>" in page and "<em>selection</em>" in page and "<strong>underpowered</strong>" in page
    # self-contained: each figure embedded as a PNG, nothing fetched from elsewhere
    imgs = [a["src"] for t, a in p.tags if t == "img"]
    assert len(imgs) == len(re.findall(r"^!\[", md, re.M)) == 7
    assert all(base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n" for s in imgs)
    assert "http://" not in page and "https://" not in page and "<link" not in page
    # every link of the page leads to a result.json on disk, or to an anchor of the page
    hrefs = [a["href"] for t, a in p.tags if t == "a" and "href" in a]
    assert len(hrefs) > 100
    for h in hrefs:
        if h.startswith("#"):
            assert h[1:] in p.ids, h
        else:
            assert h.endswith("/result.json") and (out / unquote(h)).is_file(), h


def test_results_numbers_link_to_their_cells(report):
    res, out, md, _ = report
    head, rows = table(md, "Results (report split)")
    row = dict(zip(head, next(r for r in rows if r[0] == "quack"), strict=True))
    chosen = [(res / f"quack_lr2_s{s}" / "result.json").resolve() for s in range(3)]  # quack chose x2
    ref = [(res / f"none_lr1_s{s}" / "result.json").resolve() for s in range(3)]  # none chose x1
    every = [(res / f"quack_lr{m}_s{s}" / "result.json").resolve() for m in (1, 2) for s in range(3)]
    assert row["report loss"].startswith("[5.003 ± 0.015](")
    assert targets(md, out, row["report loss"]) == chosen
    assert targets(md, out, row["max logit"]) == chosen and targets(md, out, row["n"]) == chosen
    assert targets(md, out, row["vs reference (paired)"]) == chosen + ref
    assert targets(md, out, row["diverged"]) == every
    assert all(p.is_file() for p in chosen + ref + every)
    assert row["variant"] == "quack" and row["bootstrap 95%"] == "-"  # no number, no link


PLANTED = [ClaimRow(**{**r, "stats": ClaimStats(**{"a": None, "b": None, **r["stats"]}) if r.get("stats") else None})
           for r in [  # claims rows as claims.claims_table gives them
    {"id": "qkmap.val", "paper": "QK-MAP", "claim": "lower validation loss than Standard attention",
     "status": "confirmatory", "measurement": "report-split loss, paired over seeds",
     "measured": "qkmap - none: -0.120",
     "verdict": "agree", "reason": "Holm p = 0.01 < 0.05", "verdict_old": "agree", "amended": True,
     "verdict_registered": "inconclusive", "reason_registered": "Holm p = 0.2 is not below 0.05",
     "stats": {"n": 8, "df": 7, "mean": -0.12, "ci_lo": -0.2, "ci_hi": -0.04, "boot_lo": -0.19, "boot_hi": -0.05,
               "effect": -1.5, "p": 0.004, "p_flip": 0.008, "margin": 0.0, "a": "qkmap", "b": "none"},
     "p_holm": 0.01, "q_bh": 0.01, "shows": "QK-MAP beats Standard attention at these rates.",
     "not_shows": "Whether it holds at larger scale."},
    {"id": "quack.logits", "paper": "QuacK", "claim": "keeps attention logits smaller", "status": "confirmatory",
     "measurement": "max logit ratio", "measured": "quack / none", "verdict": "inconclusive",
     "reason": "Holm p = 0.3 is not below 0.05", "verdict_old": "agree", "p_holm": 0.3, "q_bh": 0.3,
     "stats": {"n": 6, "df": 5, "mean": -1.0, "ci_lo": -2.0, "ci_hi": 0.0, "boot_lo": -1.9, "boot_hi": -0.1,
               "effect": -1.0, "p": 0.05, "p_flip": 0.06, "margin": 0.0, "log_ratio": True}},
    {"id": "quack.mla", "paper": "QuacK", "claim": "outperforms no intervention in the MLA setting",
     "status": "exploratory", "measurement": "report-split loss", "measured": "mla-quack - mla-none: -0.090",
     "verdict": "exploratory", "reason": "not registered", "verdict_old": "agree", "stats": None,
     "p_holm": float("nan"), "q_bh": float("nan"), "shows": "EXPLORATORY SHOWS"},
    {"id": "quack.speed", "paper": "QuacK", "claim": "trains faster than QK-Norm", "status": "confirmatory",
     "measurement": "step time", "measured": "-", "verdict": "not measurable", "reason": "benchmarks measure it",
     "verdict_old": "not measurable", "stats": None, "p_holm": float("nan"), "q_bh": float("nan")},
]]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A report whose claims rows are PLANTED, each with result files of the planted study."""
    res = _write(tmp_path)
    cells = [[res / "qkmap_lr1_s0" / "result.json", res / "none_lr1_s0" / "result.json"],
             [res / "quack_lr2_s1" / "result.json"], [res / "mla-quack_lr1_s2" / "result.json"], None]
    rows = [dataclasses.replace(r, cells=[str(p) for p in c]) if c else r for r, c in zip(PLANTED, cells, strict=True)]
    monkeypatch.setattr(render, "claims_table", lambda groups, studies=None, registered_groups=None: list(rows))
    out = write_report([res], out=tmp_path / "rep")
    return out, (out / "report.md").read_text(), cells


def test_answers_open_the_report_with_the_registered_questions(planted):
    out, md, _ = planted
    answers = md.split("### Registered questions\n", 1)[1].split("\n## ", 1)[0]
    assert md.index("## What these results say") < md.index("### Registered questions") < md.index("## Results")
    assert md.index("## Results") < md.index("Claims\n") < md.index("The verdict rule\n")
    items = [ln for ln in answers.splitlines() if ln.startswith("- ")]
    assert len(items) == 3  # the confirmatory ones only
    first, second, third = items
    assert first.startswith("- **QK-MAP: lower validation loss than Standard attention** (qkmap.val): **agree** "
                            "under the amended plan; **inconclusive** under the registered plan; ")
    assert "[qkmap - none: -0.120, 95% CI \\[-0.200, -0.040\\], n=8, Holm p 0.01](" in first
    assert first.endswith("*Shows:* QK-MAP beats Standard attention at these rates. "
                          "*Limits:* Whether it holds at larger scale.")
    assert "[ratio 0.1, 95% CI \\[0.01, 1\\], n=6, Holm p 0.3](" in second and "**inconclusive**;" in second
    assert "*Shows:* Max logit ratio: Holm p = 0.3 is not below 0.05." in second  # from measurement and reason
    assert third.startswith("- **QuacK: trains faster than QK-Norm** (quack.speed): **not measurable**; nothing "
                            "measured.")
    assert "EXPLORATORY" not in md and "outperforms no intervention in the MLA setting" not in answers


def test_claims_table_verdicts_and_links(planted):
    out, md, cells = planted
    head, rows = table(md, "<a id=\"claims\"></a>Claims")
    got = {r[1]: dict(zip(head, r, strict=True)) for r in rows}
    assert got["outperforms no intervention in the MLA setting"]["verdict"] == "exploratory"
    # a row without a number (and without the new fields) is not in the table: one line under it names it
    assert "trains faster than QK-Norm" not in got
    claims = md.split('<a id="claims"></a>Claims\n', 1)[1].split("\n## ", 1)[0]
    assert "Without a number in these results (1), not measurable (1): QuacK: trains faster than QK-Norm." in claims
    amended = got["lower validation loss than Standard attention"]
    assert amended["verdict"] == "**agree**"
    assert amended["reason"] == ("Holm p = 0.01 < 0.05 (amended plan); under the registered plan: inconclusive "
                                 "(Holm p = 0.2 is not below 0.05)")
    for col in ("n", "mean difference", "95% t-interval", "p Holm", "measured here"):
        assert targets(md, out, amended[col]) == [p.resolve() for p in cells[0]], col
    one = got["keeps attention logits smaller"]["n"]  # one cell: a direct link to its file
    assert one == "[6](../results/quack_lr2_s1/result.json)" and (out / "../results/quack_lr2_s1/result.json").is_file()
    mla = got["outperforms no intervention in the MLA setting"]["measured here"]
    assert targets(md, out, mla) == [cells[2][0].resolve()]
