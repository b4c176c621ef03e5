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
from qklab.hf.attention import LayerTracker
from qklab.methods import AttnShape, QKMethod
from qklab.methods.base import NoOptions
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.methods.standard import Standard
from qklab.model.attention import head_max_logit


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
        self.biases: dict[str, torch.Tensor] = {}  # "wq"/"wk" -> (n_heads, rows) view of that projection's bias
        for k, w in weights.items():  # wq -> an object with .weight, as qklab's nn.Linear layers
            setattr(self, k, None if w is None else SimpleNamespace(weight=w))


@dataclass
class LayerSpec:
    """One attention layer of any PyTorch model, for ``attach(..., layers=[...])``.

    ``q`` and ``k`` name parameters, optionally with a row range for fused matrices:
    ``"h.0.attn.c_attn.weight[0:768]"``. ``transposed``: the weight is stored (in, out) (GPT-2's Conv1D),
    so the range selects columns. Max logits (QK-clip, logging) are computed from the outputs of the
    modules owning q and k, i.e. of the projections: exact for models whose positions do not rotate q and k
    after them (learned or no position embeddings); RoPE models call ``layer.observe`` themselves or use
    ``track=False``."""

    q: str
    k: str
    n_heads: int
    n_kv_heads: int = 0  # 0: n_heads
    transposed: bool = False
    causal: bool = True
    track: bool = True


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
    """Build a QKLayer from an explicit LayerSpec; hooks its projections for max logits when asked."""
    params = dict(model.named_parameters())
    (qn, qs), (kn, ks) = _parse(spec.q), _parse(spec.k)
    for n in (qn, kn):
        if n not in params:
            raise ConfigError(f"layer {index}: no parameter '{n}' in {type(model).__name__}")
    Hkv = spec.n_kv_heads or spec.n_heads
    if spec.n_heads % Hkv:
        raise ConfigError(f"layer {index}: n_kv_heads={Hkv} must divide n_heads={spec.n_heads}")
    wq = _head_view(params[qn], qs, spec.n_heads, spec.transposed)
    wk = _head_view(params[kn], ks, Hkv, spec.transposed)
    qmod, kmod = _owner(model, qn), _owner(model, kn)
    layer = QKLayer(f"layer{index}", qmod, spec.n_heads, Hkv, {"wq": wq, "wk": wk})
    for key, name, sl, n in (("wq", qn, qs, spec.n_heads), ("wk", kn, ks, Hkv)):
        bias = params.get(name.removesuffix("weight") + "bias") if name.endswith("weight") else None
        if bias is not None:
            layer.biases[key] = _bias_view(bias, sl, n)
    if spec.track:
        _hook_projections(layer, qmod, kmod, qs, ks, wq.shape[1], spec.causal)
    return layer


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
                if causal:
                    layer._track(head_max_logit(q, k, 1.0 / math.sqrt(d)))
                else:
                    k = k.repeat_interleave(layer.n_heads // layer.n_kv_heads, dim=1)
                    layer.observe((q @ k.transpose(-2, -1)) / math.sqrt(d), None)
        return hook

    layer.hooks = [qmod.register_forward_hook(grab("q", qs)), kmod.register_forward_hook(grab("k", ks))]


def _llama_layer(mod: nn.Module, cfg) -> QKLayer:
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qk = getattr(mod, "qk_method", None)  # standard attention (apply's "none", e.g. with a gate) keeps the norms
    if (qk is None or qk.name == "none") and getattr(mod, "q_norm", None) is not None:  # the family's QK-Norm
        qk = QKNorm(AttnShape(cfg.hidden_size, H, Hkv, mod.head_dim, mod.layer_idx, 1), QKNormOptions())
    layer = QKLayer(f"layer{mod.layer_idx}", mod, H, Hkv,
                    {"wq": _head_view(mod.q_proj.weight, None, H, False),
                     "wk": _head_view(mod.k_proj.weight, None, Hkv, False)}, qk)
    for key, lin, n in (("wq", mod.q_proj, H), ("wk", mod.k_proj, Hkv)):
        if lin.bias is not None:  # Qwen2
            layer.biases[key] = _bias_view(lin.bias, None, n)
    return layer


def _deepseek_layer(mod: nn.Module, cfg) -> QKLayer:
    H, n, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    qb = (mod.q_b_proj if mod.q_b_proj is not None else mod.q_proj).weight.detach()
    qb = qb.view(H, n + cfg.qk_rope_head_dim, -1)  # (H, nope + rope, q_in): each head's rows [nope | rope]
    kva = mod.kv_a_proj_with_mqa.weight.detach()  # (kv_rank + rope, C)
    kvb = mod.kv_b_proj.weight.detach().view(H, n + cfg.v_head_dim, R)  # (H, nope + v, kv_rank)
    return QKLayer(f"layer{mod.layer_idx}", mod, H, H, {
        "wuq": qb[:, :n], "wqr": qb[:, n:], "wuk": kvb[:, :n], "wkr": kva[R:], "wdkv": kva[:R],
        "wdq": mod.q_a_proj.weight.detach() if mod.q_a_proj is not None else None})


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
