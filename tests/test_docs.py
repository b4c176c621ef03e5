"""The front door and the docs: README's quick start comes first and stays short, and every link in README and
docs/ (hand-written pages and committed reports) resolves to a file, and an anchor to a heading of it.

Links are read by a Markdown parser (markdown-it, as the report's HTML is rendered), so links inside code are
not links; anchors follow GitHub's heading slugs."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
MD = MarkdownIt("commonmark").enable("table")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _links(path: Path) -> list[str]:
    out = []
    for tok in MD.parse(path.read_text(encoding="utf-8")):
        for child in tok.children or []:
            if child.type == "link_open":
                out.append(child.attrGet("href"))
            elif child.type == "image":
                out.append(child.attrGet("src"))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    tokens = MD.parse(path.read_text(encoding="utf-8"))
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            base = slug(tokens[i + 1].content)
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text(encoding="utf-8")))
    return out


def _broken(path: Path) -> list[str]:
    bad = []
    for href in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # http:, https:, mailto:, data:
            continue
        target, _, frag = href.partition("#")
        dest = (path.parent / unquote(target)).resolve() if target else path
        if not dest.exists():
            bad.append(f"{href}: no such file")
        elif frag and dest.suffix == ".md" and unquote(frag) not in _anchors(dest):
            bad.append(f"{href}: no heading #{frag} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert not _broken(page), f"{page.relative_to(ROOT)}: " + "; ".join(_broken(page))


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Two words: here\n\n## Again\n\n## Again\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#two-words-here) [ok](b.md#again-1) `[not a link](x.md)` [bad](c.md) "
                    "[bad](b.md#nope) [web](https://example.org/x)\n\n```\n[in code](y.md)\n```\n")
    assert _broken(page) == ["c.md: no such file", "b.md#nope: no heading #nope in b.md"]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines; keep it a front door (details go to docs/)"
    head = "\n".join(lines[:40])
    for command in ("make demo", "make test", "qklab train --config tiny"):
        assert command in head, f"'{command}' is not in README's first 40 lines"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    docs = {p.name for p in (ROOT / "docs").glob("*.md")}
    index = set(_links(ROOT / "docs" / "index.md"))
    assert docs - {"index.md"} <= index, f"pages docs/index.md does not list: {sorted(docs - index - {'index.md'})}"
