"""QK-MAP properties, each against a direct formula (see docs/qk-map.md)."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import AttnShape
from qklab.methods.qkmap import QKMap, QKMapOptions
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.model import GPT, Rope

SHAPE = AttnShape(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, layer_idx=0, n_layers=2)
VARIANTS = {
    "post-M1": QKMapOptions(),
    "post-M2": QKMapOptions(n_freqs=2),
    "expanded": QKMapOptions(n_freqs=2, proj_dim=8),
    "coord": QKMapOptions(sharing="coord", freq_min=0.25, freq_max=2.0),
    "layer": QKMapOptions(sharing="layer", n_freqs=2),
    "frozen": QKMapOptions(learn_freqs=False, learn_temperature=False),
    "rope-before": QKMapOptions(rope="before"),
    "polar": QKMapOptions(variant="polar", n_freqs=2),
    "polar-id": QKMapOptions(variant="polar", polar_g="identity"),
    "input": QKMapOptions(variant="input"),
}
SPECIAL = [torch.zeros(3, 8), torch.full((3, 8), 1e6), torch.full((3, 8), -7.5), torch.randn(3, 8) * 1e4]


def _gpt(opts: QKMapOptions, n_kv: int = 2, impl: str = "auto") -> GPT:
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64, attn_impl=impl)
    return GPT(cfg, QKConfig(method="qkmap", options={"qkmap": opts})).eval()


@pytest.mark.parametrize("opts", [VARIANTS["post-M2"], VARIANTS["coord"], VARIANTS["polar"]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_norm_is_fixed_for_any_input(opts, dtype):
    m = QKMap(SHAPE, opts)
    d = m.proj_dim()
    want = math.sqrt(opts.n_freqs * d) if opts.variant == "post" else math.sqrt(opts.n_freqs)
    for z in [torch.zeros(2, 2, 5, d), torch.full((2, 2, 5, d), 1e6), -torch.rand(2, 2, 5, d) * 1e3,
              torch.randn(2, 2, 5, d)]:
        f = m._phi(z.to(dtype)).to(dtype).float()  # features as stored in the model dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(f.norm(dim=-1), torch.full(f.shape[:-1], want), atol=tol * want, rtol=0)


def test_input_variant_features_have_unit_rms():
    """Input features sqrt(2) [cos | sin] have RMS exactly 1, like the normalised x they replace."""
    m = QKMap(SHAPE, VARIANTS["input"])
    for x in [torch.zeros(2, 5, 64), torch.full((2, 5, 64), 1e6), torch.randn(2, 5, 64)]:
        f = m.map_input(x)
        assert f.shape[-1] == 2 * 64
        torch.testing.assert_close(f.pow(2).mean(dim=-1).sqrt(), torch.ones(2, 5))


@pytest.mark.parametrize("name", ["post-M1", "post-M2", "expanded", "coord", "polar", "rope-before"])
def test_logits_within_temperature_bound(name):
    model = _gpt(VARIANTS[name])
    with torch.no_grad():
        for b in model.blocks:  # push weights and temperatures far from init
            b.attn.wq.weight.mul_(300.0)
            b.attn.wk.weight.normal_(0, 50.0)
            b.attn.qk.log_temp.copy_(torch.tensor([3.0, 2.0, 7.0, 0.5]).log())
        attn = model.blocks[0].attn
        attn.capture = {}
        model(torch.randint(0, 97, (2, 30)))
        s = attn.capture["logits"]  # (B, H, T, T)
    bound = torch.tensor([3.0, 2.0, 7.0, 0.5]).view(1, 4, 1, 1)
    assert (s.abs() <= bound * (1 + 1e-5)).all()
    assert (s.abs().amax(dim=(0, 2, 3)) > 0.3 * bound.flatten()).all()  # and the bound is not vacuous


def test_post_logit_equals_direct_formula():
    """At position 0 (RoPE = identity) s = T_h * mean_{i,m} cos(w_m (q_i - k_i))."""
    m = QKMap(SHAPE, QKMapOptions(n_freqs=2, proj_dim=6, freq_min=0.3, freq_max=1.7))
    with torch.no_grad():
        m.log_temp.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]).log())
        m.log_freq.copy_(torch.log(torch.tensor([[[0.3, 1.7]], [[0.9, 2.5]]])))  # (G=2, 1, M=2)
    q, k = torch.randn(1, 4, 1, 6) * 3, torch.randn(1, 2, 1, 6) * 3
    fq, fk = m.map_qk(q, k, Rope(8, 10000.0), 0)
    got = (fq * fk.repeat_interleave(2, dim=1)).sum(-1).flatten()  # scale is 1
    w = torch.tensor([[0.3, 1.7], [0.3, 1.7], [0.9, 2.5], [0.9, 2.5]])  # q head h uses KV head h // 2
    kk = k.repeat_interleave(2, dim=1)[0, :, 0]  # (4, 6)
    diff = q[0, :, 0] - kk  # (4, 6)
    want = torch.tensor([1.0, 2, 3, 4]) * torch.cos(diff.unsqueeze(-1) * w.unsqueeze(1)).mean(dim=(1, 2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_magnitude_sensitivity_vs_qknorm():
    """cos(phi(z), phi(2z)) is clearly below 1 at init for typical z; QK-Norm's is exactly 1."""
    torch.manual_seed(0)
    m, n = QKMap(SHAPE, QKMapOptions()), QKNorm(SHAPE, QKNormOptions())
    d = m.proj_dim()
    x = torch.randn(256, 64)  # normalised hidden states
    z = (x @ torch.randn(64, d) * m.qk_init_std(0.02)).view(1, 2, 128, d)  # typical projections at init (2 KV heads)
    f1, f2 = m._phi(z), m._phi(2 * z)
    cos_map = torch.cosine_similarity(f1, f2, dim=-1).mean().item()
    zn = torch.randn(1, 1, 256, 16)
    cos_norm = torch.cosine_similarity(n.q_norm(zn), n.q_norm(2 * zn), dim=-1).mean().item()
    assert cos_norm == pytest.approx(1.0, abs=1e-6)
    assert cos_map < 0.9
    # and it keeps falling as the scale moves away from 1
    cos4 = torch.cosine_similarity(f1, m._phi(4 * z), dim=-1).mean().item()
    assert cos4 < cos_map


@pytest.mark.parametrize("rope", ["after", "before"])
def test_rope_after_map_gives_relative_logits(rope):
    """Shifting all positions by p leaves every logit unchanged (RoPE after the map); RoPE before the map
    is also relative for the post variant but mixes position into the content phase differently."""
    m = QKMap(SHAPE, QKMapOptions(rope=rope))
    r = Rope(64, 10000.0)
    q, k = torch.randn(1, 4, 6, m.proj_dim()), torch.randn(1, 2, 6, m.proj_dim())
    logits = []
    for p in (0, 9, 31):
        fq, fk = m.map_qk(q, k, r, p)
        logits.append(fq @ fk.repeat_interleave(2, dim=1).transpose(-1, -2))
    if rope == "after":
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[2], logits[0], atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(logits[1], logits[0], atol=1e-3)


@pytest.mark.parametrize("rope", ["after", "before"])
def test_starting_logit_by_distance_follows_the_rope_kernel(rope):
    """With RoPE after the map, pair i of the features turns by theta_i per position, so the logit at
    distance D is T_h mean_i cos(w (q_i - k_i) + theta_i D); for independent q_i, k_i ~ N(0, sigma^2) its
    mean is T_h exp(-w^2 sigma^2) mean_i cos(theta_i D): the starting attention is local, the more so
    the larger T_h (docs/qk-map.md, "QK-MAP starts local"). RoPE before the map turns independent
    isotropic q and k, which leaves q_i - k_i ~ N(0, 2 sigma^2) at every distance: no distance prior."""
    torch.manual_seed(0)
    m = QKMap(SHAPE, QKMapOptions(rope=rope))  # d' = 8, F = 16, T_h = 2 sqrt(16) = 8, w = 0.5
    T, sigma, w, t0 = 48, 1.3, 0.5, 8.0
    q, k = torch.randn(512, 4, T, 8) * sigma, torch.randn(512, 2, T, 8) * sigma
    fq, fk = m.map_qk(q, k, Rope(T, 10000.0), 0)
    s = fq @ fk.repeat_interleave(2, dim=1).transpose(-1, -2)  # (B, H, T, T), scale 1
    dist = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # query minus key position
    got = torch.stack([s[..., dist == d].mean() for d in range(T)])  # mean logit at each distance
    theta = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # (8,): the rotary pairs' rates
    D = torch.arange(T, dtype=torch.float64)
    kernel = torch.cos(theta[None, :] * D[:, None]).mean(dim=-1) if rope == "after" else torch.ones_like(D)
    want = (t0 * math.exp(-(w * sigma) ** 2) * kernel).float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)  # 512 x 4 x (T - D) samples of std < 1 each
    if rope == "after":
        assert got[0] - got[16] > 2.0  # near keys start two logits and more above far ones


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gradients_finite_for_extreme_inputs(name):
    model = _gpt(VARIANTS[name])
    model.train()
    x = torch.randint(0, 97, (2, 12))
    for scale in (0.0, 1e6, -1e6):
        with torch.no_grad():
            model.tok_emb.weight.normal_().mul_(scale) if scale else model.tok_emb.weight.zero_()
        _, loss = model(x, x)
        loss.backward()
        assert torch.isfinite(loss)
        for n, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), (name, scale, n)
        model.zero_grad()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_cached_decoding_and_fast_path(name):
    model = _gpt(VARIANTS[name])
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 20)
        parts = [model(x[:, :6], caches=caches)[0]] + [model(x[:, t : t + 1], caches=caches)[0] for t in range(6, 20)]
        for b in model.blocks:
            b.attn.impl = "eager"
        eager, _ = model(x)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, full, atol=1e-5, rtol=1e-5)


def test_compute_matched_keeps_cache_width_expanded_grows_it():
    assert _gpt(VARIANTS["post-M2"]).make_caches(1, 4)[0].k.shape[-1] == 16  # 2 M d' = d_head
    assert _gpt(VARIANTS["expanded"]).make_caches(1, 4)[0].k.shape[-1] == 32  # 2 * 2 * 8


def test_bf16_autocast_and_compile_match_fp32():
    model = _gpt(VARIANTS["post-M2"])
    x = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        ref, _ = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = model(x)
        compiled, _ = torch.compile(model, backend="aot_eager")(x)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.1
    torch.testing.assert_close(compiled, ref, atol=1e-5, rtol=1e-5)


def test_frozen_and_learnable_parameters():
    frozen = QKMap(SHAPE, VARIANTS["frozen"])
    assert not frozen.log_freq.requires_grad and not frozen.log_temp.requires_grad
    m = QKMap(SHAPE, VARIANTS["coord"])
    assert m.log_freq.shape == (2, 8, 1)
    w = m.freqs()[0, :, 0]
    torch.testing.assert_close(w, torch.logspace(math.log10(0.25), math.log10(2.0), 8))  # log-spaced over coords


@pytest.mark.parametrize("override, needle", [
    ("qk.qkmap.n_freqs=3", "divisible by 2*n_freqs=6"),
    ("qk.qkmap.variant=foo", "variant='foo'"),
    ("qk.qkmap.sharing=coord", None),
])
def test_config_errors(override, needle):
    sets = ["qk.method=qkmap", override]
    if needle is None:
        assert load_config("tiny", sets).qk.opts("qkmap").sharing == "coord"
        return
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        load_config("tiny", sets)


def test_default_temperature_is_twice_qknorms_range():
    """The measured default (docs/qk-map.md): T_h starts at 2 sqrt(d_head)."""
    m = QKMap(SHAPE, QKMapOptions())
    m.reset_parameters()
    torch.testing.assert_close(m.temperature().detach(), torch.full((SHAPE.n_heads,), 2 * math.sqrt(SHAPE.head_dim)))


# --- every option combination: runs, or is refused in one line --------------------------------------

REFUSED = {("input", "head"), ("input", "coord"), ("polar", "coord")}  # (variant, sharing)


def _combos():
    for variant in ("post", "input", "polar"):
        for sharing in ("auto", "layer", "head", "coord"):
            for rope in ("after", "before"):
                for g in (("identity", "log") if variant == "polar" else ("log",)):
                    for M in (1, 2):
                        yield variant, sharing, rope, g, M


def _refused(variant, sharing, rope):
    return (variant, sharing) in REFUSED or (variant == "input" and rope == "before")


def test_every_accepted_combination_runs_forward_backward_and_decode():
    torch.manual_seed(0)
    x = torch.randint(0, 97, (2, 10))
    accepted = 0
    for variant, sharing, rope, g, M in _combos():
        sets = ["qk.method=qkmap", f"qk.qkmap.variant={variant}", f"qk.qkmap.sharing={sharing}",
                f"qk.qkmap.rope={rope}", f"qk.qkmap.polar_g={g}", f"qk.qkmap.n_freqs={M}",
                "model.n_kv_heads=2", "model.n_layers=1"]
        if _refused(variant, sharing, rope):
            with pytest.raises(ConfigError) as err:
                load_config("tiny", sets)
            assert "\n" not in str(err.value) and "qk.qkmap." in str(err.value)
            with pytest.raises(ValueError):  # also refused when built directly
                QKMap(SHAPE, QKMapOptions(variant=variant, sharing=sharing, rope=rope, n_freqs=M))
            continue
        cfg = load_config("tiny", sets)
        model = GPT(ModelConfig(**{**cfg.model.__dict__, "vocab_size": 97}), cfg.qk)
        _, loss = model(x, x)
        loss.backward()
        qk = model.blocks[0].attn.qk
        assert torch.isfinite(loss) and qk.log_freq.grad is not None and torch.isfinite(qk.log_freq.grad).all()
        if variant != "input":
            assert qk.log_temp.grad is not None and torch.isfinite(qk.log_temp.grad).all()
        model.eval()
        with torch.no_grad():
            full, _ = model(x)
            caches = model.make_caches(2, 10)
            parts = [model(x[:, :4], caches=caches)[0]]
            parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(4, 10)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
        accepted += 1
    assert accepted == 44  # post 16, input 4, polar 24


@pytest.mark.parametrize("variant, sharing, groups", [
    ("post", "auto", 2), ("polar", "auto", 2), ("input", "auto", 1), ("post", "layer", 1), ("polar", "head", 2),
])
def test_sharing_auto_and_explicit_frequency_sets(variant, sharing, groups):
    m = QKMap(SHAPE, QKMapOptions(variant=variant, sharing=sharing))
    assert m.log_freq.shape[0] == groups


# --- the log-parameterised temperature --------------------------------------------------------------

def test_log_temperature_is_positive_and_its_gradient_is_the_logit():
    """T_h = exp(log_temp_h) > 0 for any parameter value, and d s / d log T_h = s (s = T_h mean cos)."""
    m = QKMap(SHAPE, QKMapOptions())
    with torch.no_grad():
        m.log_temp.copy_(torch.tensor([-30.0, -1.0, 0.5, 4.0]))
    assert (m.temperature() > 0).all()
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8)
    fq, fk = m.map_qk(q, k, Rope(8, 10000.0), 0)
    s = (fq * fk.repeat_interleave(2, dim=1)).sum(-1).flatten()  # (H,) logits at position 0
    (grad,) = torch.autograd.grad(s.sum(), m.log_temp)
    torch.testing.assert_close(grad, s.detach(), atol=1e-6, rtol=1e-5)


# --- the stability signals --------------------------------------------------------------------------

def test_stats_against_direct_formulas():
    m = QKMap(SHAPE, QKMapOptions(n_freqs=2, proj_dim=4, freq_min=0.5, freq_max=4.0))
    m.record = True
    q, k = torch.randn(3, 4, 50, 4) * 2.0, torch.randn(3, 2, 50, 4) + 1.0
    m.map_qk(q, k, Rope(64, 10000.0), 0)
    st = m.stats()
    w = torch.tensor([0.5, 4.0])
    kk = k.repeat_interleave(2, dim=1)
    for h in range(4):
        qs = q[:, h].reshape(-1, 4)
        ks = kk[:, h].reshape(-1, 4)
        std_q = qs.std(dim=0, correction=0)  # (d,)
        want_wstd = max((wm * std_q).mean().item() for wm in w)
        assert st["w_std"][h] == pytest.approx(want_wstd, rel=1e-4)
        # rms of q_i - k_i over all independent pairs (every query row against every key row)
        diff = (qs.unsqueeze(1) - ks.unsqueeze(0)).reshape(-1, 4)
        rms = diff.pow(2).mean(dim=0).sqrt()
        assert st["phase_spread"][h] == pytest.approx(max((wm * rms).mean().item() for wm in w), rel=1e-4)
        assert st["aliased"][h] == pytest.approx(torch.stack([wm * rms > math.pi for wm in w]).float().mean().item())
        assert st["q_norm"][h] == pytest.approx(q[:, h].norm(dim=-1).mean().item(), rel=1e-5)
        assert st["k_norm"][h] == pytest.approx(kk[:, h].norm(dim=-1).mean().item(), rel=1e-5)
    assert st["temperature"] == pytest.approx([2 * math.sqrt(16)] * 4)
    assert 0 < st["aliased"][0] < 1  # the 4.0 frequency wraps, the 0.5 one does not


# --- starting logit statistics, against the values documented in docs/qk-map.md ---------------------

# layer 0 of the `small` shape at init (benchmarks/qkmap_init.py --config small, held-out text):
# (std of all causal logits, mean per-row std across keys)
DOCUMENTED_INIT = {
    "none": (0.076, 0.074, []),
    "qknorm": (1.00, 0.98, ["qk.method=qknorm"]),
    "qkmap-post": (1.75, 1.56, ["qk.method=qkmap"]),
    "qkmap-post-T1": (0.87, 0.78, ["qk.method=qkmap", "qk.qkmap.temperature=5.65685"]),
    "qkmap-polar": (2.35, 2.33, ["qk.method=qkmap", "qk.qkmap.variant=polar"]),
    "qkmap-input": (0.14, 0.108, ["qk.method=qkmap", "qk.qkmap.variant=input"]),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_INIT))
def test_initial_logit_statistics_match_documented_values(name):
    """At init a layer-0 logit depends on the text only through which tokens repeat, so random tokens
    reproduce the documented (held-out text) figures; the tolerance covers that and the sampling."""
    want_std, want_row, sets = DOCUMENTED_INIT[name]
    cfg = load_config("small", [*sets, "model.n_layers=1"])
    cfg.model.vocab_size = 4096
    model = GPT(cfg.model, cfg.qk).eval()
    attn = model.blocks[0].attn
    idx = torch.randint(0, 4096, (2, 256))
    attn.capture = {}
    with torch.no_grad():
        model(idx)
    s = attn.capture["logits"][0]  # (H, T, T), first sequence
    rows = [s[:, t, : t + 1] for t in range(1, 256)]  # causal keys of each query row
    pooled = torch.cat([r.flatten() for r in [s[:, 0, :1], *rows]])
    row_std = torch.stack([r.std(dim=-1, correction=0) for r in rows]).mean()
    assert pooled.std().item() == pytest.approx(want_std, rel=0.25)
    assert row_std.item() == pytest.approx(want_row, rel=0.1)


def test_weights_saved_with_the_linear_temperature_still_load():
    m = QKMap(SHAPE, QKMapOptions())
    old = {k: v for k, v in m.state_dict().items() if k != "log_temp"}
    old["temp"] = torch.tensor([3.0, -2.0, 7.0, 0.5])  # the earlier parameter: T_h, any sign
    m.load_state_dict(old)
    torch.testing.assert_close(m.temperature().detach(), torch.tensor([3.0, 2.0, 7.0, 0.5]))


def test_the_map_rate_reads_its_earlier_name_and_hashes_under_it():
    """``map_lr_scale`` was ``lr_mult``: a config, a committed result or a record giving the earlier name is
    read as the new one, and a study cell hashes under the earlier name, so committed cells stay valid. The
    hash is pinned to the one qklab computed before the rename for the same config."""
    from qklab.config import RunConfig, from_dict
    from qklab.study.spec import cell_hash

    old = from_dict(RunConfig, {"qk": {"method": "qkmap", "qkmap": {"lr_mult": 3.0}}}).validate()
    new = load_config("tiny", ["qk.method=qkmap", "qk.qkmap.map_lr_scale=3"])
    assert old.qk.opts("qkmap").map_lr_scale == 3.0 == new.qk.opts("qkmap").map_lr_scale
    assert cell_hash(old) == "3291daee389e925c"
    assert QKMap(SHAPE, QKMapOptions(map_lr_scale=3.0)).param_group() == (
        "qk_map", 3.0)
