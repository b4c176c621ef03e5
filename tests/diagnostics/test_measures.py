"""Per-head measurements against hand-built attention: sinks, uniform heads, logit change, weight norms."""

from __future__ import annotations

import math

import pytest
import torch

from qklab.diagnostics import AttentionMonitor, qk_weight_norms, snapshot
from qklab.train.evaluate import max_attention_logits
from tests.conftest import tiny_gpt
from tests.diagnostics.handbuilt import sink_model


def _bos_batch(vocab: int = 32, B: int = 3, T: int = 40) -> torch.Tensor:
    x = torch.randint(1, vocab, (B, T))
    x[:, 0] = 0
    return x


def test_head_attending_only_to_position_0_is_a_sink():
    model = sink_model()
    heads = snapshot(model, _bos_batch()).heads
    torch.testing.assert_close(heads["first_token"], torch.ones(2, 2), atol=1e-6, rtol=0)
    assert AttentionMonitor(_bos_batch()).measure(model, 0)["sink_rate"] == 1.0
    assert heads["entropy"].abs().max() < 1e-4  # all mass on one key
    # all mass at distance i from query i: the mean over queries 1..T-1 is T / 2
    torch.testing.assert_close(heads["distance"], torch.full((2, 2), 40 / 2), atol=1e-3, rtol=0)


def test_uniform_heads_give_the_closed_forms():
    model = sink_model()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wq.weight.zero_()  # all logits 0: uniform over the i + 1 visible keys
    T = 40
    rec = AttentionMonitor(_bos_batch(T=T)).measure(model, 0)
    first = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    ent = sum(math.log(i + 1) for i in range(1, T)) / (T - 1)
    assert sum(rec["first_token"], []) == pytest.approx([first] * 4, rel=1e-5)
    assert sum(rec["entropy"], []) == pytest.approx([ent] * 4, rel=1e-5)
    dist = sum(i / 2 for i in range(1, T)) / (T - 1)  # query i spreads evenly over distances 0..i
    assert sum(rec["distance"], []) == pytest.approx([dist] * 4, rel=1e-5)
    assert rec["distance_baseline"] == pytest.approx(dist) and rec["distance_mean"] == pytest.approx(dist, rel=1e-5)
    assert rec["sink_rate"] == 0.0 and rec["max_logit_max"] == 0.0


def test_max_logit_matches_the_evaluation_helper():
    model = tiny_gpt("softcap", n_kv_heads=2)
    x = torch.randint(0, 97, (2, 30))
    torch.testing.assert_close(snapshot(model, x).heads["max_logit"], max_attention_logits(model, x))


def test_logit_change_is_zero_without_a_step_and_positive_after_one():
    model = tiny_gpt("none")
    mon = AttentionMonitor(torch.randint(0, 97, (2, 24)))
    mon.measure(model, 10)
    same = mon.measure(model, 20)  # steps "taken" by the counter, but the weights did not move
    assert same["logit_change_mean"] == 0.0 and all(v == 0.0 for row in same["logit_change"] for v in row)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randint(0, 97, (2, 24))
    model.train()
    model(x, targets=x)[1].backward()
    opt.step()
    moved = mon.measure(model, 21)
    assert moved["logit_change_mean"] > 0.0
    assert "logit_change" not in AttentionMonitor(mon.x).measure(model, 0)  # no previous evaluation yet


def test_gqa_weight_norms_follow_the_kv_groups():
    model = tiny_gpt("none", n_kv_heads=2)  # 4 query heads, 2 KV heads
    a = model.blocks[0].attn
    nq, nk = qk_weight_norms(a)
    D = a.head_dim
    assert nq[1].item() == pytest.approx(a.wq.weight[D : 2 * D].norm().item(), rel=1e-6)
    assert nk.tolist() == pytest.approx([a.wk.weight[:D].norm().item()] * 2 + [a.wk.weight[D:].norm().item()] * 2)


def test_measuring_restores_training_mode_and_leaves_no_capture():
    model = tiny_gpt("none").train()
    AttentionMonitor(torch.randint(0, 97, (1, 8))).measure(model, 0)
    assert model.training and all(b.attn.capture is None for b in model.blocks)


@pytest.mark.parametrize("q_rank", [0, 16])
def test_mla_weight_norms_are_the_norms_of_the_logit_path_maps(q_rank):
    pytest.importorskip("qklab.model.mla")
    from qklab.config import ModelConfig, QKConfig
    from qklab.model import GPT

    model = GPT(ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=4, max_seq_len=64, attention="mla",
                            q_rank=q_rank), QKConfig()).eval()
    a = model.blocks[0].attn
    eye = torch.eye(32)  # rows: unit inputs; so each map's matrix is read column by column
    with torch.no_grad():
        cq = a.wdq(eye) if a.wdq is not None else eye
        wq = torch.cat([a.wuq(cq).view(32, 4, -1), a.wqr(cq).view(32, 4, -1)], dim=-1)  # (C, H, F)
        wk_nope = a.wuk(a.wdkv(eye)).view(32, 4, -1)  # (C, H, nope), latent RMSNorm left out
        want_k = (wk_nope.pow(2).sum(dim=(0, 2)) + a.wkr.weight.pow(2).sum()).sqrt()
    nq, nk = qk_weight_norms(a)
    torch.testing.assert_close(nq, wq.pow(2).sum(dim=(0, 2)).sqrt())
    torch.testing.assert_close(nk, want_k)
    heads = snapshot(model, torch.randint(0, 97, (2, 16))).heads  # the materialised path fills the capture
    assert heads["first_token"].shape == (1, 4) and torch.isfinite(heads["wq_norm"]).all()
