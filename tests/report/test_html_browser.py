"""report.html in a real browser (headless chromium, scripts/install_browser.sh): every figure loads, the
visible text holds no literal Markdown, and every link leads to a file on disk or an anchor of the page."""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from qklab.report import write_report
from tests.report.test_report import _write

CHROMIUM = Path("/usr/bin/chromium")

# on load: each image's state, the links' resolved targets, the ids and the visible text, as JSON in a <pre>
PROBE = """<script>window.addEventListener("load", () => {
  const out = {imgs: [...document.images].map(i => i.complete && i.naturalWidth > 0),
               links: [...document.querySelectorAll("a[href]")].map(a => a.href),
               ids: [...document.querySelectorAll("[id]")].map(e => e.id),
               tables: document.querySelectorAll("table").length, text: document.body.innerText,
               // what the first screen (the window, 1280 x 800) shows: headings and tables that start in it
               first: [...document.querySelectorAll("h2, h3, table, li")]
                        .filter(e => e.getBoundingClientRect().top < window.innerHeight)
                        .map(e => e.tagName + ":" + e.textContent.slice(0, 80))};
  const pre = document.createElement("pre");
  pre.id = "qklab-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});</script>"""


def rendered(page: Path) -> dict:
    """What chromium makes of ``page`` (a copy with PROBE injected, beside it so relative links resolve)."""
    probe = page.with_name("probe_" + page.name)
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    try:
        dom = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              "--window-size=1280,800", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        probe.unlink()
    m = re.search(r'<pre id="qklab-probe">(.*?)</pre>', dom, re.S)
    assert m, "the page's load handler did not run"
    return json.loads(html.unescape(m.group(1)))


def check(page: Path) -> dict:
    """The browser check of one report.html; returns what chromium saw."""
    got = rendered(page)
    assert got["imgs"] and all(got["imgs"]), f"{page}: images loaded: {got['imgs']}"
    assert got["tables"] >= 1
    text = got["text"]
    for bad in ("`", "**", "]("):
        assert bad not in text, f"{page}: literal Markdown {bad!r} in the text"
    lines = [ln for ln in text.splitlines() if ln.lstrip().startswith(("#", "|"))]
    assert not lines, f"{page}: lines that read as Markdown: {lines[:3]}"
    for href in got["links"]:
        u = urlparse(href)
        assert u.scheme == "file", href
        if u.fragment:
            assert u.fragment in got["ids"], href
        else:
            assert Path(unquote(u.path)).is_file(), href
    return got


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make browser` installs it (apt)")
def test_report_html_in_a_browser(tmp_path):
    out = write_report([_write(tmp_path)], out=tmp_path / "rep")
    got = check(out / "report.html")
    assert len(got["imgs"]) == 7 and got["tables"] == 8
    files = [h for h in got["links"] if h.endswith("/result.json")]
    assert len(files) > 30 and all(Path(unquote(urlparse(h).path)).parent.parent == tmp_path / "results"
                                   for h in files)
    assert "What these results say" in got["text"] and "underpowered" in got["text"]
    first_screen_answers(got)


def first_screen_answers(got: dict) -> None:
    """The first screen (1280 x 800) shows the answer: the "What these results say" heading and at least one
    of its lines (a variant's chosen rate and report loss)."""
    first = got["first"]
    assert "H2:What these results say" in first, first
    assert any(e.startswith("LI:") and "report loss" in e for e in first), first


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make browser` installs it (apt)")
@pytest.mark.parametrize("study", ["demo", "qkmap_english"])
def test_committed_reports_answer_on_the_first_screen(study):
    """The committed demo report and the pre-registered English one: the answer on the first screen, every
    figure loads, and no figure is drawn that has nothing to show."""
    from qklab.report.figures import nothing_to_show
    from qklab.report.html import page

    report = Path(__file__).parents[2] / "docs" / "results" / study / "report"
    md = (report / "report.md").read_text()
    html_file = report / "report.html"
    made = not html_file.exists()  # only the demo keeps its HTML copy: render the others beside their Markdown
    if made:
        images = {p.name: p for p in report.glob("*.png")}
        html_file.write_text(page(md, study, images))
    try:
        got = check(html_file)
    finally:
        if made:
            html_file.unlink()
    first_screen_answers(got)
    drawn = {p.stem for p in report.glob("*.png")} & set(re.findall(r"!\[(\w+)\]", md))
    empty = nothing_to_show(json.loads((report / "report.json").read_text())["figures"])
    assert drawn and not drawn & set(empty), (drawn, empty)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make browser` installs it (apt)")
def test_the_check_finds_literal_markdown(tmp_path):
    """The check can fail: Markdown left in the text, or an image that does not load."""
    import matplotlib.pyplot as plt

    plt.imsave(tmp_path / "fig.png", [[0.0, 1.0], [1.0, 0.0]])
    ok = '<img src="fig.png"><table></table>'
    for body, why in ((f"{ok}<p>a **bold** claim</p>", "literal Markdown"), (f"{ok}<p>see [x](y)</p>", "literal"),
                      (f"{ok}<p>x</p>\n<p>| a | b |</p>", "read as Markdown"),
                      ('<img src="missing.png"><table></table>', "images loaded"),
                      (f'{ok}<a href="nowhere/result.json">1</a>', "nowhere")):
        page = tmp_path / "report.html"
        page.write_text(f"<!doctype html><html><body>{body}</body></html>")
        with pytest.raises(AssertionError, match=re.escape(why)):
            check(page)
    page.write_text(f"<!doctype html><html><body>{ok}<p>fine</p></body></html>")
    assert check(page)["imgs"] == [True]


if __name__ == "__main__":  # by hand, from the repository root: python -m tests.report.test_html_browser REPORT.html
    import sys

    for p in sys.argv[1:]:
        got = check(Path(p).resolve())
        print(f"{p}: ok: {len(got['imgs'])} images loaded, {got['tables']} tables, {len(got['links'])} links, "
              f"{len(got['text'])} characters of visible text")
