"""qklab's attention function inside transformers: the chunked max-logit pass against the full masked logits
written out, and the switch between a model's own attention implementation and qklab's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.hf.attention import AttnSwitch, masked_head_max  # noqa: E402
from tests.hf.common import tiny_model  # noqa: E402


def _full_max(q, k, scale, allowed):
    """Every logit materialised, disallowed ones -inf, max per head."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("Tq,Tk,chunk", [(37, 37, 8), (37, 37, 64), (5, 12, 2), (1, 9, 64)])
def test_masked_head_max_equals_the_full_masked_logits(Tq, Tk, chunk):
    """Causal, left padding (row 0 sees no key before position 4) and a cache offset (Tk > Tq), GQA."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, F = 2, 4, 2, 8
    q, k = torch.randn(B, H, Tq, F, generator=g), torch.randn(B, Hkv, Tk, F, generator=g)
    q[1, 2, -1] *= 20.0  # one large logit in the last chunk, on the diagonal's side
    k[0, :, 0] = 5.0 * q[0, :: H // Hkv, -1]  # and one on a padding key
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).expand(B, 1, Tq, Tk).clone()
    allowed[0, :, :, :4] = False  # padding keys of row 0
    got = masked_head_max(q, k, 0.3, allowed, causal=Tq > 1, chunk=chunk)
    torch.testing.assert_close(got, _full_max(q, k, 0.3, allowed), rtol=0, atol=1e-6)
    unmasked = masked_head_max(q, k, 0.3, None, causal=False, chunk=chunk)  # every key
    torch.testing.assert_close(unmasked, _full_max(q, k, 0.3, torch.ones(1, 1, Tq, Tk, dtype=torch.bool)))
    assert not torch.equal(unmasked, got)  # the mask mattered


def test_attn_switch_puts_every_setting_back():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    switch = AttnSwitch(model)
    assert switch.on and model.config._attn_implementation == "qklab"
    assert model.model.layers[0].self_attn.config._attn_implementation == "qklab"
    switch.use_qklab(False)
    assert model.config._attn_implementation == "sdpa" and model.config._attn_implementation_internal == "sdpa"
    switch.use_qklab(True)
    assert model.config._attn_implementation == "qklab"
    switch.restore()
    assert model.config._attn_implementation == "sdpa"
