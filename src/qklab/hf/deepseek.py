"""DeepSeek-V2/V3 attention weights to and from qklab's MLA (``qklab.model.mla.MLAttention``).

transformers' DeepSeek attention keeps, per layer:

    q_a_proj (q_rank, C), q_a_layernorm, q_b_proj (H * (nope + rope), q_rank)   or q_proj without a query latent
    kv_a_proj_with_mqa (kv_rank + rope, C), kv_a_layernorm, kv_b_proj (H * (nope + v), kv_rank), o_proj

with each head's q rows laid out [nope | rope] and kv_b rows [k_nope | v]. qklab splits them into
``wdq, q_norm, wuq, wqr, wdkv, kv_norm, wkr, wuk, wuv, wo``. RoPE: DeepSeek-V2 always, and V3 with
``rope_interleave``, rotates adjacent pairs; qklab rotates halves, so the rope rows are permuted by
``rope_permutation`` on the way in (and back on the way out). The latent RMSNorms carry their own eps
(transformers builds them with 1e-6 whatever ``rms_norm_eps`` says); YaRN settings map to
``model.rope_scaling=yarn`` (frequencies, attention factor, and the softmax-scale correction).
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.config import ModelConfig, QKConfig
from qklab.errors import ConfigError
from qklab.model.mla import MLAttention, rope_permutation


def interleaved(hf_cfg) -> bool:
    """Whether the checkpoint's rope rows rotate adjacent pairs (V2 always; V3 unless rope_interleave=False)."""
    return getattr(hf_cfg, "model_type", "") == "deepseek_v2" or bool(getattr(hf_cfg, "rope_interleave", True))


def mla_config(hf_cfg, **overrides) -> ModelConfig:
    """The qklab ``ModelConfig`` (attention=mla) of a DeepSeek-V2/V3 config: widths, heads, RoPE, YaRN."""
    rp = dict(hf_cfg.rope_parameters or {})
    kw = dict(vocab_size=hf_cfg.vocab_size, d_model=hf_cfg.hidden_size, n_layers=hf_cfg.num_hidden_layers,
              n_heads=hf_cfg.num_attention_heads, max_seq_len=hf_cfg.max_position_embeddings,
              rope_theta=float(rp.get("rope_theta", 10000.0)), norm_eps=hf_cfg.rms_norm_eps, attention="mla",
              q_rank=hf_cfg.q_lora_rank or 0, kv_rank=hf_cfg.kv_lora_rank, nope_dim=hf_cfg.qk_nope_head_dim,
              rope_dim=hf_cfg.qk_rope_head_dim, v_dim=hf_cfg.v_head_dim)
    rtype = rp.get("rope_type", "default")
    if rtype == "yarn":
        kw.update(rope_scaling="yarn", yarn_factor=float(rp["factor"]),
                  yarn_original_max_len=int(rp["original_max_position_embeddings"]),
                  yarn_beta_fast=float(rp.get("beta_fast") or 32.0), yarn_beta_slow=float(rp.get("beta_slow") or 1.0),
                  yarn_mscale=float(rp.get("mscale") or 0.0),
                  yarn_mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))
        if rp.get("attention_factor") is not None or rp.get("truncate", True) is False:
            raise ConfigError("YaRN with an explicit attention_factor or truncate=False is not supported")
    elif rtype != "default":
        raise ConfigError(f"rope_type '{rtype}' is not supported; qklab's MLA has default and yarn RoPE")
    kw.update(overrides)
    return ModelConfig(**kw)


def _check(theirs: nn.Module) -> None:
    for name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
        lin = getattr(theirs, name, None)
        if lin is not None and lin.bias is not None:
            raise ConfigError(f"DeepSeek attention with attention_bias=True ({name}.bias) has no qklab MLA equivalent")


@torch.no_grad()
def load_deepseek_attention(ours: MLAttention, theirs: nn.Module) -> MLAttention:
    """Copy a transformers DeepSeek-V2/V3 attention layer's weights (and latent-norm eps) into ``ours``."""
    _check(theirs)
    H, n, r, R, v = ours.n_heads, ours.nope_dim, ours.rope_dim, ours.kv_rank, ours.v_dim
    perm = rope_permutation(r) if interleaved(theirs.config) else torch.arange(r)
    q = (theirs.q_b_proj if theirs.q_lora_rank is not None else theirs.q_proj).weight.view(H, n + r, -1)
    ours.wuq.weight.copy_(q[:, :n].reshape(H * n, -1))
    ours.wqr.weight.copy_(q[:, n:][:, perm].reshape(H * r, -1))
    if theirs.q_lora_rank is not None:
        ours.wdq.weight.copy_(theirs.q_a_proj.weight)
        ours.q_norm.weight.copy_(theirs.q_a_layernorm.weight)
        ours.q_norm.eps = theirs.q_a_layernorm.variance_epsilon
    kva = theirs.kv_a_proj_with_mqa.weight  # (kv_rank + rope, C)
    ours.wdkv.weight.copy_(kva[:R])
    ours.wkr.weight.copy_(kva[R:][perm])
    ours.kv_norm.weight.copy_(theirs.kv_a_layernorm.weight)
    ours.kv_norm.eps = theirs.kv_a_layernorm.variance_epsilon
    kvb = theirs.kv_b_proj.weight.view(H, n + v, R)
    ours.wuk.weight.copy_(kvb[:, :n].reshape(H * n, R))
    ours.wuv.weight.copy_(kvb[:, n:].reshape(H * v, R))
    ours.wo.weight.copy_(theirs.o_proj.weight)
    _method_gains(ours, theirs, perm, into_ours=True)
    return ours


def _method_gains(ours: MLAttention, theirs: nn.Module, perm: torch.Tensor, into_ours: bool) -> None:
    """QK-Norm gains of a layer converted with ``qklab.hf.apply``: per coordinate of [nope | rope], so their
    rope part follows the rope rows' permutation."""
    qm = getattr(theirs, "qk_method", None)
    if qm is None or not hasattr(qm, "q_norm") or not hasattr(ours.qk, "q_norm"):
        return
    n = ours.nope_dim
    for a, b in ((ours.qk.q_norm, qm.q_norm), (ours.qk.k_norm, qm.k_norm)):
        if into_ours:
            a.weight[:n], a.weight[n:] = b.weight[:n], b.weight[n:][perm]
        else:
            b.weight[:n], b.weight[n:] = a.weight[:n], a.weight[n:][torch.argsort(perm)]


@torch.no_grad()
def save_deepseek_attention(ours: MLAttention, theirs: nn.Module) -> nn.Module:
    """Copy ``ours`` into a transformers DeepSeek-V2/V3 attention layer of the same widths (the inverse of
    ``load_deepseek_attention``)."""
    _check(theirs)
    H, n, r, R, v = ours.n_heads, ours.nope_dim, ours.rope_dim, ours.kv_rank, ours.v_dim
    inv = torch.argsort(rope_permutation(r)) if interleaved(theirs.config) else torch.arange(r)
    q = (theirs.q_b_proj if theirs.q_lora_rank is not None else theirs.q_proj).weight.view(H, n + r, -1)
    q[:, :n] = ours.wuq.weight.view(H, n, -1)
    q[:, n:] = ours.wqr.weight.view(H, r, -1)[:, inv]
    if theirs.q_lora_rank is not None:
        theirs.q_a_proj.weight.copy_(ours.wdq.weight)
        theirs.q_a_layernorm.weight.copy_(ours.q_norm.weight)
        theirs.q_a_layernorm.variance_epsilon = ours.q_norm.eps
    kva = theirs.kv_a_proj_with_mqa.weight
    kva[:R] = ours.wdkv.weight
    kva[R:] = ours.wkr.weight[inv]
    theirs.kv_a_layernorm.weight.copy_(ours.kv_norm.weight)
    theirs.kv_a_layernorm.variance_epsilon = ours.kv_norm.eps
    kvb = theirs.kv_b_proj.weight.view(H, n + v, R)
    kvb[:, :n] = ours.wuk.weight.view(H, n, R)
    kvb[:, n:] = ours.wuv.weight.view(H, v, R)
    theirs.o_proj.weight.copy_(ours.wo.weight)
    _method_gains(ours, theirs, torch.argsort(inv), into_ours=False)
    return theirs


def mla_from_deepseek(theirs: nn.Module, qk: QKConfig | None = None) -> MLAttention:
    """A qklab MLA layer built from a transformers DeepSeek attention layer (config and weights)."""
    cfg = mla_config(theirs.config)
    ours = MLAttention(cfg, qk or QKConfig(), theirs.layer_idx)
    p = theirs.kv_b_proj.weight
    return load_deepseek_attention(ours.to(device=p.device, dtype=p.dtype), theirs)
