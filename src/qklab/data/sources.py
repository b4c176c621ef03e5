"""Reading documents from the standard library, the english corpus, local files or Hugging Face datasets.

Every source becomes a list of Documents ordered deterministically, plus counts
of what was skipped (empty, binary or non-UTF-8 inputs).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import english
from .config import HF_PREFIX, PYSTDLIB, DataConfig, DataError

BINARY_SNIFF_BYTES = 8192
HF_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_HF_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Document:
    relpath: str  # stable id: path relative to the source root, or the row index for datasets
    text: str
    nbytes: int  # length of the UTF-8 encoding of text


@dataclass
class SkipCounts:
    empty: int = 0
    binary: int = 0
    non_utf8: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"empty": self.empty, "binary": self.binary, "non_utf8": self.non_utf8}


@dataclass
class SourceDocs:
    label: str  # short name of the source used in log lines
    docs: list[Document] = field(default_factory=list)
    skipped: SkipCounts = field(default_factory=SkipCounts)
    # english only: per part its package, registry, version, licence, text SHA-256 and cap (the fingerprint)
    corpus_parts: dict[str, Any] = field(default_factory=dict)
    parts_note: str = ""  # english only: documents and characters kept per part, for the log line

    @property
    def total_bytes(self) -> int:
        return sum(d.nbytes for d in self.docs)

    def summary(self) -> str:
        s = self.skipped
        return (
            f"{self.label}: {len(self.docs)} files, {self.total_bytes / 1e6:.1f} MB "
            f"(skipped: {s.empty} empty, {s.binary} binary, {s.non_utf8} non-UTF-8)"
            + (f"; {self.parts_note}" if self.parts_note else "")
        )


def subset_key(relpath: str) -> str:
    """Ordering key for max_files. Salted so the subset is independent of the train/val hash."""
    return hashlib.sha256(b"subset:" + relpath.encode("utf-8")).hexdigest()


def take_subset(relpaths: list[str], max_files: int) -> set[str]:
    """The first max_files ids ordered by subset_key (all of them when max_files is 0)."""
    if max_files <= 0 or max_files >= len(relpaths):
        return set(relpaths)
    return set(sorted(relpaths, key=lambda r: (subset_key(r), r))[:max_files])


def classify(data: bytes, skipped: SkipCounts) -> str | None:
    """Decode data as UTF-8 text, or count why it is skipped and return None."""
    if not data:
        skipped.empty += 1
        return None
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        skipped.binary += 1
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        skipped.non_utf8 += 1
        return None


def load_documents(cfg: DataConfig) -> SourceDocs:
    """All usable documents of cfg.source, honouring cfg.max_files."""
    if cfg.source == PYSTDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        return _read_files(PYSTDLIB, root, _stdlib_files(root), cfg.max_files)
    if cfg.source == english.ENGLISH:
        return _load_english(cfg)
    if cfg.source.startswith(HF_PREFIX):
        return _load_hf(cfg)
    root, files = _local_files(cfg.source)
    return _read_files(cfg.source, root, files, cfg.max_files)


def _stdlib_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _local_files(source: str) -> tuple[Path, list[Path]]:
    """(root that relative paths are taken from, regular files of the source)."""
    if glob.has_magic(source):
        files = [Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p)]
        return _glob_root(source), files
    path = Path(source)
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        return path, [p for p in path.rglob("*") if p.is_file()]
    raise DataError(
        f"data.source: no such file, folder or glob {source!r}; give an existing path or 'pystdlib'"
    )


def _glob_root(pattern: str) -> Path:
    """The folder made of the pattern's leading components that have no wildcards."""
    parts = Path(pattern).parts
    fixed: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _read_files(label: str, root: Path, files: Iterable[Path], max_files: int) -> SourceDocs:
    by_rel = {p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix(): p for p in files}
    keep = take_subset(list(by_rel), max_files)
    out = SourceDocs(label)
    for rel in sorted(keep):
        text = classify(by_rel[rel].read_bytes(), out.skipped)
        if text is not None:
            out.docs.append(Document(rel, text, len(text.encode("utf-8"))))
    return out


def _load_english(cfg: DataConfig) -> SourceDocs:
    """The documents of the english corpus (data/english.py), ids ``<part>/<name>``, ordered by id."""
    corpus = english.load_corpus()
    keep = take_subset([rel for rel, _ in corpus.docs], cfg.max_files)
    out = SourceDocs(english.ENGLISH, corpus_parts=corpus.fingerprint)
    out.parts_note = "corpus parts: " + ", ".join(
        f"{p.name} {p.documents} docs {p.chars / 1e6:.1f}M chars" for p in corpus.stats
    )
    for rel, text in corpus.docs:
        if rel in keep:
            out.docs.append(Document(rel, text, len(text.encode("utf-8"))))
    return out


def _load_hf(cfg: DataConfig) -> SourceDocs:
    target = cfg.source[len(HF_PREFIX) :].strip()
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a declared dependency
        raise DataError(
            "data.source: 'hf:' sources need the 'datasets' package; pip install 'qklab[datasets]'"
        ) from exc

    cache = str(Path(cfg.cache_dir) / "hf")
    try:
        if os.path.exists(target):
            fmt, files = _hf_local_files(target)
            ds = datasets.load_dataset(
                fmt, data_files={cfg.hf_split: files}, split=cfg.hf_split, cache_dir=cache
            )
        else:
            ds = datasets.load_dataset(target, split=cfg.hf_split, cache_dir=cache)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many exception types (network, format, missing split)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(
            f"data.source: could not load {cfg.source!r} (split {cfg.hf_split!r}): {first_line}; "
            "give a local parquet/jsonl/arrow file or folder, or a hub name reachable from this machine"
        ) from exc

    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"data.text_field: column {cfg.text_field!r} not in {cfg.source!r}; "
            f"available columns: {', '.join(ds.column_names)}"
        )
    ds = ds.select_columns([cfg.text_field])
    keep = take_subset([str(i) for i in range(len(ds))], cfg.max_files)
    out = SourceDocs(cfg.source)
    row = 0
    for batch in ds.iter(batch_size=_HF_BATCH_ROWS):
        for value in batch[cfg.text_field]:
            rel = str(row)
            row += 1
            if rel not in keep:
                continue
            text = _hf_text(value, out.skipped)
            if text is not None:
                out.docs.append(Document(rel, text, len(text.encode("utf-8"))))
    return out


def _hf_text(value: object, skipped: SkipCounts) -> str | None:
    if value is None:
        skipped.empty += 1
        return None
    if isinstance(value, bytes):
        return classify(value, skipped)
    try:
        data = str(value).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be written as UTF-8
        skipped.non_utf8 += 1
        return None
    return classify(data, skipped)


def _hf_local_files(target: str) -> tuple[str, list[str]]:
    """(datasets builder name, data files) for a local file or folder."""
    path = Path(target)
    candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    by_format: dict[str, list[str]] = {}
    for p in candidates:
        fmt = HF_FORMATS.get(p.suffix.lower())
        if fmt is not None:
            by_format.setdefault(fmt, []).append(str(p))
    if not by_format:
        raise DataError(
            f"data.source: no .parquet, .json, .jsonl or .arrow files at {target!r}; "
            "convert the data to one of these formats"
        )
    if len(by_format) > 1:
        raise DataError(
            f"data.source: {target!r} mixes formats ({', '.join(sorted(by_format))}); "
            "keep one format per folder"
        )
    ((fmt, files),) = by_format.items()
    return fmt, files
