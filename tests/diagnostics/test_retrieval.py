"""The retrieval test: a planted retrieval head scores at the top, a random model at the control level;
the three measures agree with a recomputation from the eager path's attention."""

from __future__ import annotations

import math

import numpy as np
import torch

from qklab.data.retrieval import query_context
from qklab.diagnostics import capturing, retrieval_test, rope_length
from qklab.diagnostics.retrieval import _contexts, _measure
from tests.conftest import tiny_gpt
from tests.diagnostics.handbuilt import induction_model

TEXT = np.random.default_rng(0).integers(0, 10, 4000)  # "held-out text": tokens 0..9
POOL = np.arange(10, 60)  # ids "seen in training" for keys and values


def test_planted_retrieval_head_scores_at_the_top():
    model = induction_model(vocab=60, max_len=64)  # layer 1: attends to the token after an earlier match
    res = retrieval_test(model, TEXT, POOL, [48, 64, 128], train_len=64, n_samples=4)
    assert (res["head"]["layer"], res["head"]["head"]) == (1, 0) and res["head"]["selected_at_length"] == 64
    assert [r["length"] for r in res["lengths"]] == [48, 64, 128]
    assert [r["extrapolation"] for r in res["lengths"]] == [False, False, True]
    for r in res["lengths"]:  # figures: mass 1.000, rank 1, log-contrast ~33, accuracy 1 at every N
        assert r["mass"] > 0.99 and r["rank"] == 1.0 and r["top1"] == 1.0
        assert r["log_contrast"] > 10.0 and r["accuracy"] == 1.0 and r["contrast"] > 10.0
    assert len(res["cells"]) == 9 and all(c["mass_per_head"][0][0] < 0.05 for c in res["cells"])


def test_random_model_scores_at_the_control_level():
    model = tiny_gpt("none")  # vocab 97, max_seq_len 64
    text = np.random.default_rng(1).integers(0, 50, 4000)
    res = retrieval_test(model, text, np.arange(50, 97), [64, 128], train_len=64, n_samples=8)
    for r in res["lengths"]:  # figures at N=64: mass 0.031 (uniform 0.031), log-contrast 0.00 +- 0.02, acc 0
        assert abs(r["log_contrast"]) < 0.05 and r["log_contrast_std"] < 0.1 and abs(r["contrast"]) < 0.1
        assert abs(r["mass"] - r["uniform_mass"]) < 0.1 * r["uniform_mass"]
        assert r["top1"] < 0.2 and r["accuracy"] < 0.2
        assert r["rank"] > 0.2 * r["chance_rank"]
    assert res["lengths"][1]["extrapolation"] and model.rope.max_len == 64


def test_measures_match_the_eager_attention():
    model = tiny_gpt("softcap", n_kv_heads=2, init_std=0.3)
    rng = np.random.Generator(np.random.PCG64(3))
    text = np.random.default_rng(4).integers(0, 50, 2000)
    ctxs = _contexts(text, 60, 0.5, np.arange(50, 97), 4, 3, rng)
    with torch.no_grad():
        vals, hits = _measure(model, ctxs, batch=2)
        x = torch.from_numpy(np.stack([c.tokens for c in ctxs]))
        with capturing(model) as caps:
            logits, _ = model(x)
    for li, cap in enumerate(caps):
        p = cap["probs"][:, :, -1].double()  # (S, H, N): the query's attention row
        for i, c in enumerate(ctxs):
            ev, ctrl = list(c.positions(c.query)), list(c.positions(c.control))
            mass = p[i][:, ev].sum(dim=-1)
            torch.testing.assert_close(vals["mass"][i, li].double(), mass, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(vals["log_contrast"][i, li].double(),
                                       (mass / p[i][:, ctrl].sum(dim=-1)).log(), atol=1e-5, rtol=1e-5)
            others = torch.ones(p.shape[-1], dtype=torch.bool)
            others[ev[1]] = False  # the value against the mean of every other key the query sees
            torch.testing.assert_close(vals["contrast"][i, li].double(),
                                       (p[i][:, ev[1]] / p[i][:, others].mean(dim=-1)).log(), atol=1e-5, rtol=1e-5)
            for h in range(p.shape[1]):
                best = p[i, h, ev].max()
                assert vals["rank"][i, li, h].item() == 1 + int((p[i, h] > best * (1 + 1e-6)).sum())
    want = torch.tensor([int(c.pairs[c.query, 1]) for c in ctxs])
    assert torch.equal(hits, logits[:, -1].argmax(dim=-1) == want)


def test_contexts_use_seen_ids_absent_from_the_text_and_separate_selection_draws():
    pool = np.arange(10, 60)
    c = query_context(TEXT[:100], 0.9, pool, 4, np.random.Generator(np.random.PCG64(0)))
    assert len(c.tokens) == 100 + 9 and c.start == 90
    pairs = c.pairs.reshape(-1).tolist()
    assert len(set(pairs)) == 8 and set(pairs) <= set(pool.tolist()) and not set(pairs) & set(TEXT[:100].tolist())
    assert c.tokens[c.start : c.start + 8].tolist() == pairs and c.tokens[-1] == c.pairs[c.query, 0]
    assert c.control != c.query
    sel = _contexts(TEXT, 64, 0.5, pool, 4, 4, np.random.Generator(np.random.PCG64([0, 64, 1, 1])))
    score = _contexts(TEXT, 64, 0.5, pool, 4, 4, np.random.Generator(np.random.PCG64([0, 64, 1, 0])))
    assert all(not np.array_equal(a.tokens, b.tokens) for a in sel for b in score)


def test_rope_resize_equals_a_model_built_longer():
    from qklab.model import GPT

    model = tiny_gpt("none")
    long = GPT(type(model.cfg)(**{**vars(model.cfg), "max_seq_len": 200}), model.qk_cfg).eval()
    long.load_state_dict(model.state_dict())
    x = torch.randint(0, 97, (1, 150))
    with torch.no_grad(), rope_length(model, 200):
        got, _ = model(x)
    with torch.no_grad():
        want, _ = long(x)
    assert torch.equal(got, want) and model.rope.max_len == 64
    assert math.isclose(model.rope.tables(16, x.device)[0].shape[0], 64)
