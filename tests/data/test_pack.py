"""Token packs (data/pack.py): a pack written from the source gives, on a machine without the source, the
tokens, tokenizer and fingerprint that the source gives; a pack of other settings or a damaged one is refused."""

from __future__ import annotations

import dataclasses
import lzma
import shutil
from pathlib import Path

import numpy as np
import pytest
from english_fixture import make_corpus

from qklab.cli import main
from qklab.config import NEUTRAL, RESUMABLE, load_config
from qklab.data import DataConfig, DataError, english, prepare_data
from qklab.data.pack import load_pack, read_meta, write_pack
from qklab.study.spec import cell_hash

SAMPLE = "The committee met again: héllo 🙂 <|endoftext|> def f(x): return x"


def quiet(_: str) -> None:
    pass


def _same_data(a, b) -> None:
    """Two PreparedData hold the same tokens, fingerprint and tokenizer."""
    assert np.array_equal(a.train_tokens(), b.train_tokens()) and a.train_tokens().size > 0
    assert np.array_equal(a.val_tokens(), b.val_tokens()) and a.val_tokens().size > 0
    assert a.fingerprint == b.fingerprint
    assert (a.vocab_size, a.eot_id, a.tokenizer.name) == (b.vocab_size, b.eot_id, b.tokenizer.name)
    assert a.tokenizer.encode(SAMPLE) == b.tokenizer.encode(SAMPLE)


@pytest.fixture
def english_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_corpus(tmp_path / "english")
    monkeypatch.setenv(english.CORPUS_ENV, str(root))
    return root


@pytest.fixture
def folder_pack(corpus: Path, tmp_path: Path) -> tuple[DataConfig, Path]:
    """A byte-tokenizer config on the local folder `corpus`, and its pack."""
    cfg = DataConfig(source=str(corpus), tokenizer="bytes", val_fraction=0.3, cache_dir=str(tmp_path / "c1"))
    return cfg, write_pack(cfg, tmp_path / "pack", log=quiet)


def test_an_english_bpe_pack_stands_in_for_the_corpus(english_dir, tmp_path, monkeypatch):
    cfg = DataConfig(source="english", vocab_size=300, val_fraction=0.3, cache_dir=str(tmp_path / "c1"))
    from_source = prepare_data(cfg, log=quiet)
    pack = write_pack(cfg, tmp_path / "pack", log=quiet)
    assert sorted(p.name for p in pack.iterdir()) == ["pack.json", "tokenizer.json", "train.bin.xz", "val.bin.xz"]

    empty = tmp_path / "nothing"
    empty.mkdir()
    monkeypatch.setenv(english.CORPUS_ENV, str(empty))
    without = dataclasses.replace(cfg, cache_dir=str(tmp_path / "c2"))
    with pytest.raises(DataError, match="make corpus"):  # the corpus is gone indeed
        prepare_data(without, log=quiet)
    lines: list[str] = []
    from_pack = prepare_data(dataclasses.replace(without, token_pack=str(pack)), log=lines.append)
    _same_data(from_pack, from_source)
    assert from_pack.fingerprint["corpus_parts"]  # the corpus's versions and licences, carried over
    assert lines == [f"tokens: from pack {pack} ({from_pack.train_tokens().size:,} train, "
                     f"{from_pack.val_tokens().size:,} val tokens; the source is not read)"]
    assert from_pack.train_path.parent == tmp_path / "c2" and from_pack.train_path.name.startswith("tokens-pack-")
    again = prepare_data(dataclasses.replace(without, token_pack=str(pack)), log=quiet)  # unpacked files reused
    assert again.train_path == from_pack.train_path
    _same_data(again, from_source)


def test_a_byte_pack_stands_in_for_a_removed_folder(folder_pack, corpus, tmp_path):
    cfg, pack = folder_pack
    from_source = prepare_data(cfg, log=quiet)
    assert not (pack / "tokenizer.json").exists()
    shutil.rmtree(corpus)
    without = dataclasses.replace(cfg, cache_dir=str(tmp_path / "c2"))
    with pytest.raises(DataError, match="no such file"):
        without.validate()
    _same_data(prepare_data(dataclasses.replace(without, token_pack=str(pack)), log=quiet), from_source)


@pytest.mark.parametrize(("field", "value"), [("val_fraction", 0.2), ("max_files", 3), ("source", "pystdlib"),
                                              ("tokenizer", "bpe")])
def test_a_pack_of_other_settings_is_refused(folder_pack, tmp_path, field, value):
    cfg, pack = folder_pack
    other = dataclasses.replace(cfg, token_pack=str(pack), cache_dir=str(tmp_path / "c2"), **{field: value})
    with pytest.raises(DataError) as e:
        prepare_data(other, log=quiet)
    msg = str(e.value)
    assert "\n" not in msg and f"data.{field}={getattr(cfg, field)!r}" in msg and f"data.{field}={value!r}" in msg


def test_a_bpe_pack_of_another_vocab_size_is_refused(english_dir, tmp_path):
    cfg = DataConfig(source="english", vocab_size=300, val_fraction=0.3, cache_dir=str(tmp_path / "c1"))
    pack = write_pack(cfg, tmp_path / "pack", log=quiet)
    with pytest.raises(DataError, match=r"data\.vocab_size=300.*data\.vocab_size=512"):
        prepare_data(dataclasses.replace(cfg, vocab_size=512, token_pack=str(pack)), log=quiet)


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=1)


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [
    lambda pack: _flip(pack / "train.bin.xz"),
    lambda pack: (pack / "val.bin.xz").write_bytes(_xz(np.arange(50, dtype=np.uint16).tobytes())),
    lambda pack: (pack / "train.bin.xz").write_bytes(_xz(lzma.decompress((pack / "train.bin.xz").read_bytes())[:-2])),
    lambda pack: (pack / "train.bin.xz").write_bytes(b"not xz"),
    lambda pack: (pack / "pack.json").write_text("{"),
], ids=["flipped", "other-tokens", "cut-short", "not-xz", "meta-not-json"])
def test_a_damaged_pack_is_refused(folder_pack, tmp_path, damage):
    cfg, pack = folder_pack
    damage(pack)
    with pytest.raises(DataError, match="damaged pack") as e:
        prepare_data(dataclasses.replace(cfg, token_pack=str(pack), cache_dir=str(tmp_path / "c2")), log=quiet)
    assert "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "c2").glob("*") if p.name.endswith(".tmp")]


def test_an_unpacked_file_that_changed_is_written_again(folder_pack, tmp_path):
    cfg, pack = folder_pack
    use = dataclasses.replace(cfg, token_pack=str(pack), cache_dir=str(tmp_path / "c2"))
    first = load_pack(use, log=quiet)
    good = first.train_path.read_bytes()
    first.train_path.write_bytes(good[:-2])
    assert load_pack(use, log=quiet).train_path.read_bytes() == good


def test_the_pack_records_the_identity_and_the_fingerprint(folder_pack):
    cfg, pack = folder_pack
    meta = read_meta(pack)
    assert meta["format"] == "qklab-token-pack/1"
    identity = ("source", "tokenizer", "vocab_size", "val_fraction", "max_files", "text_field", "hf_split")
    assert meta["data"] == {k: getattr(cfg, k) for k in identity}
    assert meta["fingerprint"] == prepare_data(cfg, log=quiet).fingerprint
    assert meta["splits"]["train"]["tokens"] == meta["fingerprint"]["train_tokens"]


def test_write_pack_refuses_what_is_no_pack_and_replaces_a_pack(folder_pack, tmp_path):
    cfg, pack = folder_pack
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a token pack"):
        write_pack(cfg, other, log=quiet)
    assert (other / "keep.txt").read_text() == "mine"
    with pytest.raises(DataError, match="mqar"):
        write_pack(DataConfig(source="mqar", cache_dir=cfg.cache_dir), tmp_path / "m", log=quiet)
    (pack / "stale").write_text("x")
    assert write_pack(cfg, pack, log=quiet) == pack and not (pack / "stale").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp folder left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_meta(write_pack(cfg, empty, log=quiet)) == read_meta(pack)


def test_a_token_pack_must_be_a_pack(tmp_path):
    with pytest.raises(DataError, match="no token pack"):
        DataConfig(source="english", token_pack=str(tmp_path)).validate()
    with pytest.raises(DataError, match="mqar"):
        DataConfig(source="mqar", token_pack=str(tmp_path)).validate()


def test_the_token_pack_does_not_change_a_cell_hash(folder_pack):
    _, pack = folder_pack
    assert "data.token_pack" in NEUTRAL and "data.token_pack" in RESUMABLE
    base = load_config("tiny", ["data.source=english"])
    packed = load_config("tiny", ["data.source=english", f"data.token_pack={pack}"])
    assert packed.data.token_pack == str(pack)
    assert cell_hash(packed) == cell_hash(base)
    assert cell_hash(load_config("tiny", ["data.source=english", "data.val_fraction=0.1"])) != cell_hash(base)


def test_qklab_tokens_writes_a_pack_that_loads(corpus, tmp_path, capsys):
    sets = ["--set", f"data.source={corpus}", "--set", "data.tokenizer=bytes",
            "--set", f"data.cache_dir={tmp_path / 'c1'}"]
    out = tmp_path / "pack"
    assert main(["tokens", "--config", "tiny", *sets, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    meta = read_meta(out)
    assert printed.startswith(f"pack: {out} (") and f"{meta['splits']['train']['tokens']:,} train" in printed
    cfg = load_config("tiny", sets[1::2])
    from_source = prepare_data(cfg.data, log=quiet)
    shutil.rmtree(corpus)
    use = dataclasses.replace(cfg.data, token_pack=str(out), cache_dir=str(tmp_path / "c2"))
    _same_data(prepare_data(use, log=quiet), from_source)


@pytest.mark.parametrize("argv", [["--set", "data.val_fraction=2"], ["--set", "data.source=mqar"]])
def test_qklab_tokens_says_a_mistake_in_one_line(tmp_path, capsys, argv):
    assert main(["tokens", "--config", "tiny", *argv, "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qklab: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "p").exists()
