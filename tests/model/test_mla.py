"""MLA: the absorbed latent-cache path equals the materialised path; both equal independent references
(a per-head formula written out here; transformers' DeepSeek attention: ``tests/hf/test_deepseek.py``);
the latent cache holds kv_rank + rope values per token; QK methods that cannot keep it are refused."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import ConfigError, ModelConfig, QKConfig, load_config
from qklab.methods import METHODS, AttnShape, QKMethod
from qklab.methods.qkmap import QKMapOptions
from qklab.methods.softcap import SoftCapOptions
from qklab.model import GPT, KVCache, LatentCache, MLAttention, Rope

H, NOPE, ROPE, V, KV_RANK, Q_RANK = 4, 16, 8, 12, 24, 20  # distinct widths catch mixed-up dimensions
LATENT_METHODS = ["none", "softcap", "qknorm"]


def _cfg(q_rank: int = Q_RANK, impl: str = "auto", **kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=H, max_seq_len=64, attn_impl=impl,
                       attention="mla", q_rank=q_rank, kv_rank=KV_RANK, nope_dim=NOPE, rope_dim=ROPE, v_dim=V,
                       **kw)


def _qk(method: str) -> QKConfig:
    opts = {"softcap": SoftCapOptions(cap=2.0)} if method == "softcap" else {}  # small cap: tanh is active
    return QKConfig(method=method, options=opts)


def _randomise_gains(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:  # RMSNorm gains (latents, QK-Norm): non-trivial
                p.uniform_(0.5, 1.5)


def mla_gpt(method: str = "none", q_rank: int = Q_RANK, impl: str = "auto") -> GPT:
    model = GPT(_cfg(q_rank, impl), _qk(method)).eval()
    _randomise_gains(model)
    with torch.no_grad():  # larger q/k weights: peaked attention, so that the tests can fail
        for b in model.blocks:
            for lin in (b.attn.wuq, b.attn.wqr, b.attn.wuk, b.attn.wkr):
                lin.weight.mul_(15.0)
    return model


def _set(model: GPT, **attrs) -> None:
    for b in model.blocks:
        for k, v in attrs.items():
            setattr(b.attn, k, v)


def _decode(model: GPT, x: torch.Tensor, caches) -> torch.Tensor:
    """Prefill 5 tokens, a 4-token chunk, then one token at a time; logits at every position."""
    parts = [model(x[:, :5], caches=caches)[0], model(x[:, 5:9], caches=caches)[0]]
    parts += [model(x[:, t : t + 1], caches=caches)[0] for t in range(9, x.shape[1])]
    return torch.cat(parts, dim=1)


# --- absorbed == materialised ------------------------------------------------------------------------
@pytest.mark.parametrize("q_rank", [Q_RANK, 0])
@pytest.mark.parametrize("method", LATENT_METHODS)
def test_absorbed_equals_materialised_at_every_position(method, q_rank):
    model = mla_gpt(method, q_rank)
    x = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        full, _ = model(x)  # materialised, no cache
        _set(model, latent_path="absorbed")
        caches = model.make_caches(2, 40)
        assert all(isinstance(c, LatentCache) for c in caches)
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    # the test has teeth: attention is far from uniform (1/30 per key)
    attn = model.blocks[0].attn
    attn.capture = {}
    with torch.no_grad():
        model(x)
    assert attn.capture["probs"][:, :, -1].max() > 0.1


@pytest.mark.parametrize("kind", ["auto", "absorbed", "materialised", "per-head"])
@pytest.mark.parametrize("method", LATENT_METHODS)
def test_cached_decoding_equals_full_forward(method, kind):
    assert_decoding_equals_full_forward(mla_gpt(method), kind)


def assert_decoding_equals_full_forward(model: GPT, kind: str) -> None:
    """Decoding through the ``kind`` of cache (a latent path, or per-head caches) equals the full forward."""
    x = torch.randint(0, 97, (2, 26))
    with torch.no_grad():
        full, _ = model(x)
        if kind != "per-head":
            _set(model, latent_path=kind)
        caches = model.make_caches(2, 32, latent=kind != "per-head")
        assert isinstance(caches[0], KVCache if kind == "per-head" else LatentCache)
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", LATENT_METHODS)
def test_generate_uses_latent_cache_and_matches_full_forward(method, monkeypatch):
    model = mla_gpt(method)
    made = []
    orig = LatentCache.append
    monkeypatch.setattr(LatentCache, "append", lambda self, *a: made.append(self) or orig(self, *a))
    prompt = torch.randint(0, 97, (2, 5))
    out = model.generate(prompt, max_new_tokens=10, temperature=0)
    assert out.shape == (2, 15) and len(made) == 2 * 10  # 2 layers x (prefill + 9 decode steps)
    with torch.no_grad():
        logits, _ = model(out[:, :-1])
    torch.testing.assert_close(out[:, 5:], logits[:, 4:].argmax(-1))


@pytest.mark.parametrize("q_rank", [Q_RANK, 0])
@pytest.mark.parametrize("method", LATENT_METHODS)
def test_fast_path_equals_eager_path(method, q_rank):
    model = mla_gpt(method, q_rank)
    x = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        _set(model, impl="sdpa" if not METHODS[method].modifies_logits else "auto")
        fast, _ = model(x)
        _set(model, impl="eager")
        slow, _ = model(x)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


# --- independent per-head reference --------------------------------------------------------------------
def _rot(x: torch.Tensor, t: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE of x (T, D) at positions t, written out pair by pair."""
    D = x.shape[-1]
    out = x.clone()
    for i in range(D // 2):
        a = t * theta ** (-2 * i / D)
        x1, x2 = x[:, i], x[:, i + D // 2]
        out[:, i], out[:, i + D // 2] = x1 * torch.cos(a) - x2 * torch.sin(a), x2 * torch.cos(a) + x1 * torch.sin(a)
    return out


def _rms(z: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return g * z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps)


def reference_mla(a: MLAttention, x: torch.Tensor, qknorm: bool) -> torch.Tensor:
    """The MLA formula head by head, for one sequence x (T, C); QK-Norm on each head's full q and k."""
    T = x.shape[0]
    t = torch.arange(T, dtype=torch.float64)
    cq = _rms(x @ a.wdq.weight.T, a.q_norm.weight) if a.wdq is not None else x
    c = _rms(x @ a.wdkv.weight.T, a.kv_norm.weight)
    k_rope = x @ a.wkr.weight.T  # (T, rope), shared by the heads
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    for h in range(a.n_heads):
        rows_n, rows_r = slice(h * NOPE, (h + 1) * NOPE), slice(h * ROPE, (h + 1) * ROPE)  # head h's rows
        q = torch.cat([cq @ a.wuq.weight[rows_n].T, cq @ a.wqr.weight[rows_r].T], -1)
        k = torch.cat([c @ a.wuk.weight[rows_n].T, k_rope], -1)
        if qknorm:
            q, k = _rms(q, a.qk.q_norm.weight), _rms(k, a.qk.k_norm.weight)
        q = torch.cat([q[:, :NOPE], _rot(q[:, NOPE:].double(), t).float()], -1)
        k = torch.cat([k[:, :NOPE], _rot(k[:, NOPE:].double(), t).float()], -1)
        s = (q @ k.T / math.sqrt(NOPE + ROPE)).masked_fill(~mask, -math.inf)
        outs.append(torch.softmax(s, -1) @ (c @ a.wuv.weight[h * V : (h + 1) * V].T))
    return torch.cat(outs, -1) @ a.wo.weight.T


@pytest.mark.parametrize("path", ["materialised", "absorbed"])
@pytest.mark.parametrize("q_rank", [Q_RANK, 0])
@pytest.mark.parametrize("method", ["none", "qknorm"])
def test_mla_matches_per_head_reference(method, q_rank, path):
    model = mla_gpt(method, q_rank)
    a = model.blocks[0].attn
    x = torch.randn(2, 18, 64)
    with torch.no_grad():
        if path == "materialised":
            got = a(x, model.rope)
        else:
            a.latent_path = "absorbed"
            cache = a.make_cache(2, 18, x.device, x.dtype)
            got = torch.cat([a(x[:, t : t + 1], model.rope, cache) for t in range(18)], dim=1)
        ref = torch.stack([reference_mla(a, xb, qknorm=method == "qknorm") for xb in x])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_qknorm_normalises_each_materialised_head():
    model = mla_gpt("qknorm")
    a = model.blocks[0].attn
    with torch.no_grad():
        a.qk.k_norm.weight.fill_(1.0)
        a.capture = {}
        a(torch.randn(2, 6, 64) * 50, model.rope)
    k = a.capture["k"]  # (B, H, T, F): each head's key has rms 1 (RoPE is a rotation)
    torch.testing.assert_close(k.pow(2).mean(-1), torch.ones_like(k[..., 0]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if m.latent_cache_ok])
def test_latent_map_is_map_qk_factorised(name):
    """Every method that claims the latent cache: latent_map's q is map_qk's, and map_qk's key is
    RoPE(gain * k) * s."""
    shape = AttnShape(64, H, H, NOPE + ROPE, 0, 2)
    m = METHODS[name](shape, QKConfig().opts(name))
    _randomise_gains(m)
    rope = Rope(64, 10000.0)
    q, k = torch.randn(2, H, 7, NOPE + ROPE) * 3, torch.randn(2, H, 7, NOPE + ROPE) * 3
    with torch.no_grad():
        q_mapped, k_mapped = m.map_qk(q, k, rope, 5)
        q_lat, gain, s = m.latent_map(q, k, rope, 5)
    k_fact = rope(k * (1 if gain is None else gain), 5) * (1 if s is None else s)
    torch.testing.assert_close(q_lat, q_mapped)
    torch.testing.assert_close(k_fact, k_mapped)


# --- the cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, extra", [("none", 0), ("softcap", 0), ("qknorm", H)])
def test_latent_cache_size_per_token(method, extra):
    model = mla_gpt(method)
    caches = model.make_caches(2, 16)
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 9)), caches=caches)
    for c in caches:
        assert c.length == 9 and c.kv.shape == (2, 16, KV_RANK + ROPE)
        assert c.values_per_token() == KV_RANK + ROPE + extra  # QK-Norm: one inverse RMS per head beside it
        assert (c.kv[:, 9:] == 0).all() and (c.kv[:, :9] != 0).any()
    per_head = model.make_caches(2, 16, latent=False)[0]
    assert per_head.k.shape[-1] * H + per_head.v.shape[-1] * H == H * (NOPE + ROPE + V)


class _NoLatent(QKMethod):
    """A key map that is not a gain times a scalar: cannot keep the latent cache."""

    name = "nolatent"
    latent_cache_ok = False

    def map_qk(self, q, k, rope, pos):
        return rope(q, pos), rope(torch.tanh(k), pos)


@pytest.mark.parametrize("method", ["nolatent", "qkmap"])
def test_methods_without_latent_cache_run_materialised_and_refuse_latent(method, monkeypatch):
    monkeypatch.setitem(METHODS, "nolatent", _NoLatent)
    opts = {"qkmap": QKMapOptions(proj_dim=NOPE + ROPE)}  # qkmap keeps MLA's q/k width
    model = GPT(_cfg(), QKConfig(method=method, options=opts)).eval()
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 24)  # default: per-head caches for such a method
        assert all(isinstance(c, KVCache) for c in caches)
        torch.testing.assert_close(_decode(model, x, caches), full, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=f"qk.method='{method}' needs per-head keys") as e:
            model.make_caches(2, 24, latent=True)
        assert "\n" not in str(e.value)
        latent = LatentCache(torch.zeros(2, 24, KV_RANK + ROPE))
        with pytest.raises(ValueError, match="cannot decode it from the latent cache"):
            model.blocks[0].attn(torch.randn(2, 3, 64), model.rope, latent)


# --- config ---------------------------------------------------------------------------------------
def test_config_defaults_and_preset():
    d = ModelConfig(d_model=192, n_heads=6, attention="mla").mla_dims
    assert d == (0, 64, 32, 16, 32)
    cfg = load_config("small_mla")
    assert cfg.model.attention == "mla" and cfg.model.d_model == 192 and cfg.model.n_layers == 4


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.attention=gqa", "model.attention='gqa'"),
        ("model.rope_dim=3", "must be even"),
        ("model.kv_rank=-1", "must be >= 0"),
        ("model.n_kv_heads=2", "leave it 0 with attention=mla"),
    ],
)
def test_bad_mla_config_is_one_clear_error(override, needle):
    sets = ["model.attention=mla"] if not override.startswith("model.attention") else []
    with pytest.raises(ConfigError) as e:
        load_config("tiny", sets + [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mla_refuses_methods_that_change_the_projection_width():
    with pytest.raises(ConfigError, match="model.attention=mla does not support"):
        GPT(_cfg(), QKConfig(method="qkmap"))  # compute-matched qkmap projects to a narrower width


# --- multi-token absorbed decode, keys only when needed, key scalars allocated with the cache ----------
@pytest.mark.parametrize("method", LATENT_METHODS)
def test_auto_decodes_short_chunks_absorbed_and_matches_materialised(method, monkeypatch):
    """Chunks of 2-8 tokens (speculative decoding's verify step) take the absorbed path under "auto"; a
    longer chunk is expanded. Logits equal the materialised full forward at every position."""
    from qklab.model import mla

    model = mla_gpt(method)
    calls = []
    for name in ("_absorbed", "_expand"):
        orig = getattr(MLAttention, name)
        monkeypatch.setattr(MLAttention, name, lambda self, *a, _o=orig, _n=name: calls.append(_n) or _o(self, *a))
    x = torch.randint(0, 97, (2, 40))
    sizes = [mla.ABSORB_MAX_T + 1, 2, 3, 5, mla.ABSORB_MAX_T, 1, 7]  # 9 + 2 + 3 + 5 + 8 + 1 + 7 = 35
    with torch.no_grad():
        full, _ = model(x)
        caches = model.make_caches(2, 40)
        parts, t = [], 0
        for n in sizes:
            calls.clear()
            parts.append(model(x[:, t : t + n], caches=caches)[0])
            assert set(calls) == {"_expand" if n > mla.ABSORB_MAX_T else "_absorbed"}, n
            t += n
    torch.testing.assert_close(torch.cat(parts, 1), full[:, :t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, builds", [("none", False), ("softcap", False), ("qknorm", True)])
def test_latent_path_builds_per_head_keys_only_for_key_scalars(method, builds, monkeypatch):
    model = mla_gpt(method)
    caches = model.make_caches(2, 16)
    n = []
    orig = MLAttention.keys
    monkeypatch.setattr(MLAttention, "keys", lambda self, *a: n.append(1) or orig(self, *a))
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 3)), caches=caches)
    assert bool(n) == builds


@pytest.mark.parametrize("method", LATENT_METHODS)
def test_key_scalars_are_allocated_with_the_cache(method):
    model = mla_gpt(method)
    c = model.make_caches(2, 16)[0]
    if method == "qknorm":
        assert c.kscale is not None and c.kscale.shape == (2, H, 16)
        assert c.values_per_token() == KV_RANK + ROPE + H  # before any token is written
    else:
        assert c.kscale is None and c.values_per_token() == KV_RANK + ROPE


# --- coarser QK-Norm key granularities: per group of heads, per nope/rope part -----------------------
GRANULARITIES = [{"k_group": 2}, {"k_parts": True}, {"k_group": 4, "k_parts": True}]


def _qknorm_gpt(**opts) -> GPT:
    from qklab.methods.qknorm import QKNormOptions

    model = GPT(_cfg(), QKConfig(method="qknorm", options={"qknorm": QKNormOptions(**opts)})).eval()
    _randomise_gains(model)
    with torch.no_grad():
        for b in model.blocks:
            for lin in (b.attn.wuq, b.attn.wqr, b.attn.wuk, b.attn.wkr):
                lin.weight.mul_(15.0)
    return model


@pytest.mark.parametrize("opts", GRANULARITIES, ids=str)
def test_qknorm_granularity_normalises_keys_as_documented(opts):
    model = _qknorm_gpt(**opts)
    a = model.blocks[0].attn
    with torch.no_grad():
        a.qk.k_norm.weight.fill_(1.0)
        a.capture = {}
        a(torch.randn(2, 6, 64) * 50, model.rope)
    k = a.capture["k"]  # (B, H, T, F) post-RoPE (a rotation of the rope part: its RMS is unchanged)
    g = opts.get("k_group", 1)
    parts = [k[..., :NOPE], k[..., NOPE:]] if opts.get("k_parts") else [k]
    for part in parts:  # mean square over each group's heads and the part's features is 1
        ms = part.pow(2).view(2, H // g, g, 6, -1).mean(dim=(2, 4))
        torch.testing.assert_close(ms, torch.ones_like(ms), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("opts", GRANULARITIES, ids=str)
@pytest.mark.parametrize("kind", ["auto", "absorbed", "materialised"])
def test_qknorm_granularity_latent_decode_equals_full_forward(opts, kind):
    model = _qknorm_gpt(**opts)
    x = torch.randint(0, 97, (2, 26))
    with torch.no_grad():
        full, _ = model(x)
        _set(model, latent_path=kind)
        caches = model.make_caches(2, 32)
        got = _decode(model, x, caches)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    # the cache keeps one scalar per group of heads; the rope part's scalar lives in the rope key
    assert caches[0].values_per_token() == KV_RANK + ROPE + H // opts.get("k_group", 1)


@pytest.mark.parametrize("opts", GRANULARITIES, ids=str)
def test_qknorm_granularity_latent_map_is_map_qk_factorised(opts):
    from qklab.methods.qknorm import QKNorm, QKNormOptions
    from qklab.model.mla import PartialRope

    m = QKNorm(AttnShape(64, H, H, NOPE + ROPE, 0, 2, ROPE), QKNormOptions(**opts))
    _randomise_gains(m)
    rope = PartialRope(Rope(64, 10000.0), ROPE)  # MLA rotates the rope part only
    q, k = torch.randn(2, H, 7, NOPE + ROPE) * 3, torch.randn(2, H, 7, NOPE + ROPE) * 3
    k[..., NOPE:] = k[:, :1, :, NOPE:]  # MLA: one rope key shared by every head
    with torch.no_grad():
        q_mapped, k_mapped = m.map_qk(q, k, rope, 5)
        q_lat, gain, s = m.latent_map(q, k, rope, 5)
    torch.testing.assert_close(q_lat, q_mapped)
    torch.testing.assert_close(rope(k * gain, 5) * s, k_mapped)
    if opts.get("k_parts"):  # the rope part's scalar is the same for every head (one shared rope key)
        rope_s = s[..., NOPE:]
        assert torch.equal(rope_s, rope_s[:, :1].expand_as(rope_s))


@pytest.mark.parametrize("sets, needle", [
    (["qk.qknorm.k_parts=true"], "needs keys with a nope and a rope part"),
    (["qk.qknorm.k_group=3"], "must divide the 4 key heads"),
])
def test_qknorm_granularity_refusals(sets, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config("tiny", ["qk.method=qknorm", *sets])
    assert "\n" not in str(e.value)
    assert load_config("tiny", ["qk.method=qknorm", "model.attention=mla", "qk.qknorm.k_parts=true",
                                "qk.qknorm.k_group=2"]).qk.opts("qknorm").k_parts
