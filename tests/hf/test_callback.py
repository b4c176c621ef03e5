"""QKCallback under transformers' Trainer: tiny Llama and Qwen3 models train 5 steps with QuacK and QK-clip,
and every head's weights end where a plain loop with the controller written out here puts them; the log
records hold scalars that TensorBoard and W&B read back, the per-head arrays go to qk_heads.jsonl, max logits
are measured on the logged steps only, and remove() leaves the model as it was."""

from __future__ import annotations

import copy
import glob
import json
import logging
import math
import struct
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import qklab.hf  # noqa: E402
from qklab.hf.callback import QKCallback  # noqa: E402
from tests.hf.common import HKV, H, assert_same, snapshot, tiny_model  # noqa: E402

STEPS, LR, N, T = 5, 0.05, 4, 16
D = 64 // H


def _data():
    ids = torch.randint(3, 101, (N, T), generator=torch.Generator().manual_seed(3))
    return ids, [{"input_ids": r, "labels": r} for r in ids]


def _trainer(model, callback, tmp_path, report_to="none", logging_steps=1, lr=LR, callbacks=()):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=N,
                             learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             max_grad_norm=0.0, optim="sgd", logging_steps=logging_steps, save_strategy="no",
                             report_to=report_to, use_cpu=True, seed=0, disable_tqdm=True)
    callbacks = [cb for cb in (callback, *callbacks) if cb is not None]
    return Trainer(model=model, args=args, train_dataset=_data()[1], callbacks=callbacks)


def _train(model, callback, tmp_path, **kw):
    trainer = _trainer(model, callback, tmp_path, **kw)
    trainer.train()
    model.trainer = trainer
    return model


def _heads_file(tmp_path):
    """The records of qk_heads.jsonl, in order."""
    with open(tmp_path / "qk_heads.jsonl") as f:
        return [json.loads(line) for line in f]


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
    # the factors QuacK wrote per head are the written-out ones (last step); the log has their range
    logged = _heads_file(tmp_path)[-1]["quack_wq"]
    torch.testing.assert_close(torch.tensor(logged), torch.stack(factors[-1]), atol=1e-4, rtol=1e-4)
    spread = [max(layer) - min(layer) for layer in logged]
    assert max(spread) > 2e-3, spread  # per-head factors differ by far more than the tolerance
    flat = torch.stack(factors[-1]).detach().flatten()
    rec = cb.history[-1]
    got = (rec["qk/quack_wq/min"], rec["qk/quack_wq/max"], rec["qk/quack_wq/mean"])
    assert got == pytest.approx((flat.min().item(), flat.max().item(), flat.mean().item()), abs=1e-4)


@torch.no_grad()
def _head_max(a, x, cos, sin):
    """Per head: max causal logit of attention layer a on its input x (B, T, C), written out."""
    B = x.shape[0]
    q = a.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = a.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    s = q @ k.repeat_interleave(H // HKV, 1).transpose(-2, -1) * D**-0.5
    return s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


def _max_logits(m, captured):
    """Per layer, per head: max causal logit of the forward just run, from the captured attention inputs."""
    out = [_head_max(a, x, cos, sin) for a, (x, (cos, sin)) in zip(_attns(m), list(captured), strict=True)]
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
    # per-head max logits written at each step are the written-out ones, each layer's max logged; clip counts agree
    assert [r["step"] for r in cb.history] == [r["step"] for r in _heads_file(tmp_path)] == list(range(1, STEPS + 1))
    for step, (rec, heads) in enumerate(zip(cb.history, _heads_file(tmp_path), strict=True)):
        for i in range(2):
            torch.testing.assert_close(torch.tensor(heads["max_logit"][i]), seen[step][i], atol=1e-4, rtol=1e-4)
            assert rec[f"qk/max_logit/layer{i}"] == pytest.approx(seen[step][i].max().item(), abs=1e-4)
        assert rec["qk/qkclip_heads_clipped"] == clipped[step]
    logged = [r for r in got.trainer.state.log_history if "loss" in r]  # the Trainer's own records have them too
    assert len(logged) == STEPS and logged[0]["qk/max_logit/layer0"] == cb.history[0]["qk/max_logit/layer0"]


def test_qkclip_is_refused_on_qwen3_qk_norm(tmp_path):
    """Qwen3's QK-Norm makes logits independent of the scale of W_Q, W_K: clipping them would do nothing."""
    with pytest.raises(ValueError, match="(?i)qk-norm|qknorm"):
        _train(tiny_model("qwen3"), QKCallback("qkclip", tau_clip=1.0), tmp_path)


def _expected_scalars(heads: dict) -> dict[str, float]:
    """The qk/ scalars one qk_heads.jsonl record implies, written out with torch: per-layer and overall max of
    the max logits, min/max/mean of every other array, and every head's value."""
    out = {}
    for name, rows in heads.items():
        if name == "step":
            continue
        t = torch.tensor(rows, dtype=torch.float64)  # (layers, heads)
        if name == "max_logit":
            out["qk/max_logit"] = t.max().item()
            out.update({f"qk/max_logit/layer{i}": v for i, v in enumerate(t.amax(dim=1).tolist())})
        else:
            out.update({f"qk/{name}/min": t.min().item(), f"qk/{name}/max": t.max().item(),
                        f"qk/{name}/mean": t.mean().item()})
        out.update({f"qk/{name}/layer{i}/head{j}": v for i, row in enumerate(t.tolist()) for j, v in enumerate(row)})
    if "quack_wq" in heads:  # QuacK's own scalars: the range of its factors over both matrices
        both = [x for k in ("quack_wq", "quack_wk") for h in heads[k] for x in h]
        out.update({"qk/quack_factor_min": min(both), "qk/quack_factor_max": max(both)})
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_tensorboard_reads_back_every_qk_scalar(tmp_path):
    """A real Trainer with report_to=["tensorboard"]: every qk key of every record is in the event file at its
    step, with the value the per-head arrays of qk_heads.jsonl imply; TensorBoard drops nothing, no record
    holds a non-finite value, and the end-of-training summary adds no qk record."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        cb = QKCallback("quack", tau=0.5, per_head=True)
        model = _train(tiny_model("llama"), cb, tmp_path, report_to=["tensorboard"])
        logging.getLogger("transformers.integrations.integration_utils").warning("probe")  # the handler hears them
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert records.messages[-1] == "probe"
    assert not [m for m in records.messages if "dropped" in m or "attempting to log" in m], records.messages
    (path,) = glob.glob(str(tmp_path / "**" / "events.out.tfevents*"), recursive=True)
    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    tb = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    heads = _heads_file(tmp_path)
    assert [h["step"] for h in heads] == [r["step"] for r in cb.history] == list(range(1, STEPS + 1))
    for rec, h in zip(cb.history, heads, strict=True):
        want = _expected_scalars(h)
        assert set(rec) - {"step"} == set(want)
        assert len(want) == 2 * (4 + 2 + 4 + 2 + 4) + 4 * 3 + 3 + 2  # heads of wq, wk, their updates, max logit;
        # min/max/mean of the four QuacK arrays; the max logit of each layer and overall; QuacK's factor range
        for key, value in want.items():
            assert tb[f"train/{key}"][rec["step"]] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    qk_tags = {t for t in tb if t.startswith("train/qk/")}
    assert qk_tags == {f"train/{k}" for r in cb.history for k in r if k != "step"}
    assert all(len(tb[t]) == STEPS and all(math.isfinite(v) for v in tb[t].values()) for t in qk_tags)
    summary = model.trainer.state.log_history[-1]
    assert "train_runtime" in summary and not [k for k in summary if k.startswith("qk/")]


def _wandb_records(path):
    """The payloads of a W&B run file: a 7-byte file header (":W&B", magic 0xBEE1, version), then LevelDB-log
    records in 32 KiB blocks, each a 7-byte header (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last) and its bytes; a block's tail shorter than a header is padding."""
    with open(path, "rb") as f:
        raw = f.read()
    ident, magic, _ = struct.unpack("<4sHB", raw[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, parts = 7, []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += 32768 - pos % 32768
            continue
        parts.append(raw[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            yield b"".join(parts)
            parts = []


def wait_for_file(cond, timeout: float = 60.0):
    """``cond()`` once it is truthy: a file another process is still closing (at most ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < end, "W&B's run file did not end with its exit record"
        time.sleep(0.2)
    return got


def test_wandb_offline_history_holds_the_qk_scalars(tmp_path, monkeypatch):
    """report_to=["wandb"] in offline mode: the run's history records (read from its .wandb file) hold every
    qk scalar of every step, with the callback's values."""
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_PROJECT": "qklab-test"}.items():
        monkeypatch.setenv(k, v)
    cb = QKCallback("quack", tau=0.5)
    _train(tiny_model("llama"), cb, tmp_path / "out", report_to=["wandb"])
    wandb.finish()
    wandb.teardown()  # stops W&B's service process: the run file is complete only once it has closed it
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))

    def records():
        out = []
        for data in _wandb_records(path):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            out.append(rec)
        return out

    recs = wait_for_file(lambda: (r := records()) and r[-1].WhichOneof("record_type") == "exit" and r)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in recs if r.WhichOneof("record_type") == "history"]
    by_step = {int(r["train/global_step"]): r for r in history if "train/qk/max_logit" in r}
    assert sorted(by_step) == [r["step"] for r in cb.history] == list(range(1, STEPS + 1))
    for rec in cb.history:
        got = by_step[rec["step"]]
        for key, value in rec.items():
            if key != "step":
                assert got[f"train/{key}"] == pytest.approx(value, rel=1e-6), key


def test_monitoring_measures_the_logged_steps_only(tmp_path):
    """QKCallback("none") with logging_steps=2 over 5 steps: steps 2 and 4 run qklab's attention and their
    records hold the max logits of their forwards (written out from the layer inputs at the time); steps 1, 3
    and 5 run the model's own SDPA; the last record (step 5, the summary) has no max-logit key, never -inf."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    impls, ref = [], []

    def look(mod, args, kw):
        if mod.training:
            impls.append(mod.config._attn_implementation)
            ref.append(_head_max(mod, kw["hidden_states"].detach(), *kw["position_embeddings"]))

    hooks = [a.register_forward_pre_hook(look, with_kwargs=True) for a in _attns(model)]
    cb = QKCallback("none")
    _train(model, cb, tmp_path, logging_steps=2)
    for h in hooks:
        h.remove()
    per_step = [impls[2 * i] for i in range(STEPS)]
    assert impls == [i for i in per_step for _ in range(2)]
    assert per_step == ["sdpa", "qklab", "sdpa", "qklab", "sdpa"]
    assert model.config._attn_implementation == "sdpa"
    heads = _heads_file(tmp_path)
    assert [h["step"] for h in heads] == [r["step"] for r in cb.history] == [2, 4]
    for h, rec in zip(heads, cb.history, strict=True):
        want = torch.stack(ref[2 * (h["step"] - 1): 2 * h["step"]])  # (layers, heads) of that step's forward
        torch.testing.assert_close(torch.tensor(h["max_logit"]), want, atol=1e-5, rtol=1e-5)
        assert rec["qk/max_logit"] == pytest.approx(want.max().item(), abs=1e-5)
    last = model.trainer.state.log_history[-1]
    assert last["step"] == 5 and not [k for k in last if k.startswith("qk/")]


def test_callback_remove_restores_the_model_exactly(tmp_path):
    """After train() at lr 0 (the weights stay) the model is what the same Trainer leaves without the callback
    (accelerate marks a model it prepared): its own attention implementation, attributes and hooks; and its
    logits are the untouched model's bit for bit."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    untouched, plain = copy.deepcopy(model), copy.deepcopy(model)
    cb = QKCallback("quack", tau=0.5)
    _trainer(model, cb, tmp_path / "qk", lr=0.0).train()
    _trainer(plain, None, tmp_path / "plain", lr=0.0).train()
    assert cb.attached.removed and cb.history  # it did attach, and log
    assert_same(snapshot(model), snapshot(plain))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(_data()[0]).logits, untouched(_data()[0]).logits)


class _Interrupt(transformers.TrainerCallback):
    def __init__(self):
        self.armed = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == 2:
            self.armed = False
            raise KeyboardInterrupt


def test_train_again_after_an_interrupt_replaces_the_callbacks_own_handle(tmp_path):
    """An interrupted train() leaves the callback's handle live; train() again replaces it (one controller,
    not two), while a live handle of someone else's on the model is refused in one line."""
    model = tiny_model("llama")
    cb = QKCallback("qk_lr_multiplier", tau=0.1)
    trainer = _trainer(model, cb, tmp_path, callbacks=[_Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    first = cb.attached
    assert not first.removed and qklab.hf.Attached.of(model) is first
    trainer.train()
    assert first.removed and cb.attached is not first and cb.attached.removed
    other = qklab.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "quack")
    with pytest.raises(ValueError, match=r"this model \(LlamaForCausalLM\) already has a live qklab handle, "
                                         r"<qklab handle: quack"):
        trainer.train()
    other.remove()
