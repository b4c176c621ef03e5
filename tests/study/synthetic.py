"""Result dicts shaped like ``result.json``, with known values, for protocol and report tests."""

from __future__ import annotations

from typing import Any


def result(variant: str, mult: float, seed: int, val: float, report: float, *, attention: str = "mha",
           method: str = "none", controller: str = "none", diverged: bool = False, failed: bool = False,
           max_logit: float = 10.0, first_token: float = 0.1, study: str = "s", curve_shift: float = 0.0,
           lr: float = 1e-3, probe: dict | None = None, not_learned: bool = False) -> dict[str, Any]:
    """``diverged``: it blew up (a non-finite step); ``not_learned``: diverged by the entropy rule alone, its
    final selection loss ``val`` above the unigram entropy (6.0) and within a nat of its curve's best (6.0 +
    ``curve_shift``)."""
    head = {"schema": 1, "study": study, "cell": f"{variant}_lr{mult:g}_s{seed}", "variant": variant,
            "point": {}, "lr_mult": mult, "seed": seed, "log": f"logs/{variant}.log"}
    if failed:
        return {**head, "status": "failed", "diverged": False, "failure": "KeyError: planted", "cell_hash": None}
    steps = [0, 50, 100]
    why = (f"final selection loss {val:.4f} above the unigram entropy 6.0000" if not_learned
           else "non-finite loss or gradient (planted)" if diverged else None)
    return {**head, "status": "diverged" if why else "ok", "diverged": bool(why), "divergence": why,
            "nonfinite_steps": int(diverged and not not_learned), "failure": None, "git_sha": "abc",
            "attention": attention, "method": method, "controller": controller, "lr": lr * mult,
            "config": {"model": {"attention": attention}, "train": {"seq_len": 64}}, "unigram_entropy": 6.0,
            "final": {"step": 100, "val_loss": val, "report_loss": report, "train_loss": val - 0.1,
                      "max_logit": max_logit, "first_token": first_token, "logit_change": 0.01},
            "curves": {"val": {"step": steps, "val_loss": [8.0 + curve_shift, 6.0 + curve_shift, val]},
                       "train": {"step": steps, "loss": [8.0, 6.5, val - 0.1]},
                       "max_logit": {"step": steps, "max_logit": [1.0, 5.0, max_logit]},
                       "logit_change": {"step": [50, 100], "logit_change_mean": [0.1, 0.01]},
                       "first_token": {"step": steps, "first_token_mean": [0.1, 0.1, first_token]}},
            "heads": {}, "tokens_per_s": 1000.0 + seed, "probe": probe}


def probe(js4: float, contrast: float) -> dict[str, Any]:
    """A cell's probe entry: the headline summary and the series by context length and input scale."""
    rows = [{"length": 64, "extrapolation": False, "mass": 0.2, "uniform_mass": 0.03, "log_contrast": contrast,
             "rank": 1.0, "top1": 0.5, "accuracy": 0.1},
            {"length": 128, "extrapolation": True, "mass": 0.1, "uniform_mass": 0.015, "log_contrast": contrast / 2,
             "rank": 3.0, "top1": 0.2, "accuracy": 0.0}]
    summary = {"magnitude_js_a4": js4, "log_contrast": contrast, "first_token": 0.05, "retrieval_head": "L0.H1"}
    return {"summary": summary,
            "retrieval": rows, "magnitude": {"scales": [0.25, 1.0, 4.0], "js_mean": [js4 / 2, 0.0, js4]}}
