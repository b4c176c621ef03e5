"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with a latent-cache decode path.

Per layer, H heads, widths from ``ModelConfig.mla_dims`` (q_rank, kv_rank, nope, rope, v):

    queries  c_q = RMSNorm(W_dq x)                (B, T, q_rank);  q_rank = 0: no query latent, c_q = x
             q_nope^h = W_uq^h c_q,   q_rope^h = RoPE(W_qr^h c_q)
    keys     c_kv = RMSNorm(W_dkv x)              (B, T, kv_rank)
             k_nope^h = W_uk^h c_kv,  k_rope = RoPE(W_kr x)      one rope key shared by all heads
    values   v^h = W_uv^h c_kv
    logits   s^h = (q_nope^h . k_nope^h + q_rope^h . k_rope) / sqrt(nope + rope)
    output   W_o [o^1 .. o^H]

One ``nn.Linear`` per matrix (``wdq``, ``q_norm``, ``wuq``, ``wqr``, ``wdkv``, ``kv_norm``, ``wkr``, ``wuk``,
``wuv``, ``wo``); head h owns rows ``h*n : (h+1)*n`` of ``wuq``, ``wqr``, ``wuk``, ``wuv`` (n: that
matrix's per-head width).

Two paths compute the same thing:
* materialised (training, prefill): per-head q (B, H, T, nope+rope) and k through ``attention.attend``,
  the kernel choice (SDPA, FlexAttention or eager) MHA makes; with a per-head ``KVCache`` it decodes like
  MHA.
* latent (``LatentCache``): the cache holds [c_kv | RoPE(k_rope)], kv_rank + rope values per token, and
  decoding is absorbed: q_nope^h . W_uk^h c = ((W_uk^h)^T q_nope^h) . c moves W_uk to the query side,
  and sum_j p_j W_uv^h c_j = W_uv^h (sum_j p_j c_j) moves W_uv to the output, so every head attends to
  the one shared latent key (an MQA-shaped product). ``latent_path`` "auto" uses the absorbed form for
  steps of up to ``ABSORB_MAX_T`` tokens (decoding, and the short chunks that speculative decoding
  verifies) and expands the latent into per-head k, v for longer chunks (prefill).

QK methods see MLA through the one interface: ``map_qk`` gets q and k as (B, H, T, nope+rope), [nope |
rope] pre-RoPE, and a rope that rotates only the trailing ``rope`` features. The latent path asks
``latent_map`` instead: the same map with the key side written as a static gain (folded into the query)
times one scalar per token and head (cached; QK-Norm's inverse RMS). Methods with
``latent_cache_ok = False`` run on the materialised path only.

RoPE layout: qklab rotates halves (pair i is (x_i, x_{i+D/2})); DeepSeek checkpoints rotate adjacent
pairs (``rope_interleave`` in transformers). The two agree exactly once the rows of W_kr and of each
head's W_qr slice are permuted by ``rope_permutation(rope)``; ``qklab.hf.deepseek`` imports and exports
DeepSeek-V2/V3 attention weights. With ``model.rope_scaling=yarn`` the rotary tables are YaRN's (``Rope``)
and the softmax scale gets DeepSeek's correction ``Yarn.softmax_mscale()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from qklab.methods import METHODS, AttnShape, QKMethod
from qklab.methods.base import positions_of
from qklab.methods.headwise import AttnKind
from qklab.model.attention import (
    KVCache,
    MaxLogitTracker,
    apply_gate,
    attend,
    causal_mask,
    eager_probs,
    make_gate,
    make_sink,
)
from qklab.model.rope import Rope, Yarn

LATENT_PATHS = ("auto", "absorbed", "materialised")
ABSORB_MAX_T = 8  # "auto": chunks of up to this many new tokens decode absorbed (docs/mla.md)


def rope_permutation(rope_dim: int) -> torch.Tensor:
    """Row order that turns an interleaved-RoPE projection (pairs (2i, 2i+1)) into qklab's rotate-half
    layout (pairs (i, i + rope_dim/2)): [0, 2, 4, .., 1, 3, 5, ..]. Apply it to W_kr's rows and to the
    rows of each head's slice of W_qr."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class PartialRope:
    """RoPE on the trailing ``dim`` features of x (B, H, T, F); the leading F - dim pass through."""

    def __init__(self, rope: Rope, dim: int) -> None:
        self.rope, self.dim = rope, dim

    def __call__(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        keep, rot = x.split([x.shape[-1] - self.dim, self.dim], dim=-1)
        return torch.cat([keep, self.rope(rot, pos)], dim=-1)

    def positions(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        return positions_of(self.rope, x, pos)


@dataclass
class LatentCache:
    """Per-layer MLA cache. kv (B, Lmax, kv_rank + rope): per token the normalised latent c_kv and the
    post-RoPE shared rope key. kscale (B, H, Lmax): the per-token, per-head key scalar of a QK method that
    has one (QK-Norm's inverse RMS), allocated with the cache (``MLAttention.make_cache``); None otherwise."""

    kv: torch.Tensor
    kscale: torch.Tensor | None = None
    length: int = 0

    def values_per_token(self) -> int:
        """Cached values per token (per layer): kv_rank + rope, plus H with key scalars."""
        return self.kv.shape[-1] + (self.kscale.shape[1] if self.kscale is not None else 0)

    def append(self, kv: torch.Tensor, kscale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv (B, T, kv_rank + rope), kscale (B, H, T) or None -> the cached (B, L, .), (B, H, L) so far."""
        T, Lmax = kv.shape[1], self.kv.shape[1]
        if self.length + T > Lmax:
            raise ValueError(f"latent cache full: {self.length + T} > {Lmax} positions")
        a, b = self.length, self.length + T
        self.kv[:, a:b] = kv
        if (kscale is None) != (self.kscale is None):
            raise ValueError("latent cache: key scalars given for a cache allocated without them, or missing")
        if kscale is not None:
            self.kscale[:, :, a:b] = kscale
        self.length = b
        ks = self.kscale[:, :, :b] if kscale is not None else None
        return self.kv[:, :b], ks


class MLAttention(nn.Module, MaxLogitTracker):
    """Multi-head latent attention (module docstring)."""

    kind: ClassVar[AttnKind] = "mla"  # what controllers and the optimizer test (``methods.headwise.is_mla``)

    def __init__(self, cfg, qk_cfg, layer_idx: int) -> None:
        super().__init__()
        d = cfg.mla_dims
        self.n_heads, self.q_rank, self.kv_rank = cfg.n_heads, d.q_rank, d.kv_rank
        self.nope_dim, self.rope_dim, self.v_dim = d.nope, d.rope, d.v
        self.n_kv_heads = self.n_heads  # materialised keys are per head
        self.head_dim = d.nope + d.rope  # per-head q/k width (AttnShape.head_dim); values have v_dim
        # widths the method would change are refused by config.check_model, before any layer is built
        yarn = Yarn.from_config(cfg)
        self.softmax_mscale = yarn.softmax_mscale() if yarn else 1.0  # YaRN (DeepSeek)
        shape = replace(AttnShape.of(cfg, layer_idx), logit_gain=self.softmax_mscale)  # the scale's correction
        self.qk: QKMethod = METHODS[qk_cfg.method](shape, qk_cfg.opts(qk_cfg.method))
        H, C, n, r, R = cfg.n_heads, cfg.d_model, d.nope, d.rope, d.kv_rank
        q_in = d.q_rank or C
        self.wdq = nn.Linear(C, d.q_rank, bias=False) if d.q_rank else None
        self.q_norm = nn.RMSNorm(d.q_rank, eps=cfg.norm_eps) if d.q_rank else None
        self.wuq = nn.Linear(q_in, H * n, bias=False)  # q_nope, head-major
        self.wqr = nn.Linear(q_in, H * r, bias=False)  # q_rope, head-major
        self.wdkv = nn.Linear(C, R, bias=False)
        self.kv_norm = nn.RMSNorm(R, eps=cfg.norm_eps)
        self.wkr = nn.Linear(C, r, bias=False)  # the shared rope key
        self.wuk = nn.Linear(R, H * n, bias=False)
        self.wuv = nn.Linear(R, H * d.v, bias=False)
        self.wo = nn.Linear(H * d.v, C, bias=False)
        self.wg = make_gate(cfg, H, d.v)  # model.attn_gate, on each head's output (outside the latent cache)
        self.sink = make_sink(cfg, H)  # model.attn_sink: a per-head logit in every softmax denominator
        self.impl = cfg.attn_impl
        self.latent_path = "auto"  # auto | absorbed | materialised, for LatentCache decoding
        self.capture: dict[str, torch.Tensor] | None = None
        self.init_tracker(self.n_heads)  # QK-clip's per-head max logit (materialised path)

    def scale(self, width: int) -> float:
        """The softmax scale of q.k over ``width`` features: the method's, times YaRN's correction."""
        return self.qk.scale(width) * self.softmax_mscale

    # --- projections ------------------------------------------------------------------------------
    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> pre-RoPE q (B, H, T, nope + rope)."""
        B, T, _ = x.shape
        cq = self.q_norm(self.wdq(x)) if self.wdq is not None else x  # (B, T, q_rank | C)
        qn = self.wuq(cq).view(B, T, self.n_heads, self.nope_dim)
        qr = self.wqr(cq).view(B, T, self.n_heads, self.rope_dim)
        return torch.cat([qn, qr], dim=-1).transpose(1, 2)

    def keys(self, c: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
        """c (B, T, kv_rank), kr (B, T, rope) -> pre-RoPE k (B, H, T, nope + rope), rope part shared."""
        B, T, _ = c.shape
        kn = self.wuk(c).view(B, T, self.n_heads, self.nope_dim)
        return torch.cat([kn, kr.unsqueeze(2).expand(B, T, self.n_heads, self.rope_dim)], dim=-1).transpose(1, 2)

    def values(self, c: torch.Tensor) -> torch.Tensor:
        """c (B, T, kv_rank) -> v (B, H, T, v_dim)."""
        B, T, _ = c.shape
        return self.wuv(c).view(B, T, self.n_heads, self.v_dim).transpose(1, 2)

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache | LatentCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, C)
        pos = cache.length if cache is not None else 0
        q = self.queries(x)  # (B, H, T, F)
        c = self.kv_norm(self.wdkv(x))  # (B, T, kv_rank)
        kr = self.wkr(x)  # (B, T, rope), pre-RoPE
        prope = PartialRope(rope, self.rope_dim)
        if isinstance(cache, LatentCache):
            y = self._latent(q, c, kr, rope, prope, pos, cache)
        else:
            k, v = self.keys(c, kr), self.values(c)  # (B, H, T, F), (B, H, T, Dv)
            q, k = self.qk.map_qk(q, k, prope, pos)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, L, F), (B, H, L, Dv)
            y = self._attend(q, k, v)
        y = apply_gate(self.wg, x, y)  # (B, H, T, Dv)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)  # (B, T, H*Dv)
        return self.wo(y)

    def check_latent(self) -> None:
        if not self.qk.latent_cache_ok:
            raise ValueError(f"qk.method='{self.qk.name}' needs per-head keys, so MLA cannot decode it from the "
                             "latent cache; use per-head caches: model.make_caches(..., latent=False)")

    def make_cache(self, batch: int, max_len: int, device, dtype, latent: bool | None = None):
        """A LatentCache (latent=None: when the QK method allows it; True: always) or a per-head KVCache."""
        if latent is None:
            latent = self.qk.latent_cache_ok
        if latent:
            self.check_latent()
            kv = torch.zeros(batch, max_len, self.kv_rank + self.rope_dim, device=device, dtype=dtype)
            n_ks = self.n_heads // self.qk.latent_key_group  # key scalars per token (QK-Norm: one per head or group)
            ks = torch.zeros(batch, n_ks, max_len, device=device, dtype=dtype) if self.qk.latent_key_scale else None
            return LatentCache(kv, ks)
        k = torch.zeros(batch, self.n_heads, max_len, self.qk.feature_dim(), device=device, dtype=dtype)
        v = torch.zeros(batch, self.n_heads, max_len, self.v_dim, device=device, dtype=dtype)
        return KVCache(k, v)

    def _latent(self, q, c, kr, rope, prope, pos, cache: LatentCache) -> torch.Tensor:
        """Append the new tokens' latents to the cache and attend over it; returns (B, H, T, Dv)."""
        self.check_latent()
        n = self.nope_dim
        k = self.keys(c, kr) if self.qk.latent_key_scale else None  # (B, H, T, F) pre-RoPE, for key scalars
        q, gain, ks = self.qk.latent_map(q, k, prope, pos)  # (B, H, T, F) rotated; (F,) | None; (B, H, T, 1|F) | None
        if gain is not None:  # the rope part of the gain goes on the shared rope key before RoPE
            kr = kr * gain[n:]
        if ks is not None and self.qk.latent_key_parts:  # the rope part's scalar, equal for all heads, goes there too
            kr = kr * ks[:, 0, :, n : n + 1]
        kr = rope(kr.unsqueeze(1), pos).squeeze(1)  # (B, T, rope)
        ks_n = ks[:, :: self.qk.latent_key_group, :, 0] if ks is not None else None  # (B, H / group, T)
        kv, kscale = cache.append(torch.cat([c, kr], dim=-1), ks_n)
        scale = self.scale(q.shape[-1])
        T = q.shape[2]
        if self.latent_path == "absorbed" or (self.latent_path == "auto" and T <= ABSORB_MAX_T):
            return self._absorbed(q, kv, kscale, gain, scale)
        if self.latent_path not in LATENT_PATHS:
            raise ValueError(f"latent_path='{self.latent_path}': use one of {', '.join(LATENT_PATHS)}")
        k, v = self._expand(kv, kscale, gain)
        return self._attend(q, k, v)

    def _expand(self, kv, kscale, gain) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents (B, L, kv_rank + rope) -> the method's per-head keys (B, H, L, F), post-RoPE,
        and values (B, H, L, Dv)."""
        c, kr = kv.split([self.kv_rank, self.rope_dim], dim=-1)  # (B, L, kv_rank), (B, L, rope)
        B, L, _ = c.shape
        kn = self.wuk(c).view(B, L, self.n_heads, self.nope_dim).transpose(1, 2)  # (B, H, L, nope)
        if gain is not None:
            kn = kn * gain[: self.nope_dim]
        ks = self._key_scale(kscale)  # (B, H, L, 1) | None
        if ks is not None and self.qk.latent_key_parts:  # the rope part's scalar is already in kr
            kn = kn * ks
        k = torch.cat([kn, kr.unsqueeze(1).expand(B, self.n_heads, L, self.rope_dim)], dim=-1)
        if ks is not None and not self.qk.latent_key_parts:
            k = k * ks
        return k, self.values(c)

    def _key_scale(self, kscale: torch.Tensor | None) -> torch.Tensor | None:
        """Cached key scalars (B, H / group, L) -> one per head (B, H, L, 1)."""
        if kscale is None:
            return None
        return kscale.repeat_interleave(self.qk.latent_key_group, dim=1).unsqueeze(-1)

    def _absorbed(self, q, kv, kscale, gain, scale: float) -> torch.Tensor:
        """q (B, H, T, F) mapped and rotated; kv (B, L, kv_rank + rope); kscale (B, H, L) | None.
        Returns (B, H, T, Dv) without materialising per-head keys or values."""
        B, H, T, _ = q.shape
        L, R = kv.shape[1], self.kv_rank
        qn, qr = q.split([self.nope_dim, self.rope_dim], dim=-1)
        if gain is not None:  # the static key gain, folded into the query side
            qn = qn * gain[: self.nope_dim]
        q_lat = torch.matmul(qn, self.wuk.weight.view(H, self.nope_dim, R))  # (B, H, T, kv_rank): W_uk^T q_nope
        ks = self._key_scale(kscale)  # (B, H, L, 1) | None
        if ks is not None and self.qk.latent_key_parts:  # the scalar acts on the nope logits only
            c, kr = kv.split([R, self.rope_dim], dim=-1)
            s_n = torch.matmul(q_lat.reshape(B, H * T, R), c.transpose(1, 2)).view(B, H, T, L)
            s_r = torch.matmul(qr.reshape(B, H * T, self.rope_dim), kr.transpose(1, 2)).view(B, H, T, L)
            s = (s_n * ks.transpose(2, 3) + s_r) * scale  # (B, H, T, L)
        else:
            ql = torch.cat([q_lat, qr], dim=-1).reshape(B, H * T, R + self.rope_dim)
            s = torch.matmul(ql, kv.transpose(1, 2)).view(B, H, T, L) * scale  # (B, H, T, L)
            if ks is not None:
                s = s * ks.transpose(2, 3)
        mask = causal_mask(T, L, s.device) if T > 1 or self.capture is not None else None  # one query sees all
        p = eager_probs(self.qk, s, mask, self.sink, s.dtype, capture=self.capture)  # (B, H, T, L)
        o = torch.matmul(p.reshape(B, H * T, L), kv[..., :R]).view(B, H, T, R)  # sum_j p_j c_j
        return torch.matmul(o, self.wuv.weight.view(H, self.v_dim, R).transpose(1, 2))  # (B, H, T, Dv): W_uv o

    # --- attention on materialised q, k, v ---------------------------------------------------------
    def _attend(self, q, k, v) -> torch.Tensor:
        """q (B, H, Tq, F), k (B, H, Tk, F), v (B, H, Tk, Dv) -> (B, H, Tq, Dv), on MHA's kernel choice."""
        return attend(self.qk, q, k, v, eager=self.impl == "eager", sink=self.sink, tracker=self,
                      capture=self.capture, scale=self.scale(q.shape[-1]))
