"""The train step's model work (forward, loss, backward) compiles as one graph for every forward-side
method on MHA, GQA and MLA, with QK-clip's max-logit tracking on, and computes what eager mode computes."""

from __future__ import annotations

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.model import GPT

CASES = [("mha", 0, m) for m in ("none", "qknorm", "softcap", "qkmap")] + [("mha", 2, "qknorm")] + \
    [("mla", 0, m) for m in ("none", "qknorm", "softcap")]


@pytest.mark.parametrize("attention, n_kv, method", CASES)
def test_train_step_compiles_fullgraph_and_matches_eager(attention, n_kv, method):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=1, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                      attention=attention)
    eager = GPT(cfg, QKConfig(method=method)).train()
    compiled = GPT(cfg, QKConfig(method=method)).train()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        for b in m.blocks:
            b.attn.track_max_logit = True  # QK-clip's per-head max logit, updated inside the graph
    x = torch.randint(0, 97, (2, 32))
    y = torch.randint(0, 97, (2, 32))
    torch._dynamo.reset()
    # fullgraph: a graph break raises; aot_eager traces the backward too, without a C++ compiler
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    _, want = eager(x, y)
    _, got = fn(x, y)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    for a, b in zip(eager.blocks, compiled.blocks, strict=True):
        torch.testing.assert_close(b.attn.pop_max_logit(), a.attn.pop_max_logit())
