from __future__ import annotations

import pytest

from qklab.data import BPETokenizer, ByteTokenizer

SAMPLES = [
    "",
    "hello world",
    "def f(x):\n\treturn x ** 2  # square\n",
    "ünïcödé, 日本語, emoji 🙂👍, and a literal <|endoftext|> marker",
    "  leading and trailing spaces  \n\n\n",
]

TINY_CORPUS = [
    "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "the quick brown fox jumps over the lazy dog\n" * 5,
]


def test_byte_tokenizer_ids_are_utf8_bytes_and_round_trip() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode("aé") == [0x61, 0xC3, 0xA9]
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode([0x61, 256, 0x62]) == "a<|endoftext|>b"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced, not an error
    with pytest.raises(ValueError):
        tok.decode([257])


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TINY_CORPUS, vocab_size=300)


def test_bpe_round_trip(bpe: BPETokenizer) -> None:
    for s in SAMPLES + TINY_CORPUS:
        assert bpe.decode(bpe.encode(s)) == s
    assert bpe.encode_batch(SAMPLES) == [bpe.encode(s) for s in SAMPLES]


def test_bpe_vocab_merges_and_eot(bpe: BPETokenizer) -> None:
    assert 257 < bpe.vocab_size <= 300  # 256 bytes + eot + at least one merge
    assert bpe.name == f"bpe-{bpe.vocab_size}"
    text = TINY_CORPUS[2]
    assert len(bpe.encode(text)) < len(text.encode("utf-8"))  # merges compress repeated text
    # the special token is only produced by the pipeline, never by text that spells it
    ids = bpe.encode("a <|endoftext|> b")
    assert bpe.eot_id not in ids
    assert bpe.decode([bpe.eot_id]) == "<|endoftext|>"


def test_bpe_json_round_trip(bpe: BPETokenizer) -> None:
    again = BPETokenizer.from_json(bpe.to_json())
    assert (again.vocab_size, again.eot_id) == (bpe.vocab_size, bpe.eot_id)
    for s in SAMPLES:
        assert again.encode(s) == bpe.encode(s)
