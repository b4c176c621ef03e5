"""The probes table of a study: every attention probe (``qklab probe``) of the final checkpoints at each
variant's chosen rate, as mean ± std over seeds, with the paired difference to the study's reference
variant (same seeds) and its 95% t-interval.

Rows: first-token attention beside its uniform-attention baseline, the sink rate, the retrieval evidence
log-contrast (against a control pair; where measured, also against the whole context), evidence mass and
accuracy at every probed context length (beyond the training length marked), and
the attention change (Jensen-Shannon divergence) at every input scale. This is the table behind the
QK-MAP paper's first-token, evidence-contrast and magnitude claims, read at every length rather than at
the one length the claims table uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qklab.report.figures import _nanmean, variant_name
from qklab.study.analyze import Group
from qklab.study.stats import describe, fmt_ci, fmt_mean_std, paired_difference

Table = tuple[list[str], list[list[str]]]
Getter = Callable[[dict[str, Any]], Any]  # a cell's probe entry -> a number, or None where not measured


def _retrieval(length: int, key: str) -> Getter:
    return lambda p: next((r.get(key) for r in p.get("retrieval") or [] if r["length"] == length), None)


def _js(scale: float) -> Getter:
    def get(p):
        m = p.get("magnitude") or {}
        scales, js = m.get("scales") or [], m.get("js_mean") or []
        return next((v for a, v in zip(scales, js, strict=False) if math.isclose(a, scale)), None)
    return get


def _measures(probes: list[dict[str, Any]]) -> list[tuple[str, Getter]]:
    """(row label, getter) for everything the probes of one study measured, in a fixed order."""
    summ = [p["summary"] for p in probes]
    rows: list[tuple[str, Getter]] = []
    if any(s.get("first_token") is not None for s in summ):
        base = _nanmean([s.get("first_token_baseline") for s in summ])
        rows.append(("first-token attention" + (f" (uniform: {base:.3f})" if math.isfinite(base) else ""),
                     lambda p: p["summary"].get("first_token")))
    if any(s.get("sink_first_token") is not None for s in summ):
        base = _nanmean([s.get("sink_first_token_baseline") for s in summ])
        rows.append(("first-token attention on 64-token inputs" + (f" (uniform: {base:.3f})" if math.isfinite(base)
                                                                   else ""),
                     lambda p: p["summary"].get("sink_first_token")))
    if any(s.get("sink_rate") is not None for s in summ):
        rows.append(("sink rate (share of heads with first-token attention > 0.3, 64-token inputs)",
                     lambda p: p["summary"].get("sink_rate")))
    lengths: dict[int, bool] = {}
    for p in probes:
        for r in p.get("retrieval") or []:
            lengths[int(r["length"])] = lengths.get(int(r["length"]), False) or bool(r.get("extrapolation"))
    for n, beyond in sorted(lengths.items()):
        tag = f"{n} tokens" + (", beyond the training length" if beyond else "")
        uni = _nanmean([_retrieval(n, "uniform_mass")(p) for p in probes])
        rows.append((f"evidence log-contrast at {tag}", _retrieval(n, "log_contrast")))
        if any(_retrieval(n, "contrast")(p) is not None for p in probes):  # probes that measured it
            rows.append((f"evidence contrast against the whole context at {tag}", _retrieval(n, "contrast")))
        rows.append((f"evidence mass at {tag}" + (f" (uniform: {uni:.4f})" if math.isfinite(uni) else ""),
                     _retrieval(n, "mass")))
        rows.append((f"retrieval accuracy at {tag}", _retrieval(n, "accuracy")))
    scales = sorted({a for p in probes for a in (p.get("magnitude") or {}).get("scales") or [] if a != 1.0})
    rows += [(f"attention change (JS) at input scale x{a:g}", _js(a)) for a in scales]
    return rows


def _by_seed(g: Group, get: Getter) -> dict[int, float]:
    out = {}
    for s, p in g.probe_by_seed.items():
        v = get(p)
        if v is not None and math.isfinite(float(v)):
            out[int(s)] = float(v)
    return out


def _cell(vals: dict[int, float], ref: dict[int, float] | None) -> str:
    if not vals:
        return "-"
    txt = fmt_mean_std(describe(list(vals.values())))
    if ref is None:
        return txt
    d = paired_difference(vals, ref)
    if d.n == 0:
        return txt
    return txt + f" ({d.mean:+.3f}" + (f" {fmt_ci(d.ci_lo, d.ci_hi)})" if d.n >= 2 else ", one seed)")


def probes_tables(groups: list[Group]) -> dict[str, Table]:
    """One table per (study, attention type) whose chosen-rate cells carry probes: rows are measures,
    columns variants; a non-reference cell reads 'mean ± std (difference to the reference [95% CI])'."""
    tables: dict[str, Table] = {}
    keys = dict.fromkeys((g.study, g.attention) for g in groups if g.probe_by_seed)
    for study, att in keys:
        gs = [g for g in groups if g.study == study and g.attention == att and g.probe_by_seed]
        probes = [p for g in gs for p in g.probe_by_seed.values()]
        refs = {(g.point, g.variant): g for g in gs}
        head = ["measure", *(variant_name(g) + ("" if g.variant == g.reference else
                                                 f" (vs {g.reference})" if (g.point, g.reference)
                                                 in refs else "") for g in gs)]
        rows = []
        for label, get in _measures(probes):
            row = [label]
            for g in gs:
                ref = refs.get((g.point, g.reference))
                row.append(_cell(_by_seed(g, get), None if ref is None or ref is g else _by_seed(ref, get)))
            rows.append(row)
        tables[f"probes {study}" + (f" {att}" if len({a for s, a in keys if s == study}) > 1 else "")] = (head, rows)
    return tables
