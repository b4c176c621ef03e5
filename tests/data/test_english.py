"""The ``english`` data source on a fake corpus folder made at test time (tests/data/english_fixture.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from english_fixture import EXPECTED, EXPECTED_IDS, PACKAGES, make_corpus

from qklab.cli import main
from qklab.config import load_config
from qklab.data import DataConfig, DataError, english, prepare_data
from qklab.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def quiet(_: str) -> None:
    pass


@pytest.fixture
def corpus_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_corpus(tmp_path / "english")
    monkeypatch.setenv(english.CORPUS_ENV, str(root))
    return root


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(source="english", tokenizer="bytes", val_fraction=0.3, cache_dir=str(tmp_path / "c"), **kw)


def _set_manifest(root: Path, part: str, **fields: str) -> None:
    path = root / english.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["parts"][part].update(fields)
    path.write_text(json.dumps(manifest))


def test_corpus_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(english.CORPUS_ENV, str(tmp_path / "x"))
    assert english.corpus_dir() == tmp_path / "x"
    monkeypatch.delenv(english.CORPUS_ENV)
    assert english.corpus_dir() == Path.home() / ".cache" / "qklab" / "english"


def test_extraction_strips_markup_and_recovers_text(corpus_dir: Path) -> None:
    corpus = english.load_corpus()
    docs = dict(corpus.docs)
    assert sorted(docs) == EXPECTED_IDS
    for rel, text in EXPECTED.items():
        assert docs[rel] == text, rel
    for rel, text in docs.items():
        assert "<" not in text and "&amp;" not in text and "[Applause]" not in text.title(), rel
        assert text == text.strip() and "\n\n\n" not in text and "  " not in text and "\t" not in text, rel
    # long documents come through whole: no sentence of the generated filler is lost
    assert docs["brown/cn02"].count("brown fiction sentence") == 6
    assert docs["python-docs/library/widgets"].count("widgets sentence") == 7
    assert "footer" not in docs["python-docs/tutorial/intro"] and "print" not in docs["python-docs/tutorial/intro"]


def test_order_is_deterministic_and_independent_of_file_order(tmp_path: Path) -> None:
    a = english.load_corpus(make_corpus(tmp_path / "a"))
    b = english.load_corpus(make_corpus(tmp_path / "b", reverse=True))
    assert a.docs == b.docs == sorted(a.docs)
    assert [p for p in a.fingerprint.values()] == [p for p in b.fingerprint.values()]
    assert list(a.fingerprint) == list(english.PART_NAMES)


def test_manifest_records_packages_sizes_and_text_hashes(corpus_dir: Path) -> None:
    manifest = english.read_manifest()
    assert manifest["format"] == english.MANIFEST_FORMAT
    for part in english.PARTS:
        entry = manifest["parts"][part.name]
        registry, package, version, licence = PACKAGES[part.name]
        assert (entry["registry"], entry["package"], entry["version"], entry["licence"]) == (
            registry,
            package,
            version,
            licence,
        )
        every = english.extract_part(corpus_dir, part)
        assert entry["documents"] == len(every) and entry["chars"] == sum(len(t) for _, t in every)
        assert entry["sha256"] == english.text_sha256(every)
        files = [p for p in (corpus_dir / part.name).rglob("*") if p.is_file() and p.name != english.PART_META]
        assert entry["files"] == len(files) and entry["bytes"] == sum(p.stat().st_size for p in files)


def test_cap_keeps_a_deterministic_hash_ordered_subset() -> None:
    docs = [(f"p/{i:03d}", "x" * 10) for i in range(100)]
    kept = english.cap_documents(docs, 255)
    assert len(kept) == 26 and kept == sorted(kept)  # stops once 255 characters are reached
    assert kept == english.cap_documents(list(reversed(docs)), 255)
    assert kept != docs[:26]  # spread over the part, not its first documents
    assert english.cap_documents(docs, 0) == docs
    assert english.cap_documents(docs, 10**6) == docs


def test_prepare_fingerprint_names_each_part(corpus_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    data = prepare_data(_cfg(tmp_path), log=lines.append)
    fp = data.fingerprint
    assert fp["source"] == "english" and fp["files"] == len(EXPECTED_IDS)
    assert list(fp["corpus_parts"]) == list(english.PART_NAMES)
    for name, (registry, package, version, licence) in PACKAGES.items():
        entry = fp["corpus_parts"][name]
        assert (entry["registry"], entry["package"], entry["version"], entry["licence"]) == (
            registry,
            package,
            version,
            licence,
        )
        assert entry["cap_chars"] == next(p.cap_chars for p in english.PARTS if p.name == name)
    assert lines[0].startswith(f"english: {len(EXPECTED_IDS)} files") and "corpus parts: sotu 3 docs" in lines[0]


@pytest.mark.parametrize("field", ["version", "licence"])
def test_fingerprint_and_token_cache_change_with_a_part_version_or_licence(
    corpus_dir: Path, tmp_path: Path, field: str
) -> None:
    before = prepare_data(_cfg(tmp_path), log=quiet)
    _set_manifest(corpus_dir, "brown", **{field: "changed"})
    after = prepare_data(_cfg(tmp_path), log=quiet)
    assert after.fingerprint["corpus_parts"]["brown"][field] == "changed"
    assert after.fingerprint["corpus_parts"] != before.fingerprint["corpus_parts"]
    assert after.fingerprint["sha256"] == before.fingerprint["sha256"]  # same text...
    assert after.train_path != before.train_path  # ...but its tokens are not shared


def test_max_files_keeps_a_subset(corpus_dir: Path, tmp_path: Path) -> None:
    data = prepare_data(_cfg(tmp_path, max_files=5), log=quiet)
    assert data.fingerprint["files"] == 5


def test_missing_corpus_is_one_line_naming_make_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(english.CORPUS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as err:
        prepare_data(_cfg(tmp_path), log=quiet)
    msg = str(err.value)
    assert "\n" not in msg and "make corpus" in msg and str(tmp_path / "nowhere") in msg

    out = str(tmp_path / "runs")
    code = main(["train", "--config", "tiny", "--set", "data.source=english", "--set", f"train.out_dir='{out}'",
                 "--set", f"data.cache_dir='{tmp_path / 'c'}'"])  # fmt: skip
    assert code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "make corpus" in err_lines[0]


def test_a_changed_file_or_missing_part_is_reported(corpus_dir: Path, tmp_path: Path) -> None:
    (corpus_dir / "moby-dick" / "chapter_1.txt").write_text("CHAPTER 1. Changed.\n")
    with pytest.raises(DataError, match=r"part 'moby-dick' .* differs from its manifest.json.*make corpus"):
        english.load_corpus()
    manifest = json.loads((corpus_dir / english.MANIFEST).read_text())
    del manifest["parts"]["bible"]
    (corpus_dir / english.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"lacks part\(s\) bible.*make corpus"):
        english.load_corpus()
    (corpus_dir / english.MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="damaged.*make corpus"):
        english.load_corpus()


def test_trains_a_few_steps_on_english(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        "tiny",
        [
            f"train.out_dir='{tmp_path / 'runs'}'",
            "train.name=english",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=2",
            "train.ckpt_every=4",
            "train.progress=false",
            "data.source=english",
            "data.max_files=0",
            "data.val_fraction=0.3",
            f"data.cache_dir='{tmp_path / 'cache'}'",
        ],
    )
    trainer = Trainer(cfg, log=quiet)
    trainer.run()
    assert trainer.step == 4
    assert trainer.data.fingerprint["source"] == "english"
    assert set(trainer.data.fingerprint["corpus_parts"]) == set(english.PART_NAMES)
    saved = json.loads((trainer.run_dir / "config.json").read_text())
    assert saved["corpus"]["corpus_parts"]["wikipedia"]["licence"] == "CC-BY-SA-4.0"
    losses = [r["loss"] for r in map(json.loads, (trainer.run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]  # fmt: skip
    assert losses and all(math.isfinite(x) for x in losses)


def test_manifest_command_and_installer_script(corpus_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert english.manifest_is_current(corpus_dir)
    assert english.main(["manifest", str(corpus_dir)]) == 0
    assert "is up to date" in capsys.readouterr().out
    (corpus_dir / "sotu" / "speeches" / "2001-Gamma-1.txt").write_text("A new address.\n")
    assert not english.manifest_is_current(corpus_dir)
    # the installer runs english.py as a file (no torch import): it rewrites the stale manifest
    done = subprocess.run([sys.executable, english.__file__, "manifest", str(corpus_dir)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert "sotu" in done.stdout and english.manifest_is_current(corpus_dir)
    assert english.read_manifest(corpus_dir)["parts"]["sotu"]["documents"] == 4
    assert dict(english.load_corpus().docs)["sotu/2001-Gamma-1"] == "A new address."
    (corpus_dir / english.MANIFEST).unlink()
    assert english.main(["manifest", str(corpus_dir)]) == 0
    assert english.read_manifest(corpus_dir)["parts"]["sotu"]["documents"] == 4
    assert english.main(["stats", str(corpus_dir)]) == 0
    assert "total" in capsys.readouterr().out
    assert english.main(["stats", str(corpus_dir / "missing")]) == 2
    assert "make corpus" in capsys.readouterr().err
    script = REPO / "scripts" / "install_corpus.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
