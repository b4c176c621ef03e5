"""One kernel choice for MHA and MLA: ``choose_kernel`` picks SDPA, FlexAttention or eager from what the
method and the caller need, both attention kinds run it through ``attend``, and each layer names its kind."""

from __future__ import annotations

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.methods import METHODS, AttnShape
from qklab.methods.base import NoOptions
from qklab.methods.headwise import is_mla
from qklab.methods.softcap import SoftCapOptions
from qklab.model import GPT, attention
from qklab.model.attention import causal_mask, choose_kernel


def _gpt(kind: str, method: str = "none") -> GPT:
    mla = {"q_rank": 20, "kv_rank": 24, "nope_dim": 16, "rope_dim": 8, "v_dim": 12} if kind == "mla" else {}
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, attention=kind, **mla)
    opts = {"softcap": SoftCapOptions(cap=2.0)} if method == "softcap" else {}
    return GPT(cfg, QKConfig(method=method, options=opts))


def _method(name: str):
    opts = SoftCapOptions(cap=2.0) if name == "softcap" else NoOptions()
    return METHODS[name](AttnShape(64, 4, 4, 16, 0, 1), opts)


def test_choose_kernel_takes_eager_for_what_needs_logits_and_sdpa_otherwise():
    q = torch.randn(2, 4, 8, 16)  # (B, H, T, F); CPU, so FlexAttention's max scores are not available
    plain, cap = _method("none"), _method("softcap")
    assert choose_kernel(plain, q, q, q) == "sdpa"
    assert choose_kernel(plain, q, q, q, tracking=True) == "sdpa"  # the max logit from a chunked pass
    assert choose_kernel(plain, q, q, q, sink=torch.zeros(4)) == "sdpa"
    assert choose_kernel(cap, q, q, q) == "eager"  # SDPA would drop the rewrite
    assert choose_kernel(plain, q, q, q, eager=True) == "eager"
    assert choose_kernel(plain, q, q, q, capture=True) == "eager"
    assert choose_kernel(plain, q, q, q, causal=False) == "eager"
    assert choose_kernel(plain, q, q, q, mask=torch.ones(8, 8, dtype=torch.bool)) == "eager"


@pytest.mark.parametrize("method, capture, want", [("none", False, "sdpa"), ("softcap", False, "eager"),
                                                   ("none", True, "eager")])
def test_mha_and_mla_make_the_same_choice(method, capture, want, monkeypatch):
    seen = {"mha": [], "mla": []}
    for kind in seen:
        model = _gpt(kind, method).eval()

        def spy(*args, kind=kind, **kw):
            seen[kind].append(out := choose_kernel(*args, **kw))
            return out

        monkeypatch.setattr(attention, "choose_kernel", spy)
        for a in model.attention_layers():
            a.capture = {} if capture else None
        with torch.no_grad():
            model(torch.randint(0, 97, (2, 12)))
    assert seen["mha"] == seen["mla"] == [want, want]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_eager_tracking_reads_the_logits_it_softmaxes(kind, monkeypatch):
    """A tracked eager forward takes each head's max from its own logits: no second QK^T pass."""
    model = _gpt(kind, "softcap").train()
    monkeypatch.setattr(attention, "head_max_logit", lambda *a, **kw: pytest.fail("a second QK^T pass"))
    for a in model.attention_layers():
        a.track_max_logit, a.capture = True, {}
    x = torch.randint(0, 97, (2, 12))
    model(x, x)
    for a in model.attention_layers():
        s = a.capture["logits"].masked_fill(~causal_mask(12, 12, x.device), float("-inf"))  # (B, H, T, T)
        assert torch.equal(a.pop_max_logit(), s.amax(dim=(0, 2, 3)).float())


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_each_layer_names_its_kind(kind):
    layers = _gpt(kind).attention_layers()
    assert [a.kind for a in layers] == [kind, kind]
    assert all(is_mla(a) == (kind == "mla") for a in layers)
