"""A decoder-only GPT: token embedding, pre-norm RMSNorm blocks, SwiGLU MLP, RoPE, MHA/GQA or MLA."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qklab.config import ModelConfig, QKConfig, check_model
from qklab.errors import ConfigError
from qklab.model.attention import Attention, KVCache
from qklab.model.loss import cross_entropy
from qklab.model.mla import LatentCache, MLAttention
from qklab.model.rope import Rope, Yarn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)  # gate
        self.w3 = nn.Linear(d_model, d_ff, bias=False)  # up
        self.w2 = nn.Linear(d_ff, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, qk: QKConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = MLAttention(cfg, qk, layer_idx) if cfg.attention == "mla" else Attention(cfg, qk, layer_idx)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ff_dim)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache | LatentCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, qk: QKConfig | None = None) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ConfigError("model.vocab_size must be set (it is taken from the tokenizer when training)")
        self.cfg, self.qk_cfg = cfg, qk or QKConfig()
        check_model(cfg, self.qk_cfg)  # the same one-line errors as a config file's
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, self.qk_cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.rope = Rope(cfg.max_seq_len, cfg.rope_theta, Yarn.from_config(cfg))
        self.ignore_index: int | None = None  # a target id without loss (a task scored at some positions only)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every weight initialisation of the model, in one place.

        * token embedding (and the tied head): N(0, init_std)
        * Q, K projections: N(0, qk_init_std) when the config sets it (one rule for every QK method, for
          fair comparisons), else N(0, qk.qk_init_std(init_std)): init_std unless the method asks otherwise
        * V projection, MLP gate/up, untied head: N(0, init_std)
        * output projections (attention wo, MLP w2): N(0, init_std / sqrt(2 * n_layers)), so that the
          residual stream's variance does not grow with depth (GPT-2)
        * RMSNorm gains: 1
        * MLA: the matrices that produce q and k (wuq, wqr, wuk, wkr) as Q, K projections; wdq, wdkv, wuv
          as V; wo as an output projection; the latent RMSNorm gains 1
        * the attention gate W_g (``model.attn_gate``), like V: N(0, init_std), so gates start near 1/2
        * the attention sinks (``model.attn_sink``): 0, so each head's denominator starts with exp(0) = 1
        * the QK method's own parameters: its ``reset_parameters()``
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_emb.weight, 0.0, std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, 0.0, std)
        for block in self.blocks:
            a, m = block.attn, block.mlp
            if isinstance(a, MLAttention):
                qk_ws, v_ws = (a.wuq, a.wqr, a.wuk, a.wkr), [w for w in (a.wdq, a.wdkv, a.wuv) if w is not None]
                for norm in (a.q_norm, a.kv_norm):
                    if norm is not None:
                        norm.reset_parameters()
            else:
                qk_ws, v_ws = (a.wq, a.wk), [a.wv]
            qk_std = self.cfg.qk_init_std or a.qk.qk_init_std(std)  # a QK method may ask for its own scale
            for w in qk_ws:
                nn.init.normal_(w.weight, 0.0, qk_std)
            gate = [a.wg] if a.wg is not None else []
            for w in (*v_ws, *gate, m.w1, m.w3):
                nn.init.normal_(w.weight, 0.0, std)
            if a.sink is not None:
                nn.init.zeros_(a.sink)
            for w in (a.wo.weight, m.w2.weight):
                nn.init.normal_(w, 0.0, out_std)
            block.attn_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
            a.qk.reset_parameters()
        self.norm.reset_parameters()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        caches: list[KVCache | LatentCache] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, V) and, with targets (B, T), the mean cross-entropy."""
        x = self.tok_emb(idx)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope, caches[i] if caches is not None else None)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), self.ignore_index)
        return logits, loss

    def make_caches(self, batch: int, max_len: int | None = None,
                    latent: bool | None = None) -> list[KVCache | LatentCache]:
        """Empty KV caches, one per layer, for ``batch`` sequences of up to ``max_len`` tokens. MLA layers
        get a latent cache when their QK method allows it (``latent=None``), always (``True``; refused
        for methods that cannot keep it) or per-head k/v caches (``False``)."""
        L = max_len or self.cfg.max_seq_len
        p = self.tok_emb.weight
        caches = []
        for block in self.blocks:
            a = block.attn
            if isinstance(a, MLAttention):
                caches.append(a.make_cache(batch, L, p.device, p.dtype, latent))
                continue
            k = torch.zeros(batch, a.n_kv_heads, L, a.qk.feature_dim(), device=p.device, dtype=p.dtype)
            v = torch.zeros(batch, a.n_kv_heads, L, a.head_dim, device=p.device, dtype=p.dtype)
            caches.append(KVCache(k, v))
        return caches

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations of idx (B, T0) with a KV cache; returns (B, T0 + max_new_tokens).
        temperature 0 means greedy decoding."""
        B, T0 = idx.shape
        caches = self.make_caches(B, T0 + max_new_tokens)
        logits, _ = self(idx, caches=caches)
        out = [idx]
        for i in range(max_new_tokens):
            last = logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                nxt = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.shape[-1])).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator)  # (B, 1)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits, _ = self(nxt, caches=caches)
        return torch.cat(out, dim=1)

    def attention_layers(self) -> list[nn.Module]:
        """The attention layers, first block first: what controllers act on and diagnostics measure (a model
        wrapped by ``qklab.attach`` answers the same question for its own layers)."""
        return [b.attn for b in self.blocks]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
