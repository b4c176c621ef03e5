"""Small on-disk corpora shared by the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

# Text documents that must survive reading; each one names itself so tests can map text back to files.
GOOD_FILES: dict[str, str] = {
    f"docs/part{i:02d}.txt": f"document part{i:02d}\n"
    + "the quick brown fox jumps over the lazy dog. " * (i + 1)
    for i in range(12)
}
GOOD_FILES["code/hello.py"] = 'def hello(name: str) -> str:\n    return f"héllo {name} 🙂"\n'
GOOD_FILES["notes.md"] = "# notes\n\nA literal <|endoftext|> inside a file is ordinary text.\n"

BAD_FILES: dict[str, bytes] = {
    "empty.txt": b"",
    "docs/empty2.txt": b"",
    "blob.bin": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)),
    "latin1.txt": "café crème brûlée\n".encode("latin-1"),
}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder with GOOD_FILES plus 2 empty, 1 binary and 1 latin-1 file."""
    root = tmp_path / "corpus"
    for rel, text in GOOD_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    for rel, data in BAD_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def good_files() -> dict[str, str]:
    """relpath -> text of the files in `corpus` that must be kept."""
    return dict(GOOD_FILES)
