"""Tokenizers: raw bytes, and byte-level BPE built with the Hugging Face `tokenizers` library."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT_TOKEN = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the package needs from a tokenizer."""

    name: str  # e.g. "bytes" or "bpe-4096"; part of the token cache key

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is the end-of-text token."""

    name = "bytes"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eot_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; the end-of-text id becomes EOT_TOKEN, broken UTF-8 becomes U+FFFD."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eot_id:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(EOT_TOKEN)
                buf.clear()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise ValueError(f"token id {i} is outside the byte vocabulary (0..256)")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class BPETokenizer:
    """Byte-level BPE; any text round-trips exactly through encode and decode.

    A literal "<|endoftext|>" inside a document is encoded as ordinary text, so the
    end-of-text id only ever appears where the pipeline puts it between documents.
    """

    def __init__(self, tok: HFTokenizer) -> None:
        eot = tok.token_to_id(EOT_TOKEN)
        if eot is None:
            raise ValueError(f"BPE tokenizer has no {EOT_TOKEN!r} token")
        tok.encode_special_tokens = True
        self._tok = tok
        self._eot_id = int(eot)
        self.name = f"bpe-{tok.get_vocab_size()}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges from texts until the vocabulary (special token included) has vocab_size entries."""
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        return cls(HFTokenizer.from_str(text))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def to_json(self) -> str:
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eot_id(self) -> int:
        return self._eot_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
