"""examples/nanogpt_qk.py, a GPT of one's own (fused qkv, its own RoPE, SDPA): every forward method by one
call trains, and its attention computes what qklab's own Attention computes with the same weights (fp64,
1e-10), for both RoPE conventions; every controller attaches by one call and acts on the fused rows."""

from __future__ import annotations

import copy

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.methods import CONTROLLERS, METHODS
from qklab.methods.build import method_options
from qklab.model import Attention, Rope
from tests.examples import load_example

ex = load_example("nanogpt_qk")
OPTIONS = {"qknorm_free": ("qknorm", {"q_gain": False, "k_gain": False}),
           "quest_scaled": ("quest", {"head_scale": True})}


def _half_perm(d: int) -> torch.Tensor:
    """The feature order qklab.QK puts an interleaved head in: to_half(x) = x[..., perm]."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _ours(cfg, attn) -> Attention:
    """qklab's own Attention with the example layer's weights (interleaved: each head's W_Q/W_K rows in the
    half-split order the example's q and k are put in)."""
    mcfg = ModelConfig(vocab_size=cfg.vocab_size, d_model=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head,
                       n_kv_heads=cfg.n_kv_head, max_seq_len=cfg.block_size, rope_theta=cfg.rope_theta)
    qcfg = QKConfig(method=cfg.qk, options={cfg.qk: method_options(cfg.qk, dict(cfg.qk_options))})
    ours = Attention(mcfg, qcfg, layer_idx=0).double()
    wq, wk, wv = attn.c_attn.weight.detach().double().split(attn.split, dim=0)
    if cfg.rope_interleaved:
        d = attn.qk.proj_dim
        wq = wq.view(attn.H, d, -1)[:, _half_perm(d)].reshape(wq.shape)
        wk = wk.view(attn.Hkv, d, -1)[:, _half_perm(d)].reshape(wk.shape)
    with torch.no_grad():
        for lin, w in ((ours.wq, wq), (ours.wk, wk), (ours.wv, wv), (ours.wo, attn.c_proj.weight.double())):
            lin.weight.copy_(w)
    ours.qk.load_state_dict({k: v.double() for k, v in attn.qk.method.state_dict().items()})
    return ours


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("name", [*METHODS, *OPTIONS])
def test_each_method_trains_and_matches_qklab_attention(name, interleaved):
    method, opts = OPTIONS.get(name, (name, {}))
    cfg = ex.GPTConfig(qk=method, qk_options=opts, rope_interleaved=interleaved, n_layer=2)
    model, losses, _ = ex.train(cfg, steps=6, seed=1)
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0] - 0.3, losses
    if method != "none":  # the method's own parameters trained with the model (those it has)
        fresh = ex.GPT(cfg).h[0].attn.qk.method.state_dict()
        moved = [k for k, v in model.h[0].attn.qk.method.state_dict().items() if not torch.equal(v, fresh[k])]
        assert moved or not any(p.requires_grad for p in model.h[0].attn.qk.method.parameters())
    attn = copy.deepcopy(model.h[0].attn).double().train()
    ours = _ours(cfg, attn).train()
    x = torch.randn(3, cfg.block_size, cfg.n_embd, dtype=torch.float64)
    want = ours(x, Rope(cfg.block_size, cfg.rope_theta))
    got = attn(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert want.abs().max() > 1e-3  # not a comparison of zeros


def test_sdpa_and_attend_agree_in_the_example():
    """The example calls SDPA itself for methods without a logit rewrite; qk.attend gives the same."""
    cfg = ex.GPTConfig(qk="ssmax")
    attn = ex.GPT(cfg).h[0].attn.double()
    x = torch.randn(2, 16, cfg.n_embd, dtype=torch.float64)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(attn.split, dim=-1)
    q, k = attn.qk(q.view(B, T, attn.H, -1).transpose(1, 2), k.view(B, T, attn.Hkv, -1).transpose(1, 2))
    y = attn.qk.attend(q, k, v.view(B, T, attn.Hkv, -1).transpose(1, 2))
    torch.testing.assert_close(attn.c_proj(y.transpose(1, 2).reshape(B, T, C)), attn(x), rtol=1e-12, atol=1e-12)


CONTROLLER_OPTIONS = {"qkclip": {"tau_clip": 0.02}, "quack": {"tau": 0.5}, "qk_lr_multiplier": {"tau": 0.25}}


@pytest.mark.parametrize("controller", sorted(CONTROLLERS))
def test_each_controller_attaches_by_one_call(controller):
    """Each controller runs from the optimizer's hooks on the fused W_Q/W_K rows: the V rows step as without
    it, the Q/K rows (or, for none, nothing) as the controller says."""
    cfg = ex.GPTConfig(n_layer=1)
    opts = CONTROLLER_OPTIONS.get(controller, {})
    model, losses, metrics = ex.train(cfg, controller, steps=1, seed=2, **opts)
    plain, plain_losses, _ = ex.train(cfg, "none", steps=1, seed=2)
    assert "max_logit" in metrics and len(metrics["max_logit_per_head"]) == 1
    w, w0 = model.h[0].attn.c_attn.weight, plain.h[0].attn.c_attn.weight
    nqk = sum(model.h[0].attn.split[:2])
    assert torch.equal(w[nqk:], w0[nqk:])  # V as without a controller
    if controller == "none":
        assert torch.equal(w, w0)
        return
    assert not torch.equal(w[:nqk], w0[:nqk])  # the controller changed W_Q/W_K
    if controller == "qkclip":  # every head's max logit of the last training forward ends at most at tau
        assert max(metrics["max_logit_per_head"][0]) > 0.02 and metrics["qkclip_heads_clipped"] > 0


def test_qk_lr_multiplier_scales_the_fused_qk_rows_step():
    """qk_lr_multiplier at tau: with SGD, W_Q/W_K rows of the fused matrix step at tau * lr, V rows at lr."""
    import qklab

    torch.manual_seed(0)
    model = ex.GPT(ex.GPTConfig(n_layer=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qklab.attach(model, opt, "qk_lr_multiplier", layers=model.layer_specs(), tau=0.25)
    idx = torch.randint(0, 16, (2, 33))
    w0 = model.h[0].attn.c_attn.weight.detach().clone()
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    g = model.h[0].attn.c_attn.weight.grad.clone()
    opt.step()
    nqk = sum(model.h[0].attn.split[:2])
    w = model.h[0].attn.c_attn.weight
    torch.testing.assert_close(w[:nqk], w0[:nqk] - 0.025 * g[:nqk], rtol=0, atol=1e-7)
    torch.testing.assert_close(w[nqk:], w0[nqk:] - 0.1 * g[nqk:], rtol=0, atol=1e-7)


def _usage_line(capsys) -> tuple[str, list[str]]:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1], err


def test_the_documented_command_line_runs(capsys):
    """The command line the example's docstring shows is one the example accepts (it once showed a pair
    that qklab refuses), and it prints what ``train`` gives for those arguments."""
    line = next(ln.strip() for ln in ex.__doc__.splitlines() if ln.strip().startswith("python examples/"))
    argv = line.split()[2:]
    argv[argv.index("--steps") + 1] = "3"
    assert ex.main(argv) == 0
    qk, controller = argv[argv.index("--qk") + 1], argv[argv.index("--controller") + 1]
    _, losses, metrics = ex.train(ex.GPTConfig(qk=qk), controller, 3)
    assert capsys.readouterr().out == (f"qk={qk} controller={controller}: loss {losses[0]:.3f} -> "
                                       f"{losses[-1]:.3f}, max logit {metrics['max_logit']:.2f}\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--qk", "qknorm", "--controller", "qkclip"], "qk.controller=qkclip cannot bound qk.method=qknorm"),
    (["--qk", "bogus"], "unknown QK method 'bogus'"),
    (["--controller", "bogus"], "unknown QK controller 'bogus'"),
    (["--steps", "0"], "argument --steps: 0 is not a positive number of steps"),
    (["--steps", "ten"], "argument --steps: ten is not a positive number of steps"),
])
def test_a_mistake_is_one_line_and_exit_2(capsys, argv, message):
    """A refused method/controller pair, an unknown name or no steps: argparse's usage and one error line,
    exit 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        ex.main(argv)
    last, err = _usage_line(capsys)
    assert e.value.code == 2
    assert last.startswith("nanogpt_qk.py: error: ") and message in last, last
    assert not any("Traceback" in ln for ln in err) and len(err) <= 3
