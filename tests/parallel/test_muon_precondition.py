"""HeadMuon's preconditioner hook (``set_preconditioner``): post(NS(pre(U^h))) per head block against the
step written out; an identity hook changes nothing, bit for bit; on FSDP2 shards (2 gloo processes, heads
split between ranks) the hooked step and Compositional Muon's exact rule compute what one process does."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from qklab.parallel.muon import HeadMuon
from tests.parallel.common import (
    ShardedMuonJob,
    assert_ranks_equal,
    check_against_one,
    head_muon,
    muon_grads,
    muon_steps,
    run_cases,
    spawn,
)

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
LR, WD, MU = 0.02, 0.1, 0.95  # head_muon's (tests/parallel/common.py), for the step written out
SHAPES = ((6, 2), (9, 3), (8, 4), (5, 0))  # (rows, rows per head; 0 whole): head 1 split 3 + 3; 5 + 4; one each


class Mix:
    """pre: U^h -> A_h U^h; post: O^h -> B_h O^h, fixed (r, r) matrices per head (a stand-in controller)."""

    def __init__(self, n: int, r: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.A = torch.eye(r) + 0.5 * torch.randn(n, r, r, generator=g)
        self.B = torch.eye(r) + 0.5 * torch.randn(n, r, r, generator=g)
        self.calls = 0

    def pre(self, u: torch.Tensor) -> torch.Tensor:
        assert u.dtype == torch.float32 and u.shape[:2] == self.A.shape[:2]
        self.calls += 1
        return self.A @ u

    def post(self, o: torch.Tensor) -> torch.Tensor:
        assert o.dtype == torch.float32
        return self.B @ o


class Identity:
    def pre(self, u):
        return u

    def post(self, o):
        return o


@pytest.mark.parametrize("n, rows", SHAPES)
def test_identity_hook_changes_nothing(n, rows):
    ps = [torch.nn.Parameter(torch.randn(n, 8, generator=torch.Generator().manual_seed(n))) for _ in range(2)]
    opts = [head_muon([p], rows) for p in ps]
    opts[1].set_preconditioner(ps[1], Identity())
    for step in range(3):
        for p, o in zip(ps, opts, strict=True):
            p.grad = muon_grads(n, step)
            o.step()
    assert torch.equal(ps[0], ps[1])


@pytest.mark.parametrize("n, rows", SHAPES)
def test_hooked_step_is_post_ns_pre_per_head(n, rows):
    """Two steps: W <- (1 - lr wd) W - lr_adj B_h NS(A_h U^h) per head, U Muon's Nesterov momentum, lr_adj
    = 0.2 lr sqrt(max(r, C)) on the head's shape (whole: the matrix's)."""
    r = rows or n
    w0 = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
    p = torch.nn.Parameter(w0.clone())
    opt = head_muon([p], rows)
    hook = Mix(n // r, r, seed=n)
    opt.set_preconditioner(p, hook)
    w, buf = w0.clone(), torch.zeros(n, 8)
    for step in range(2):
        g = muon_grads(n, step)
        p.grad = g.clone()
        opt.step()
        buf = buf + (1 - MU) * (g - buf)  # lerp
        u = (g + MU * (buf - g)).view(n // r, r, 8)
        o = torch.stack([_zeropower_via_newtonschulz(hook.A[h] @ u[h], *NS) for h in range(n // r)]).float()
        w = w * (1 - LR * WD) - LR * 0.2 * max(r, 8) ** 0.5 * (hook.B @ o).reshape(n, 8)
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    assert hook.calls == 2


def test_without_hooks_it_is_torch_muon_bit_for_bit():
    """The hook's plumbing leaves the unhooked step alone: whole matrices as torch.optim.Muon."""
    ps = [torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(1))) for _ in range(2)]
    opts = [HeadMuon([ps[0]], lr=LR, weight_decay=WD, momentum=MU, adjust_lr_fn="match_rms_adamw"),
            torch.optim.Muon([ps[1]], lr=LR, weight_decay=WD, momentum=MU, adjust_lr_fn="match_rms_adamw")]
    for step in range(3):
        for p, o in zip(ps, opts, strict=True):
            p.grad = muon_grads(6, step)
            o.step()
    assert torch.equal(ps[0], ps[1])


def test_a_parameter_outside_the_optimizer_is_refused():
    opt = head_muon([torch.nn.Parameter(torch.randn(4, 8))], 2)
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.set_preconditioner(torch.nn.Parameter(torch.randn(4, 8)), Identity())


def mix_hook(n: int, rows: int) -> Mix:
    """The preconditioner of an (n, 8) matrix with head blocks of ``rows`` rows (0: one block)."""
    return Mix(n // (rows or n), rows or n, seed=n)


def test_sharded_hooked_muon_equals_one_process(tmp_path):
    spawn(tmp_path, [ShardedMuonJob(SHAPES, "hooked.pt", mix_hook)])
    got, want = torch.load(tmp_path / "hooked.pt"), muon_steps(SHAPES, mix_hook)
    for shape in SHAPES:
        torch.testing.assert_close(got[shape], want[shape], rtol=1e-5, atol=1e-6)


EXACT = ["qk.controller=compositional", "qk.compositional.form=exact", "qk.compositional.decay=base",
         "train.optimizer=muon"]
CASES = {  # MQA: W_K's one head (16 rows) is split 8 + 8 between the ranks
    "mqa-compositional-exact-muon": [*EXACT, "train.muon_per_head=qk", "model.n_kv_heads=1"],
    "mla-compositional-exact-muon": [*EXACT, "train.muon_per_head=qkv", "model.attention=mla"],
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, run_cases(tmp, CASES, "fsdp")


@pytest.mark.parametrize("name", list(CASES))
def test_exact_rule_on_fsdp_matches_one_process(fsdp_runs, name):
    tmp, refs = fsdp_runs
    check_against_one(tmp, refs, name, "fsdp")
    assert_ranks_equal(tmp, f"{name}-fsdp", "fsdp")
