"""qklab in torchtitan (0.3): a forward-side method in every ``GQAttention`` through torchtitan's override
mechanism, and a controller around its optimizers' step.

    # the trainer's command line:
    --override.imports 'qklab.integrations.torchtitan.qk_attention={"method": "qknorm"}'
    # or in Python, on a Trainer.Config, a ModelSpec or a model config, before anything is built:
    qklab.integrations.torchtitan.apply(config, "softcap", cap=30.0)
    # once the model and its OptimizersContainer exist:
    handle = qklab.integrations.torchtitan.attach(model, optimizers, "qkclip", tau_clip=100.0)

``qk_attention`` is an ``@override`` on ``GQAttention.Config`` (Llama 3, Qwen 3, ... in torchtitan): each
matched attention's config becomes ``QKGQAttention.Config``, the same fields plus the method. The module
keeps torchtitan's projections, RoPE tables (``ComplexRoPE``: interleaved, ``CosSinRoPE``: half-split),
inner attention (FlexAttention with its block mask, or varlen) and output projection; between them q and
k go through ``qklab.QK`` with the model's RoPE, and the inner attention gets the method's softmax scale
(a logit rewrite, softcap, as FlexAttention's ``score_mod``). QK-MAP, which narrows q and k, gets its own
W_Q/W_K/W_V projections (``QKVProjections``, the stock ``wq``/``wk``/``wv`` names). A method that replaces
q/k norms drops the model's ``q_norm``/``k_norm`` (QK-Norm first takes over their gains, which keep their
checkpoint names: a stock Qwen 3 checkpoint loads); the others keep them in front. ``attention="qklab"``
runs qklab's own attention with the model's masks made dense (torch 2.13's FlexAttention has no backward
on the CPU).

``attach`` runs ``qklab.attach`` on the model's attention layers (W_Q/W_K as per-head views of ``wq``/``wk``
or of the fused ``wqkv`` of MHA layers) with the controller's hooks on the ``OptimizersContainer``; the
max logits come from each layer's ``qklab.QK`` (packed documents kept apart by their positions) or, on a
stock attention, from a hook on its inner attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torchtitan.config import OverrideConfig, apply_overrides, derive, override
from torchtitan.models.common.attention import (
    FlexAttention,
    FusedQKVLinear,
    GQAttention,
    QKVLinear,
    ScaledDotProductAttention,
)
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
from torchtitan.protocols.module import Module

from qklab.errors import ConfigError
from qklab.hf.attach import Attached
from qklab.hf.attach import attach as qklab_attach
from qklab.hf.attention import masked_head_max
from qklab.hf.layers import QKLayer, norm_refusal
from qklab.methods.build import method_options
from qklab.model.qk import QK
from qklab.model.user_rope import UserRope

OVERRIDE = f"{__name__}.qk_attention"
ATTENTIONS = ("inner", "qklab")


class QKVProjections(Module):
    """W_Q and W_K at a method's widths (QK-MAP: n_heads * proj_dim rows, input ``in_features``) and W_V:
    torchtitan Linears named as the stock ``QKVLinear``'s, W_Q/W_K initialised at the method's std."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        in_features: int
        q_features: int
        k_features: int
        v_features: int
        qk_std: float

    def __init__(self, config: Config) -> None:
        super().__init__()
        init = {"weight": lambda w, s=config.qk_std: nn.init.normal_(w, 0.0, s)}
        self.wq = Linear.Config(in_features=config.in_features, out_features=config.q_features, param_init=init).build()
        self.wk = Linear.Config(in_features=config.in_features, out_features=config.k_features, param_init=init).build()
        self.wv = Linear.Config(in_features=config.dim, out_features=config.v_features,
                                param_init={"weight": lambda w: nn.init.trunc_normal_(w, std=0.02)}).build()


class QKGQAttention(GQAttention):
    """torchtitan's grouped-query attention with a qklab forward-side method between its projections and
    its inner attention (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GQAttention.Config):
        qk_method: str = "none"
        qk_options: dict = field(default_factory=dict)
        qk_attention: str = "inner"  # inner: the model's inner attention; qklab: qklab's, the masks made dense

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.qk_attention not in ATTENTIONS:
            raise ConfigError(f"attention={config.qk_attention!r}: use inner or qklab")
        if not isinstance(self.rope, ComplexRoPE | CosSinRoPE):
            raise ConfigError(f"qklab reads torchtitan's ComplexRoPE and CosSinRoPE tables, not "
                              f"{type(self.rope).__name__}")
        inner = self.inner_attention
        if config.qk_attention == "inner" and not isinstance(inner, FlexAttention | ScaledDotProductAttention):
            raise ConfigError(f"qklab runs inside torchtitan's FlexAttention or SDPA, not {type(inner).__name__}; "
                              "use attention='qklab' or the flex backend")
        self.qk_attention = config.qk_attention
        self.qk = QK(config.qk_method, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                     d_model=config.dim, **config.qk_options)
        if (self.qk.proj_dim, self.qk.in_features) != (self.head_dim, config.dim):  # QK-MAP: its own widths
            self.qkv_linear = QKVProjections.Config(
                dim=config.dim, in_features=self.qk.in_features, q_features=self.qk.q_features,
                k_features=self.qk.k_features, v_features=self.n_kv_heads * self.head_dim,
                qk_std=self.qk.method.qk_init_std(0.02)).build()
        self.stock_names: list[tuple[str, str]] = []  # (qklab's, torchtitan's) name of a gain taken over
        if self.q_norm is not None and config.qk_method != "none" and not self.qk.method.keeps_model_qk_norm:
            m = self.qk.method
            m.adopt_qk_norm(self.q_norm, self.k_norm)  # QK-Norm takes over the model's gains
            self.stock_names = [(f"qk.method.{n}.weight", f"{n}.weight") for n in ("q_norm", "k_norm")
                                if getattr(getattr(m, n, None), "weight", None) is not None
                                and getattr(m, n).weight.shape == getattr(self, n).weight.shape]
            self.q_norm = self.k_norm = None
            if self.stock_names:  # checkpoints keep the stock names: a stock one brings its trained gains
                self.register_state_dict_post_hook(_to_stock_names)
                self.register_load_state_dict_pre_hook(_from_stock_names)

    def _init_self_parameters(self) -> None:
        super()._init_self_parameters()
        self.qk.reset_parameters()  # init_states reaches only torchtitan's own Modules

    def user_rope(self) -> UserRope:
        """The model's RoPE tables as they are now (init_states may rebuild them on another device)."""
        cache = self.rope.cache
        if isinstance(self.rope, ComplexRoPE):  # (L, D/2) complex, pairs (2i, 2i + 1)
            return UserRope(cache, "interleaved")
        return UserRope((cache[:, : self.head_dim], cache[:, self.head_dim :]), "half")  # (L, 2D): [cos | sin]

    def forward(self, x_BLD: torch.Tensor, attention_masks, positions: torch.Tensor | None = None) -> torch.Tensor:
        qk = self.qk
        B, L, _ = x_BLD.shape
        if isinstance(self.qkv_linear, QKVProjections):
            p, xqk = self.qkv_linear, qk.map_input(x_BLD)
            xq, xk = p.wq(xqk).view(B, L, -1, qk.proj_dim), p.wk(xqk).view(B, L, -1, qk.proj_dim)
            xv = p.wv(x_BLD).view(B, L, -1, self.head_dim)  # (B, L, N, d'), (B, L, Nkv, d'), (B, L, Nkv, D)
        else:
            xq, xk, xv = self.qkv_linear(x_BLD)  # (B, L, N, D), (B, L, Nkv, D), (B, L, Nkv, D)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        pos = positions if positions is not None else torch.arange(L, device=x_BLD.device).expand(B, L)
        segments = (pos == 0).cumsum(dim=1)  # (B, L): torchtitan restarts the positions at each packed document
        q, k = qk(xq.transpose(1, 2), xk.transpose(1, 2), pos, rope=self.user_rope(), segments=segments)
        v = xv.transpose(1, 2)  # (B, Nkv, L, D)
        if self.qk_attention == "qklab" or (qk.rewrites_logits and not isinstance(self.inner_attention, FlexAttention)):
            y = qk.attend(q, k, v, mask=dense_mask(attention_masks, B, L, x_BLD.device)).transpose(1, 2)
        else:
            more = {"score_mod": _score_mod(qk)} if qk.rewrites_logits else {}
            y = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), xv, attention_masks=attention_masks,
                                     scale=qk.scale, enable_gqa=self.enable_gqa, **more)  # (B, L, N, D)
        return self.wo(y.contiguous().flatten(2))


def _to_stock_names(module: QKGQAttention, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the gains a QK-Norm took over under the model's own names (``q_norm.weight``)."""
    for ours, theirs in module.stock_names:
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = state_dict.pop(prefix + ours)


def _from_stock_names(module: QKGQAttention, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: the model's own names back to the QK-Norm's."""
    for ours, theirs in module.stock_names:
        if prefix + theirs in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)


def _score_mod(qk: QK):
    """The method's rewrite of each scaled logit, as FlexAttention's score_mod (elementwise: softcap)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return qk.logits(score)
    return score_mod


def dense_mask(masks, B: int, L: int, device) -> torch.Tensor | None:
    """The model's attention masks as a (B, 1, L, L) bool (True: seen); None (causal) without masks."""
    if masks is None:
        return None
    if isinstance(masks, BlockMask):
        return create_mask(masks.mask_mod, B, 1, L, L, device=device)
    raise ConfigError(f"attention='qklab' reads FlexAttention block masks, not {type(masks).__name__}")


@override(target=GQAttention.Config, description="qklab forward-side QK method (qklab.integrations.torchtitan)")
def qk_attention(cfg: GQAttention.Config, method: str = "none", attention: str = "inner",
                 **options) -> QKGQAttention.Config:
    """torchtitan override: this attention with qklab's ``method`` and its ``options``."""
    if isinstance(cfg, QKGQAttention.Config):
        raise ConfigError(f"this attention already has qklab method '{cfg.qk_method}'; apply one method once")
    return derive(cfg, QKGQAttention.Config, qk_method=method, qk_options=dict(options), qk_attention=attention)


def apply(config, method: str, *, attention: str = "inner", **options) -> list[str]:
    """Give every GQAttention of a torchtitan config tree (a Trainer.Config, a ModelSpec, a model config)
    qklab's ``method`` with its ``options``, through torchtitan's override mechanism; before ``build``.
    Returns torchtitan's lines naming each replaced attention."""
    method_options(method, options)  # the name and values checked before any replacement; shapes at build
    kwargs = {"method": method, "attention": attention, **options}
    done = apply_overrides(OverrideConfig(imports=[(OVERRIDE, kwargs)]), config)
    if not done:
        raise ConfigError(f"no torchtitan GQAttention in {type(config).__name__}; qklab replaces GQAttention configs")
    return done


def _weights(attn: GQAttention, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head views (n_heads, rows, C) of a layer's W_Q and (n_kv_heads, rows, C) of its W_K."""
    lin = attn.qkv_linear
    if isinstance(lin, QKVLinear | QKVProjections):
        return (lin.wq.weight.detach().unflatten(0, (attn.n_heads, -1)),
                lin.wk.weight.detach().unflatten(0, (attn.n_kv_heads, -1)))
    if isinstance(lin, FusedQKVLinear) and attn.n_heads == attn.n_kv_heads:
        w = lin.wqkv.weight.detach().view(attn.n_heads, 3, attn.head_dim, -1)  # per head [q | k | v] rows
        return w[:, 0], w[:, 1]
    raise ConfigError(f"layer {i}: qklab's controllers read W_Q/W_K of QKVLinear, or of FusedQKVLinear with as many "
                      "key as query heads; build GQA layers with fuse_qkv=False")


def hook_inner_attention(layer: QKLayer, inner: nn.Module) -> None:
    """A pre-hook on a stock attention's inner attention, called as f(q, k, v, attention_masks=..., scale=...)
    on the final (B, L, N, D) q and k: their per-head max logit over the keys each query sees (a block
    mask's, e.g. its own document's; causal without one) into the layer's tracker."""
    def hook(m, args, kwargs):
        if not layer.tracking:
            return
        q, k = args[0].detach().transpose(1, 2), args[1].detach().transpose(1, 2)  # (B, N, L, D), (B, Nkv, L, D)
        B, _, L, D = q.shape
        masks = kwargs.get("attention_masks")
        allowed = dense_mask(masks, B, L, q.device) if isinstance(masks, BlockMask) else None  # (B, 1, L, L)
        layer._track(masked_head_max(q, k, kwargs.get("scale") or D**-0.5, allowed, causal=True))

    layer.hooks = [inner.register_forward_pre_hook(hook, with_kwargs=True)]


def attention_layers(model: nn.Module) -> list[QKLayer]:
    """Every GQAttention of a torchtitan model as a ``QKLayer`` (what ``qklab.attach`` acts on)."""
    out = []
    for i, attn in enumerate(m for m in model.modules() if isinstance(m, GQAttention)):
        wq, wk = _weights(attn, i)
        qk = getattr(attn, "qk", None)
        layer = QKLayer(f"layer{i}", qk if qk is not None else attn.inner_attention, attn.n_heads, attn.n_kv_heads,
                        {"wq": wq, "wk": wk}, qk.method if qk is not None else None)
        if attn.q_norm is not None and qk is None:
            layer.qk = norm_refusal(layer)  # QK-clip refused on normalised logits, as for transformers' Qwen3
        elif attn.q_norm is not None:  # the model's norms kept in front of the method (softcap, SSMax)
            layer.model_norm = "q_norm"
        if qk is not None:
            layer.fed = True  # its qklab.QK measures the logits
        else:  # the stock attention: a hook where it forms its logits
            hook_inner_attention(layer, attn.inner_attention)
        out.append(layer)
    if not out:
        raise ConfigError(f"no torchtitan GQAttention in {type(model).__name__}")
    return out


def attach(model: nn.Module, optimizers, controller: str, *, track: bool = False, **options) -> Attached:
    """Run ``controller`` (as ``qklab.attach``) on a torchtitan model, around every ``optimizers.step()`` (its
    ``OptimizersContainer``, or one optimizer); the lookups of learning rates and weight decay read the
    container's own optimizers."""
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    handle = qklab_attach(model, inner, controller, layers=attention_layers(model), hooks=False, track=track,
                          **options)
    handle.run_around(optimizers)
    return handle
