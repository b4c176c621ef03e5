"""``qklab.QK``: a forward-side QK method inside any PyTorch attention, with the model's own RoPE.

    qk = qklab.QK("qknorm", n_heads=12, n_kv_heads=4, head_dim=64, rope=my_rope)   # in __init__
    self.wq = nn.Linear(qk.in_features, qk.q_features); self.wk = nn.Linear(qk.in_features, qk.k_features)
    q, k = qk(q, k, positions)      # q (B, H, T, d'), k (B, Hkv, T, d') from the projections, pre-RoPE
    y = qk.attend(q, k, v)          # causal attention as the method forms its logits (SDPA where it can)

``forward`` maps q and k and rotates them with the model's RoPE (``qklab.model.user_rope``: a callable
``rope(x, positions)``, (cos, sin) tables or a complex ``freqs_cis``, half-split or interleaved) in the
order the method needs; the q and k it returns enter the dot product as they are, scaled by ``qk.scale``.
A method that rewrites logits (softcap) needs its ``logits`` on them: ``attend`` applies it, or call
``qk.logits(s)`` on your own scaled logits. ``after_rope`` applies a method to q and k the model has
already rotated, for the methods whose map commutes with RoPE; the others refuse in one line.

The widths the projections need (``in_features``, ``q_features``, ``k_features``: QK-MAP narrows q and k)
and their initialisation (``init_qk_``) come from the same object. qklab's own ``Attention`` runs the same
two calls: ``QKMethod.map_qk`` and ``qklab.model.attention.attend``.

QK-clip and max-logit logging (``qklab.attach`` with ``LayerSpec(..., logits="<this module's name>")``)
read the logits of the q and k ``forward`` and ``after_rope`` return: while the attached layer measures
(training forwards), each call adds their per-head max logit.
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.errors import ConfigError
from qklab.methods import METHODS, AttnShape, QKMethod
from qklab.methods.build import method_options
from qklab.model.attention import attend, causal_mask, head_max_logit
from qklab.model.rope import Rope
from qklab.model.user_rope import NoRope, UserRope, to_half


def _positions(positions, T: int, device) -> torch.Tensor:
    """None -> 0 .. T - 1; an int p -> p .. p + T - 1; a tensor (T,) or (B, T) as it is."""
    if positions is None or isinstance(positions, int):
        p = positions or 0
        return torch.arange(p, p + T, device=device)
    if positions.dim() not in (1, 2) or positions.shape[-1] != T:
        raise ConfigError(f"positions {tuple(positions.shape)} must be (T,) or (B, T) with T = {T}")
    return positions.to(device)


def build_method(method: str, shape: AttnShape, opts: object) -> QKMethod:
    """The method's module for one layer of ``shape``; a shape it cannot take (QK-MAP's widths, QK-Norm's
    k_group) is the user's to fix: one line (``ConfigError``)."""
    try:
        return METHODS[method](shape, opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@torch.no_grad()
def masked_max(q: torch.Tensor, k: torch.Tensor, scale: float, rewrite, causal: bool,
               segments: torch.Tensor | None, chunk: int = 64) -> torch.Tensor:
    """Per-head max logit, (H,) fp32, of q (B, H, T, F) over the keys k (B, Hkv, T, F) each query sees:
    causal or all, and only those of its own segment (``segments`` (B, T) document ids); in query chunks,
    so at most (B, H, chunk, T) logits exist at a time."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, T, F)
    T = q.shape[2]
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for i in range(0, T, chunk):
        s = (q[:, :, i : i + chunk] @ k.transpose(-2, -1)) * scale  # (B, H, c, T)
        s = rewrite(s) if rewrite is not None else s
        seen = torch.ones(s.shape[2], T, dtype=torch.bool, device=q.device)  # (c, T)
        if causal:
            seen = seen.tril(diagonal=i)
        seen = seen[None, None]
        if segments is not None:
            seen = seen & (segments[:, None, i : i + chunk, None] == segments[:, None, None, :])  # (B, 1, c, T)
        best = torch.maximum(best, s.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3)).float())
    return best


class QK(nn.Module):
    """One attention layer's forward-side QK method (``method``: a name of ``qklab.methods.METHODS``, with its
    ``options``), for ``n_heads`` query heads and ``n_kv_heads`` key heads (default: n_heads) of width
    ``head_dim``; ``d_model`` the width of the attention input (default n_heads * head_dim).

    ``rope``: the model's RoPE (see ``qklab.model.user_rope``), qklab's own ``Rope``, or None (a model
    without RoPE); ``convention`` "half" | "interleaved"; ``layout`` of what a RoPE callable takes, "bhtd" |
    "bthd". With an interleaved RoPE the q and k returned are in the half-split layout (each head's
    features permuted alike: the same dot products). ``causal``: queries see the keys up to their own
    position (``attend`` and the measured max logits); False: every key."""

    def __init__(self, method: str = "none", *, n_heads: int, head_dim: int, n_kv_heads: int | None = None,
                 d_model: int | None = None, rope=None, convention: str = "half", layout: str = "bhtd",
                 causal: bool = True, layer_idx: int = 0, n_layers: int = 1, **options) -> None:
        super().__init__()
        n_kv = n_kv_heads or n_heads
        if n_heads < 1 or head_dim < 1 or n_heads % n_kv:
            raise ConfigError(f"n_heads={n_heads}, n_kv_heads={n_kv}, head_dim={head_dim}: need positive sizes and "
                              "n_kv_heads dividing n_heads")
        shape = AttnShape(d_model or n_heads * head_dim, n_heads, n_kv, head_dim, layer_idx, n_layers)
        self.method: QKMethod = build_method(method, shape, method_options(method, options))
        if self.method.causal_only and not causal:
            raise ConfigError(f"{method} is defined for causal attention only (a query sees no later key); "
                              "use causal=True")
        self.causal = causal
        self.own_rope = rope if isinstance(rope, Rope) else None  # qklab's Rope: called with a position offset
        self.rope = UserRope(rope, convention, layout) if rope is not None and self.own_rope is None else None
        if self.rope is None and convention != "half":
            raise ConfigError("convention='interleaved' describes a RoPE: give it as rope=...")
        self.eager = False  # True: explicit logits in attend even where SDPA could run

    # --- the projections -------------------------------------------------------------------------
    @property
    def in_features(self) -> int:
        """Input width of W_Q and W_K: d_model, or the width of ``map_input``'s output (QK-MAP input)."""
        return self.method.qk_in_dim()

    @property
    def q_features(self) -> int:
        """Output width of W_Q: n_heads * proj_dim."""
        return self.method.shape.n_heads * self.method.proj_dim()

    @property
    def k_features(self) -> int:
        """Output width of W_K: n_kv_heads * proj_dim."""
        return self.method.shape.n_kv_heads * self.method.proj_dim()

    @property
    def proj_dim(self) -> int:
        """Per-head width of q and k out of the projections (d'), what ``forward`` takes."""
        return self.method.proj_dim()

    @property
    def feature_dim(self) -> int:
        """Per-head width of the q and k ``forward`` returns (what a KV cache keeps)."""
        return self.method.feature_dim()

    @property
    def scale(self) -> float:
        """The softmax scale of q . k for this method (1/sqrt(F), or 1 for QUEST and QK-MAP)."""
        return self.method.scale(self.method.feature_dim())

    @property
    def rewrites_logits(self) -> bool:
        """True when the method rewrites the scaled logits (softcap): SDPA alone would drop that; use ``attend``
        or ``logits``."""
        return self.method.modifies_logits

    def map_input(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> the input of W_Q and W_K (B, T, in_features); x itself except for QK-MAP input."""
        return self.method.map_input(x)

    @torch.no_grad()
    def init_qk_(self, *weights: torch.Tensor | nn.Linear, std: float = 0.02) -> None:
        """Initialise W_Q and W_K (Linears, or their weights: rows of a fused matrix included) as qklab
        initialises its own: N(0, the method's std for them, ``std`` unless the method asks otherwise), and
        the method's own parameters."""
        s = self.method.qk_init_std(std)
        for w in weights:
            nn.init.normal_(w.weight if isinstance(w, nn.Module) else w, 0.0, s)
        self.method.reset_parameters()

    def reset_parameters(self) -> None:
        self.method.reset_parameters()

    # --- q and k -----------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | int | None = None, *,
                rope: UserRope | None = None, segments: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, T, d'), k (B, Hkv, T, d') straight from the projections -> q (B, H, T, F), k (B, Hkv, T, F)
        mapped and rotated at ``positions`` ((T,) or (B, T) absolute positions, an offset, or None: 0 ..).
        ``rope``: this call's RoPE in place of the one given at construction (a framework whose tables live
        in a buffer of its own). ``segments`` (B, T): document ids of rows packed with several documents (a
        query sees no key of another), for the measured max logits."""
        if rope is not None:
            pos = _positions(positions, q.shape[2], q.device)
            if rope.interleaved:
                q, k = to_half(q), to_half(k)
            q, k = self.method.map_qk(q, k, rope.bind(pos), 0)
        elif self.own_rope is not None:
            if not (positions is None or isinstance(positions, int)):
                raise ConfigError("qklab's own Rope takes a position offset (an int), not a positions tensor")
            q, k = self.method.map_qk(q, k, self.own_rope, positions or 0)
        else:
            pos = _positions(positions, q.shape[2], q.device)
            if self.rope is not None and self.rope.interleaved:
                q, k = to_half(q), to_half(k)
            q, k = self.method.map_qk(q, k, self.rope.bind(pos) if self.rope is not None else NoRope(pos), 0)
        self._measure(q, k, segments)
        return q, k

    def after_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The method on q (B, H, T, D) and k (B, Hkv, T, D) the model has already rotated: the same q . k as
        ``forward`` on them before RoPE, for methods whose map commutes with the rotation; refused otherwise."""
        reason = self.method.after_rope_refusal()
        if reason:
            raise ConfigError(reason)
        q, k = self.method.map_qk(q, k, NoRope(_positions(positions, q.shape[2], q.device)), 0)
        self._measure(q, k)
        return q, k

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """The method's rewrite of scaled logits s (B, H, Tq, Tk) (softcap; the identity for the others)."""
        return self.method.logits(s)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of what ``forward`` returned, v (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv): fused SDPA, or explicit
        logits for a method that rewrites them or a ``mask`` (B|1, 1|H, Tq, Tk) bool, True where a query sees a
        key (in place of the causal one); ``sink`` (H,) per-head sink logits."""
        if mask is not None and self.method.causal_only:
            Tq, Tk = mask.shape[-2:]
            if (mask & ~causal_mask(Tq, Tk, mask.device)).any():
                raise ConfigError(f"{self.method.name} is defined for causal attention only, but the mask lets a "
                                  "query see a later key")
        return attend(self.method, q, k, v, eager=self.eager, sink=sink, causal=self.causal, mask=mask)

    @torch.no_grad()
    def _measure(self, q: torch.Tensor, k: torch.Tensor, segments: torch.Tensor | None = None) -> None:
        """Feed the attached layer's tracker (``qklab.attach``) with this forward's per-head max logit."""
        layer = getattr(self, "qk_layer", None)
        if layer is None or not layer.tracking:
            return
        rewrite = self.method.logits if self.method.modifies_logits else None
        if self.causal and segments is None:
            layer._track(head_max_logit(q, k, self.scale, rewrite))
            return
        layer._track(masked_max(q, k, self.scale, rewrite, self.causal, segments))

    def extra_repr(self) -> str:
        conv = "qklab Rope" if self.own_rope is not None else (self.rope.convention if self.rope else "no RoPE")
        return f"rope={conv}, causal={self.causal}"
