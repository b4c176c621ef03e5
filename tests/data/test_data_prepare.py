from __future__ import annotations

import hashlib
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from qklab.data import BPETokenizer, ByteTokenizer, DataConfig, DataError, PreparedData, prepare_data


def quiet(_: str) -> None:
    pass


def in_val(relpath: str, val_fraction: float) -> bool:
    """The split rule, written out independently of the package."""
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def split_docs(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(tokens == eot)
    return np.split(np.asarray(tokens), cuts)[:1] + [p[1:] for p in np.split(np.asarray(tokens), cuts)[1:]]


def decoded_docs(data: PreparedData, tokens: np.ndarray) -> list[str]:
    return [data.tokenizer.decode(part.tolist()) for part in split_docs(tokens, data.eot_id)]


VAL_FRACTION = 0.3


def test_local_folder_skips_counts_and_fingerprint(
    corpus: Path, good_files: dict[str, str], tmp_path: Path
) -> None:
    lines: list[str] = []
    cfg = DataConfig(
        source=str(corpus), tokenizer="bytes", val_fraction=VAL_FRACTION, cache_dir=str(tmp_path / "c")
    )
    data = prepare_data(cfg, log=lines.append)

    fp = data.fingerprint
    assert fp["skipped"] == {"empty": 2, "binary": 1, "non_utf8": 1}
    assert fp["files"] == len(good_files)
    assert fp["bytes"] == sum(len(t.encode()) for t in good_files.values())
    h = hashlib.sha256()
    for rel in sorted(good_files):
        body = good_files[rel].encode()
        h.update(f"{rel}\0{len(body)}\0".encode() + body)
    assert fp["sha256"] == h.hexdigest()
    assert fp["tokenizer"] == "bytes"
    assert lines[0] == f"{corpus}: {len(good_files)} files, 0.0 MB (skipped: 2 empty, 1 binary, 1 non-UTF-8)"

    # bytes tokenizer: one token per UTF-8 byte plus one EOT between neighbouring documents
    assert (
        fp["train_tokens"]
        == len(data.train_tokens())
        == sum(len(good_files[r].encode()) for r in good_files if not in_val(r, VAL_FRACTION))
        + fp["train_files"]
        - 1
    )
    assert (data.vocab_size, data.eot_id) == (257, 256)


def test_split_follows_hash_rule_and_eot_separates_documents(
    corpus: Path, good_files: dict[str, str], tmp_path: Path
) -> None:
    expected_val = sorted(r for r in good_files if in_val(r, VAL_FRACTION))
    expected_train = sorted(r for r in good_files if not in_val(r, VAL_FRACTION))
    assert expected_val and expected_train  # the corpus exercises both sides of the rule

    cfg = DataConfig(
        source=str(corpus), tokenizer="bytes", val_fraction=VAL_FRACTION, cache_dir=str(tmp_path / "c")
    )
    data = prepare_data(cfg, log=quiet)
    assert data.fingerprint["train_files"] == len(expected_train)
    assert data.fingerprint["val_files"] == len(expected_val)

    train = data.train_tokens()
    assert train.dtype == np.dtype("<u2") and not train.flags.writeable
    assert int((train == data.eot_id).sum()) == len(expected_train) - 1
    assert train[0] != data.eot_id and train[-1] != data.eot_id
    # documents appear in sorted relative-path order, each exactly once
    assert decoded_docs(data, train) == [good_files[r] for r in expected_train]
    assert decoded_docs(data, data.val_tokens()) == [good_files[r] for r in expected_val]

    # stable: a second run in a fresh cache gives identical token files
    again = prepare_data(DataConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "c2")}), log=quiet)
    assert again.train_path.read_bytes() == data.train_path.read_bytes()
    assert again.val_path.read_bytes() == data.val_path.read_bytes()


def test_token_files_are_little_endian_on_any_machine(
    corpus: Path, good_files: dict[str, str], tmp_path: Path
) -> None:
    """The files (and the packs made of them) travel between machines: two bytes per id, low byte first,
    whatever this machine's own byte order. Decoded here by hand from the raw bytes, not through numpy."""
    cfg = DataConfig(
        source=str(corpus), tokenizer="bytes", val_fraction=VAL_FRACTION, cache_dir=str(tmp_path / "c")
    )
    data = prepare_data(cfg, log=quiet)
    raw = data.train_path.read_bytes()
    ids = [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)]
    first = sorted(r for r in good_files if not in_val(r, VAL_FRACTION))[0]
    body = list(good_files[first].encode())  # the byte tokenizer: one id per UTF-8 byte
    assert ids[: len(body) + 1] == body + [data.eot_id]


def test_bpe_pipeline_and_cache_reuse(
    corpus: Path, good_files: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cfg = DataConfig(source=str(corpus), vocab_size=300, val_fraction=VAL_FRACTION, cache_dir=str(cache))
    first = prepare_data(cfg, log=quiet)
    assert isinstance(first.tokenizer, BPETokenizer)
    assert first.vocab_size == first.tokenizer.vocab_size <= 300
    assert first.fingerprint["tokenizer"] == f"bpe-{first.vocab_size}"
    assert decoded_docs(first, first.train_tokens()) == [
        good_files[r] for r in sorted(good_files) if not in_val(r, VAL_FRACTION)
    ]
    tok_files = list(cache.glob("tok-*.json"))
    assert len(tok_files) == 1 and json.loads(tok_files[0].read_text())["model"]["type"] == "BPE"
    assert not list(cache.glob("*.tmp"))
    stamps = {p: p.stat().st_mtime_ns for p in cache.iterdir()}

    def no_training(*args: object, **kwargs: object) -> BPETokenizer:
        raise AssertionError("tokenizer was retrained although it is cached")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    lines: list[str] = []
    second = prepare_data(cfg, log=lines.append)
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert any("reusing" in line and "tok-" in line for line in lines)
    assert (second.train_path, second.val_path) == (first.train_path, first.val_path)
    assert second.fingerprint == first.fingerprint

    # new content invalidates the cache: the tokenizer must be trained again
    (corpus / "docs" / "new.txt").write_text("a brand new training document\n")
    with pytest.raises(AssertionError, match="retrained"):
        prepare_data(DataConfig(**{**cfg.__dict__, "val_fraction": 0.01}), log=quiet)


def test_half_written_cache_file_is_not_reused(corpus: Path, tmp_path: Path) -> None:
    cfg = DataConfig(source=str(corpus), tokenizer="bytes", cache_dir=str(tmp_path / "c"))
    data = prepare_data(cfg, log=quiet)
    good = data.train_path.read_bytes()
    data.val_path.unlink()  # as if the run stopped between the two files
    data.train_path.write_bytes(good[:10])
    again = prepare_data(cfg, log=quiet)
    assert again.train_path.read_bytes() == good


def test_glob_and_single_file_sources(corpus: Path, good_files: dict[str, str], tmp_path: Path) -> None:
    data = prepare_data(
        DataConfig(
            source=str(corpus / "docs" / "**" / "*.txt"), tokenizer="bytes", cache_dir=str(tmp_path / "c")
        ),
        log=quiet,
    )
    n_docs = sum(r.startswith("docs/") for r in good_files)
    assert data.fingerprint["files"] == n_docs
    assert data.fingerprint["skipped"] == {"empty": 1, "binary": 0, "non_utf8": 0}

    single = tmp_path / "single.txt"
    text = "".join(f"line {i}\n" for i in range(200))
    single.write_text(text)
    data = prepare_data(
        DataConfig(source=str(single), tokenizer="bytes", cache_dir=str(tmp_path / "c")), log=quiet
    )
    train_text = ByteTokenizer().decode(data.train_tokens().tolist())
    val_text = ByteTokenizer().decode(data.val_tokens().tolist())
    assert train_text + val_text == text
    assert train_text.endswith("\n") and 0 < len(val_text) < len(train_text)


def test_nothing_usable_raises(tmp_path: Path) -> None:
    root = tmp_path / "bad"
    root.mkdir()
    (root / "empty.txt").write_bytes(b"")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="no usable text"):
        prepare_data(
            DataConfig(source=str(root), tokenizer="bytes", cache_dir=str(tmp_path / "c")), log=quiet
        )


def test_pystdlib_subset_with_bytes(tmp_path: Path) -> None:
    start = time.perf_counter()
    data = prepare_data(DataConfig(max_files=20, tokenizer="bytes", cache_dir=str(tmp_path / "c")), log=quiet)
    assert time.perf_counter() - start < 10

    # recompute the subset independently: the 20 stdlib .py files with the smallest salted hash
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not {"site-packages", "__pycache__"} & set(p.relative_to(root).parts)
    ]
    chosen = sorted(rels, key=lambda r: (hashlib.sha256(b"subset:" + r.encode()).hexdigest(), r))[:20]
    kept = {}
    for rel in chosen:
        raw = (root / rel).read_bytes()
        try:
            if raw and b"\0" not in raw[:8192]:
                kept[rel] = raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
    fp = data.fingerprint
    assert fp["files"] + sum(fp["skipped"].values()) == 20
    assert fp["files"] == len(kept)
    assert fp["bytes"] == sum(len(t.encode()) for t in kept.values())
    assert fp["train_files"] >= 1 and fp["val_files"] >= 1
    assert fp["train_tokens"] + fp["val_tokens"] == fp["bytes"] + fp["files"] - 2


def test_hf_local_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")  # the `datasets` extra
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"row number {i}: " + "abc " * i, "id": i} for i in range(30)]
    rows[5]["text"] = ""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    cfg = DataConfig(source=f"hf:{path}", tokenizer="bytes", val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    data = prepare_data(cfg, log=quiet)
    kept = [i for i, r in enumerate(rows) if r["text"]]
    assert data.fingerprint["skipped"] == {"empty": 1, "binary": 0, "non_utf8": 0}
    assert data.fingerprint["files"] == len(kept)
    val_rows = [i for i in kept if in_val(str(i), 0.2)]
    assert val_rows and len(val_rows) < len(kept)
    assert decoded_docs(data, data.val_tokens()) == [rows[i]["text"] for i in val_rows]

    with pytest.raises(DataError, match="available columns"):
        prepare_data(DataConfig(**{**cfg.__dict__, "text_field": "body"}), log=quiet)
