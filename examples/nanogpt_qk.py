"""A nanoGPT-style GPT of one's own (a fused qkv Linear, its own RoPE, SDPA) that takes any of qklab's QK
methods by one call in its attention, and any controller by one call in its training loop.

    python examples/nanogpt_qk.py --qk qknorm --controller quack --steps 50

(QK-clip bounds the logits through the scale of W_Q/W_K, so it is refused with QK-Norm, whose logits
ignore that scale: pair it with none or qkmap. A refused pair or an unknown name is one line, exit 2.)

Forward side: ``qklab.QK(name, ...)`` in ``CausalSelfAttention.__init__`` (the widths of W_Q and W_K come
from it) and ``q, k = self.qk(q, k)`` on the projections' outputs, the model's RoPE inside. Optimizer side:
``qklab.attach(model, optimizer, name, layers=model.layer_specs())`` before the loop.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import qklab
from qklab.errors import UserError
from qklab.hf import LayerSpec


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # pairs (2i, 2i + 1) as in GPT-J; False: (i, i + D/2) as in Llama
    qk: str = "none"  # any of qklab.methods.METHODS
    qk_options: dict = field(default_factory=dict)


class RotaryEmbedding(nn.Module):
    """The model's own RoPE: cos/sin tables (block_size, head_dim), angles in fp64, kept in fp32."""

    def __init__(self, dim: int, max_len: int, theta: float, interleaved: bool) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (D/2,)
        ang = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # (T, D/2)
        ang = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat([ang, ang], dim=-1)  # (T, D)
        self.interleaved = interleaved
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) rotated at positions (T,)."""
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)  # (T, D)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            rot = torch.stack([-x2, x1], dim=-1).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat([-x2, x1], dim=-1)
        return x * cos + rot * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, rope: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.H, self.Hkv, self.D = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        # the one call: the QK method, with this model's RoPE (qklab rotates q and k where the method needs it)
        self.qk = qklab.QK(cfg.qk, n_heads=self.H, n_kv_heads=self.Hkv, head_dim=self.D, d_model=cfg.n_embd,
                           rope=rope, convention="interleaved" if cfg.rope_interleaved else "half",
                           layer_idx=layer, n_layers=cfg.n_layer, **cfg.qk_options)
        self.split = [self.qk.q_features, self.qk.k_features, self.Hkv * self.D]  # QK-MAP narrows q and k
        self.c_attn = nn.Linear(cfg.n_embd, sum(self.split), bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(self.split, dim=-1)
        q = q.view(B, T, self.H, -1).transpose(1, 2)  # (B, H, T, d')
        k = k.view(B, T, self.Hkv, -1).transpose(1, 2)  # (B, Hkv, T, d')
        v = v.view(B, T, self.Hkv, self.D).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = self.qk(q, k)  # mapped and rotated: (B, H, T, F), (B, Hkv, T, F)
        if self.qk.rewrites_logits:  # soft-capping: the rewrite runs on explicit logits
            y = self.qk.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.qk.scale,
                                               enable_gqa=self.H != self.Hkv)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, rope: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.RMSNorm(cfg.n_embd), CausalSelfAttention(cfg, rope, layer)
        self.ln_2, self.mlp = nn.RMSNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta, cfg.rope_interleaved)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, self.rope, i) for i in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
        for b in self.h:  # W_Q and W_K at the scale the method asks for; the method's own parameters
            qk_rows = b.attn.split[0] + b.attn.split[1]
            b.attn.qk.init_qk_(b.attn.c_attn.weight[:qk_rows], std=std)
            nn.init.normal_(b.attn.c_proj.weight, 0.0, std / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def layer_specs(self) -> list[LayerSpec]:
        """Each layer's W_Q and W_K rows in its fused c_attn, and its qklab.QK, where the logits are formed."""
        out = []
        for i, b in enumerate(self.h):
            nq, nk = b.attn.split[:2]
            w = f"h.{i}.attn.c_attn.weight"
            out.append(LayerSpec(q=f"{w}[0:{nq}]", k=f"{w}[{nq}:{nq + nk}]", n_heads=b.attn.H,
                                 n_kv_heads=b.attn.Hkv, logits=f"h.{i}.attn.qk"))
        return out


def train(cfg: GPTConfig, controller: str = "none", steps: int = 20, lr: float = 1e-2, batch: int = 8,
          seed: int = 0, **controller_options) -> tuple[GPT, list[float], dict]:
    """Train on sequences that repeat a random motif of 8 tokens out of the first 16 (learnable: first the
    16 tokens, then the repeats); returns the model, the losses and the controller's last metrics."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    handle = qklab.attach(model, opt, controller, layers=model.layer_specs(), track=True,
                          **controller_options)  # the one call
    gen = torch.Generator().manual_seed(seed)
    losses, metrics = [], {}
    for _ in range(steps):
        motif = torch.randint(0, min(16, cfg.vocab_size), (batch, 8), generator=gen)
        idx = motif.repeat(1, cfg.block_size // 8 + 1)[:, : cfg.block_size + 1]  # (B, T + 1)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # the controller runs from the optimizer's step hooks
        losses.append(loss.item())
        metrics = handle.metrics()
    return model, losses, metrics


def _steps(text: str) -> int:
    n = int(text) if text.strip().lstrip("+-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of steps")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanogpt_qk.py", description=__doc__.splitlines()[0])
    ap.add_argument("--qk", default="none")
    ap.add_argument("--controller", default="none")
    ap.add_argument("--steps", type=_steps, default=50)
    ap.add_argument("--interleaved", action="store_true")
    args = ap.parse_args(argv)
    try:
        _, losses, metrics = train(GPTConfig(qk=args.qk, rope_interleaved=args.interleaved), args.controller,
                                   args.steps)
    except UserError as e:  # a refused method/controller pair, an unknown name: one line, exit 2
        ap.error(str(e))
    print(f"qk={args.qk} controller={args.controller}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"max logit {metrics.get('max_logit', float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
