"""Optimizer grouping and the learning-rate schedules, against direct formulas."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.config import TrainConfig
from qklab.train.optim import build_optimizer, schedule_factor, set_lr
from tests.conftest import tiny_gpt


def test_warmup_then_cosine_to_min():
    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert [schedule_factor(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert schedule_factor(9, cfg) == pytest.approx(1.0)
    assert schedule_factor(10, cfg) == pytest.approx(1.0)
    mid = 10 + 99 / 2
    want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 99))
    assert schedule_factor(int(mid), cfg) == pytest.approx(want)
    assert schedule_factor(109, cfg) == pytest.approx(0.1)


def test_warmup_then_constant():
    cfg = TrainConfig(steps=50, warmup_steps=4, schedule="constant")
    assert [schedule_factor(s, cfg) for s in (0, 3, 4, 49)] == pytest.approx([0.25, 1.0, 1.0, 1.0])


def test_adamw_groups_cover_every_parameter_once():
    model = tiny_gpt("qknorm")
    (opt,) = build_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-3, weight_decay=0.1))
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert wd == {"decay": 0.1, "no_decay": 0.0}
    no_decay = next(g for g in opt.param_groups if g["name"] == "no_decay")
    assert all(p.ndim == 1 for p in no_decay["params"])  # norms and QK-Norm gains


def test_muon_takes_hidden_matrices_adamw_the_rest():
    model = tiny_gpt("qknorm")
    muon, adam = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02, adam_lr=3e-3))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adam, torch.optim.AdamW)
    muon_names = set(muon.param_groups[0]["param_names"])
    assert "blocks.0.attn.wq.weight" in muon_names and "blocks.1.mlp.w2.weight" in muon_names
    assert all(n.startswith("blocks.") for n in muon_names)
    adam_names = {n for g in adam.param_groups for n in g["param_names"]}
    assert "tok_emb.weight" in adam_names and "blocks.0.attn.qk.q_norm.weight" in adam_names
    assert muon_names.isdisjoint(adam_names)
    assert len(muon_names) + len(adam_names) == len(list(model.parameters()))
    set_lr([muon, adam], 0.5)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.01)
    assert [g["lr"] for g in adam.param_groups] == pytest.approx([1.5e-3] * len(adam.param_groups))


def test_adamw_update_matches_direct_formula():
    """One step of our AdamW on a parameter equals the textbook update."""
    model = tiny_gpt()
    (opt,) = build_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95))
    w = model.blocks[0].attn.wq.weight
    w0 = w.detach().clone()
    g = torch.randn_like(w)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w.grad = g.clone()
    opt.step()
    m, v = 0.1 * g, 0.05 * g * g
    want = w0 * (1 - 1e-2 * 0.1) - 1e-2 * (m / 0.1) / ((v / 0.05).sqrt() + 1e-8)
    torch.testing.assert_close(w.detach(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_qkmap_parameters_get_their_own_group(optimizer):
    """log_freq and log_temp: one AdamW group, no weight decay, map_lr_scale times the AdamW rate."""
    from qklab.config import ModelConfig, QKConfig
    from qklab.methods.qkmap import QKMapOptions
    from qklab.model import GPT

    model = GPT(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
                QKConfig(method="qkmap", options={"qkmap": QKMapOptions(map_lr_scale=4.0)}))
    opts = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=0.02, adam_lr=1e-3, weight_decay=0.1))
    groups = {g["name"]: g for o in opts for g in o.param_groups}
    own = groups["qk_map"]
    want = {n for n, _ in model.named_parameters() if n.endswith(("qk.log_freq", "qk.log_temp"))}
    assert set(own["param_names"]) == want and len(want) == 4
    adam_lr = 0.02 if optimizer == "adamw" else 1e-3
    assert own["weight_decay"] == 0.0 and own["lr"] == pytest.approx(4.0 * adam_lr)
    others = {n for name, g in groups.items() if name != "qk_map" for n in g["param_names"]}
    assert others.isdisjoint(want) and len(others) + len(want) == len(list(model.parameters()))
    # one step with zero gradients: decayed matrices shrink, the map's parameters stay put (no decay)
    lt0, wq0 = model.blocks[0].attn.qk.log_temp.detach().clone(), model.blocks[0].attn.wq.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for o in opts:
        o.step()
    assert torch.equal(model.blocks[0].attn.qk.log_temp, lt0)
    assert not torch.equal(model.blocks[0].attn.wq.weight, wq0)
    # schedule: the group keeps its multiplier
    set_lr(opts, 0.5)
    assert own["lr"] == pytest.approx(0.5 * 4.0 * adam_lr)


# --- per-head Muon (train.muon_per_head) -------------------------------------------------------------


def _mla_gpt():
    from qklab.config import ModelConfig, QKConfig
    from qklab.model import GPT

    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, attention="mla",
                      q_rank=24, kv_rank=16, nope_dim=8, rope_dim=8, v_dim=8)
    return GPT(cfg, QKConfig()).eval()


def _per_head_names(mla: bool, which: str) -> dict[str, int]:
    """Suffix of each per-head matrix -> its number of heads (tiny_gpt: 4 heads; GQA: 2 KV heads)."""
    if mla:
        return {"wuq": 4, "wuk": 4, "wqr": 4, **({"wuv": 4} if which == "qkv" else {})}
    return {"wq": 4, "wk": 2, **({"wv": 2} if which == "qkv" else {})}


def _steps_against_torch_blocks(model, cfg: TrainConfig, blocks: dict[str, int]) -> int:
    """Two steps of qklab's Muon under ``cfg`` against a torch.optim.Muon per block: a matrix whose kind is in
    ``blocks`` (suffix -> number of blocks) is split into that many row blocks, each its own parameter (its
    own shape, so its own match_rms_adamw rate); every other matrix is one parameter and must match bit for
    bit. Returns the number of matrices split."""
    lr, wd = cfg.lr, cfg.weight_decay
    muon, _ = build_optimizer(model, cfg)
    names = muon.param_groups[0]["param_names"]
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(2)]
    refs: dict[str, list[torch.nn.Parameter]] = {}
    ref_opts = []
    for n in names:
        kind = n.split(".")[-2]
        refs[n] = [torch.nn.Parameter(b.clone()) for b in w0[n].chunk(blocks.get(kind, 1))]
        ref_opts.append(torch.optim.Muon(refs[n], lr=lr, weight_decay=wd, momentum=0.95,
                                         adjust_lr_fn="match_rms_adamw"))
    params = dict(model.named_parameters())
    for g in grads:
        for n in names:
            params[n].grad = g[n].clone()
            for b, gb in zip(refs[n], g[n].chunk(len(refs[n])), strict=True):
                b.grad = gb.clone()
        muon.step()
        for o in ref_opts:
            o.step()
    split = 0
    for n in names:
        want = torch.cat([b.detach() for b in refs[n]])
        if len(refs[n]) > 1:
            split += 1
            torch.testing.assert_close(params[n].detach(), want, atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert torch.equal(params[n].detach(), want), n
    return split


@pytest.mark.parametrize("mla, which", [(False, "qk"), (False, "qkv"), (True, "qkv")])
def test_per_head_muon_equals_torch_muon_on_each_head_slice(mla, which):
    """Two steps of the per-head Muon: every head's block of W_Q, W_K (W_V) equals a torch.optim.Muon built
    on that block alone (its own shape, so its own match_rms_adamw rate); every other matrix equals torch's
    Muon on the whole matrix, bit for bit."""
    model = _mla_gpt() if mla else tiny_gpt(n_kv_heads=2)
    heads = _per_head_names(mla, which)
    cfg = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_per_head=which)
    assert _steps_against_torch_blocks(model, cfg, heads) == 2 * len(heads)  # every per-head matrix, both layers


# --- Group Muon (train.muon_head_groups) -------------------------------------------------------------


@pytest.mark.parametrize("mla, groups, blocks", [
    (False, 2, {"wq": 2, "wk": 2, "wv": 2}),  # 4 query heads in 2 groups; 2 KV heads, one a group
    (False, 4, {"wq": 4, "wk": 2, "wv": 2}),  # past the KV heads: a KV group is one KV head
    (True, 2, {"wuq": 2, "wuk": 2, "wqr": 2, "wuv": 2}),
])
def test_group_muon_equals_torch_muon_on_each_group(mla, groups, blocks):
    """Newton-Schulz over g groups of adjacent heads: each group's row block of a matrix equals a torch Muon
    on that block alone (rate matched on the group's shape), the other matrices torch's Muon whole."""
    model = _mla_gpt() if mla else tiny_gpt(n_kv_heads=2)
    cfg = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_per_head="qkv", muon_head_groups=groups)
    assert _steps_against_torch_blocks(model, cfg, blocks) == 2 * len(blocks)


def _muon_steps(cfg: TrainConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = tiny_gpt()
    muon, _ = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        muon.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("groups, same_as", [(1, "none"), (4, "qk")])
def test_group_muon_ends_are_packed_and_per_head_bit_for_bit(groups, same_as):
    """g = 1 is Muon on the whole matrix and g = H (4 heads) the per-head Muon, bit for bit."""
    got = _muon_steps(TrainConfig(optimizer="muon", lr=0.02, muon_per_head="qk", muon_head_groups=groups))
    want = _muon_steps(TrainConfig(optimizer="muon", lr=0.02, muon_per_head=same_as))
    assert all(torch.equal(got[n], want[n]) for n in want)
    other = _muon_steps(TrainConfig(optimizer="muon", lr=0.02, muon_per_head="qk", muon_head_groups=2))
    assert not torch.equal(other["blocks.0.attn.wq.weight"], want["blocks.0.attn.wq.weight"])


def test_group_muon_config_rules():
    from qklab.config import ConfigError, load_config

    assert load_config("tiny", ["train.muon_per_head=qk", "train.muon_head_groups=2"]).train.muon_head_groups == 2
    with pytest.raises(ConfigError, match="set train.muon_per_head=qk or qkv"):
        load_config("tiny", ["train.muon_head_groups=2"])
    with pytest.raises(ConfigError, match="does not divide model.n_heads"):
        load_config("tiny", ["train.muon_per_head=qk", "train.muon_head_groups=3"])
    with pytest.raises(ConfigError, match="KV heads"):  # 6 query heads in 2 groups, but 3 KV heads do not split in 2
        load_config("tiny", ["model.d_model=96", "model.n_heads=6", "model.n_kv_heads=3",
                             "train.muon_per_head=qk", "train.muon_head_groups=2"])


def test_per_head_muon_default_is_torch_muon():
    model = tiny_gpt()
    muon, _ = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    assert type(muon) is torch.optim.Muon and "head_rows" not in muon.param_groups[0]
    muon, _ = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02, muon_per_head="qk"))
    rows = dict(zip(muon.param_groups[0]["param_names"], muon.param_groups[0]["head_rows"], strict=True))
    assert rows["blocks.0.attn.wq.weight"] == 16 and rows["blocks.0.attn.wk.weight"] == 16
    assert rows["blocks.0.attn.wv.weight"] == 0 and rows["blocks.1.mlp.w2.weight"] == 0


def test_per_head_muon_rate_is_adjusted_on_the_head_shape():
    """The documented rate: head h of a (H rows, C) matrix steps by -0.2 lr sqrt(max(rows, C)) NS(M_h),
    NS torch's Newton-Schulz of the head's Nesterov momentum. MLA's W_uk (4 heads x 8 rows, 16 columns)
    therefore steps at sqrt(16 / 32) of the packed matrix's rate 0.2 lr sqrt(max(32, 16))."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    model = _mla_gpt()
    lr = 0.02
    muon, _ = build_optimizer(model, TrainConfig(optimizer="muon", lr=lr, weight_decay=0.0, muon_per_head="qk"))
    w = model.blocks[0].attn.wuk.weight
    w0 = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.randn_like(w)
    w.grad = g.clone()
    muon.step()
    nesterov = g.lerp(0.05 * g, 0.95)  # momentum buffer (1 - 0.95) g after one step, then the Nesterov mix
    for h in range(4):
        o = _zeropower_via_newtonschulz(nesterov[h * 8 : (h + 1) * 8], (3.4445, -4.7750, 2.0315), 5, 1e-7)
        want = w0[h * 8 : (h + 1) * 8] - 0.2 * lr * math.sqrt(16) * o.float()
        torch.testing.assert_close(w[h * 8 : (h + 1) * 8].detach(), want, atol=1e-6, rtol=1e-5)
    assert math.sqrt(16) / math.sqrt(max(32, 16)) == pytest.approx(1 / math.sqrt(2))


def test_per_head_muon_config_key():
    from qklab.config import ConfigError, load_config

    assert load_config("tiny", []).train.muon_per_head == "none"
    assert load_config("tiny", ["train.muon_per_head=qkv"]).train.muon_per_head == "qkv"
    with pytest.raises(ConfigError, match="muon_per_head"):
        load_config("tiny", ["train.muon_per_head=heads"])
