"""RoPE's eager fast path (roll with a signed sine table, a hand-written backward) against an
independent form: each pair (x_i, x_{i + D/2}) as a complex number turned by e^{i t f_i}."""

import pytest
import torch

from qklab.model.rope import Rope, Yarn, heads_inner, rope_reference

THETA = 10000.0


def complex_rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """x (..., T, D) in fp64: the rotate-half pairs as complex numbers, turned by their angle."""
    T, D = x.shape[-2], x.shape[-1]
    f = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    ang = torch.outer(torch.arange(pos, pos + T, dtype=torch.float64), f)  # (T, D/2)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("pos", [0, 7])
def test_fast_rope_matches_complex_rotation(layout, pos):
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 11, 16
    base = torch.randn(B, T, H, D, dtype=torch.float64) if layout == "bthd" else torch.randn(B, H, T, D,
                                                                                             dtype=torch.float64)
    base.requires_grad_()
    x = base.transpose(1, 2) if layout == "bthd" else base  # (B, H, T, D) either way
    assert heads_inner(x) == (layout == "bthd")
    rope = Rope(64, THETA)
    y = rope(x, pos)
    ref = complex_rope(x, pos, THETA)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)  # the tables are fp32
    cos, sin, _ = rope.window(x, pos)
    same_tables = rope_reference(x, cos, sin)
    torch.testing.assert_close(y, same_tables, rtol=0, atol=1e-12)
    assert y.stride() == x.stride()  # the memory order is kept (no copy into another layout)
    w = torch.randn_like(ref)
    g_fast, = torch.autograd.grad((y * w).sum(), base)
    g_ref, = torch.autograd.grad((ref * w).sum(), base)
    g_same, = torch.autograd.grad((same_tables * w).sum(), base)
    torch.testing.assert_close(g_fast, g_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_fast, g_same, rtol=0, atol=1e-12)


def test_fast_rope_matches_textbook_form_with_yarn_and_single_head():
    torch.manual_seed(1)
    rope = Rope(128, THETA, Yarn(factor=4.0, original_max_len=32))
    for x in (torch.randn(2, 1, 9, 8, dtype=torch.float64), torch.randn(2, 9, 8, dtype=torch.float64)):
        cos, sin, _ = rope.window(x, 3)
        torch.testing.assert_close(rope(x, 3), rope_reference(x, cos, sin), rtol=0, atol=1e-12)


def test_compiled_rope_uses_the_textbook_form_with_the_same_numbers():
    torch.manual_seed(2)
    rope = Rope(64, THETA)
    x = torch.randn(2, 5, 3, 16).transpose(1, 2)
    got = torch.compile(lambda t: rope(t, 2), backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, rope(x, 2), rtol=1e-6, atol=1e-6)


def test_position_past_the_tables_is_refused():
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=8"):
        Rope(8, THETA)(torch.randn(1, 1, 6, 4), 4)
