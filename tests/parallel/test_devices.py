"""Off-CPU correctness that a CPU machine can still check: controllers build every tensor on the
weights' device (the meta device stands in for a GPU: mixing it with a CPU tensor fails the same way)."""

from __future__ import annotations

import torch

from qklab.config import ModelConfig, QKConfig
from qklab.methods.quack import partner_factors
from qklab.model import GPT


def test_quack_mla_factors_without_query_latent_stay_on_the_weights_device():
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=1, n_heads=4, max_seq_len=64, attention="mla", q_rank=0)
    with torch.device("meta"):
        model = GPT(cfg, QKConfig())
    f = partner_factors(model.blocks[0].attn)
    assert "wdq" not in f
    assert {v.device.type for v in f.values()} == {"meta"}
    # and the same formula on CPU: wuq's factor is 1 / (||W_uk^h|| ||W_dkv||) with ||W_dq|| = 1
    cpu = GPT(cfg, QKConfig())
    a = cpu.blocks[0].attn
    f = partner_factors(a)
    uk = a.wuk.weight.detach().view(4, -1, a.wuk.weight.shape[1]).flatten(1).norm(dim=1)
    torch.testing.assert_close(f["wuq"], 1.0 / (uk * a.wdkv.weight.detach().norm()))
