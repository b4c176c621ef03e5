from __future__ import annotations

import re
from pathlib import Path

import pytest

from qklab.data import DataConfig, DataError, prepare_data


def test_defaults_are_valid() -> None:
    DataConfig().validate()
    assert issubclass(DataError, ValueError)


def test_missing_path_message(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "*.txt")
    with pytest.raises(DataError) as err:
        DataConfig(source=missing).validate()
    msg = str(err.value)
    assert "\n" not in msg
    assert (
        msg == f"data.source: no such file, folder or glob {missing!r}; give an existing path or 'pystdlib'"
    )
    with pytest.raises(DataError, match="no such file"):
        DataConfig(source=str(tmp_path / "missing.txt")).validate()


def test_missing_path_is_reported_by_prepare_data(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.source"):
        prepare_data(
            DataConfig(source=str(tmp_path / "absent"), cache_dir=str(tmp_path / "c")), log=lambda s: None
        )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 65536}, "data.vocab_size"),
        ({"vocab_size": 259}, "data.vocab_size"),
        ({"vocab_size": 4096.0}, "data.vocab_size"),
        ({"tokenizer": "wordpiece"}, "data.tokenizer"),
        ({"val_fraction": 0.0}, "data.val_fraction"),
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"max_files": -1}, "data.max_files"),
        ({"source": "hf:"}, "data.source"),
        ({"source": ""}, "data.source"),
        ({"text_field": ""}, "data.text_field"),
        ({"cache_dir": ""}, "data.cache_dir"),
        ({"mqar_keys": 1}, "data.mqar_keys"),
        ({"mqar_keys": 2.5}, "data.mqar_keys"),
        ({"max_files": True}, "data.max_files"),
        ({"mqar_pairs": 0}, "data.mqar_pairs"),
        ({"mqar_queries": -1}, "data.mqar_queries"),
    ],
)
def test_invalid_values(changes: dict[str, object], field: str) -> None:
    with pytest.raises(DataError) as err:
        DataConfig(**changes).validate()  # type: ignore[arg-type]
    assert re.match(re.escape(field) + "[=:]", str(err.value)), str(err.value)  # one line naming the key
    assert "\n" not in str(err.value)


def test_vocab_bounds_are_inclusive_and_bpe_only() -> None:
    DataConfig(vocab_size=260).validate()
    DataConfig(vocab_size=65535).validate()
    DataConfig(tokenizer="bytes", vocab_size=10**6).validate()  # ignored for bytes
