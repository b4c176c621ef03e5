"""DDP and FSDP2 (fully_shard) on 2 gloo processes give the loss curve of one process at the same global
batch (fp32, 1e-5 relative) for every QK method family, with AdamW and Muon, MHA, GQA and MLA, and the
same final weights; what every rank holds whole is equal on both ranks (QK-clip's clip included)."""

from __future__ import annotations

import math

import pytest

from qklab.rundir.metrics import read_metrics
from tests.parallel.common import assert_ranks_equal, check_against_one, run_cases

CASES = {
    "ddp": {
        f"{m}-{o}": [f"qk.method={m}", f"train.optimizer={o}"]
        for m in ("none", "qknorm", "qkmap") for o in ("adamw", "muon")
    } | {
        f"{c}-{o}": [f"qk.controller={c}", f"train.optimizer={o}"]
        for c in ("quack", "qkclip") for o in ("adamw", "muon")
    } | {
        "mla-quack-muon": ["model.attention=mla", "qk.controller=quack", "train.optimizer=muon"],
        "mla-qkclip-adamw": ["model.attention=mla", "qk.controller=qkclip"],
        "accum-qkclip": ["qk.controller=qkclip", "train.grad_accum=2"],
    },
    "fsdp": {
        "none-adamw": ["qk.method=none"],
        "qknorm-muon": ["qk.method=qknorm", "train.optimizer=muon"],
        "qkmap-adamw": ["qk.method=qkmap"],
        "quack-adamw": ["qk.controller=quack"],
        "quack-muon-gqa": ["qk.controller=quack", "train.optimizer=muon", "model.n_kv_heads=2"],
        "qkclip-adamw": ["qk.controller=qkclip", "train.grad_accum=2"],
        "qkclip-qkmap-muon": ["qk.method=qkmap", "qk.controller=qkclip", "train.optimizer=muon"],
        "mla-quack-adamw": ["model.attention=mla", "qk.controller=quack"],
        "mla-qkclip-muon": ["model.attention=mla", "qk.controller=qkclip", "train.optimizer=muon"],
        "diag-qkmap-adamw": ["qk.method=qkmap", "train.diag_every=3"],
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, tuple] = {}

    def get(mode: str):  # one spawn of 2 processes per mode, all its cases in a row
        if mode not in done:
            tmp = tmp_path_factory.mktemp(mode)
            done[mode] = tmp, run_cases(tmp, CASES[mode], mode)
        return done[mode]

    return get


@pytest.mark.parametrize("mode, name", [(m, n) for m in CASES for n in CASES[m]])
def test_matches_one_process(runs, mode, name):
    tmp, refs = runs(mode)
    check_against_one(tmp, refs, name, mode)
    # DDP: every tensor; FSDP2: vectors and QK-method parameters (QK-MAP's temperature, which QK-clip
    # scales), kept whole on every rank. QK-clip reduces its max logits over the ranks: one clip everywhere
    assert_ranks_equal(tmp, f"{name}-{mode}", mode)


def _diag(tmp, name):
    return [r["diag"] for r in read_metrics(tmp / "runs" / name / "metrics.jsonl") if "diag" in r]


def test_fsdp_diagnostics_are_those_of_one_process(runs):
    tmp, _ = runs("fsdp")
    one, fsdp = _diag(tmp, "diag-qkmap-adamw-one"), _diag(tmp, "diag-qkmap-adamw-fsdp")
    assert len(one) == len(fsdp) == 3  # steps 0, 3, 6
    a, b = _numbers(one), _numbers(fsdp)
    assert len(a) > 100 and a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(a[k]) and math.isnan(b[k])), k


def _numbers(x, at: str = "") -> dict[str, float]:
    """Every number in nested dicts and lists, by its path."""
    if isinstance(x, dict):
        return {k: v for key, sub in x.items() for k, v in _numbers(sub, f"{at}.{key}").items()}
    if isinstance(x, list):
        return {k: v for i, sub in enumerate(x) for k, v in _numbers(sub, f"{at}[{i}]").items()}
    return {at: float(x)} if isinstance(x, int | float) and not isinstance(x, bool) else {}


def _held_out(tmp, name) -> dict[str, float]:
    final = [r for r in read_metrics(tmp / "runs" / name / "metrics.jsonl") if "report_loss" in r][-1]
    return {k: final[k] for k in ("val_loss", "report_loss", "max_logit")}


@pytest.mark.parametrize("mode", sorted(CASES))
def test_held_out_losses_are_those_of_one_process(runs, mode):
    """2 ranks at batch 4 evaluate the held-out windows one process at batch 8 evaluates (each rank its rows,
    averaged over the ranks) and take the max logit on the same rows: val_loss, report_loss and max_logit
    equal one process's to float rounding. Each rank used to evaluate batches of 4 windows of its own
    spacing, half the held-out text one process reads, so a run resumed 2 -> 1 changed its selection loss."""
    tmp, _ = runs(mode)
    for name in CASES[mode]:
        one, two = _held_out(tmp, f"{name}-one"), _held_out(tmp, f"{name}-{mode}")
        for k in one:
            tol = 1e-3 if "muon" in name else 1e-4  # Muon's bf16 orthogonalisation (check_against_one)
            assert math.isclose(one[k], two[k], rel_tol=tol), (name, k, one[k], two[k])
