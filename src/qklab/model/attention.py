"""Causal self-attention (MHA and GQA) with a pluggable QK method, and the kernel choice MLA shares.

``attend`` runs one of three kernels on materialised q, k, v (``choose_kernel`` says which):
* sdpa: ``F.scaled_dot_product_attention``, for a method that leaves the logits as they are;
* flex: on CUDA while QK-clip tracks the max logit, FlexAttention, which also returns it
  (``qklab.model.flex``);
* eager: explicit logits -> method.logits -> mask -> softmax, for a method that rewrites logits, for
  ``model.attn_impl=eager``, and for diagnostics, which read the pre-softmax logits (set
  ``attn.capture = {}`` and read ``capture["logits"]``, ``capture["probs"]``).
``Attention`` (MHA/GQA), ``MLAttention``'s materialised path and ``qklab.QK.attend`` all call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from qklab.methods import METHODS, AttnShape, QKMethod
from qklab.methods.headwise import AttnKind
from qklab.model.flex import flex_causal_with_max, flex_usable
from qklab.model.rope import Rope


@dataclass
class KVCache:
    """Per-layer cache of post-RoPE keys and values: k (B, Hkv, L, Dk), v (B, Hkv, L, Dv)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        if self.length + T > self.k.shape[2]:
            raise ValueError(f"KV cache full: {self.length + T} > {self.k.shape[2]} positions")
        self.k[:, :, self.length : self.length + T] = k
        self.v[:, :, self.length : self.length + T] = v
        self.length += T
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


def causal_mask(Tq: int, Tk: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i (at absolute position Tk - Tq + i) may see key j."""
    offset = Tk - Tq
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=offset)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool = False,
                sink: torch.Tensor | None = None) -> torch.Tensor:
    """Causal fused attention of q (B, H, Tq, F) over the last-Tq-aligned keys k (B, Hk, Tk, F) and v;
    (B, H, Tq, Dv). A single query (decoding) sees every key, so it needs no mask.

    ``sink`` (H,): a per-head logit b_h in every softmax denominator, exp(s_ij) / (exp(b_h) + sum_j exp(s_ij)),
    exactly: one extra key and value of zeros (its logit q.0 = 0) whose float mask entry is b_h.

    PyTorch's CPU flash kernel needs one head width for q, k and v; with another (MLA: q/k nope + rope,
    v narrower) it falls back to the math path, which keeps the (Tq, Tk) probabilities. So on CPU the
    narrower side is zero-padded: zero columns of v give output columns that are sliced off, zero
    columns of q and k add nothing to q.k (the scale is explicit)."""
    Fq, Dv = q.shape[-1], v.shape[-1]
    if Fq != Dv and q.device.type == "cpu":
        if Dv < Fq:
            return sdpa_causal(q, k, F.pad(v, (0, Fq - Dv)), scale, gqa, sink)[..., :Dv]
        q, k = F.pad(q, (0, Dv - Fq)), F.pad(k, (0, Dv - Fq))
    Tq, Tk = q.shape[2], k.shape[2]
    if sink is not None:
        k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))  # the sink: a zero key and value after the rest
        bias = torch.zeros(q.shape[1], Tq, Tk, dtype=q.dtype, device=q.device)
        if Tq > 1:
            bias = bias.masked_fill(~causal_mask(Tq, Tk, q.device), float("-inf"))
        bias = torch.cat([bias, sink.to(q.dtype).view(-1, 1, 1).expand(-1, Tq, 1)], dim=-1)  # (H, Tq, Tk + 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = None if Tq == 1 else causal_mask(Tq, Tk, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@torch.no_grad()
def head_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, logits_fn=None, chunk: int = 32) -> torch.Tensor:
    """Per-head max over batch, queries and allowed keys of the pre-softmax logit, (H,); q (B, H, Tq, F),
    k (B, Hkv, Tk, F), queries aligned with the last Tq keys. ``logits_fn``: a method's rewrite of the
    scaled logits (None: none, and the scale is applied to the max alone, which is exact for scale > 0).

    In query chunks of ``chunk`` rows, each against the keys its queries may see: the keys before the
    chunk, seen by all of its queries (no mask), and the chunk's own causal triangle. So at most
    (B, H, chunk, Tk) logits exist at a time, and the pass does about half the work of a full QK^T."""
    H, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, H, Tk, F)
    kt = k.transpose(-2, -1)  # (B, H, F, Tk)
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    best = torch.full((H,), float("-inf"), device=q.device)
    for i in range(0, Tq, chunk):
        c = min(chunk, Tq - i)
        lo, end = Tk - Tq + i, Tk - Tq + i + c  # keys [0, lo) seen by every query; [lo, end) by some
        s = q[:, :, i : i + c] @ kt[..., :end]  # (B, H, c, end)
        if logits_fn is not None:
            s = logits_fn(s * scale)
        if lo > 0:
            best = torch.maximum(best, s[..., :lo].amax(dim=(0, 2, 3)).float())
        diag = s[..., lo:end].masked_fill(~tri[:c, :c], float("-inf"))  # (B, H, c, c)
        best = torch.maximum(best, diag.amax(dim=(0, 2, 3)).float())
    return best if logits_fn is not None else best * scale


def softmax_with_sink(s: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of masked logits s (B, H, Tq, Tk), in fp32 (fp64 logits: in fp64), with the
    per-head sink logit (H,) in the denominator (the sink's own probability is dropped)."""
    s = s.to(torch.promote_types(s.dtype, torch.float32))  # fp32, or fp64 for fp64 logits
    if sink is None:
        return torch.softmax(s, dim=-1)
    b = sink.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    return torch.softmax(torch.cat([s, b], dim=-1), dim=-1)[..., :-1]


def make_gate(cfg, n_heads: int, head_out: int) -> nn.Linear | None:
    """``model.attn_gate``: W_g, (C -> H) for "head" or (C -> H * head_out) for "element"; None for "none"."""
    kind = getattr(cfg, "attn_gate", "none")
    if kind == "none":
        return None
    return nn.Linear(cfg.d_model, n_heads * (1 if kind == "head" else head_out), bias=False)


def apply_gate(wg: nn.Linear | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (B, H, T, Dv) times sigmoid(W_g x), x (B, T, C): one gate per head or per output feature."""
    if wg is None:
        return y
    B, H, T, _ = y.shape
    return y * torch.sigmoid(wg(x)).view(B, T, H, -1).transpose(1, 2).to(y.dtype)


def make_sink(cfg, n_heads: int) -> nn.Parameter | None:
    """``model.attn_sink``: one sink logit per head (initialised in ``GPT.init_weights``)."""
    return nn.Parameter(torch.zeros(n_heads)) if getattr(cfg, "attn_sink", False) else None


class MaxLogitTracker:
    """Per-head running max of the pre-softmax logit over every training-mode forward while
    ``track_max_logit`` is on (QK-clip reads it once per optimizer step with ``pop_max_logit``);
    evaluation forwards (``model.eval()``) do not count."""

    @property
    def tracking(self) -> bool:
        return self.track_max_logit and self.training

    def init_tracker(self, n_heads: int) -> None:
        self.track_max_logit = False
        self.max_logit = torch.full((n_heads,), float("-inf"))

    def _track(self, m: torch.Tensor) -> None:
        self.max_logit = torch.maximum(self.max_logit.to(m.device), m.float())

    def pop_max_logit(self) -> torch.Tensor:
        """Per-head max logit seen since the last call, (H,); resets the tracker."""
        out, self.max_logit = self.max_logit, torch.full_like(self.max_logit, float("-inf"))
        return out


Kernel = Literal["sdpa", "flex", "eager"]


def choose_kernel(qk: QKMethod, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eager: bool = False,
                  sink: torch.Tensor | None = None, tracking: bool = False, capture: bool = False,
                  causal: bool = True, mask: torch.Tensor | None = None) -> Kernel:
    """Which kernel ``attend`` runs for q (B, H, Tq, F), k (B, Hkv, Tk, F), v (B, Hkv, Tk, Dv).

    eager: asked for (``model.attn_impl=eager``), or needed: a method that rewrites logits (SDPA would
    drop the rewrite), a ``capture`` (diagnostics read the logits), or a mask other than the causal one.
    flex: while a tracker wants the per-head max logit, where FlexAttention hands it back (CUDA, one
    length for queries and keys, no sink, widths ``flex_usable`` takes). sdpa: everything else."""
    if eager or qk.modifies_logits or capture or not causal or mask is not None:
        return "eager"
    if tracking and sink is None and flex_usable(q, k, v):
        return "flex"
    return "sdpa"


def attend(qk: QKMethod, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eager: bool = False,
           sink: torch.Tensor | None = None, tracker: MaxLogitTracker | None = None,
           capture: dict[str, torch.Tensor] | None = None, causal: bool = True,
           mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of q (B, H, Tq, F) over k (B, Hkv, Tk, F), v (B, Hkv, Tk, Dv) as method ``qk`` forms its
    logits: ``scale`` (None: ``qk.scale(F)``; MLA passes it with YaRN's correction), ``qk.logits`` rewrite,
    causal mask (queries last-aligned with the keys; ``causal=False``: every key; ``mask`` (B|1, 1|H, Tq, Tk)
    bool, True where a query sees a key: that mask, e.g. documents packed in one row), softmax with the
    per-head ``sink`` logits (H,) if any; (B, H, Tq, Dv).

    The kernel is ``choose_kernel``'s; all three compute the same attention. ``capture``: a dict that
    receives the logits, probabilities, mask, q and k (eager). ``tracker``: while it tracks, it gets the
    per-head max logit of this forward (eager: from its logits; flex: the kernel's; sdpa: a chunked QK^T
    pass, ``head_max_logit``)."""
    scale = qk.scale(q.shape[-1]) if scale is None else scale
    tracking = tracker is not None and tracker.tracking
    gqa = k.shape[1] != q.shape[1]
    kernel = choose_kernel(qk, q, k, v, eager=eager, sink=sink, tracking=tracking, capture=capture is not None,
                           causal=causal, mask=mask)
    if kernel == "eager":
        return eager_attention(qk, q, k, v, scale, sink, tracker if tracking else None, capture, causal, mask)
    if kernel == "flex":  # CUDA: the max logit from the kernel
        y, m = flex_causal_with_max(q, k, v, scale, gqa=gqa)
        tracker._track(m)
        return y
    if tracking:  # a second, chunked QK^T pass (the logits are not rewritten on this path)
        tracker._track(head_max_logit(q, k, scale))
    return sdpa_causal(q, k, v, scale, gqa=gqa, sink=sink)


def eager_attention(qk: QKMethod, q, k, v, scale: float, sink=None, tracker: MaxLogitTracker | None = None,
                    capture: dict[str, torch.Tensor] | None = None, causal: bool = True,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """The explicit kernel of ``attend``: logits -> ``eager_probs`` -> p @ v, (B, H, Tq, Dv)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, L, *)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if mask is None and causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    elif mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    p = eager_probs(qk, s, mask, sink, q.dtype, tracker, capture)  # (B, H, Tq, Tk)
    if capture is not None:
        capture["q"], capture["k"] = q.detach(), k.detach()
    return p @ v  # (B, H, Tq, Dv)


def eager_probs(qk: QKMethod, s: torch.Tensor, mask: torch.Tensor | None, sink: torch.Tensor | None,
                dtype: torch.dtype, tracker: MaxLogitTracker | None = None,
                capture: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Scaled logits s (B, H, Tq, Tk) -> ``qk.logits`` -> ``mask`` (bool, True where a query sees a key;
    None: every key, a single decoding query) -> softmax in fp32 or wider with the ``sink`` logits ->
    probabilities (B, H, Tq, Tk) in ``dtype``. The eager kernel and MLA's absorbed decoding both run it.
    ``tracker``: gets the per-head max of the masked logits; ``capture``: the logits, probabilities, mask."""
    s = qk.logits(s)
    seen = s if mask is None else s.masked_fill(~mask, float("-inf"))
    p = softmax_with_sink(seen, sink).to(dtype)
    if tracker is not None:
        tracker._track(seen.detach().amax(dim=(0, 2, 3)))
    if capture is not None:
        capture["logits"], capture["probs"], capture["mask"] = s.detach(), p.detach(), mask
    return p


class Attention(nn.Module, MaxLogitTracker):
    """MHA, or GQA with fewer KV heads than query heads (``model.n_kv_heads``)."""

    kind: ClassVar[AttnKind] = "mha"  # what controllers and the optimizer test (``methods.headwise.is_mla``)

    def __init__(self, cfg, qk_cfg, layer_idx: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        shape = AttnShape(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, layer_idx, cfg.n_layers)
        self.qk: QKMethod = METHODS[qk_cfg.method](shape, qk_cfg.opts(qk_cfg.method))
        dqk = self.qk.proj_dim()
        self.wq = nn.Linear(self.qk.qk_in_dim(), self.n_heads * dqk, bias=False)
        self.wk = nn.Linear(self.qk.qk_in_dim(), self.n_kv_heads * dqk, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.wg = make_gate(cfg, self.n_heads, self.head_dim)  # model.attn_gate (None: no gate)
        self.sink = make_sink(cfg, self.n_heads)  # model.attn_sink (None: no sink)
        self.impl = cfg.attn_impl
        self.capture: dict[str, torch.Tensor] | None = None
        self.init_tracker(self.n_heads)

    def scale(self, width: int) -> float:
        """The softmax scale of q.k over ``width`` features: the method's (as ``attend`` takes it by default;
        MLA's adds YaRN's correction), so diagnostics ask either attention kind the same question."""
        return self.qk.scale(width)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, C)
        pos = cache.length if cache is not None else 0
        xqk = self.qk.map_input(x)  # (B, T, C') -- x itself for most methods
        q = self.wq(xqk).view(B, T, self.n_heads, -1).transpose(1, 2)  # (B, H, T, d')
        k = self.wk(xqk).view(B, T, self.n_kv_heads, -1).transpose(1, 2)  # (B, Hkv, T, d')
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = self.qk.map_qk(q, k, rope, pos)  # (B, H, T, F), (B, Hkv, T, F)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, L, F), (B, Hkv, L, D)
        y = attend(self.qk, q, k, v, eager=self.impl == "eager", sink=self.sink, tracker=self,
                   capture=self.capture)  # (B, H, T, D)
        y = apply_gate(self.wg, x, y)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(y)
