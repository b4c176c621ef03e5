"""A registered positive control: read before the claims; when it fails, the study's other registered claims
are not measurable. The evidence claims at a registered context read the probes at that length."""

from __future__ import annotations

import numpy as np
import pytest

from qklab.report.claims import claims_table
from qklab.study.analyze import analyze, load_results
from qklab.study.plan import parse_plan, registration
from qklab.study.result import write_json_atomic
from tests.study.synthetic import result

SEEDS = range(8)
CONTRAST = {"none": [0.5, 0.2, 0.9, 0.4, 0.3, 0.8, 0.6, 0.1], "qknorm": [0.7, 0.1, 0.5, 0.6, 0.2, 0.4, 0.9, 0.3]}
CONTRAST["qkmap"] = [c + 1.0 + 0.1 * s for s, c in enumerate(CONTRAST["none"])]
CLAIMS = {"control.retrieval_learned": {}, "qkmap.evidence_contrast": {"context": 256},
          "qkmap.evidence_contrast_vs_qknorm": {"context": 256}}


def _probe(acc: float, contrast: float) -> dict:
    rows = [{"length": n, "extrapolation": n > 64, "contrast": contrast * (n == 256) - 5.0 * (n != 256),
             "log_contrast": -contrast, "accuracy": acc if n == 64 else 0.0, "mass": 0.1, "uniform_mass": 1 / n}
            for n in (64, 128, 256)]  # the claims read "contrast" (against the whole context) at 256 tokens
    return {"summary": {"retrieval_accuracy": acc, "log_contrast": -5.0}, "retrieval": rows}


def _study(tmp_path, none_acc: list[float]):
    res = tmp_path / "res"
    write_json_atomic(res / "study.json", {"name": "ev", "config": "tiny", "seeds": list(SEEDS),
                                           "variants": {"none": {}, "qknorm": {}, "qkmap": {}},
                                           "plan": registration(parse_plan(CLAIMS)),
                                           "protocol": {"reference": "none", "lr_mults": [1.0, 2.0]}})
    for s in SEEDS:
        for v in ("none", "qknorm", "qkmap"):
            for m, loss in ((1.0, 1.0), (2.0, 1.5)):  # x1 chosen; x2's probes are never read
                acc = none_acc[s] if v == "none" else 0.99
                c = result(v, m, s, loss, loss, method=v, study="ev",
                           probe=_probe(acc if m == 1.0 else 0.0, CONTRAST[v][s] if m == 1.0 else 99.0))
                write_json_atomic(res / c["cell"] / "result.json", c)
    results, studies = load_results([res])
    return {r.id: r for r in claims_table(analyze(results, studies).groups, studies)}


def test_control_holds_and_the_claims_are_read_at_the_registered_context(tmp_path):
    acc = [0.95, 0.92, 0.99, 0.9, 0.97, 0.93, 0.91, 0.96]
    rows = _study(tmp_path, acc)
    ctrl = rows["control.retrieval_learned"]
    assert (ctrl.verdict, ctrl.status) == ("holds", "confirmatory")
    assert f"mean accuracy {np.mean(acc):.3f}" in ctrl.measured and "n=8" in ctrl.measured
    ev = rows["qkmap.evidence_contrast"]
    d = np.subtract(CONTRAST["qkmap"], CONTRAST["none"])  # at 256 tokens, by hand
    assert ev.stats.mean == pytest.approx(-d.mean()) and ev.stats.n == 8  # none - qkmap: < 0 agrees
    assert ev.verdict == "agree" and ev.p_holm == pytest.approx(2 * 2 / 2 ** 8)  # two claims in the family
    vs = rows["qkmap.evidence_contrast_vs_qknorm"]
    assert vs.stats.mean == pytest.approx(np.subtract(CONTRAST["qknorm"], CONTRAST["qkmap"]).mean())
    assert vs.family == ev.family == "QK-MAP"


def test_a_failed_control_leaves_the_claims_not_measurable(tmp_path):
    rows = _study(tmp_path, [0.95, 0.2, 0.99, 0.9, 0.97, 0.93, 0.91, 0.96])  # mean 0.85 < 0.9
    assert rows["control.retrieval_learned"].verdict == "fails"
    for cid in ("qkmap.evidence_contrast", "qkmap.evidence_contrast_vs_qknorm"):
        assert rows[cid].verdict == "not measurable"
        assert "positive control did not hold" in rows[cid].reason
    assert rows["qkmap.evidence"].verdict == "exploratory"  # not registered: untouched


def test_own_claims_are_listed_only_where_registered(tmp_path):
    res = tmp_path / "plain"
    write_json_atomic(res / "study.json", {"name": "plain", "seeds": [0], "variants": {"none": {}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0]}})
    c = result("none", 1.0, 0, 1.0, 1.0, study="plain")
    write_json_atomic(res / c["cell"] / "result.json", c)
    results, studies = load_results([res])
    ids = {r.id for r in claims_table(analyze(results, studies).groups, studies)}
    assert "qkmap.evidence" in ids and not ids & {"control.retrieval_learned", "qkmap.evidence_contrast",
                                                  "qkmap.evidence_contrast_vs_qknorm"}
