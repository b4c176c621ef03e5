"""Headline scalars of a ``probes.json`` result, for tables across runs (schema: docs/diagnostics.md)."""

from __future__ import annotations

from typing import Any


def _longest_main(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    main = [r for r in rows if not r.get("extrapolation")]
    return max(main, key=lambda r: r["length"]) if main else None


def probe_summary(probes: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of one probe result; a quantity that was not measured is None.

    step; max_logit; first_token and first_token_baseline (mean first-token attention over heads on the
    T-token probe batch, and the same for uniform attention); distance and distance_baseline (mean attention
    distance in tokens over heads, and T / 4 for uniform attention); sink_first_token, sink_first_token_baseline
    and sink_rate (64-token inputs, share of heads above 0.3); retrieval_length (the longest N <= T),
    evidence_mass (+ _std), evidence_mass_uniform, log_contrast (+ _std), top1_rank (mean rank, + _std),
    top1_share, retrieval_accuracy, retrieval_head ("L<layer>.H<head>"); induction_contrast at that length
    (mean over depths); magnitude_js_a4 and magnitude_js_a025 (mean JS at a = 4 and a = 0.25)."""
    heads = probes.get("heads") or {}
    sink = heads.get("sink") or {}
    out: dict[str, Any] = {
        "step": probes.get("step"),
        "qk_method": probes.get("qk_method"),
        "qk_controller": probes.get("qk_controller"),
        "max_logit": heads.get("max_logit_max"),
        "first_token": heads.get("first_token_mean"),
        "first_token_baseline": heads.get("first_token_baseline"),
        "distance": heads.get("distance_mean"),
        "distance_baseline": heads.get("distance_baseline"),
        "sink_first_token": sink.get("first_token_mean"),
        "sink_first_token_baseline": sink.get("first_token_baseline"),
        "sink_rate": sink.get("rate"),
    }
    rt = probes.get("retrieval") or {}
    row = _longest_main(rt.get("lengths") or [])
    head = rt.get("head")
    out.update({
        "retrieval_length": row["length"] if row else None,
        "evidence_mass": row["mass"] if row else None,
        "evidence_mass_std": row["mass_std"] if row else None,
        "evidence_mass_uniform": row["uniform_mass"] if row else None,
        "log_contrast": row["log_contrast"] if row else None,
        "log_contrast_std": row["log_contrast_std"] if row else None,
        "top1_rank": row["rank"] if row else None,
        "top1_rank_std": row["rank_std"] if row else None,
        "top1_share": row["top1"] if row else None,
        "retrieval_accuracy": row["accuracy"] if row else None,
        "retrieval_head": f"L{head['layer']}.H{head['head']}" if head else None,
    })
    ind = probes.get("induction") or {}
    cells = [c for c in ind.get("cells") or [] if not c.get("extrapolation")]
    n = max((c["length"] for c in cells), default=None)
    at_n = [c["contrast"] for c in cells if c["length"] == n]
    out["induction_contrast"] = sum(at_n) / len(at_n) if at_n else None
    mag = probes.get("magnitude") or {}
    js = dict(zip(mag.get("scales") or [], mag.get("js_mean") or [], strict=False))
    out["magnitude_js_a4"] = js.get(4.0)
    out["magnitude_js_a025"] = js.get(0.25)
    return out
