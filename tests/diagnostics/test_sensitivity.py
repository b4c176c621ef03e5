"""Magnitude sensitivity: QK-Norm is invariant to the input scale, standard attention sharpens with it."""

from __future__ import annotations

import pytest
import torch

from qklab.diagnostics import magnitude_sensitivity
from qklab.diagnostics.sensitivity import SCALES
from tests.conftest import tiny_gpt
from tests.diagnostics import oracles as O


def _x():
    return torch.randint(0, 97, (2, 32))


def test_qknorm_is_invariant():
    res = magnitude_sensitivity(tiny_gpt("qknorm", init_std=0.2), _x(), SCALES)
    assert max(res["js_mean"]) < 1e-6
    assert res["cos_q_mean"] == pytest.approx([1.0] * 5, abs=1e-5)
    assert res["norm_ratio_k_mean"] == pytest.approx([1.0] * 5, abs=1e-3)


def test_standard_attention_grows_with_the_scale():
    res = magnitude_sensitivity(tiny_gpt("none", n_kv_heads=2, init_std=0.2), _x(), SCALES)
    js = dict(zip(res["scales"], res["js_mean"], strict=True))
    assert js[1.0] == 0.0
    assert js[4.0] > js[2.0] > 1e-3 and js[0.25] > js[0.5] > 1e-4
    assert res["norm_ratio_q_mean"] == pytest.approx(SCALES, rel=1e-5)  # linear map: ||q|| scales with a
    assert res["cos_k_mean"] == pytest.approx([1.0] * 5, abs=1e-5)  # ... and keeps its direction
    L, H = len(res["js"][0]), len(res["js"][0][0])
    assert (L, H) == (2, 4)


def test_only_the_probed_layer_sees_the_scaled_input():
    model = tiny_gpt("none", init_std=0.2)
    x = _x()
    with torch.no_grad():
        before, _ = model(x)
    magnitude_sensitivity(model, x, SCALES)
    with torch.no_grad():
        after, _ = model(x)
    assert torch.equal(before, after) and all(b.attn.capture is None for b in model.blocks)


def test_js_equals_the_full_eager_computation(monkeypatch):
    monkeypatch.setattr("qklab.diagnostics.streamed.CHUNK_ELEMENTS", 2 * 4 * 32 * 5)  # 5 query rows per chunk
    model = tiny_gpt("softcap", n_kv_heads=2, init_std=0.3)
    x = _x()
    res = magnitude_sensitivity(model, x, SCALES)
    inputs = {}
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, k, i=i: inputs.__setitem__(i, (a, k)), with_kwargs=True)
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    for i, b in enumerate(model.blocks):
        (h_in, *rest), kw = inputs[i]
        caps = {}
        for a in (1.0, 4.0):
            b.attn.capture = {}
            with torch.no_grad():
                b.attn(h_in * a, *rest, **kw)
            caps[a] = b.attn.capture
        b.attn.capture = None
        want = O.js_divergence(caps[4.0]["probs"], caps[1.0]["probs"], caps[1.0]["mask"])
        torch.testing.assert_close(torch.tensor(res["js"][4][i]), want, atol=1e-6, rtol=1e-5)
