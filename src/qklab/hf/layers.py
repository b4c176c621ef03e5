"""Q/K weights of foreign models as qklab's controllers see them.

A ``QKLayer`` stands for one attention layer: the weights on its logit path as per-head views into the
model's parameters (named like qklab's own layers: ``wq``/``wk``, or MLA's ``wuq``, ``wqr``, ``wuk``,
``wkr``, ``wdkv``, ``wdq``), its head counts, and a per-head max-logit tracker. Controllers scale the
views in place, so the model's parameters change.

They are found by name in transformers models (``find_layers``): Llama-style ``q_proj``/``k_proj``
(Llama, Mistral, Qwen2, Qwen3) and DeepSeek's ``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/
``kv_b_proj``; any other model describes its layers with ``LayerSpec`` (fused QKV matrices included).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from qklab.errors import ConfigError
from qklab.hf.attention import LayerTracker, masked_head_max
from qklab.methods import AttnShape, QKMethod
from qklab.methods.base import NoOptions
from qklab.methods.headwise import AttnKind
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.methods.standard import Standard
from qklab.model.attention import head_max_logit
from qklab.model.qk import QK


class QKLayer(LayerTracker):
    """One attention layer: ``weights`` name -> view (n_heads * rows, C) or (n_heads, rows, C); ``qk`` the
    forward-side method the layer computes (``qk_method`` after ``apply``, QK-Norm for a family with q/k
    norms, else standard attention), which QK-clip consults."""

    def __init__(self, name: str, module: nn.Module, n_heads: int, n_kv_heads: int,
                 weights: dict[str, torch.Tensor | None], qk: QKMethod | None = None) -> None:
        super().__init__(module, n_heads)
        self.name, self.n_heads, self.n_kv_heads = name, n_heads, n_kv_heads
        d = next(w for w in weights.values() if w is not None).shape[1]
        self.qk = qk or Standard(AttnShape(0, n_heads, n_kv_heads, d, 0, 1), NoOptions())
        self.hooks: list = []  # forward hooks that feed the tracker (LayerSpec layers)
        self.refusal = ""  # why this layer's max logits cannot be measured ("" where they can)
        self.fed = False  # True: the module (a qklab.QK) feeds the tracker through its qk_layer attribute
        self.biases: dict[str, torch.Tensor] = {}  # "wq"/"wk" -> (n_heads, rows) view of that projection's bias
        self.model_norm = ""  # the model's own q/k norm left in front of the method (Qwen3 with softcap), or ""
        self.kind: AttnKind = "mla" if "wuk" in weights else "mha"  # MLA's weight names, or MHA/GQA's
        for k, w in weights.items():  # wq -> an object with .weight, as qklab's nn.Linear layers
            setattr(self, k, None if w is None else SimpleNamespace(weight=w))


@dataclass
class LayerSpec:
    """One attention layer of any PyTorch model, for ``attach(..., layers=[...])``.

    ``q`` and ``k`` name parameters, optionally with a row range for fused matrices:
    ``"h.0.attn.c_attn.weight[0:768]"``. ``transposed``: the weight is stored (in, out) (GPT-2's Conv1D),
    so the range selects columns.

    ``logits``: where the q and k of the logits are formed, for the max logits (QK-clip, logging):
    * ``"projections"``: the projections' outputs reach the dot product as they are (learned or no position
      embeddings, no norm after them);
    * the name of a ``qklab.QK`` module: the logits of the q and k it returns, with its method's rewrite
      (and its method decides what QK-clip does, as in qklab's own attention);
    * the name of any other module called as f(q, k, ...) on the final q and k (an SDPA wrapper): a hook
      reads them, ``layout`` "bhtd" (B, H, T, D) or "bthd" (B, T, H, D), the ``scale`` keyword or 1/sqrt(D);
    * ``""`` (default): a ``qklab.QK`` module inside the layer's attention module if there is one, else the
      projections, unless the model rotates q and k (a module, parameter or buffer named like RoPE): then
      measuring is refused in one line, since the projections' outputs are not what the logits see.
    ``qk_norm``: whether a norm on q and k sits in the attention (then QK-clip is refused: scaling W_Q and
    W_K does not change normalised logits); None: detected (a module named like q_norm or k_ln inside the
    attention module, outside any ``qklab.QK``). ``attn``: the attention module's name (default: the deepest
    module holding both projections; for a fused matrix, the one above its owner)."""

    q: str
    k: str
    n_heads: int
    n_kv_heads: int = 0  # 0: n_heads
    transposed: bool = False
    causal: bool = True
    track: bool = True
    logits: str = ""
    layout: str = "bhtd"
    qk_norm: bool | None = None
    attn: str = ""


_RANGE = re.compile(r"^(?P<name>[\w.]+?)(\[(?P<a>\d+):(?P<b>\d+)\])?$")


def _parse(ref: str) -> tuple[str, slice | None]:
    m = _RANGE.match(ref.strip())
    if not m:
        raise ConfigError(f"parameter reference '{ref}' must look like 'name' or 'name[start:stop]'")
    sl = slice(int(m["a"]), int(m["b"])) if m["a"] is not None else None
    return m["name"], sl


def _head_view(p: torch.Tensor, sl: slice | None, n_heads: int, transposed: bool) -> torch.Tensor:
    """A (n_heads, rows, C) view of the selected output rows of parameter p."""
    w = p.detach()
    if transposed:  # (in, out): the output features are columns
        w = w[:, sl] if sl is not None else w
        return w.unflatten(1, (n_heads, -1)).permute(1, 2, 0)  # (n_heads, rows, in)
    w = w[sl] if sl is not None else w
    return w.unflatten(0, (n_heads, -1))  # (n_heads, rows, in)


def _bias_view(b: torch.Tensor | None, sl: slice | None, n_heads: int) -> torch.Tensor | None:
    """A (n_heads, rows) view of the selected entries of a bias, or None."""
    if b is None:
        return None
    b = b.detach()
    return (b[sl] if sl is not None else b).unflatten(0, (n_heads, -1))


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def spec_layer(model: nn.Module, spec: LayerSpec, index: int) -> QKLayer:
    """Build a QKLayer from an explicit LayerSpec; hooks where its logits are formed (``LayerSpec.logits``)."""
    params = dict(model.named_parameters())
    (qn, qs), (kn, ks) = _parse(spec.q), _parse(spec.k)
    for n in (qn, kn):
        if n not in params:
            raise ConfigError(f"layer {index}: no parameter '{n}' in {type(model).__name__}")
    Hkv = spec.n_kv_heads or spec.n_heads
    if spec.n_heads % Hkv:
        raise ConfigError(f"layer {index}: n_kv_heads={Hkv} must divide n_heads={spec.n_heads}")
    if spec.layout not in ("bhtd", "bthd"):
        raise ConfigError(f"layer {index}: layout={spec.layout!r}: use bhtd or bthd")
    wq = _head_view(params[qn], qs, spec.n_heads, spec.transposed)
    wk = _head_view(params[kn], ks, Hkv, spec.transposed)
    qmod, kmod = _owner(model, qn), _owner(model, kn)
    attn_name = spec.attn or _attention_name(qn, kn)
    source, where = _logit_source(model, spec, attn_name, index)
    qk = source.method if isinstance(source, QK) else None
    layer = QKLayer(f"layer{index}", source if isinstance(source, QK) else qmod, spec.n_heads, Hkv,
                    {"wq": wq, "wk": wk}, qk)
    for key, name, sl, n in (("wq", qn, qs, spec.n_heads), ("wk", kn, ks, Hkv)):
        bias = params.get(name.removesuffix("weight") + "bias") if name.endswith("weight") else None
        if bias is not None:
            layer.biases[key] = _bias_view(bias, sl, n)
    norm = _qk_norm(model, attn_name) if spec.qk_norm is None else ("(stated)" if spec.qk_norm else "")
    if norm and qk is None:  # QK-clip is refused on it, as on a transformers family's own QK-Norm
        layer.qk = norm_refusal(layer)
    elif norm:
        layer.model_norm = norm
    if not spec.track:
        return layer
    if isinstance(source, QK):
        layer.fed = True  # attach sets source.qk_layer: its forward feeds the tracker
    elif isinstance(source, nn.Module):
        hook_logits(layer, source, spec)
    elif source == "projections":
        _hook_projections(layer, qmod, kmod, qs, ks, wq.shape[1], spec.causal)
    layer.refusal = where
    return layer


def norm_refusal(layer: QKLayer) -> QKMethod:
    """The method QK-clip consults on a layer whose q and k a norm of the model's fixes: a QK-Norm, which it
    refuses (scaling W_Q and W_K cannot shrink normalised logits)."""
    d = layer.wq.weight.shape[-2] if layer.wq.weight.dim() == 3 else layer.wq.weight.shape[0] // layer.n_heads
    return QKNorm(AttnShape(0, layer.n_heads, layer.n_kv_heads, d, 0, 1), QKNormOptions())


def _attention_name(qn: str, kn: str) -> str:
    """The deepest module holding both parameters; the one above it when both are in one module (fused)."""
    a, b = qn.split(".")[:-1], kn.split(".")[:-1]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if a == b:
        n -= 1
    return ".".join(a[:max(n, 0)])


def _logit_source(model: nn.Module, spec: LayerSpec, attn_name: str, index: int) -> tuple[object, str]:
    """(a qklab.QK, another module, "projections" or None, and the one-line reason measuring is refused, or "")."""
    if spec.logits == "projections":
        return "projections", ""
    if spec.logits:
        try:
            return model.get_submodule(spec.logits), ""
        except AttributeError:
            raise ConfigError(f"layer {index}: no module '{spec.logits}' in {type(model).__name__} "
                              "(LayerSpec.logits)") from None
    attn = model.get_submodule(attn_name) if attn_name else model
    found = [m for m in attn.modules() if isinstance(m, QK)]
    if len(found) == 1:
        return found[0], ""
    rot = _rotary_name(model)
    if len(found) > 1 or rot:
        why = (f"{len(found)} qklab.QK modules in '{attn_name}'" if found else
               f"the model rotates q and k after the projections ('{rot}')")
        return None, (f"layer {index}: cannot measure its logits: {why}; name where they are formed: "
                      "LayerSpec(logits='<the qklab.QK module, or the module called on the final q and k>'), or "
                      "logits='projections' if the projections' outputs are what the dot product sees")
    return "projections", ""


def _rotary_name(model: nn.Module) -> str:
    """The name of the first module, parameter or buffer that looks like RoPE (a rotary embedding), or ""."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_buffers()]
    names += [type(m).__name__ for m in model.modules()]
    return next((n for n in names if _ROTARY.search(n)), "")


_ROTARY = re.compile(r"(?i)rope|rotary|freqs_cis|inv_freq")


def _qk_norm(model: nn.Module, attn_name: str) -> str:
    """The name of a norm module on q or k (named like q_norm, k_ln, query_layernorm) inside the attention
    module (the model itself when the projections sit at its top), outside any qklab.QK; or ""."""
    attn = model.get_submodule(attn_name) if attn_name else model
    inside_qk = {id(m) for q in attn.modules() if isinstance(q, QK) for m in q.modules()}
    for name, m in attn.named_modules():
        if id(m) not in inside_qk and _QK_NORM.search(name) and isinstance(m, nn.Module) and not m._modules:
            return f"{attn_name}.{name}" if attn_name else name
    return ""


_QK_NORM = re.compile(r"(?i)(^|[._])(q|k|qk|query|key)_?(norm|ln|layernorm|layer_norm)$")


def hook_logits(layer: QKLayer, mod: nn.Module, spec: LayerSpec) -> None:
    """A pre-hook on a module called as f(q, k, ...) on the final q and k (``spec.layout``, ``spec.causal``):
    their per-head max logit into the layer's tracker, over the keys an ``attn_mask`` keyword (SDPA's: bool,
    True where a query sees a key, or additive, -inf where it does not) leaves each query."""
    def hook(m, args, kwargs):
        if not layer.tracking:
            return
        q = args[0] if args else kwargs.get("query", kwargs.get("q"))
        k = args[1] if len(args) > 1 else kwargs.get("key", kwargs.get("k"))
        if spec.layout == "bthd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        scale = kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        mask = kwargs.get("attn_mask")  # broadcasts to (B, H, Tq, Tk)
        allowed = None if mask is None else mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        _track_qk(layer, q.detach(), k.detach(), scale, spec.causal, allowed)

    layer.hooks = [mod.register_forward_pre_hook(hook, with_kwargs=True)]


def _track_qk(layer: QKLayer, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
              allowed: torch.Tensor | None = None) -> None:
    """q (B, H, T, d), k (B, Hkv, T, d): this forward's per-head max logit into the layer's tracker, over the
    ``allowed`` keys (bool, broadcasting to (B, H, T, T)) if given."""
    if allowed is not None:
        layer._track(masked_head_max(q, k, scale, allowed, causal))
    elif causal:
        layer._track(head_max_logit(q, k, scale))
    else:
        k = k.repeat_interleave(layer.n_heads // layer.n_kv_heads, dim=1)
        layer.observe((q @ k.transpose(-2, -1)) * scale, None)


def _hook_projections(layer: QKLayer, qmod, kmod, qs, ks, d: int, causal: bool) -> None:
    seen: dict[str, torch.Tensor] = {}

    def grab(which: str, sl):
        def hook(mod, args, out):
            if not layer.tracking:
                return
            seen[which] = (out[..., sl] if sl is not None else out).detach()  # (B, T, heads * d)
            if "q" in seen and "k" in seen:
                q, k = seen.pop("q"), seen.pop("k")
                B, T = q.shape[:2]
                q = q.reshape(B, T, layer.n_heads, d).transpose(1, 2)  # (B, H, T, d)
                k = k.reshape(B, T, layer.n_kv_heads, d).transpose(1, 2)  # (B, Hkv, T, d)
                _track_qk(layer, q, k, 1.0 / math.sqrt(d), causal)
        return hook

    layer.hooks = [qmod.register_forward_hook(grab("q", qs)), kmod.register_forward_hook(grab("k", ks))]


def _llama_layer(mod: nn.Module, cfg) -> QKLayer:
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qk = getattr(mod, "qk_method", None)  # standard attention (apply's "none", e.g. with a gate) keeps the norms
    standard = qk is None or qk.name == "none"
    own_norm = getattr(mod, "q_norm", None) is not None  # apply removed it where the method took its gains
    if standard and own_norm:  # the family's QK-Norm
        qk = QKNorm(AttnShape(cfg.hidden_size, H, Hkv, mod.head_dim, mod.layer_idx, 1), QKNormOptions())
    layer = QKLayer(f"layer{mod.layer_idx}", mod, H, Hkv,
                    {"wq": _head_view(mod.q_proj.weight, None, H, False),
                     "wk": _head_view(mod.k_proj.weight, None, Hkv, False)}, qk)
    for key, lin, n in (("wq", mod.q_proj, H), ("wk", mod.k_proj, Hkv)):
        if lin.bias is not None:  # Qwen2
            layer.biases[key] = _bias_view(lin.bias, None, n)
    if own_norm and not standard:  # kept in front of the method apply gave the layer
        layer.model_norm = "q_norm"
    return layer


def _deepseek_layer(mod: nn.Module, cfg) -> QKLayer:
    H, n, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    qb = (mod.q_b_proj if mod.q_b_proj is not None else mod.q_proj).weight.detach()
    qb = qb.view(H, n + cfg.qk_rope_head_dim, -1)  # (H, nope + rope, q_in): each head's rows [nope | rope]
    kva = mod.kv_a_proj_with_mqa.weight.detach()  # (kv_rank + rope, C)
    kvb = mod.kv_b_proj.weight.detach().view(H, n + cfg.v_head_dim, R)  # (H, nope + v, kv_rank)
    return QKLayer(f"layer{mod.layer_idx}", mod, H, H, {
        "wuq": qb[:, :n], "wqr": qb[:, n:], "wuk": kvb[:, :n], "wkr": kva[R:], "wdkv": kva[:R],
        "wdq": mod.q_a_proj.weight.detach() if mod.q_a_proj is not None else None},
        getattr(mod, "qk_method", None))  # what apply gave the layer decides QK-clip and QK-Guard's trigger


def find_layers(model: nn.Module) -> list[QKLayer]:
    """The attention layers of a transformers model of a known family, found by their weight names."""
    cfg = getattr(model, "config", None)
    out = []
    for mod in model.modules():
        if hasattr(mod, "kv_a_proj_with_mqa") and hasattr(mod, "kv_b_proj"):
            out.append((mod.layer_idx, _deepseek_layer(mod, cfg)))
        elif all(hasattr(mod, a) for a in ("q_proj", "k_proj", "layer_idx")) and isinstance(mod.q_proj, nn.Linear):
            out.append((mod.layer_idx, _llama_layer(mod, cfg)))
    if cfg is None or not out:
        raise ConfigError(f"no attention layers found by name in {type(model).__name__}; describe them with "
                         "layers=[LayerSpec(q=..., k=..., n_heads=...), ...]")
    return [layer for _, layer in sorted(out, key=lambda t: t[0])]
