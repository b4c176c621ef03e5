"""The MQAR evidence test: its arithmetic against a hand computation on planted logits, and a planted
induction head (which retrieves by construction) against a random model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qklab.data.mqar import MQARSpec
from qklab.diagnostics.mqar import mqar_evidence, query_stats
from tests.conftest import tiny_gpt
from tests.diagnostics.handbuilt import induction_model


def hand(row: list[float], q: int, e: int) -> dict[str, float]:
    """log(A[e] / mean of A over the other allowed keys), A[e] and the evidence's rank, by the definition."""
    a = [math.exp(v) for v in row[: q + 1]]
    z = sum(a)
    a = [v / z for v in a]
    others = [a[k] for k in range(q + 1) if k != e]
    return {"log_contrast": math.log(a[e] / (sum(others) / len(others))), "mass": a[e],
            "rank": 1 + sum(row[k] > row[e] for k in range(q + 1))}


def test_contrast_arithmetic_on_planted_logits():
    rows = [[0.5, 3.0, -1.0, 2.0, 9.0, 9.0, 9.0],  # query at 3, evidence 1; keys 4.. are in its future
            [1.0, -2.0, 0.0, 4.0, 1.5, 0.0, 50.0],  # query at 5, evidence 3 (top of its row)
            [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]  # query at 6, evidence 0: uniform, contrast 0
    qpos, ev = torch.tensor([3, 5, 6]), torch.tensor([1, 3, 0])
    s = torch.tensor(rows, dtype=torch.float64)
    s = torch.stack([s, -s]).unsqueeze(0)  # (1, H=2, K=3, N=7): the second head with the signs turned
    got = query_stats(s, qpos, ev)
    for h, sign in enumerate((1, -1)):
        for j, (q, e) in enumerate(zip(qpos.tolist(), ev.tolist(), strict=True)):
            want = hand([sign * v for v in rows[j]], q, e)
            for key in ("log_contrast", "mass", "rank"):
                assert got[key][h, j].item() == pytest.approx(want[key], rel=1e-6, abs=1e-9), (h, j, key)
    assert got["log_contrast"][0, 2].item() == pytest.approx(0.0, abs=1e-12)
    assert got["rank"][0, 1].item() == 1.0  # the future key at 6 (logit 50) is not counted


SPEC = MQARSpec(n_keys=12, n_pairs=4)  # vocabulary 56: fits the planted model's 60 ids


def test_planted_induction_head_retrieves_at_every_length():
    model = induction_model(vocab=60, max_len=64)
    res = mqar_evidence(model, SPEC, 64, mults=(1, 2, 4, 8), n_samples=6, n_select=4, batch=3)
    assert (res["head"]["layer"], res["head"]["head"]) == (1, 0)  # chosen on the selection split
    assert [r["length"] for r in res["lengths"]] == [64, 128, 256, 512]
    for r in res["lengths"]:
        assert r["accuracy"] == 1.0 and r["top1"] == 1.0 and r["rank"] == 1.0
        assert r["log_contrast"] > 10.0 and r["mass"] > 0.9
        assert r["log_contrast_per_head"][0][0] < 0.0  # layer 0 looks at the previous token instead
        assert r["extrapolation"] == (r["length"] > 64) and r["filler_added"] == r["length"] - 64
    assert model.rope.max_len == 64  # the model itself was not changed


def test_random_model_is_about_zero_and_deterministic():
    torch.manual_seed(0)
    model = tiny_gpt("none")  # vocab 97, max_seq_len 64
    a = mqar_evidence(model, SPEC, 64, mults=(1, 2), n_samples=8, n_select=4)
    for r in a["lengths"]:
        assert abs(r["log_contrast"]) < 1.0 and r["accuracy"] < 0.5
        assert np.isclose(r["uniform_mass"], r["mass"], rtol=1.0)  # near uniform attention
    b = mqar_evidence(model, SPEC, 64, mults=(1, 2), n_samples=8, n_select=4)
    assert a == b


def test_a_trained_mqar_run_is_probed_on_its_task(tmp_path):
    from qklab.config import load_config
    from qklab.diagnostics.probe import ProbeOptions, run_probe
    from qklab.train.trainer import Trainer

    cfg = load_config("tiny", ["data.source=mqar", "data.mqar_keys=12", "data.mqar_pairs=4", "data.mqar_queries=8",
                               "train.seq_len=32", "model.max_seq_len=32", "train.steps=4", "train.batch_size=4",
                               "train.eval_every=4", "train.ckpt_every=4", "train.diag_every=0",
                               f"train.out_dir={tmp_path}", "train.progress=false"])
    run = Trainer(cfg, log=lambda s: None).run()
    assert run.final_val_loss < 10.0  # the selection split's queried values (vocabulary 56: ln 56 = 4.0 at init)
    rt = run_probe(run.run_dir, opts=ProbeOptions(max_mult=2, seg_len=8), log=lambda s: None)["retrieval"]
    assert rt["test"] == "mqar" and [r["length"] for r in rt["lengths"]] == [32, 64]
    assert rt["head"]["split"] == "selection" and all(0.0 <= r["accuracy"] <= 1.0 for r in rt["lengths"])
