"""The induction-copy test: a planted induction head scores high, a random model about 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qklab.diagnostics import capturing, evidence_contrast
from qklab.diagnostics.evidence import build_contexts, contrast_from_logits
from tests.conftest import tiny_gpt
from tests.diagnostics.handbuilt import induction_model

TEXT = np.random.default_rng(0).integers(0, 10, 4000)  # "held-out text": tokens 0..9 only
LENGTHS = [64, 128, 256]  # beyond max_seq_len=64: RoPE tables enlarged for the test
POOL = np.arange(10, 60)


def test_planted_induction_head_scores_high():
    model = induction_model(vocab=60, max_len=64)
    x = torch.from_numpy(TEXT[:64]).view(1, -1)
    with capturing(model) as caps, torch.no_grad():
        model(x)
    assert (caps[0]["probs"][0, 0, 1:].argmax(-1) == torch.arange(63)).all()  # the construction works

    res = evidence_contrast(model, TEXT, LENGTHS, seg_len=8, n_samples=2, pool=POOL, train_len=64)
    assert res["skipped"] == [] and len(res["cells"]) == 9
    assert (res["head"]["layer"], res["head"]["head"]) == (1, 0)  # chosen on the selection contexts
    for cell in res["cells"]:
        assert cell["contrast"] > 10.0  # layer 1: the induction head
        assert cell["contrast_per_head"][0][0] < -10.0  # layer 0 looks at the previous token, not the evidence
        assert cell["accuracy"] == 1.0
        assert cell["extrapolation"] == (cell["length"] > 64)
    assert model.cfg.max_seq_len == 64 and model.rope.max_len == 64  # the model itself was not changed


def test_random_model_is_about_zero():
    model = tiny_gpt("none")  # vocab 97, max_seq_len 64
    text = np.random.default_rng(1).integers(0, 97, 4000)
    res = evidence_contrast(model, text, [64, 128], seg_len=8, n_samples=4, train_len=64)
    for cell in res["cells"]:
        assert max(abs(c) for row in cell["contrast_per_head"] for c in row) < 0.1
        assert abs(cell["contrast"]) < 0.1 and cell["accuracy"] < 0.2


def test_contrast_is_the_log_ratio_to_the_mean_of_the_others():
    s = torch.randn(2, 3, 4, 12)  # (B, H, Q, N)
    qpos, ev = torch.tensor([8, 9, 10, 11]), torch.tensor([2, 3, 4, 5])
    got = contrast_from_logits(s, qpos, ev)
    for q in range(4):
        p = torch.softmax(s[:, :, q, : qpos[q] + 1], dim=-1)  # (B, H, qpos+1)
        others = torch.cat([p[..., : ev[q]], p[..., ev[q] + 1 :]], dim=-1).mean(dim=-1)
        torch.testing.assert_close(got[:, :, q], (p[..., ev[q]] / others).log(), atol=1e-5, rtol=1e-5)


def test_contexts_place_the_segment_at_depth_and_repeat_it():
    rng = np.random.Generator(np.random.PCG64(0))
    text = np.random.default_rng(2).integers(0, 30, 4000)
    tokens, segs, d = build_contexts(text, 100, 0.5, 8, 3, POOL, rng)
    assert tokens.shape == (3, 100) and d == round(0.5 * (100 - 16))
    assert torch.equal(tokens[:, d : d + 8], segs) and torch.equal(tokens[:, -8:], segs)
    for row, seg in zip(tokens, segs, strict=True):
        assert len(set(seg.tolist())) == 8 and set(seg.tolist()) <= set(POOL.tolist())
        filler = torch.cat([row[:d], row[d + 8 : -8]])
        assert not set(seg.tolist()) & set(filler.tolist())  # the segment's ids occur only in its two copies


def test_too_short_text_is_skipped_with_a_reason():
    res = evidence_contrast(tiny_gpt("none"), TEXT[:100], [64, 256], seg_len=8, n_samples=1, pool=POOL)
    assert [c["length"] for c in res["cells"]] == [64, 64, 64]
    assert res["skipped"][0]["length"] == 256 and "held-out tokens" in res["skipped"][0]["reason"]
    with pytest.raises(ValueError, match="segment pool"):
        evidence_contrast(tiny_gpt("none"), TEXT, [64], pool=np.arange(490, 500))
