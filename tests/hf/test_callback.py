"""QKCallback under transformers' Trainer: tiny Llama and Qwen3 models train 5 steps with QuacK and QK-clip,
and every head's weights end where a plain loop with the controller written out here puts them."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from qklab.hf.callback import QKCallback  # noqa: E402
from tests.hf.common import HKV, H, tiny_model  # noqa: E402

STEPS, LR, N, T = 5, 0.05, 4, 16
D = 64 // H


def _data():
    ids = torch.randint(3, 101, (N, T), generator=torch.Generator().manual_seed(3))
    return ids, [{"input_ids": r, "labels": r} for r in ids]


def _train(model, callback, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=N,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             max_grad_norm=0.0, optim="sgd", logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_data()[1], callbacks=[callback])
    trainer.train()
    model.trainer = trainer
    return model


def _heads(w, n):
    return w.view(n, -1, w.shape[-1])  # (n, D, C)


def _reference(model, before_step, after_step):
    """SGD on the full batch, the controller's hooks around each step (all by hand)."""
    ids = _data()[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for step in range(STEPS):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        state = before_step(model, step)
        opt.step()
        with torch.no_grad():
            after_step(model, step, state)
    return model


def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quack_callback_matches_per_head_reference(family, tmp_path):
    tau = 0.3
    model = tiny_model(family)
    with torch.no_grad():  # small keys: their norms move fast, so the query factors move per head
        for a in _attns(model):
            a.k_proj.weight.mul_(0.05)
    ref, plain, start = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    norms = lambda a: (_heads(a.q_proj.weight, H).flatten(1).norm(dim=1),  # noqa: E731
                       _heads(a.k_proj.weight, HKV).flatten(1).norm(dim=1))
    init = [norms(a) for a in _attns(ref)]
    factors = []

    def before(m, step):
        snap = []
        for a, (q0, k0) in zip(_attns(m), init, strict=True):
            q, k = norms(a)
            fq = tau * (k0 / k).repeat_interleave(H // HKV)  # 1/||W_K^g(h)|| relative to init
            fk = tau * q0.view(HKV, -1).amax(1) / q.view(HKV, -1).amax(1)  # 1/max_h ||W_Q^h||
            snap.append((a.q_proj.weight.detach().clone(), a.k_proj.weight.detach().clone(), fq, fk))
        factors.append([s[2] for s in snap])
        return snap

    def after(m, step, snap):
        for a, (wq, wk, fq, fk) in zip(_attns(m), snap, strict=True):
            _heads(a.q_proj.weight, H).copy_(_heads(wq, H) + fq.view(-1, 1, 1) * _heads(a.q_proj.weight - wq, H))
            _heads(a.k_proj.weight, HKV).copy_(_heads(wk, HKV) + fk.view(-1, 1, 1)
                                               * _heads(a.k_proj.weight - wk, HKV))

    _reference(ref, before, after)
    _reference(plain, lambda m, s: None, lambda m, s, st: None)
    cb = QKCallback("quack", tau=tau)
    got = _train(model, cb, tmp_path)
    for a, b, c, d in zip(_attns(got), _attns(ref), _attns(plain), _attns(start), strict=True):
        for name in ("q_proj", "k_proj"):
            w, wr = getattr(a, name).weight.detach(), getattr(b, name).weight.detach()
            w_plain, w0 = getattr(c, name).weight.detach(), getattr(d, name).weight.detach()
            torch.testing.assert_close(w, wr, atol=1e-6, rtol=1e-4)
            assert (w - w_plain).norm() > 0.5 * (w_plain - w0).norm()  # QuacK changed the steps (x0.3)
    # the factors QuacK logged per head are the written-out ones (last step)
    logged = cb.history[-1]["qk/quack_wq"]
    torch.testing.assert_close(torch.tensor(logged), torch.stack(factors[-1]), atol=1e-4, rtol=1e-4)
    spread = [max(layer) - min(layer) for layer in logged]
    assert max(spread) > 2e-3, spread  # per-head factors differ by far more than the tolerance


@torch.no_grad()
def _max_logits(m, captured):
    """Per layer, per head: max causal logit of the forward just run, from the captured attention inputs."""
    out = []
    for a, (x, (cos, sin)) in zip(_attns(m), list(captured), strict=True):
        B = x.shape[0]
        q = a.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        s = q @ k.repeat_interleave(H // HKV, 1).transpose(-2, -1) * D**-0.5
        out.append(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3)))
    captured.clear()
    return out


def test_qkclip_callback_matches_per_head_reference(tmp_path):
    model = tiny_model("llama")
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    captured = []
    for a in _attns(ref):
        a.register_forward_pre_hook(lambda mod, args, kw: captured.append(
            (kw["hidden_states"].detach(), kw["position_embeddings"])), with_kwargs=True)
    ids = _data()[0]
    with torch.no_grad():
        ref(ids)
        s_init = _max_logits(ref, captured)
    tau = float(torch.cat(s_init).median())
    seen, clipped = [], []

    def before(m, step):
        s = _max_logits(m, captured)  # the training forward of this step
        seen.append(s)
        return s

    def after(m, step, smax):
        n = 0
        for a, s in zip(_attns(m), smax, strict=True):
            g = torch.where(s > tau, tau / s, torch.ones_like(s))
            gk = g.view(HKV, -1).amin(1)
            _heads(a.q_proj.weight, H).mul_(g.sqrt().view(-1, 1, 1))
            _heads(a.k_proj.weight, HKV).mul_(gk.sqrt().view(-1, 1, 1))
            n += int((g < 1).sum())
        clipped.append(n)

    captured.clear()
    _reference(ref, before, after)
    _reference(plain, lambda m, s: captured.clear(), lambda m, s, st: None)
    cb = QKCallback("qkclip", tau_clip=tau)
    got = _train(model, cb, tmp_path)
    assert 0 < clipped[0] < 2 * H  # some heads clipped, not all
    for a, b, c in zip(_attns(got), _attns(ref), _attns(plain), strict=True):
        for name in ("q_proj", "k_proj"):
            w, wr = getattr(a, name).weight.detach(), getattr(b, name).weight.detach()
            torch.testing.assert_close(w, wr, atol=2e-5, rtol=1e-4)
            assert (w - getattr(c, name).weight).abs().max() > 1e-3
    # per-head max logits logged at each step are the written-out ones; clip counts agree
    for step, rec in enumerate(cb.history[:STEPS]):
        for i in range(2):
            torch.testing.assert_close(torch.tensor(rec[f"qk/max_logit/layer{i}"]), seen[step][i], atol=1e-4,
                                       rtol=1e-4)
        assert rec["qk/qkclip_heads_clipped"] == clipped[step]
    logged = [r for r in got.trainer.state.log_history if "loss" in r]  # the Trainer's own records have them too
    assert len(logged) == STEPS and logged[0]["qk/max_logit/layer0"] == cb.history[0]["qk/max_logit/layer0"]


def test_qkclip_is_refused_on_qwen3_qk_norm(tmp_path):
    """Qwen3's QK-Norm makes logits independent of the scale of W_Q, W_K: clipping them would do nothing."""
    with pytest.raises(ValueError, match="(?i)qk-norm|qknorm"):
        _train(tiny_model("qwen3"), QKCallback("qkclip", tau_clip=1.0), tmp_path)
