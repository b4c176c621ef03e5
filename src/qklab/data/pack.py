"""Token packs: the tokens and tokenizer of one data config, for a machine that does not have its source.

A pack is a folder (``qklab tokens --out DIR`` writes one; ``data.token_pack = DIR`` reads it):

    pack.json       {"format": "qklab-token-pack/1",
                     "data": the DataConfig fields that decide the tokens (IDENTITY: source, tokenizer,
                             vocab_size, val_fraction, max_files, text_field, hf_split),
                     "fingerprint": what prepare_data returned for the source, unchanged,
                     "vocab_size", "eot_id": of the tokenizer,
                     "splits": {"train": {"tokens": N, "sha256": ...}, "val": {...}}  (sha256 of the raw bytes),
                     "tokenizer_sha256": of tokenizer.json (BPE; null for bytes)}
    tokenizer.json  BPE only: the tokenizer as prepare_data caches it (the byte tokenizer needs none)
    train.bin.xz    the train tokens, as in the token cache: raw uint16 ids, little-endian on every machine,
    val.bin.xz      documents joined by eot_id, xz-compressed

Reading a pack checks that every identity field equals the config's and that each decompressed file has
its recorded sha256, then writes the tokens into cfg.cache_dir under names the source's cache never uses
(``tokens-pack-<sha12>-<split>.bin``). The run's fingerprint is the pack's, so a run reads the same as one
on the source. The source itself is never read. A pack holds the corpus's text as tokens: it keeps the
licences of the text it was made from, and belongs under an ignored path (.cache/), never in git.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qklab.atomic import atomic_write_text, fsync_dir, fsync_file

from . import mqar
from .config import DataConfig, DataError
from .prepare import TOKEN_DTYPE, PreparedData, prepare_data
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

FORMAT = "qklab-token-pack/1"
META = "pack.json"
TOKENIZER = "tokenizer.json"
IDENTITY = ("source", "tokenizer", "vocab_size", "val_fraction", "max_files", "text_field", "hf_split")
SPLITS = ("train", "val")
PRESET = 9  # xz -9: a 64 MiB window, more than one split of a small corpus needs
_CHUNK = 1 << 20  # bytes read or written at a time
_ITEMSIZE = np.dtype(TOKEN_DTYPE).itemsize


def write_pack(cfg: DataConfig, out: Path, log: Callable[[str], None] = print) -> Path:
    """Prepare cfg's tokens (building or reusing the cache) and write their pack to ``out``, atomically:
    a folder beside it, renamed into place. An existing pack at ``out`` is replaced; any other non-empty
    path is refused."""
    out = Path(out)
    if cfg.source == mqar.MQAR:
        raise DataError("data.source=mqar: nothing to pack, its sequences are generated on the machine that trains")
    if cfg.token_pack:
        raise DataError(f"data.token_pack={cfg.token_pack!r}: a pack is written from the source; leave it empty")
    if out.exists() and not is_pack(out) and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out}: exists and is not a token pack; choose a new or empty folder")
    data = prepare_data(cfg, log)
    assert isinstance(data, PreparedData)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        tok_sha = None
        if isinstance(data.tokenizer, BPETokenizer):
            tok_json = data.tokenizer.to_json()
            tok_sha = _sha256(tok_json.encode("utf-8"))
            atomic_write_text(tmp / TOKENIZER, tok_json)
        splits = {split: _compress(path, tmp / f"{split}.bin.xz")
                  for split, path in zip(SPLITS, (data.train_path, data.val_path), strict=True)}
        meta = {"format": FORMAT, "data": {k: getattr(cfg, k) for k in IDENTITY}, "fingerprint": data.fingerprint,
                "vocab_size": data.vocab_size, "eot_id": data.eot_id, "splits": splits, "tokenizer_sha256": tok_sha}
        atomic_write_text(tmp / META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_pack(path: Path) -> bool:
    return (Path(path) / META).is_file()


def pack_bytes(path: Path) -> int:
    """The pack's size on disk: its files' bytes."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def read_meta(path: Path) -> dict[str, Any]:
    """pack.json of the pack at ``path``, its format checked (DataError otherwise)."""
    try:
        meta = json.loads((Path(path) / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"data.token_pack: {path} is no token pack (no {META}); write one with qklab tokens") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"data.token_pack: damaged pack {path}: {META} is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"data.token_pack: {path} has format {found!r}, this qklab reads {FORMAT!r}")
    return meta


def load_pack(cfg: DataConfig, log: Callable[[str], None] = print) -> PreparedData:
    """The tokens and tokenizer of the pack cfg.token_pack, checked against cfg and unpacked into
    cfg.cache_dir (reused when already there); the source is not read."""
    root = Path(cfg.token_pack)
    meta = read_meta(root)
    try:
        for name in IDENTITY:
            have, want = meta["data"][name], getattr(cfg, name)
            if have != want:
                raise DataError(f"data.token_pack: the pack {root} holds the tokens of data.{name}={have!r}, "
                                f"this config has data.{name}={want!r}; write a pack for these settings (qklab tokens)")
        tokenizer = _tokenizer(root, meta)
        if (tokenizer.vocab_size, tokenizer.eot_id) != (meta["vocab_size"], meta["eot_id"]):
            raise DataError(f"data.token_pack: damaged pack {root}: its tokenizer does not match {META}")
        cache = Path(cfg.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        train, val = (_unpack(root, split, meta["splits"][split], cache) for split in SPLITS)
        counts = [meta["splits"][split]["tokens"] for split in SPLITS]
        fingerprint = meta["fingerprint"]
    except (KeyError, TypeError) as e:
        raise DataError(f"data.token_pack: damaged pack {root}: {META} lacks {e}") from None
    log(f"tokens: from pack {root} ({counts[0]:,} train, {counts[1]:,} val tokens; the source is not read)")
    return PreparedData(train_path=train, val_path=val, vocab_size=tokenizer.vocab_size, eot_id=tokenizer.eot_id,
                        tokenizer=tokenizer, fingerprint=fingerprint)


def _tokenizer(root: Path, meta: dict[str, Any]) -> Tokenizer:
    if meta["data"]["tokenizer"] == "bytes":
        return ByteTokenizer()
    raw = (root / TOKENIZER).read_bytes()
    if _sha256(raw) != meta["tokenizer_sha256"]:
        raise DataError(f"data.token_pack: damaged pack {root}: {TOKENIZER} does not have its recorded sha256")
    return BPETokenizer.from_json(raw.decode("utf-8"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _compress(src: Path, dst: Path) -> dict[str, Any]:
    """Write src xz-compressed to dst, in chunks; its token count and the sha256 of its raw bytes."""
    h, n = hashlib.sha256(), 0
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=PRESET) as z:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            z.write(chunk)
            n += len(chunk)
    fsync_file(dst)
    return {"tokens": n // _ITEMSIZE, "sha256": h.hexdigest()}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _unpack(root: Path, split: str, entry: dict[str, Any], cache: Path) -> Path:
    """The split's tokens in cache, decompressed from the pack unless a file with its sha256 is there."""
    sha = entry["sha256"]
    path = cache / f"tokens-pack-{sha[:12]}-{split}.bin"
    if path.is_file() and _file_sha256(path) == sha:
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    h, n = hashlib.sha256(), 0
    try:
        with lzma.open(root / f"{split}.bin.xz", "rb") as z, open(tmp, "wb") as f:
            while chunk := z.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if h.hexdigest() != sha or n != entry["tokens"] * _ITEMSIZE:
            raise DataError(f"data.token_pack: damaged pack {root}: {split}.bin.xz does not hold the recorded tokens "
                            f"({n // _ITEMSIZE:,} tokens, sha256 {h.hexdigest()[:12]}; recorded {entry['tokens']:,}, "
                            f"{sha[:12]})")
        os.replace(tmp, path)
    except (lzma.LZMAError, EOFError) as e:
        raise DataError(f"data.token_pack: damaged pack {root}: {split}.bin.xz does not decompress ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder tmp to out; an existing pack (or empty folder) there is replaced."""
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)
