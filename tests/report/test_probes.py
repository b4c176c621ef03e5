"""The probes table: each measure at every context length and input scale, per variant at its chosen
rate, with the paired difference to the reference checked against a direct t-interval."""

from __future__ import annotations

import json
import math

import numpy as np
from scipy import stats as sps

from qklab.report import write_report
from qklab.study.result import write_json_atomic
from tests.study.synthetic import probe, result


def _study(tmp_path, seeds=(0, 1, 2)):
    res = tmp_path / "res"
    write_json_atomic(res / "study.json", {"name": "pq", "config": "tiny", "seeds": list(seeds),
                                           "variants": {"none": {}, "qkmap": {}, "qknorm": {}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0, 2.0]}})
    contrast = {"none": [0.2, 0.5, 0.3], "qkmap": [0.9, 1.0, 1.4], "qknorm": [0.1, 0.6, 0.2]}
    js4 = {"none": 0.3, "qkmap": 0.2, "qknorm": 0.0}
    for s in seeds:
        for v, method in (("none", "none"), ("qkmap", "qkmap"), ("qknorm", "qknorm")):
            for m, shift in ((1.0, 0.0), (2.0, 0.5)):  # x1 is chosen; x2's probes must not be read
                p = probe(js4[v] + shift, contrast[v][s] + shift)
                p["summary"].update(first_token=0.05 + 0.01 * s + (v == "none") * 0.02, first_token_baseline=0.02)
                c = result(v, m, s, 4.0 + shift, 4.0 + shift, method=method, study="pq", probe=p)
                write_json_atomic(res / c["cell"] / "result.json", c)
    return res, contrast


def _ci(d):
    d = np.asarray(d)
    half = sps.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return d.mean(), d.mean() - half, d.mean() + half


def test_probes_table_pairs_every_measure_with_the_reference(tmp_path):
    res, contrast = _study(tmp_path)
    out = write_report([res], out=tmp_path / "rep")
    head, rows = (json.loads((out / "report.json").read_text())["tables"]["probes pq"][k] for k in ("head", "rows"))
    assert head == ["measure", "none", "qkmap (vs none)", "qknorm (vs none)"]
    table = {r[0]: r[1:] for r in rows}
    assert list(table) == ["first-token attention (uniform: 0.020)", "evidence log-contrast at 64 tokens",
                           "evidence mass at 64 tokens (uniform: 0.0300)", "retrieval accuracy at 64 tokens",
                           "evidence log-contrast at 128 tokens, beyond the training length",
                           "evidence mass at 128 tokens, beyond the training length (uniform: 0.0150)",
                           "retrieval accuracy at 128 tokens, beyond the training length",
                           "attention change (JS) at input scale x0.25", "attention change (JS) at input scale x4"]
    # the reference: mean ± sample std over seeds
    c = np.asarray(contrast["none"])
    assert table["evidence log-contrast at 64 tokens"][0] == f"{c.mean():.3f} ± {c.std(ddof=1):.3f}"
    # qkmap - none at 64 tokens, paired over seeds, against a direct t-interval
    mean, lo, hi = _ci(np.asarray(contrast["qkmap"]) - c)
    q = np.asarray(contrast["qkmap"])
    assert table["evidence log-contrast at 64 tokens"][1] == (
        f"{q.mean():.3f} ± {q.std(ddof=1):.3f} ({mean:+.3f} [{lo:+.3f}, {hi:+.3f}])")
    # at 128 tokens the probe halves the contrast: the difference halves too
    mean, lo, hi = _ci((np.asarray(contrast["qknorm"]) - c) / 2)
    assert table["evidence log-contrast at 128 tokens, beyond the training length"][2].endswith(
        f"({mean:+.3f} [{lo:+.3f}, {hi:+.3f}])")
    # identical differences on every seed: a zero-width interval
    assert table["first-token attention (uniform: 0.020)"][1].endswith("(-0.020 [-0.020, -0.020])")
    assert table["attention change (JS) at input scale x4"][2] == "0.000 ± 0.000 (-0.300 [-0.300, -0.300])"
    assert table["retrieval accuracy at 64 tokens"][1] == "0.100 ± 0.000 (+0.000 [+0.000, +0.000])"
    md = (out / "report.md").read_text()
    assert "## Attention probes of pq at the chosen rates" in md and "| evidence mass at 64 tokens" in md


def test_one_seed_gives_a_difference_without_an_interval(tmp_path):
    res, contrast = _study(tmp_path, seeds=(1,))
    out = write_report([res], out=tmp_path / "rep")
    rows = json.loads((out / "report.json").read_text())["tables"]["probes pq"]["rows"]
    row = next(r for r in rows if r[0] == "evidence log-contrast at 64 tokens")
    assert row[1:] == ["0.500", "1.000 (+0.500, one seed)", "0.600 (+0.100, one seed)"]


def test_no_probes_no_table(tmp_path):
    res = tmp_path / "res"
    write_json_atomic(res / "study.json", {"name": "np", "config": "tiny", "seeds": [0],
                                           "variants": {"none": {}}, "protocol": {"reference": "none",
                                                                                  "lr_mults": [1.0]}})
    c = result("none", 1.0, 0, 4.0, 4.0, study="np")
    write_json_atomic(res / c["cell"] / "result.json", c)
    out = write_report([res], out=tmp_path / "rep")
    assert not any(k.startswith("probes") for k in json.loads((out / "report.json").read_text())["tables"])
    assert "Attention probes of" not in (out / "report.md").read_text()
