"""qklab.integrations.torchtitan on torchtitan 0.3's smallest llama3 ("debugmodel", two of its layers): every
forward method through torchtitan's override mechanism computes what qklab's own Attention computes with
the same weights and the model's RoPE tables, forward and gradients (fp64, 1e-10), also on rows packed with
several documents; FlexAttention with the method's scale and score_mod gives the same (fp32); every
controller attaches to the OptimizersContainer by one call; QK-clip measures the real logits and clips them.

On the CPU with torch 2.13, FlexAttention (torchtitan's attention for language models) runs forward only
and not in fp64: the fp64 comparisons and the training steps run the same module with attention="qklab"
(qklab's attention under the model's own block masks); FlexAttention itself is checked forward in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

try:
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.llama3 import model_registry

    import qklab.integrations.torchtitan as tt
except ImportError as e:  # torchtitan absent, or its import-time needs (triton with CPU torch): `make torchtitan`
    pytest.skip(f"torchtitan 0.3.0 is not importable here ({e}); `make torchtitan` installs it",
                allow_module_level=True)

from qklab.config import ModelConfig, QKConfig
from qklab.errors import ConfigError
from qklab.methods import CONTROLLERS, METHODS
from qklab.methods.build import method_options
from qklab.model import Attention
from qklab.model.user_rope import UserRope

L, B = 32, 2
OPTIONS = {"softcap": {"cap": 4.0}, "quest": {"head_scale": True}}


def _model(method: str | None, attention: str = "qklab", layers: int = 2, **options):
    torch.manual_seed(0)
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    if method is not None:
        tt.apply(spec, method, attention=attention, **{**OPTIONS.get(method, {}), **options})
    model = spec.model.build()
    model.init_states()
    return model


def _half_perm(d: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _ours(attn, method: str) -> tuple[Attention, object]:
    """qklab's own Attention with the torchtitan layer's weights (each head's W_Q/W_K rows in the half-split
    order, torchtitan's RoPE being interleaved), and the model's RoPE tables as its Rope."""
    H = attn.n_heads
    mcfg = ModelConfig(vocab_size=2048, d_model=256, n_layers=2, n_heads=H, max_seq_len=L)
    ours = Attention(mcfg, QKConfig(method=method, options={method: method_options(method, OPTIONS.get(method, {}))}),
                     0).double()
    sd = attn.qkv_linear.state_dict()  # a fused wqkv is split into the stock wq, wk, wv here
    d = attn.qk.proj_dim
    perm = _half_perm(d)
    with torch.no_grad():
        ours.wq.weight.copy_(sd["wq.weight"].view(H, d, -1)[:, perm].reshape(H * d, -1))
        ours.wk.weight.copy_(sd["wk.weight"].view(H, d, -1)[:, perm].reshape(H * d, -1))
        ours.wv.weight.copy_(sd["wv.weight"])
        ours.wo.weight.copy_(attn.wo.weight)
    ours.qk.load_state_dict(attn.qk.method.state_dict())
    cache = attn.rope.cache  # (max_len, D/2) complex: the angle of each rotary pair
    tables = UserRope((cache.real.double(), cache.imag.double()), "half")
    return ours, tables


def _grads(attn) -> dict[str, torch.Tensor]:
    """The torchtitan layer's W_Q/W_K/W_V gradients, rows as qklab's (half-split order)."""
    H, d = attn.n_heads, attn.qk.proj_dim
    lin = attn.qkv_linear
    if hasattr(lin, "wqkv"):
        g = lin.wqkv.weight.grad.view(H, 3, d, -1)
        gq, gk, gv = g[:, 0], g[:, 1], g[:, 2].reshape(H * d, -1)
    else:
        gq, gk, gv = lin.wq.weight.grad.view(H, d, -1), lin.wk.weight.grad.view(H, d, -1), lin.wv.weight.grad
    perm = _half_perm(d)
    return {"wq": gq[:, perm].reshape(H * d, -1), "wk": gk[:, perm].reshape(H * d, -1), "wv": gv,
            "wo": attn.wo.weight.grad}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_method_matches_qklab_attention_forward_and_backward(method):
    model = _model(method).double()
    attn = model.layers["0"].attention
    assert isinstance(attn, tt.QKGQAttention) and attn.qk.method.name == method
    ours, tables = _ours(attn, method)
    x = torch.randn(B, L, 256, dtype=torch.float64)
    pos = torch.arange(L).expand(B, L)
    got = attn(x, model.get_attention_masks(pos), pos)
    want = ours(x, tables.bind(torch.arange(L)))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert want.abs().max() > 1e-3
    w = torch.randn_like(want)
    (got * w).sum().backward()
    (want * w).sum().backward()
    for name, g in _grads(attn).items():
        torch.testing.assert_close(g, getattr(ours, name).weight.grad, rtol=1e-10, atol=1e-10, msg=name)
    for (n, p), q in zip(attn.qk.method.named_parameters(), ours.qk.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=n)


@pytest.mark.parametrize("method", ["ssmax", "qknorm", "softcap"])
def test_packed_documents_are_attended_and_positioned_apart(method):
    """A row packing two documents (positions restart at 0): each document's outputs are those of qklab's
    Attention on that document alone (the block mask keeps them apart; RoPE and SSMax count from 0)."""
    model = _model(method).double()
    attn = model.layers["0"].attention
    ours, tables = _ours(attn, method)
    x = torch.randn(1, L, 256, dtype=torch.float64)
    cut = 12
    pos = torch.cat([torch.arange(cut), torch.arange(L - cut)]).view(1, L)
    with torch.no_grad():
        got = attn(x, model.get_attention_masks(pos), pos)
        first = ours(x[:, :cut], tables.bind(torch.arange(cut)))
        second = ours(x[:, cut:], tables.bind(torch.arange(L - cut)))
    torch.testing.assert_close(got, torch.cat([first, second], dim=1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", ["softcap", "qkmap"])
def test_flex_attention_with_the_method_scale_and_score_mod(method):
    """attention="inner": torchtitan's FlexAttention gets the method's softmax scale (and softcap as its
    score_mod); the same outputs as qklab's attention under the same block mask (fp32, forward: the CPU's
    FlexAttention has no backward and no fp64)."""
    model = _model(method, attention="inner")
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    masks = model.get_attention_masks(pos)
    with torch.no_grad():
        flex = model(tok, pos, masks)
        for layer in model.layers.values():
            layer.attention.qk_attention = "qklab"
        ours = model(tok, pos, masks)
    torch.testing.assert_close(flex, ours, rtol=1e-4, atol=1e-4)


def _real_max(attn, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per-head max causal logit of a QKGQAttention on its input x, written out from its own pieces."""
    with torch.no_grad():
        xq, xk, _ = attn.qkv_linear(x)
        q, k = attn.qk(xq.transpose(1, 2), xk.transpose(1, 2), pos, rope=attn.user_rope())
        s = attn.qk.logits((q @ k.transpose(-2, -1)) * attn.qk.scale)
        return s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("controller", sorted(CONTROLLERS))
def test_each_controller_attaches_to_the_optimizers_container(controller):
    opts = {"qkclip": {"tau_clip": 0.05}, "quack": {"tau": 0.5}, "qk_lr_multiplier": {"tau": 0.25}}.get(controller, {})
    runs = {}
    for name in ("plain", controller):
        model = _model("none", layers=1)
        optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        handle = tt.attach(model, optimizers, name, track=True, **opts) if name != "plain" else \
            tt.attach(model, optimizers, "none", track=True)
        tok = torch.randint(0, 2048, (B, L + 1), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(L).expand(B, L)
        model.train()
        logits = model(tok[:, :-1], pos, model.get_attention_masks(pos))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()).backward()
        optimizers.step()  # the controller runs from the container's step hooks
        runs[name] = (model.layers["0"].attention.qkv_linear.wqkv.weight.detach().view(16, 3, 16, -1), handle)
    (w0, _), (w, handle) = runs["plain"], runs[controller]
    metrics = handle.metrics()
    assert "max_logit" in metrics and len(metrics["max_logit_per_head"]) == 1
    assert torch.equal(w[:, 2], w0[:, 2])  # V as without a controller
    assert torch.equal(w[:, :2], w0[:, :2]) == (controller == "none")  # W_Q/W_K as the controller says
    handle.remove()
    assert not runs[controller][1].model.layers["0"].attention.qk.__dict__.get("qk_layer")


def test_qkclip_measures_the_real_logits_and_clips_them():
    model = _model("none", layers=1)
    attn = model.layers["0"].attention
    with torch.no_grad():  # heads of different logit scales
        attn.qkv_linear.wqkv.weight.view(16, 3, 16, -1)[:, 0].mul_(torch.linspace(1, 30, 16).view(-1, 1, 1))
    seen = []
    attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    with torch.no_grad():
        model(tok, pos, model.get_attention_masks(pos))
    s0 = _real_max(attn, seen[-1], pos)
    tau = float(s0.median())
    optimizers = torch.optim.SGD(model.parameters(), lr=0.0)  # the clip alone acts
    handle = tt.attach(model, optimizers, "qkclip", tau_clip=tau)
    model.train()
    model(tok, pos, model.get_attention_masks(pos)).sum().backward()
    optimizers.step()
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"][0]), s0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_real_max(attn, seen[-1], pos), torch.clamp(s0, max=tau), rtol=1e-4, atol=1e-4)


def test_qkclip_on_the_stock_attention_hooks_its_inner_attention():
    """No qklab method: the max logits are read where torchtitan forms them (its inner attention, after its
    own RoPE), forward only (FlexAttention on the CPU), and equal the written-out ones."""
    model = _model(None, layers=1)
    attn = model.layers["0"].attention
    handle = tt.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "none", track=True)
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    seen = []
    attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    model.train()
    with torch.no_grad():
        model(tok, pos, model.get_attention_masks(pos))
    handle.optimizer[0].step()
    handle.after_step()
    with torch.no_grad():
        xq, xk, _ = attn.qkv_linear(seen[0])
        q, k = attn.rope(xq, xk, pos)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) / 4.0
        want = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"][0]), want, rtol=1e-4, atol=1e-4)


def test_stock_attention_measures_only_the_keys_of_each_documents_queries():
    """Rows packed with two documents: on the stock attention the measured max logits are those the block mask
    lets into the softmax (each query over the earlier keys of its own document), not every causal pair."""
    model = _model(None, layers=1)
    attn = model.layers["0"].attention
    with torch.no_grad():  # large logits, some of them across the documents
        attn.qkv_linear.wqkv.weight.view(16, 3, 16, -1)[:, 0].mul_(20.0)
    handle = tt.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "none", track=True)
    tok = torch.randint(0, 2048, (1, L))
    cut = 12
    pos = torch.cat([torch.arange(cut), torch.arange(L - cut)]).view(1, L)  # positions restart: a second document
    seen = []
    attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    model.train()
    with torch.no_grad():
        model(tok, pos, model.get_attention_masks(pos))
    handle.after_step()
    with torch.no_grad():
        xq, xk, _ = attn.qkv_linear(seen[0])
        q, k = attn.rope(xq, xk, pos)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) / 4.0  # (1, H, L, L)
        doc = (pos[0] == 0).cumsum(0)  # (L,) document ids
        seen_keys = torch.ones(L, L, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
        want = s.masked_fill(~seen_keys, float("-inf")).amax(dim=(0, 2, 3))
        causal = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))
    assert (causal - want).max() > 1.0  # across the documents lie larger logits
    torch.testing.assert_close(torch.tensor(handle.metrics()["max_logit_per_head"][0]), want, rtol=1e-4, atol=1e-4)


def test_refusals_are_one_line():
    model = _model("qknorm", layers=1)
    with pytest.raises(ValueError, match="cannot bound qk.method=qknorm") as e:
        tt.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "qkclip", tau_clip=10.0)
    assert "\n" not in str(e.value)
    spec = model_registry("debugmodel")
    with pytest.raises(ConfigError, match="unknown QK method 'qknrom'"):
        tt.apply(spec, "qknrom")
    tt.apply(spec, "softcap")
    with pytest.raises(ConfigError, match="already has qklab method 'softcap'"):
        tt.apply(spec, "quest")
    with pytest.raises(ConfigError, match="no torchtitan GQAttention"):
        tt.attach(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), "quack")


def test_a_trained_step_changes_the_method_parameters_with_the_model():
    """A whole training step of the torchtitan model (its OptimizersContainer): the method's own parameters
    are among those it trains."""
    model = _model("qkmap", layers=1)
    before = copy.deepcopy(model.layers["0"].attention.qk.state_dict())
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    tok = torch.randint(0, 2048, (B, L + 1))
    pos = torch.arange(L).expand(B, L)
    loss = torch.nn.functional.cross_entropy(model(tok[:, :-1], pos, model.get_attention_masks(pos)).flatten(0, 1),
                                             tok[:, 1:].flatten())
    loss.backward()
    optimizers.step()
    after = model.layers["0"].attention.qk.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in ("method.log_freq", "method.log_temp"))


def test_the_command_line_override_form():
    """What `--override.imports 'qklab.integrations.torchtitan.qk_attention={...}'` hands torchtitan."""
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.config.override import parse_cli_imports

    spec = model_registry("debugmodel")
    token = 'qklab.integrations.torchtitan.qk_attention={"method": "softcap", "cap": 30.0}'
    done = apply_overrides(OverrideConfig(imports=parse_cli_imports([token])), spec)
    assert len(done) == len(spec.model.layers) == 6
    cfg = spec.model.layers[0].attention
    assert isinstance(cfg, tt.QKGQAttention.Config) and (cfg.qk_method, cfg.qk_options) == ("softcap", {"cap": 30.0})


def _debugmodel(family: str, method: str | None):
    """One layer of a torchtitan family's "debugmodel", with qklab's ``method`` (None: the stock model)."""
    import importlib

    torch.manual_seed(0)
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:1]
    if method is not None:
        tt.apply(spec, method)
    model = spec.model.build()
    model.init_states()
    return model


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_method_none_is_torchtitans_own_attention(family):
    """apply(.., "none") on Llama 3 (ComplexRoPE, fused MHA) and Qwen 3 (CosSinRoPE, its q/k norms, fused
    GQA) with the stock model's weights: the same logits as torchtitan's own model, through its
    FlexAttention and through qklab's attention (fp32, forward: the CPU's FlexAttention)."""
    stock, ours = _debugmodel(family, None), _debugmodel(family, "none")
    ours.load_state_dict(stock.state_dict())  # the same names: qklab.QK of "none" has no parameters
    attn = ours.layers["0"].attention
    assert attn.q_norm is not None if family == "qwen3" else attn.q_norm is None  # "none" keeps the model's norms
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    with torch.no_grad():
        want = stock(tok, pos, stock.get_attention_masks(pos))
        got = ours(tok, pos, ours.get_attention_masks(pos))
        attn.qk_attention = "qklab"
        eager = ours(tok, pos, ours.get_attention_masks(pos))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-4)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    if family == "qwen3":  # fused GQA rows are no per-head view; and its norms bound the logits
        with pytest.raises(ConfigError, match="build GQA layers with fuse_qkv=False"):
            tt.attach(ours, opt, "qkclip", tau_clip=10.0)


def test_qknorm_on_qwen3_loads_a_stock_checkpoint_with_its_trained_gains():
    """QK-Norm takes over Qwen 3's q/k norms: the model keeps their checkpoint names, so a stock Qwen 3 state
    dict (with trained gains) loads strictly and the model computes what the stock one does (fp32, forward)."""
    stock, ours = _debugmodel("qwen3", None), _debugmodel("qwen3", "qknorm")
    with torch.no_grad():  # trained gains: not the ones a fresh model starts from
        stock.layers["0"].attention.q_norm.weight.uniform_(0.5, 1.5)
        stock.layers["0"].attention.k_norm.weight.uniform_(0.5, 1.5)
    ours.load_state_dict(stock.state_dict())  # strict: the same names, no key missing or left over
    assert ours.state_dict().keys() == stock.state_dict().keys()
    assert ours.layers["0"].attention.q_norm is None
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    with torch.no_grad():
        want = stock(tok, pos, stock.get_attention_masks(pos))
        got = ours(tok, pos, ours.get_attention_masks(pos))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_qkclip_is_refused_where_qwen3s_norms_stay_in_front_of_the_method():
    """Qwen 3 with softcap keeps its q/k norms in front of the method: scaling W_Q/W_K leaves its logits as they
    are, so QK-clip is refused (one line), as on the stock Qwen 3; QuacK attaches."""
    from torchtitan.models.qwen3 import model_registry as qwen3_registry

    torch.manual_seed(0)
    spec = qwen3_registry("debugmodel_non_fused_qkv")
    spec.model.layers = spec.model.layers[:1]
    tt.apply(spec, "softcap", attention="qklab", cap=30.0)  # not FlexAttention: no recompile on the CPU
    model = spec.model.build()
    model.init_states()
    tok = torch.randint(0, 2048, (B, L))
    pos = torch.arange(L).expand(B, L)
    lin = model.layers["0"].attention.qkv_linear
    with torch.no_grad():
        before = model(tok, pos, model.get_attention_masks(pos))
        lin.wq.weight.mul_(0.5)
        lin.wk.weight.mul_(0.5)
        torch.testing.assert_close(model(tok, pos, model.get_attention_masks(pos)), before, rtol=1e-4, atol=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="the model's own q_norm comes before softcap; qk.controller=qkclip"):
        tt.attach(model, opt, "qkclip", tau_clip=10.0)
    tt.attach(model, opt, "quack").remove()


def test_apply_checks_shape_dependent_options_against_the_models_own_heads():
    """tt.apply checks names and values before any replacement, but the shapes only where the model's widths
    are known: QK-MAP with 2 * n_freqs = head_dim (128 in Qwen 3) builds, one that does not fit is refused
    at build in one line naming the model's head_dim."""
    from torchtitan.models.qwen3 import model_registry as qwen3_registry

    def spec(n_freqs):
        s = qwen3_registry("debugmodel_non_fused_qkv")
        s.model.layers = s.model.layers[:1]
        tt.apply(s, "qkmap", attention="qklab", n_freqs=n_freqs)
        return s

    model = spec(64).model.build()
    qk = model.layers["0"].attention.qk
    assert (qk.proj_dim, qk.feature_dim) == (1, 128) and 2 * 64 * 1 == 128
    with pytest.raises(ConfigError, match="compute-matched needs head_dim=128 divisible by 2\\*n_freqs=96"):
        spec(48).model.build()
    with pytest.raises(ConfigError, match="n_freqs=0 is out of range"):
        spec(0)
