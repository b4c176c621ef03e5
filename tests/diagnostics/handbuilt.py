"""GPTs whose attention is set by hand, so that each diagnostic has a known answer.

RoPE with a huge base (rope_theta = 1e12) leaves the low-frequency pairs practically unrotated over a
few hundred positions (angle <= 1e-3), so q . k on those pairs depends on content only; the
high-frequency pairs carry position.
"""

from __future__ import annotations

import math

import torch

from qklab.config import ModelConfig, QKConfig
from qklab.model import GPT

THETA = 1e12


def _rope_freqs(head_dim: int) -> torch.Tensor:
    return THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)


def position_free_dims(head_dim: int, max_len: int, tol: float = 1e-3) -> list[int]:
    """Head coordinates whose rotary angle stays below tol over max_len positions (both halves of a pair)."""
    half = head_dim // 2
    pairs = [f for f, w in enumerate(_rope_freqs(head_dim).tolist()) if w * max_len < tol]
    return pairs + [f + half for f in pairs]


def _zero_all(model: GPT) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm gains
                p.fill_(1.0)


def sink_model(vocab: int = 32, n_layers: int = 2, n_heads: int = 2, max_len: int = 64) -> GPT:
    """Every head attends only to position 0, whose token is 0 (a BOS): the key is nonzero only for
    token 0 and the query is a large constant, on position-free coordinates."""
    d, hd = 16, 8
    model = GPT(ModelConfig(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads, max_seq_len=max_len,
                            rope_theta=THETA), QKConfig()).eval()
    _zero_all(model)
    free = position_free_dims(hd, max_len)[0]
    with torch.no_grad():
        E = model.tok_emb.weight  # (V, d): dim 0 marks token 0, dim 1 is constant, dims 2.. the token
        E[0, 0] = 1.0
        E[:, 1] = 1.0
        for t in range(1, vocab):
            E[t, 2 + t % (d - 2)] = 1.0
        for block in model.blocks:
            for h in range(n_heads):
                block.attn.wq.weight[h * hd + free, 1] = 20.0  # constant query
                block.attn.wk.weight[h * hd + free, 0] = 20.0  # key only where the token is 0
    return model


def induction_model(vocab: int = 60, max_len: int = 64, k_freqs: int = 8) -> GPT:
    """Two layers, one head each. Layer 0 is a previous-token head (constant q and k on the K highest
    rotary frequencies, phased so that q . k peaks at offset 1) that copies the previous token into
    dims [V, 2V). Layer 1 is an induction head: its query (current token) matches keys whose previous
    token is the same, on position-free coordinates, and it copies the attended token into dims [0, V),
    which the tied head reads as the prediction."""
    d, hd, V = 128, 128, vocab
    assert 2 * V < d - 1
    const = d - 1
    model = GPT(ModelConfig(vocab_size=V, d_model=d, n_layers=2, n_heads=1, max_seq_len=max_len,
                            rope_theta=THETA), QKConfig()).eval()
    _zero_all(model)
    w = _rope_freqs(hd)
    free = position_free_dims(hd, 8 * max_len)
    assert len(free) >= V
    a0, g1 = 2.2, 3.0
    with torch.no_grad():
        E = model.tok_emb.weight  # tied with the output head
        E[:, :V] = torch.eye(V)
        E[:, const] = 1.0
        L0, L1 = model.blocks[0].attn, model.blocks[1].attn
        for f in range(k_freqs):  # q pair (cos w, -sin w), k pair (1, 0): q_i . k_j ~ cos(w (i - 1 - j))
            L0.wq.weight[f, const] = a0 * math.cos(w[f])
            L0.wq.weight[f + hd // 2, const] = -a0 * math.sin(w[f])
            L0.wk.weight[f, const] = a0
        L0.wv.weight[:V, :V] = torch.eye(V)  # value: the token
        L0.wo.weight[V : 2 * V, :V] = torch.eye(V) / 8.0  # written as "previous token"
        for t in range(V):
            L1.wq.weight[free[t], t] = g1  # query: current token
            L1.wk.weight[free[t], V + t] = g1  # key: previous token
        L1.wv.weight[:V, :V] = torch.eye(V)
        L1.wo.weight[:V, :V] = torch.eye(V)  # the attended token, into the prediction dims
    return model
