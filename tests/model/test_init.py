"""Weight init: ``model.qk_init_std`` gives W_Q and W_K of every QK method one std (a fair comparison);
at 0 each method keeps its own rule (the model's init_std; QK-MAP post: 1/sqrt(fan_in))."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.model import GPT

D = 128


def _qk_weights(model: GPT) -> list[torch.Tensor]:
    out = []
    for b in model.blocks:
        a = b.attn
        ws = (a.wuq, a.wqr, a.wuk, a.wkr) if a.kind == "mla" else (a.wq, a.wk)
        out += [w.weight for w in ws if w is not None]
    return out


def _std(ws: list[torch.Tensor]) -> float:
    return torch.cat([w.detach().flatten() for w in ws]).std().item()


@pytest.mark.parametrize("method, attention", [("none", "mha"), ("qknorm", "mha"), ("qkmap", "mha"),
                                               ("none", "mla")])
def test_one_qk_init_std_for_every_method(method, attention):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, attention=attention, qk_init_std=0.05)
    model = GPT(cfg, QKConfig(method=method))
    assert _std(_qk_weights(model)) == pytest.approx(0.05, rel=0.02)
    if attention == "mha":  # V keeps the model's init_std
        assert model.blocks[0].attn.wv.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("method, want", [("none", 0.02), ("qknorm", 0.02), ("qkmap", 1 / math.sqrt(D))])
def test_zero_keeps_each_methods_own_rule(method, want):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2), QKConfig(method=method))
    assert _std(_qk_weights(model)) == pytest.approx(want, rel=0.02)


def test_qkmap_default_equals_the_explicit_rule_bit_for_bit():
    """QK-MAP's own rule and the explicit model-wide std 1/sqrt(d_model) build the same weights."""
    models = []
    for std in (0.0, 1 / math.sqrt(D)):
        torch.manual_seed(0)
        models.append(GPT(ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, qk_init_std=std),
                          QKConfig(method="qkmap")))
    for a, b in zip(*(m.state_dict().values() for m in models), strict=True):
        assert torch.equal(a, b)


def test_negative_std_is_one_line():
    with pytest.raises(ConfigError, match=r"model.qk_init_std.*>= 0"):
        load_config("tiny", ["model.qk_init_std=-1"])
