"""A model's own RoPE as qklab's methods see it (``qklab.methods.base.Rope``).

A method rotates q and k itself (``map_qk(q, k, rope, pos)``: QK-MAP rotates its features, QK-Norm its
normalised q and k), always in qklab's layout: x (B, H, T, D) whose rotary pairs are (i, i + D/2), the
"half-split" convention of Llama and Qwen. A model's RoPE comes in one of three forms:

* a callable ``rope(x, positions)``: x (B, H, T, D) (``layout="bthd"``: (B, T, H, D)), positions (T,) or
  (B, T) absolute positions; returns x rotated, in the same layout;
* tables ``(cos, sin)``, each (L, D) (the halves repeated, as Llama keeps them) or (L, D/2) (one angle per
  rotary pair), rows indexed by position;
* a complex tensor ``freqs_cis`` (L, D/2), e^{i theta}, as torchtitan and the Llama reference code keep it.

and in one of two conventions: ``"half"`` (pairs (i, i + D/2)) or ``"interleaved"`` (pairs (2i, 2i + 1),
GPT-J, the Llama reference code, torchtitan's complex RoPE). With an interleaved RoPE, q and k are put
into the half-split layout before the method sees them (``to_half``: one fixed permutation of each head's
features, the same for q and k, so every dot product q . k is unchanged), and the callable is called
on them laid out back (``to_interleaved``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qklab.errors import ConfigError
from qklab.model.rope import rope_reference

CONVENTIONS = ("half", "interleaved")
LAYOUTS = ("bhtd", "bthd")


def to_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) with rotary pairs (2i, 2i + 1) -> the same features with pairs (i, i + D/2)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_half``: pairs (i, i + D/2) -> (2i, 2i + 1)."""
    a, b = x.chunk(2, dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)


def _half_tables(rope, convention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, D) in the half-split layout from (cos, sin) of (L, D) or (L, D/2), or a complex (L, D/2)."""
    if isinstance(rope, torch.Tensor):
        if not rope.is_complex():
            raise ConfigError("a RoPE tensor must be complex (freqs_cis, (L, D/2)); give real tables as (cos, sin)")
        cos, sin = rope.real, rope.imag
    else:
        cos, sin = rope
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ConfigError(f"RoPE tables cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be (max_len, D) "
                          "or (max_len, D/2)")
    return cos, sin


class UserRope:
    """A model's RoPE in one of the three forms above; ``bind(positions)`` gives the per-forward ``Rope``
    a method calls. ``head_dim``: the rotated width, when tables give one angle per pair (D/2 columns)."""

    def __init__(self, rope, convention: str = "half", layout: str = "bhtd") -> None:
        if convention not in CONVENTIONS:
            raise ConfigError(f"rope convention={convention!r}: use half or interleaved")
        if layout not in LAYOUTS:
            raise ConfigError(f"rope layout={layout!r}: use bhtd (B, H, T, D) or bthd (B, T, H, D)")
        self.convention, self.layout = convention, layout
        self.fn: Callable | None = None
        self.cos = self.sin = None
        if callable(rope) and not isinstance(rope, torch.Tensor):
            self.fn = rope
        elif isinstance(rope, torch.Tensor | tuple | list):
            self.cos, self.sin = _half_tables(rope, convention)
        else:
            raise ConfigError(f"rope must be a callable rope(x, positions), (cos, sin) tables or a complex freqs_cis, "
                              f"got {type(rope).__name__}")

    @property
    def interleaved(self) -> bool:
        return self.convention == "interleaved"

    def tables(self, dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (L, dim) in the half-split layout."""
        cos, sin = self.cos, self.sin
        if cos.shape[1] == dim // 2:  # one angle per rotary pair: the pair's two features share it
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        elif cos.shape[1] != dim:
            raise ConfigError(f"RoPE tables have {self.cos.shape[1]} columns, q/k features {dim}: give (L, {dim}) or "
                              f"(L, {dim // 2}) tables, or method options that keep the head width")
        elif self.interleaved:  # (L, D) interleaved tables repeat each angle twice in a row
            cos, sin = cos[:, 0::2].repeat(1, 2), sin[:, 0::2].repeat(1, 2)
        return cos.to(device, dtype), sin.to(device, dtype)

    def bind(self, positions: torch.Tensor) -> BoundRope:
        """The ``Rope`` of one forward at ``positions`` ((T,) or (B, T) absolute positions)."""
        if self.fn is None and positions.dim() == 1:
            return BoundTables(self, positions)
        return BoundRope(self, positions)


class BoundRope:
    """``qklab.methods.base.Rope`` at fixed positions: x (B, H, T, D) half-split -> rotated."""

    def __init__(self, rope: UserRope, positions: torch.Tensor) -> None:
        self.rope, self.pos = rope, positions

    def positions(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        """The absolute positions of x's rows, (T,) or (B, T) (SSMax counts the keys a query sees from them)."""
        return self.pos

    def _angles(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope.tables(x.shape[-1], x.device, x.dtype)
        cos, sin = cos[self.pos], sin[self.pos]  # (T, D) or (B, T, D)
        if self.pos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        return cos, sin

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        r = self.rope
        if r.fn is None:
            return rope_reference(x, *self._angles(x))
        y = to_interleaved(x) if r.interleaved else x
        if r.layout == "bthd":
            y = r.fn(y.transpose(1, 2), self.pos).transpose(1, 2)
        else:
            y = r.fn(y, self.pos)
        return to_half(y) if r.interleaved else y


class BoundTables(BoundRope):
    """Tables at one set of positions for the whole batch: also gives ``window``, which QK-Norm fuses with
    its normalisation (one pass, as with qklab's own ``Rope``)."""

    def window(self, x: torch.Tensor, pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin, signed sin (-sin_1, sin_2), each (T, D), in x's dtype."""
        cos, sin = self._angles(x)
        h = x.shape[-1] // 2
        return cos, sin, torch.cat([-sin[:, :h], sin[:, h:]], dim=-1)


class NoRope(BoundRope):
    """No rotation at the given positions: what a method sees when it is applied after the model's RoPE."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.pos = positions

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        return x
