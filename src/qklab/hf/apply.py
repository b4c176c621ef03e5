"""``qklab.hf.apply``: convert the attention of a transformers causal LM to a qklab forward-side method.

Every attention layer gets the method's ``QKMethod`` module (``self_attn.qk_method``, trained with the
model), the forward of ``QKAttentionMixin`` (its class is swapped; weights keep their names) and the
model switches to the ``"qklab"`` attention function and mask. What each method does to a layer:

* ``qknorm``: per-head RMSNorm of q and k before RoPE. A family that has q/k norms already (Qwen3) hands
  its gains and eps over to the method, so a Qwen3 model computes exactly what it did before.
* ``qkmap``: W_Q, W_K are rebuilt at the map's widths (new weights, the method's init: a pretrained
  W_Q/W_K does not carry over), the family's q/k norms are dropped (the map fixes the feature norm).
* ``softcap``: logits capped before the mask; everything else (family norms included) stays.
* ``quest``: keys normalised to the sphere, logits unscaled (the family's q/k norms are dropped).
* ``ssmax``: q times s_h log(position id + 1) (left padding and the cache offset counted from the
  position ids); the family's q/k norms stay in front of it.
* ``qknorm`` variants (``q_gain``, ``stats``, ``gains``, ``p``): as in qklab's attention; per-head gains
  start from a Qwen3 model's shared ones, tiled.
* ``none``: returns the model untouched.

DeepSeek-V2/V3 (MLA) layers get ``QKDeepSeekMixin``: the method maps the materialised per-head q and k as
in qklab's MLA (qknorm, softcap; qkmap is refused: MLA keeps the projection widths), and the cache holds
per-head keys and values instead of DeepSeek's compressed latent.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qklab.hf.attention import QKAttentionMixin, QKDeepSeekMixin, use_qklab_attention
from qklab.methods import CONTROLLERS, METHODS, AttnShape, QKMethod

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
_SWAPPED: dict[type, type] = {}


def method_options(method: str, options: dict) -> object:
    """The Options dataclass of a method or controller from keyword options, checked."""
    if method not in {**METHODS, **CONTROLLERS}:
        raise ValueError(f"unknown QK method '{method}'; choose one of {sorted(METHODS)}")
    cls = {**METHODS, **CONTROLLERS}[method].Options
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(options) - known)
    if bad:
        raise ValueError(f"{method} has no option {', '.join(bad)}; known: {', '.join(sorted(known)) or 'none'}")
    opts = cls(**options)
    if hasattr(opts, "validate"):
        opts.validate()
    return opts


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The Llama-style attention layers of a transformers model, in layer order."""
    mods = [m for m in model.modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(m, "layer_idx")]
    if not mods:
        raise ValueError(f"no Llama-style attention layers (q_proj/k_proj/v_proj/o_proj) in {type(model).__name__}")
    return sorted(mods, key=lambda m: m.layer_idx)


def _swap_class(module: nn.Module, mixin: type = QKAttentionMixin) -> None:
    base = type(module)
    if issubclass(base, mixin):
        return
    if base not in _SWAPPED:
        _SWAPPED[base] = type(f"QK{base.__name__}", (mixin, base), {})
    module.__class__ = _SWAPPED[base]


def _rebuild(old: nn.Linear, in_dim: int, out_dim: int, std: float) -> nn.Linear:
    if (old.in_features, old.out_features) == (in_dim, out_dim):
        return old
    new = nn.Linear(in_dim, out_dim, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        nn.init.normal_(new.weight, 0.0, std)
        if new.bias is not None:
            new.bias.zero_()
    return new


def apply(model: nn.Module, method: str, **options) -> nn.Module:
    """Convert every attention layer of ``model`` (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V2/V3; built from a
    config or loaded) to ``method`` with the method's ``options`` (e.g. ``cap=30`` for softcap). In place; returns
    the model. Padding masks, ``generate()`` with its cache and all other layers work as before."""
    opts = method_options(method, options)
    if method == "none":
        return model
    cfg = model.config
    family = getattr(cfg, "model_type", "")
    if family in DEEPSEEK:
        return _apply_deepseek(model, method, opts)
    if family not in FAMILIES:
        raise ValueError(f"qklab.hf.apply supports model types {', '.join(FAMILIES + DEEPSEEK)}; got '{family}'")
    mods = attention_modules(model)
    init_std = getattr(cfg, "initializer_range", 0.02)
    for mod in mods:
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, mod.head_dim
        qm: QKMethod = METHODS[method](AttnShape(cfg.hidden_size, H, Hkv, D, mod.layer_idx, len(mods)), opts)
        if qm.feature_dim() != D:
            raise ValueError(f"{method} with these options gives q/k features of width {qm.feature_dim()}, but the "
                             f"model's RoPE has head_dim={D}; use options that keep the width (compute-matched)")
        qm.reset_parameters()
        p = mod.q_proj.weight
        qm.to(device=p.device, dtype=p.dtype)
        std = qm.qk_init_std(init_std)  # used only where W_Q/W_K change width
        mod.q_proj = _rebuild(mod.q_proj, qm.qk_in_dim(), H * qm.proj_dim(), std)
        mod.k_proj = _rebuild(mod.k_proj, qm.qk_in_dim(), Hkv * qm.proj_dim(), std)
        if getattr(mod, "q_norm", None) is not None and not qm.keeps_model_qk_norm:
            qm.adopt_qk_norm(mod.q_norm, mod.k_norm)  # e.g. a QK-Norm takes the model's own gains
            mod.q_norm = None
            mod.k_norm = None
        mod.qk_method = qm
        _swap_class(mod)
    use_qklab_attention(model)
    return model


def _apply_deepseek(model: nn.Module, method: str, opts: object) -> nn.Module:
    """MLA layers: the method maps the materialised per-head q, k ([nope | rope], pre-RoPE) as in qklab's
    MLA; methods that change the projection widths (qkmap) are refused there as here."""
    cfg = model.config
    mods = sorted((m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")), key=lambda m: m.layer_idx)
    for mod in mods:
        F = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        H = cfg.num_attention_heads
        qm: QKMethod = METHODS[method](AttnShape(cfg.hidden_size, H, H, F, mod.layer_idx, len(mods)), opts)
        if qm.proj_dim() != F or qm.qk_in_dim() != cfg.hidden_size:
            raise ValueError(f"{method} changes the q/k projection widths, which MLA (DeepSeek) does not allow")
        qm.reset_parameters()
        p = mod.kv_b_proj.weight
        mod.qk_method = qm.to(device=p.device, dtype=p.dtype)
        _swap_class(mod, QKDeepSeekMixin)
    use_qklab_attention(model)
    return model
