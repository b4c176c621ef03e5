"""QK-Guard in a transformers model: applied, its trigger run by ``qklab.attach`` (any controller, here
"none"), the switches in the handle's metrics, a switched head's logits bounded by sqrt(D), and the state
kept through save_pretrained -> from_pretrained."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import qklab  # noqa: E402
import qklab.hf  # noqa: E402
from qklab.methods.qkguard import QKGuard  # noqa: E402
from tests.hf.common import tiny_model  # noqa: E402


def _guards(model) -> list[QKGuard]:
    return [m for m in model.modules() if isinstance(m, QKGuard)]


def test_attach_runs_the_trigger_and_the_state_survives_a_round_trip(tmp_path):
    model = tiny_model("llama")
    qklab.hf.apply(model, "qkguard", threshold=2.0)
    model.train()
    seen: list[tuple[int, torch.Tensor]] = []
    step_end = QKGuard.step_end

    def spy(self, max_logit, step):  # the maxima the trigger gets, and where they came from
        seen.append((step, max_logit.clone()))
        step_end(self, max_logit, step)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    handle = qklab.attach(model, opt, "none")
    x = torch.randint(0, model.config.vocab_size, (4, 24))
    QKGuard.step_end = spy
    try:
        for _ in range(12):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        QKGuard.step_end = step_end
    guards = _guards(model)
    assert len(seen) == 12 * len(guards) and [s for s, _ in seen[:: len(guards)]] == list(range(12))
    since = handle.metrics()["qkguard_since"]
    assert since == [g.since.tolist() for g in guards]
    assert any(s >= 0 for layer in since for s in layer)  # some head switched
    for i, g in enumerate(guards):  # each switch follows the first step whose maxima passed the threshold
        group = g.group
        for h, s in enumerate(g.since.tolist()):
            steps = [st for st, m in seen[i :: len(guards)] if m.view(-1, group)[h].max() > 2.0]
            assert s == (steps[0] if steps else -1)
    handle.remove()

    model.eval()
    with torch.no_grad():
        want = model(input_ids=x).logits
    model.save_pretrained(tmp_path / "m")
    back = qklab.hf.from_pretrained(tmp_path / "m").eval()
    assert [g.on.tolist() for g in _guards(back)] == [g.on.tolist() for g in guards]
    assert all(g.armed == bool(g.on.any()) for g in _guards(back))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, want, rtol=1e-6, atol=1e-6)

    # a switched head's logits are bounded by sqrt(D): measured with qklab's tracker on a fresh window
    h2 = qklab.attach(back, torch.optim.SGD(back.parameters(), lr=0.0), "none")
    back.train()
    back(input_ids=x * 3 % model.config.vocab_size, labels=x).loss.backward()
    D = model.config.hidden_size // model.config.num_attention_heads
    for layer, g in zip(h2.qk_layers, _guards(back), strict=True):
        m = layer.max_logit.view(-1, g.group)
        for h, on in enumerate(g.on.tolist()):
            if on:
                assert m[h].max() <= math.sqrt(D) * (1 + 1e-4)
    h2.remove()
