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
* ``alibi``: the bias -m_h (i - j) rides in eight extra q/k features (positions from the position ids); the
  family's q/k norms stay, and the cache holds keys eight features wider than the values (no flash kernel).
* ``qknorm`` variants (``q_gain``, ``stats``, ``gains``, ``p``): as in qklab's attention; per-head gains
  start from a Qwen3 model's shared ones, tiled.
* ``none``: returns the model untouched (unless it adds a gate or a sink, below; the family's q/k norms stay).

``attn_gate`` and ``attn_sink`` (keywords, any method; qklab's ``model.attn_gate`` / ``model.attn_sink``) add
to every Llama-style layer:

* ``attn_gate="head" | "element"``: gated attention (arXiv 2505.06708, the SDPA-output gate G1), each head's
  output times sigmoid(W_g x) before ``o_proj``, x the layer's (normalised) input: ``self_attn.attn_gate``,
  an ``nn.Linear(C, H)`` (one gate per head and token) or ``nn.Linear(C, H * head_dim)`` (one per output
  feature), no bias, initialised as qklab's W_g: N(0, config.initializer_range), so gates start near 1/2.
* ``attn_sink=True``: a learnable logit b_h per head in every softmax denominator, with no value
  (``self_attn.attn_sink``, (H,), initialised to 0 as in qklab): p_ij = exp(s_ij) / (exp(b_h) + sum_j
  exp(s_ij)). Exact on both paths of the ``"qklab"`` attention function (SDPA: one zero key and value and a
  float mask column b_h; eager: an extra logit column whose probability is dropped).

A layer that has a gate or a sink keeps it when ``apply`` runs again (with the defaults); asking for one it
already has is refused, as are DeepSeek (MLA) layers (``qklab.errors.ConfigError``, one line).

DeepSeek-V2/V3 (MLA) layers get ``QKDeepSeekMixin``: the method maps the materialised per-head q and k as
in qklab's MLA (qknorm, softcap; qkmap is refused: MLA keeps the projection widths), and the cache holds
per-head keys and values instead of DeepSeek's compressed latent.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from torch import nn

from qklab import __version__
from qklab.config import from_dict
from qklab.errors import ConfigError
from qklab.hf.attention import QKAttentionMixin, QKDeepSeekMixin, use_qklab_attention
from qklab.methods import METHODS, AttnShape, QKMethod
from qklab.methods.base import NoOptions
from qklab.methods.build import method_options  # noqa: F401 -- qklab.hf.apply.method_options, as before
from qklab.model.qk import build_method

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
GATES = ("none", "head", "element")  # qklab's model.attn_gate
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
_SWAPPED: dict[type, type] = {}
RECORD = "qklab"  # model.config.qklab: what apply did ({"version", "method", "options", "attn_gate", "attn_sink"})
TWIN_PREFIX = "qklab_"  # a converted model's config.model_type: "qklab_llama", ... (registered by qklab.hf)
# transformers' config and causal-LM classes of each family, by name (transformers is imported only when used)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def model_family(cfg) -> str:
    """A transformers config's family ("llama", ...), the same for qklab's twin of it ("qklab_llama")."""
    return getattr(cfg, "model_type", "").removeprefix(TWIN_PREFIX)


@functools.cache
def twin_config(family: str) -> type:
    """qklab's config class of a family: the family's own, with ``model_type`` "qklab_<family>", so that a
    saved folder names what it holds and loads only where qklab is registered."""
    import transformers

    base = getattr(transformers, CLASSES[family][0])
    return type(f"QK{base.__name__}", (base,), {"model_type": TWIN_PREFIX + family, "__module__": __name__})


@functools.cache
def twin_model(family: str) -> type:
    """qklab's causal-LM class of a family: the family's own, converted as its config's record says when it
    is built (``from_pretrained`` builds it, then loads the saved weights into the converted layers)."""
    import transformers

    base = getattr(transformers, CLASSES[family][1])

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        if getattr(config, RECORD, None):
            rebuild(self)

    return type(f"QK{base.__name__}", (base,), {"config_class": twin_config(family), "__init__": __init__,
                                                  "__module__": __name__})


def adopt_twin(model: nn.Module) -> None:
    """Make a converted model and its config qklab's twins of their family (same weights, same forward)."""
    family = model_family(model.config)
    if family in CLASSES and type(model) is not twin_model(family):
        model.config.__class__ = twin_config(family)
        model.__class__ = twin_model(family)


def own_config(model: nn.Module) -> None:
    """Give the model (and every module of it that holds its config) a config of its own: transformers'
    ``from_config`` keeps the object it is given, which may be another model's too, and what ``apply``
    records (the method, the twin class, the attention implementation) belongs to this model alone."""
    old = model.config
    new = copy.deepcopy(old)
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The Llama-style attention layers of a transformers model, in layer order."""
    mods = [m for m in model.modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(m, "layer_idx")]
    if not mods:
        raise ConfigError(f"no Llama-style attention layers (q_proj/k_proj/v_proj/o_proj) in {type(model).__name__}")
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


def _check_gate_sink(attn_gate: str, attn_sink: bool, family: str) -> None:
    if attn_gate not in GATES:
        raise ConfigError(f"attn_gate={attn_gate!r}: use none, head or element")
    if not isinstance(attn_sink, bool):
        raise ConfigError(f"attn_sink={attn_sink!r}: use True or False")
    if (attn_gate != "none" or attn_sink) and family in DEEPSEEK:
        raise ConfigError(f"qklab.hf.apply adds attn_gate / attn_sink to Llama-style layers ({', '.join(FAMILIES)}); "
                          f"'{family}' (MLA) is not supported")


def _refuse_twice(mod: nn.Module, attn_gate: str, attn_sink: bool) -> None:
    for kind, asked in (("attn_gate", attn_gate != "none"), ("attn_sink", attn_sink)):
        if asked and getattr(mod, kind, None) is not None:
            raise ConfigError(f"layer {mod.layer_idx} already has its {kind}; qklab.hf.apply adds it once")


def add_gate_sink(mod: nn.Module, n_heads: int, attn_gate: str = "none", attn_sink: bool = False,
                  init_std: float = 0.02) -> None:
    """Give one Llama-style attention layer qklab's output gate (``attn_gate``: W_g (C -> H) or (C -> H *
    head_dim), N(0, init_std)) and per-head sink logits (``attn_sink``: (H,) zeros), on its weights' device and
    dtype; refuses one it already has."""
    p = mod.v_proj.weight  # (H_kv * head_dim, C): the layer's input width C (W_Q may read a mapped input)
    _refuse_twice(mod, attn_gate, attn_sink)
    if attn_gate != "none":
        width = n_heads * (1 if attn_gate == "head" else mod.head_dim)
        gate = nn.Linear(p.shape[1], width, bias=False, device=p.device, dtype=p.dtype)
        with torch.no_grad():
            nn.init.normal_(gate.weight, 0.0, init_std)
        mod.attn_gate = gate
    if attn_sink:
        mod.attn_sink = nn.Parameter(torch.zeros(n_heads, device=p.device, dtype=p.dtype))


def apply(model: nn.Module, method: str = "none", *, attn_gate: str = "none", attn_sink: bool = False,
          **options) -> nn.Module:
    """Convert every attention layer of ``model`` (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V2/V3; built from a
    config or loaded) to ``method`` with the method's ``options`` (e.g. ``cap=30`` for softcap), and add
    qklab's output gate (``attn_gate`` "head" | "element") and per-head sinks (``attn_sink=True``) on
    Llama-style layers. In place; returns the model. Padding masks, ``generate()`` with its cache and all
    other layers work as before.

    What was applied is recorded in ``model.config.qklab`` and the model and its config become qklab's
    registered twins of their family (``model_type`` "qklab_llama", ...), so ``save_pretrained`` writes a
    folder that ``qklab.hf.from_pretrained`` (or ``AutoModelForCausalLM`` once ``qklab.hf`` is imported) loads
    back as the same model, and that transformers without qklab refuses instead of loading a different one.
    A second method on a model that has one is refused (one line); a gate or sink may be added later."""
    opts = method_options(method, options)
    before = getattr(model.config, RECORD, None)
    if before and before["method"] != "none" and method != "none":
        raise ConfigError(f"this model already has qklab's {before['method']} (model.config.{RECORD}); qklab.hf.apply "
                          "converts a model once: start from a model without a method to try another")
    if method != "none" or attn_gate != "none" or attn_sink:
        own_config(model)
    convert(model, method, opts, attn_gate, attn_sink)
    if method != "none" or attn_gate != "none" or attn_sink:
        before = before or {"method": "none", "options": {}, "attn_gate": "none", "attn_sink": False}
        keep = method == "none"
        setattr(model.config, RECORD, {
            "version": __version__, "method": before["method"] if keep else method,
            "options": before["options"] if keep else dataclasses.asdict(opts),
            "attn_gate": attn_gate if attn_gate != "none" else before["attn_gate"],
            "attn_sink": attn_sink or before["attn_sink"]})
        adopt_twin(model)
    return model


def rebuild(model: nn.Module) -> None:
    """Convert a model built from a config that carries ``config.qklab`` (a folder ``apply`` saved) as ``apply``
    did, in one pass, before its weights are loaded."""
    rec = getattr(model.config, RECORD)
    method = rec["method"]
    opts = from_dict(METHODS[method].Options, rec.get("options") or {}, f"{RECORD}.{method}.")
    convert(model, method, opts, rec.get("attn_gate", "none"), bool(rec.get("attn_sink", False)))


def convert(model: nn.Module, method: str, opts: object, attn_gate: str = "none", attn_sink: bool = False) -> None:
    """The conversion ``apply`` makes, with checked options and nothing recorded."""
    cfg = model.config
    family = model_family(cfg)
    _check_gate_sink(attn_gate, attn_sink, family)
    extras = attn_gate != "none" or attn_sink
    if method == "none" and not extras:
        return
    if family in DEEPSEEK:
        _apply_deepseek(model, method, opts)
        return
    if family not in FAMILIES:
        raise ConfigError(f"qklab.hf.apply supports model types {', '.join(FAMILIES + DEEPSEEK)}; got '{family}'")
    mods = attention_modules(model)
    init_std = getattr(cfg, "initializer_range", 0.02)
    for mod in mods:  # refused before any layer changes
        _refuse_twice(mod, attn_gate, attn_sink)
    for mod in mods:
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, mod.head_dim
        shape = AttnShape(cfg.hidden_size, H, Hkv, D, mod.layer_idx, len(mods))
        if method != "none":
            _convert(mod, build_method(method, shape, opts), method, H, Hkv, D, init_std)
        elif getattr(mod, "qk_method", None) is None:  # standard attention; the family's q/k norms stay
            qm = METHODS["none"](shape, NoOptions())
            mod.qk_method = qm.to(device=mod.q_proj.weight.device, dtype=mod.q_proj.weight.dtype)
        add_gate_sink(mod, H, attn_gate, attn_sink, init_std)
        _swap_class(mod)
    use_qklab_attention(model)


def _convert(mod: nn.Module, qm: QKMethod, method: str, H: int, Hkv: int, D: int, init_std: float) -> None:
    """One Llama-style layer to the forward-side method ``qm``."""
    if qm.rotated_dim() != D:
        raise ConfigError(f"{method} with these options rotates q/k features of width {qm.rotated_dim()}, but the "
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


def _apply_deepseek(model: nn.Module, method: str, opts: object) -> None:
    """MLA layers: the method maps the materialised per-head q, k ([nope | rope], pre-RoPE) as in qklab's
    MLA; methods that change the projection widths (qkmap) are refused there as here."""
    cfg = model.config
    mods = sorted((m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")), key=lambda m: m.layer_idx)
    for mod in mods:
        F = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        H = cfg.num_attention_heads
        # DeepSeek's scaling over the plain 1 / sqrt(F): YaRN's correction, which the layer's scale carries
        gain = mod.scaling * F ** 0.5
        qm = build_method(method, AttnShape(cfg.hidden_size, H, H, F, mod.layer_idx, len(mods), logit_gain=gain), opts)
        if qm.proj_dim() != F or qm.qk_in_dim() != cfg.hidden_size:
            raise ConfigError(f"{method} changes the q/k projection widths, which MLA (DeepSeek) does not allow")
        qm.reset_parameters()
        p = mod.kv_b_proj.weight
        mod.qk_method = qm.to(device=p.device, dtype=p.dtype)
        _swap_class(mod, QKDeepSeekMixin)
    use_qklab_attention(model)
