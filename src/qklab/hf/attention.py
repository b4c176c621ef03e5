"""qklab inside transformers' attention: the attention function and mask registered as ``"qklab"``, and the
attention forward that runs a ``QKMethod`` on Llama-style layers.

* ``qklab_attention`` is registered with ``AttentionInterface`` and its mask (an additive float mask,
  ``eager_mask``) with ``AttentionMaskInterface``, both under the name ``"qklab"``. It reads the layer's
  ``qk_method`` (logit rewrite, e.g. soft-capping), ``qk_layer`` (a per-head max-logit tracker) and
  ``attn_sink`` (per-head sink logits, (H,), qklab's ``model.attn_sink``), and runs fused SDPA unless the
  method rewrites logits (a sink is then one zero key and value with a float-mask column b_h, exactly as
  in ``qklab.model.attention.sdpa_causal``); a tracking layer gets its max logits from a separate chunked
  QK^T pass (``masked_head_max``), never from materialised probabilities.
* ``AttnSwitch`` holds a model's own attention implementation and qklab's, and puts either back exactly
  (every config's setting, sub-configs included): ``attach`` runs the model on qklab's function only while
  it measures max logits.
* ``QKAttentionMixin.forward`` replaces the forward of Llama/Mistral/Qwen2/Qwen3 attention (the module's
  class is swapped for a subclass; its weights and their names stay): q and k come from the projections
  as ``(B, H, T, d')``, go through the method's ``map_input``/``map_qk`` exactly as in qklab's own
  attention (RoPE from the model's rotary embedding), then the cache and the attention function; a layer
  with ``attn_gate`` (qklab's ``model.attn_gate``) multiplies each head's output by sigmoid(W_g x) before
  ``o_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qklab.errors import ConfigError
from qklab.model.attention import MaxLogitTracker, causal_mask, softmax_with_sink

NAME = "qklab"


class HFRope:
    """qklab's ``Rope`` interface over transformers' precomputed tables: cos, sin (B, T, D) for the
    positions of this forward (left padding and the cache offset are already in them), rotate-half layout."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        self.cos, self.sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        self.position_ids = position_ids  # (B | 1, T): what SSMax counts keys from (None: 0 .. T - 1)

    def positions(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor | None:
        """The absolute positions (B | 1, T) of this forward's rows (None: unknown, the caller counts from pos)."""
        return self.position_ids

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        if x.shape[-1] != self.cos.shape[-1]:
            raise ConfigError(f"q/k feature width {x.shape[-1]} differs from the model's RoPE width "
                             f"{self.cos.shape[-1]}; choose method options that keep head_dim")
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * self.sin.to(x.dtype)


class LayerTracker(MaxLogitTracker):
    """Per-head running max of the pre-softmax logit of one transformers attention module, over its
    training-mode forwards while ``track_max_logit`` is on (QK-clip, the callback's max-logit log)."""

    def __init__(self, module: nn.Module, n_heads: int) -> None:
        self.module = module
        self.init_tracker(n_heads)

    @property
    def training(self) -> bool:
        return self.module.training

    def observe(self, s: torch.Tensor, allowed: torch.Tensor | None) -> None:
        """s (B, H, Tq, Tk) scaled logits, allowed (B|1, 1, Tq, Tk) bool or None (all allowed)."""
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        self._track(s.detach().float().amax(dim=(0, 2, 3)))


def qklab_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """query (B, H, Tq, F), key (B, Hkv, Tk, F), value (B, Hkv, Tk, Dv), attention_mask (B, 1, Tq, Tk)
    additive (0 or the dtype's min) or None. Returns ((B, Tq, H, Dv), probs (B, H, Tq, Tk) or None).

    A family's own keywords are computed as its attention computes them: ``softcap`` (Gemma 2: cap tanh(s /
    cap), after the tracker, which sees the logits W_Q and W_K scale) and ``s_aux`` (gpt-oss: per-head sinks,
    as ``attn_sink``)."""
    method = getattr(module, "qk_method", None)
    tracker: LayerTracker | None = getattr(module, "qk_layer", None)
    tracking = tracker is not None and tracker.tracking
    rewrites = method is not None and method.modifies_logits
    cap = kwargs.get("softcap")
    H, Hkv, Tk = query.shape[1], key.shape[1], key.shape[2]
    mask = attention_mask[..., :Tk] if attention_mask is not None else None
    if mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True):
        mask = causal_mask(query.shape[2], Tk, query.device)[None, None]  # no mask given: causal, last-aligned
    if mask is not None and mask.dtype == torch.bool:  # a boolean (sdpa-style) mask: make it additive
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    drop = dropout if module.training else 0.0
    sink = getattr(module, "attn_sink", None)  # (H,) or None
    sink = kwargs.get("s_aux") if sink is None else sink
    if not (rewrites or cap or kwargs.get("output_attentions")):
        if tracking:  # before the sink's column joins the mask
            causal = query.shape[2] > 1 and getattr(module, "is_causal", True)
            tracker._track(masked_head_max(query, key, scaling, None if mask is None else mask == 0, causal))
        if sink is not None:  # one zero key and value (logit q.0 = 0) whose mask entry is the sink logit b_h
            key, value, mask = _sink_key(query, key, value, mask, sink)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=drop, scale=scaling,
                                             enable_gqa=H != Hkv)
        return out.transpose(1, 2).contiguous(), None
    if H != Hkv:
        key, value = key.repeat_interleave(H // Hkv, dim=1), value.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (B, H, Tq, Tk)
    if rewrites:
        s = method.logits(s)
    if tracking:
        tracker.observe(s, None if mask is None else mask == 0)
    if cap:
        s = cap * torch.tanh(s / cap)
    if mask is not None:
        s = s + mask
    p = softmax_with_sink(s, sink).to(query.dtype)  # fp32; the sink's own probability dropped
    p = F.dropout(p, p=drop, training=module.training)
    return torch.matmul(p, value).transpose(1, 2).contiguous(), p


@torch.no_grad()
def masked_head_max(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor | None, causal: bool,
                    chunk: int = 64) -> torch.Tensor:
    """Per-head max over batch, queries and allowed keys of the scaled logit, (H,) fp32; q (B, H, Tq, F),
    k (B, Hkv, Tk, F), allowed (B|1, 1, Tq, Tk) bool or None (every key).

    In query chunks of ``chunk`` rows, so that at most (B, H, chunk, Tk) logits exist at a time. ``causal``:
    queries are last-aligned with the keys and see none after their own position (padding and sliding
    windows only take keys away), so a chunk stops at its last query's key: about half the work of a full
    QK^T. The scale (> 0) multiplies the max alone: for fp32 logits, exactly the max of the scaled ones."""
    H, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, H, Tk, F)
    kt = k.transpose(-2, -1)  # (B, H, F, Tk)
    best = torch.full((H,), float("-inf"), device=q.device)
    for i in range(0, Tq, chunk):
        end = Tk - Tq + min(i + chunk, Tq) if causal else Tk
        s = q[:, :, i : i + chunk] @ kt[..., :end]  # (B, H, c, end)
        if allowed is not None:
            s = s.masked_fill(~allowed[..., i : i + chunk, :end], float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)).float())
    return best * scale


def _sink_key(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key (B, Hkv, Tk, F), value (B, Hkv, Tk, Dv) with one zero position appended, and the additive mask
    (B|1, H, Tq, Tk + 1) whose last column is the sink logit b_h of each head: SDPA's softmax then has
    exp(b_h) in every denominator and the zero value adds nothing to the output."""
    H, Tq, Tk = query.shape[1], query.shape[2], key.shape[2]
    base = mask if mask is not None else query.new_zeros(1, 1, Tq, Tk)
    base = base.to(query.dtype).expand(base.shape[0], H, Tq, Tk)  # (B|1, H, Tq, Tk)
    col = sink.to(query.dtype).view(1, H, 1, 1).expand(base.shape[0], H, Tq, 1)
    return F.pad(key, (0, 0, 0, 1)), F.pad(value, (0, 0, 0, 1)), torch.cat([base, col], dim=-1)


def register() -> None:
    """Register ``qklab_attention`` and its mask under ``"qklab"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, qklab_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def use_qklab_attention(model: nn.Module) -> None:
    """Switch a transformers model (and its sub-configs) to the ``"qklab"`` attention implementation."""
    register()
    model.set_attn_implementation(NAME)


def attn_settings(model: nn.Module) -> list[tuple[object, object]]:
    """(config, its attention implementation setting) for every config of a transformers model: its own, its
    sub-configs at any depth and those of its sub-models, each once."""
    todo = [model.config] + [m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                          "_attn_implementation_internal")]
    seen, out = set(), []
    while todo:
        cfg = todo.pop(0)
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append((cfg, cfg._attn_implementation_internal))
        todo += [sub for key in cfg.sub_configs if (sub := getattr(cfg, key, None)) is not None]
    return out


def put_attn_settings(settings: list[tuple[object, object]]) -> None:
    """Write back what ``attn_settings`` read, config by config (no check, no side effect)."""
    for cfg, impl in settings:
        cfg._attn_implementation_internal = impl


class AttnSwitch:
    """A transformers model's own attention implementation and qklab's, to switch between exactly: every
    config's setting is written back as it was read (transformers checks the switch to ``"qklab"`` once,
    here). A model already on ``"qklab"`` (``apply``) stays on it either way."""

    def __init__(self, model: nn.Module) -> None:
        self.own = attn_settings(model)
        if model.config._attn_implementation != NAME:
            use_qklab_attention(model)
        self.qklab = attn_settings(model)
        self.on = True

    def use_qklab(self, on: bool) -> None:
        if on != self.on:
            put_attn_settings(self.qklab if on else self.own)
            self.on = on

    def restore(self) -> None:
        """The model's own settings, as they were before."""
        put_attn_settings(self.own)
        self.on = False


def attention_function(module: nn.Module):
    """The attention function of a converted layer's implementation (``config._attn_implementation``; "eager"
    and "qklab" give ``qklab_attention``). Another one (SDPA, flash) would drop what only qklab's computes: a
    method's logit rewrite (softcap) or the layer's sinks; refused in one line."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, qklab_attention)
    qw = module.qk_method.feature_dim()
    vw = getattr(module, "v_head_dim", getattr(module, "head_dim", qw))
    if "flash" in impl and qw != vw:  # flash kernels take q, k and v of one width; this forward pads none
        raise ConfigError(f"layer {module.layer_idx}: method {module.qk_method.name} makes q and k {qw} features wide "
                          f"and v is {vw}, but the '{impl}' kernel takes one width for all three; use "
                          "model.set_attn_implementation('sdpa') or ('qklab')")
    if attend is not qklab_attention:
        needs = [what for what, has in (
            (f"method {module.qk_method.name}, which rewrites the logits", module.qk_method.modifies_logits),
            ("attention sinks", getattr(module, "attn_sink", None) is not None)) if has]
        if needs:
            raise ConfigError(f"layer {module.layer_idx} has {' and '.join(needs)}, which only the 'qklab' attention "
                              f"computes; attn_implementation is '{impl}': use model.set_attn_implementation('qklab')")
    return attend


class QKAttentionMixin:
    """Forward of a Llama/Mistral/Qwen2/Qwen3 attention layer with a qklab ``QKMethod`` (``self.qk_method``).
    Family q/k norms (Qwen3's ``q_norm``/``k_norm``) run first when the layer still has them."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        B, T, _ = hidden_states.shape  # (B, T, C)
        m = self.qk_method
        xqk = m.map_input(hidden_states)  # (B, T, C') -- hidden_states for most methods
        q = self.q_proj(xqk).view(B, T, -1, m.proj_dim())  # (B, T, H, d')
        k = self.k_proj(xqk).view(B, T, -1, m.proj_dim())  # (B, T, Hkv, d')
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if getattr(self, "q_norm", None) is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = HFRope(*position_embeddings, kwargs.get("position_ids"))
        q, k = m.map_qk(q.transpose(1, 2), k.transpose(1, 2), rope, 0)  # (B, H|Hkv, T, F)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attend = attention_function(self)
        out, w = attend(self, q, k, v, attention_mask, scaling=m.scale(q.shape[-1]),
                        dropout=self.attention_dropout if self.training else 0.0,
                        sliding_window=getattr(self, "sliding_window", None), **kwargs)  # (B, T, H, Dv)
        gate = getattr(self, "attn_gate", None)  # W_g: (C -> H) or (C -> H * Dv)
        if gate is not None:  # gated attention: each head's output times sigmoid(W_g x), x the layer's input
            out = out * torch.sigmoid(gate(hidden_states)).view(B, T, out.shape[2], -1).to(out.dtype)
        return self.o_proj(out.reshape(B, T, -1)), w


class DeepSeekRope:
    """qklab's ``Rope`` interface on DeepSeek's trailing rope features: x (B, H, T, nope + rope); the rope
    part turns with the layer's own rotation (V2's complex one, V3's interleaved or rotate-half)."""

    def __init__(self, module: nn.Module, position_embeddings, position_ids: torch.Tensor | None = None) -> None:
        import sys

        family = next(c for c in type(module).__mro__ if c.__module__.startswith("transformers."))
        self.fns, self.pe, self.dim = sys.modules[family.__module__], position_embeddings, module.qk_rope_head_dim
        self.interleave = getattr(module.config, "rope_interleave", True)
        self.position_ids = position_ids

    def positions(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor | None:
        return self.position_ids

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        keep, rot = x.split([x.shape[-1] - self.dim, self.dim], dim=-1)
        if hasattr(self.fns, "apply_rotary_emb"):  # DeepSeek-V2: complex frequencies
            rot = self.fns.apply_rotary_emb(rot, rot, self.pe)[0]
        elif self.interleave:
            rot = self.fns.apply_rotary_pos_emb_interleave(rot, rot, *self.pe)[0]
        else:
            rot = self.fns.apply_rotary_pos_emb(rot, rot, *self.pe)[0]
        return torch.cat([keep, rot], dim=-1)


class QKDeepSeekMixin:
    """Forward of a DeepSeek-V2/V3 attention layer with a qklab ``QKMethod`` on its materialised per-head
    q and k, [nope | rope] pre-RoPE, as in qklab's MLA. The cache holds the per-head (mapped) keys and
    values: a per-token, per-head key map cannot live in DeepSeek's compressed cache."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        B, T, _ = hidden_states.shape  # (B, T, C)
        n, r, R, dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
        x = hidden_states
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, -1, n + r).transpose(1, 2)  # (B, H, T, nope + rope)
        c, kr = self.kv_a_proj_with_mqa(x).split([R, r], dim=-1)  # (B, T, kv_rank), (B, T, rope)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, T, -1, n + dv).transpose(1, 2)  # (B, H, T, nope + v)
        kn, v = kv.split([n, dv], dim=-1)
        k = torch.cat([kn, kr.unsqueeze(1).expand(B, kn.shape[1], T, r)], dim=-1)  # (B, H, T, nope + rope)
        m = self.qk_method
        q, k = m.map_qk(q, k, DeepSeekRope(self, position_embeddings, kwargs.get("position_ids")), 0)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        # the method's scale times DeepSeek's YaRN correction (its scaling over the plain 1 / sqrt(nope + rope))
        scaling = m.scale(q.shape[-1]) * self.scaling * (n + r) ** 0.5
        attend = attention_function(self)
        out, w = attend(self, q, k, v, attention_mask, scaling=scaling,
                        dropout=self.attention_dropout if self.training else 0.0, **kwargs)
        return self.o_proj(out.reshape(B, T, -1)), w
