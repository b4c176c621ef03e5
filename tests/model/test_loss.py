"""The lean cross-entropy against torch's reference ``F.cross_entropy``: value and gradient."""

import pytest
import torch
import torch.nn.functional as F

from qklab.model.loss import cross_entropy


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_value_and_gradient_match_torch(scale):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(64, 50, generator=g, dtype=torch.float64) * scale).requires_grad_()
    t = torch.randint(0, 50, (64,), generator=g)
    t[:8] = 3  # repeated targets
    ours = cross_entropy(z, t)
    ref = F.cross_entropy(z, t)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    (gz,) = torch.autograd.grad(ours * 0.7, z)
    (rz,) = torch.autograd.grad(ref * 0.7, z)  # a non-unit upstream gradient
    torch.testing.assert_close(gz, rz, rtol=1e-10, atol=1e-12)


def test_bf16_logits_are_computed_in_fp32():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(32, 40, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (32,), generator=g)
    ours = cross_entropy(z, t)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, F.cross_entropy(z.float(), t))
    ours.backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()


def test_second_backward_fails_loudly():
    z = torch.randn(4, 6, requires_grad=True)
    loss = cross_entropy(z, torch.tensor([0, 1, 2, 3]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()
