"""Reading attention internals through the eager path's capture dicts, in fp32 and without gradients.

Every attention layer (``model.blocks[i].attn``) has a ``capture`` attribute: set it to a dict and the
next forward pass runs the eager path and fills it with

* ``logits`` (B, H, Tq, Tk): after the method's scaling and soft-cap, before the mask;
* ``probs`` (B, H, Tq, Tk), ``mask`` (Tq, Tk), True where a query may see a key;
* ``q`` (B, H, Tq, F) and ``k`` (B, Hk, Tk, F): after the method's map and RoPE (Hk is H or the KV
  head count).

The W_Q / W_K norms depend on how a layer type parametrises its logit path. The default reads the
matrices of ``qklab.methods.headwise.logit_matrices`` (the ones the QK controllers act on): for
MHA/GQA the head's block of W_Q / W_K; for MLA the linear map from the attention input to head h's q
(k) before the QK method's map, [W_uq^h W_dq ; W_qr^h W_dq] and [W_uk^h W_dkv ; W_kr], with the latent
RMSNorms left out (as in QuacK's partner norms). Another layer type plugs in its own rule with
``register_qk_weight_norms(AttentionClass, fn)``.

The eager capture holds a layer's full (B, H, T, T) logits and probabilities. The measurements of long
contexts use ``qk_hooks`` instead: the layer keeps its fast path, and its q and k (after the method's
map and RoPE) are handed to a callback as soon as they exist, which reduces them to per-head numbers
from ``logit_rows`` in query chunks; ``rope_length`` lets a model run past its RoPE tables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from qklab.methods.headwise import is_mla, logit_matrices

# fn(attn) -> (||W_Q^h||_F (H,), ||W_K^h||_F (H,)); a KV head's norm is repeated for its query heads
QKWeightNorms = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]
_WEIGHT_NORMS: dict[type, QKWeightNorms] = {}


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def probe_mode(model: nn.Module) -> Iterator[None]:
    """eval mode, no gradients, autocast off (fp32 on fp32 weights); restores the training flag. Layers
    that track a running max logit for a controller (``track_max_logit``, QK-clip) stop tracking
    meanwhile, so probe batches never feed the controller."""
    was_training = model.training
    tracking = [(a, a.track_max_logit) for a in model.attention_layers() if hasattr(a, "track_max_logit")]
    model.eval()
    try:
        for a, _ in tracking:
            a.track_max_logit = False
        with torch.no_grad(), torch.autocast(model_device(model).type, enabled=False):
            yield
    finally:
        for a, flag in tracking:
            a.track_max_logit = flag
        model.train(was_training)


@contextlib.contextmanager
def capturing(model: nn.Module, reduce: Callable[[dict], None] | None = None) -> Iterator[list[dict]]:
    """Yield one capture dict per layer, filled by the forward passes run inside the block.

    ``reduce(capture)``, if given, runs right after each layer's forward (a forward hook) and may shrink
    the dict in place, so that long contexts never hold every layer's (B, H, T, T) tensors at once."""
    attns = model.attention_layers()
    caps: list[dict] = [{} for _ in attns]
    handles = []
    for a, cap in zip(attns, caps, strict=True):
        a.capture = cap
        if reduce is not None:
            handles.append(a.register_forward_hook(lambda _m, _args, _out, cap=cap: reduce(cap)))
    try:
        yield caps
    finally:
        for h in handles:
            h.remove()
        for a in attns:
            a.capture = None


# fn(layer index, attention layer, q (B, H, T, F), k (B, Hk, T, F)) -> None, called inside the forward
QKHook = Callable[[int, nn.Module, torch.Tensor, torch.Tensor], None]


@contextlib.contextmanager
def qk_hooks(model: nn.Module, fn: QKHook) -> Iterator[None]:
    """Inside the block, every attention layer calls ``fn(i, attn, q, k)`` right after its QK method's
    ``map_qk`` (so q, k are what the logits are made of) and then attends as usual (fused when it may):
    nothing of size T x T is kept. Calls with a KV cache (decoding) are passed through untouched."""
    attns = model.attention_layers()
    own = []
    for i, attn in enumerate(attns):
        qk = attn.qk
        had = "map_qk" in vars(qk)  # an instance-level override (tests plant heads this way)
        inner = qk.map_qk

        def wrapped(q, k, rope, pos, i=i, attn=attn, inner=inner):
            q, k = inner(q, k, rope, pos)
            if pos == 0:
                fn(i, attn, q.detach(), k.detach())
            return q, k

        own.append((qk, had, inner))
        qk.map_qk = wrapped
    try:
        yield
    finally:
        for qk, had, inner in own:
            if had:
                qk.map_qk = inner
            else:
                del qk.map_qk


def logit_rows(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """The layer's pre-softmax logits of query rows r0..r1-1 (after the layer's scaling, YaRN's MLA
    correction included, and the method's rewrite, before the mask), fp32: q (B, H, Tq, F), k (B, Hk, Tk, F)
    -> (B, H, r1 - r0, Tk)."""
    H = q.shape[1]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, H, Tk, F)
    s = (q[:, :, r0:r1] @ k.transpose(-2, -1)) * attn.scale(q.shape[-1])  # (B, H, c, Tk)
    return attn.qk.logits(s).float()


def row_chunk(B: int, H: int, Tk: int, budget: int = 1 << 21) -> int:
    """Query rows per chunk so that one chunk of logits holds at most ``budget`` elements (>= 1 row)."""
    return max(1, budget // max(1, B * H * Tk))


@contextlib.contextmanager
def rope_length(model: nn.Module, n: int) -> Iterator[None]:
    """Let ``model`` run on up to n positions: its RoPE tables are rebuilt for n (the same formula, so
    positions below the old limit are unchanged) and restored afterwards; no copy of the weights."""
    rope = model.rope
    old = rope.max_len
    if n <= old:
        yield
        return
    rope.max_len = n
    rope._tables.clear()
    try:
        yield
    finally:
        rope.max_len = old
        rope._tables.clear()


def per_query_head(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A per-head vector (..., Hk) over KV heads -> (..., H), each KV head repeated for its group."""
    hk = x.shape[-1]
    return x if hk == n_heads else x.repeat_interleave(n_heads // hk, dim=-1)


def register_qk_weight_norms(cls: type, fn: QKWeightNorms) -> None:
    """Register how to read per-head ||W_Q^h||_F, ||W_K^h||_F from an attention layer of type ``cls``."""
    _WEIGHT_NORMS[cls] = fn


def qk_weight_norms(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(||W_Q^h||_F, ||W_K^h||_F), each (H,) in fp32; None for a layer type with no known logit path."""
    fn = next((_WEIGHT_NORMS[c] for c in type(attn).__mro__ if c in _WEIGHT_NORMS), logit_path_norms)
    try:
        with torch.no_grad():
            return fn(attn)
    except AttributeError:
        return None


def logit_path_norms(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The default rule (module docstring), MHA/GQA and MLA."""
    m = logit_matrices(attn)
    H = attn.n_heads
    if not is_mla(attn):
        return m["wq"].head_norms(), per_query_head(m["wk"].head_norms(), H)
    uq, qr, uk = (m[k].heads().float() for k in ("wuq", "wqr", "wuk"))  # (H, n | r, q_in), (H, n, R)
    if "wdq" in m:  # through the query latent: (H, rows, q_rank) @ (q_rank, C)
        dq = m["wdq"].weight.float()
        uq, qr = uq @ dq, qr @ dq
    uk = uk @ m["wdkv"].weight.float()  # (H, n, C)
    kr = m["wkr"].weight.float().norm()  # the rope key, shared by all heads
    nq = (uq.flatten(1).norm(dim=1) ** 2 + qr.flatten(1).norm(dim=1) ** 2).sqrt()  # (H,)
    nk = (uk.flatten(1).norm(dim=1) ** 2 + kr**2).sqrt()  # (H,)
    return nq, nk
