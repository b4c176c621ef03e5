"""The report renders from result files alone; the data behind its figures and tables holds the
expected series and verdicts (checked on the data, not on pixels)."""

from __future__ import annotations

import base64
import json
import re

import pytest

from qklab.config import ConfigError
from qklab.report import write_report
from qklab.report.figures import uniform_first_token
from qklab.study.catalogue import CATALOGUE, SCALE_FAMILY
from qklab.study.result import write_json_atomic
from tests.study.synthetic import probe, result

VARIANTS = {"none": {}, "qknorm": {}, "qkmap": {}, "quack": {}, "mla-none": {}, "mla-quack": {}, "mla-qkclip": {}}
# every claim registered at the catalogue's parameters, stability by the entropy rule (a planted study's plan)
PLAN = {"claims": {cid: {**c.params(), **({"stable": "entropy"} if "stable" in c.params() else {})}
                   for cid, c in CATALOGUE.items() if c.paper != SCALE_FAMILY  # the papers' claims, and no
                   and c.kind != "control"}}  # positive control (it gates the rest: test_controls.py)


def _write(tmp_path):
    res = tmp_path / "results"
    write_json_atomic(res / "study.json", {"name": "s", "config": "tiny", "seeds": [0, 1, 2],
                                           "variants": VARIANTS, "plan": PLAN,
                                           "protocol": {"reference": {"mha": "none", "mla": "mla-none"},
                                                        "lr_mults": [1.0, 2.0], "data_seed": 0}})
    noise = [0.0, 0.02, -0.01]
    for s in range(3):
        n = noise[s]
        cells = [result("none", 1.0, s, 5.0 + n, 5.05 + n, max_logit=40.0, first_token=0.20),
                 result("none", 2.0, s, 5.2 + n, 5.25 + n, diverged=s == 2),
                 result("qknorm", 1.0, s, 5.02 + n, 5.07 + n, method="qknorm", probe=probe(0.0, 0.5 + n)),
                 result("qknorm", 2.0, s, 5.1 + n, 5.1 + n, method="qknorm"),
                 result("qkmap", 1.0, s, 4.9 + n, 4.93 + n, method="qkmap", first_token=0.10, curve_shift=-0.5,
                        probe=probe(0.3 + n, 1.0 + n)),
                 result("qkmap", 2.0, s, 4.95 + n, 4.9 + n, method="qkmap"),
                 result("quack", 1.0, s, 5.0 + n, 5.06 + n, controller="quack", max_logit=12.0),
                 result("quack", 2.0, s, 4.98 + n, 5.0 + n, controller="quack", max_logit=15.0),
                 result("mla-none", 1.0, s, 5.3 + n, 5.3 + n, attention="mla"),
                 result("mla-quack", 1.0, s, 5.2 + n, 5.21 + n, attention="mla", controller="quack"),
                 result("mla-quack", 2.0, s, 5.3 + n, 5.31 + n, attention="mla", controller="quack"),
                 result("mla-qkclip", 2.0, s, 5.4 + n, 5.4 + n, attention="mla", controller="qkclip",
                        diverged=s == 0),
                 result("mla-qkclip", 1.0, s, 5.22 + n, 5.25 + n, attention="mla", controller="qkclip")]
        cells[-1]["git_sha"] = "def" if s == 2 else "abc"  # one cell finished under another version
        for c in cells:
            write_json_atomic(res / c["cell"] / "result.json", c)
    return res


def test_report_data_and_claims(tmp_path):
    res = _write(tmp_path)
    out = write_report([res], out=tmp_path / "rep")
    data = json.loads((out / "report.json").read_text())
    fig = data["figures"]
    # val curves: mean and band over the three seeds at the chosen rate (x1 for qkmap)
    qkmap = fig["val_curves"]["mha"]["qkmap"]
    assert qkmap["step"] == [0, 50, 100] and qkmap["n"] == 3
    assert qkmap["mean"][1] == pytest.approx(5.5) and qkmap["mean"][2] == pytest.approx(4.9 + 0.01 / 3)
    assert qkmap["lo"][2] == pytest.approx(4.89) and qkmap["hi"][2] == pytest.approx(4.92)
    assert set(fig["val_curves"]) == {"mha", "mla"}
    assert set(fig["val_curves"]["mla"]) == {"mla-none", "mla-quack", "mla-qkclip"}
    # learning-rate sensitivity: both rates, the diverged seed counted and left out of the mean
    sens = fig["lr_sensitivity"]["mha"]["none"]
    assert sens["lr"] == pytest.approx([1e-3, 2e-3]) and sens["diverged"] == [0, 1]
    assert sens["mean"][1] == pytest.approx(5.21) and sens["chosen_lr"] == pytest.approx(1e-3)
    assert fig["first_token"]["mha"]["qkmap"]["mean"] == pytest.approx(0.10)
    assert fig["first_token"]["mha"]["none"]["uniform"] == pytest.approx(uniform_first_token(64))
    assert fig["max_logit"]["mha"]["quack"]["mean"][-1] == pytest.approx(15.0)  # quack chose x2
    assert ("Code versions of `s` (cells): abc (HEAD at the cell's start) (38), def (HEAD at the cell's start) (1). "
            "**Warning: 2 code versions") in (out / "report.md").read_text()
    grid = data["tables"]["grid s"]  # study s, rate x variant: loss over every finished seed / max logit
    col = grid["head"].index("none")
    assert [r[0] for r in grid["rows"]] == ["0.001", "0.002"]
    assert grid["rows"][0][col] == "5.00 ± 0.02 / 40" and grid["rows"][1][col] == "5.20 ± 0.02 / 10 (1/3 diverged)"
    assert grid["rows"][1][grid["head"].index("mla-none")] == "-"  # not run at x2
    by_rate = fig["logit_by_rate"]["mha"]["quack"]  # the final max logit at every rate, not just the chosen one
    assert by_rate["lr"] == pytest.approx([1e-3, 2e-3]) and by_rate["mean"] == pytest.approx([12.0, 15.0])
    assert (out / "logit_by_rate.png").stat().st_size > 0 and "![logit_by_rate]" in (out / "report.md").read_text()
    # claims: planted effects give the expected verdicts under the old rule (the interval alone); at 3 seeds
    # every paired claim is underpowered under the new one, and the grid-rule claims keep their verdict
    head = data["tables"]["claims"]["head"]
    assert head[4:8] == ["verdict", "reason", "verdict (old rule)", "n"]
    for r in data["tables"]["claims"]["rows"]:
        assert r[4] == ("**underpowered**" if r[7] == "3" else f"**{r[6]}**"), r
    claims = {r[1]: (f"**{r[6]}**", r[5]) for r in data["tables"]["claims"]["rows"]}
    assert claims["lower validation loss than Standard attention"][0] == "**agree**"  # -0.12, tight
    assert claims["less attention on the first token than Standard attention"][0] == "**agree**"
    assert claims["outperforms no intervention in the MLA setting"][0] == "**agree**"
    assert claims["outperforms QK-clip in the MLA setting"][0] == "**agree**"  # -0.04 on every seed
    assert claims["trains faster than QK-Norm (no norms in the block)"][0] == "**not measurable**"
    measured = {r[1]: r[3] for r in data["tables"]["claims"]["rows"]}
    assert claims["keeps attention logits smaller than no intervention (MHA)"][0] == "**agree**"
    assert measured["keeps attention logits smaller than no intervention (MHA)"].startswith(
        "quack / none at x1: 0.3, 95% CI [0.3, 0.3], n=3")  # x1 only: a seed of none diverged at x2
    assert claims["keeps attention logits smaller than no intervention (MLA)"][0] == "**inconclusive**"
    assert measured["keeps attention logits smaller than no intervention (MLA)"] == (
        "mla-quack / mla-none at x1: 1, 95% CI [1, 1], n=3; by rate: x1 1")  # equal logits planted
    v, why = claims["stable where QK-clip diverges at high rates (MLA)"]  # a seed of mla-qkclip diverged at x2
    assert v == "**agree**" and measured["stable where QK-clip diverges at high rates (MLA)"] == (
        "highest rate with no diverged seed: mla-quack x2, mla-qkclip x1 (grid up to x2)")
    v, why = claims["allows a higher base learning rate than no intervention (MHA)"]
    assert v == "**agree**"  # quack x2 stable, none diverged at x2
    v, why = claims["stronger attention contrast on relevant evidence at long context"]
    assert v == "**not measurable**" and "probe" in why  # no probes on the Standard cells
    assert claims["keeps sensitivity to input scale (unlike QK-Norm)"][0] == "**agree**"  # JS 0.3 vs 0
    pq = fig["probes"]["mha"]["qkmap"]
    assert pq["n"] == 3 and pq["magnitude_js_a4"] == pytest.approx(0.3 + 0.01 / 3)
    assert pq["retrieval"]["length"] == [64, 128] and pq["retrieval"]["extrapolation"] == [False, True]
    assert pq["retrieval"]["log_contrast"] == pytest.approx([1.0 + 0.01 / 3, (1.0 + 0.01 / 3) / 2])
    assert pq["magnitude"]["scale"] == [0.25, 1.0, 4.0]
    # bands: the lowest and the highest seed (noise -0.01 and +0.02 around contrast 1.0 and JS 0.3)
    assert pq["retrieval"]["log_contrast_lo"] == pytest.approx([0.99, 0.495])
    assert pq["retrieval"]["log_contrast_hi"] == pytest.approx([1.02, 0.51])
    assert pq["magnitude"]["js_lo"] == pytest.approx([0.145, 0.0, 0.29])
    assert pq["magnitude"]["js_hi"] == pytest.approx([0.16, 0.0, 0.32])
    v, why = claims["better than the fixed-multiplier ablation"]
    assert v == "**not measurable**" and "qk_lr_multiplier" in why
    # results table: the paired difference against the reference
    rows = {r[0]: r for r in data["tables"]["results"]["rows"]}
    assert rows["qkmap"][9] == "-0.120 vs none" and rows["mla-quack"][9].startswith("-0.09")
    # html: self-contained, every figure embedded as a decodable PNG
    page = (out / "report.html").read_text()
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 7 and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in imgs)
    assert "http://" not in page and "https://" not in page
    assert '## <a id="claims"></a>Claims' in (out / "report.md").read_text()


def test_report_disagree_and_inconclusive(tmp_path):
    res = tmp_path / "r"
    write_json_atomic(res / "study.json", {"name": "s", "variants": {"none": {}, "qkmap": {}},
                                           "protocol": {"reference": "none"}})
    for s, n in enumerate([0.0, 0.01, -0.01]):
        for c in (result("none", 1.0, s, 5.0 + n, 5.0 + n), result("qkmap", 1.0, s, 5.2 + n, 5.2 + n, method="qkmap",
                                                                   first_token=0.1 + n)):
            write_json_atomic(res / c["cell"] / "result.json", c)
    data = json.loads((write_report([res]) / "report.json").read_text())
    claims = {r[1]: f"**{r[6]}**" for r in data["tables"]["claims"]["rows"]}  # the old rule; 3 seeds: underpowered
    assert claims["lower validation loss than Standard attention"] == "**disagree**"
    assert claims["less attention on the first token than Standard attention"] == "**inconclusive**"


def test_no_results_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no result.json"):
        write_report([tmp_path])


def test_several_studies_combine(tmp_path):
    for name, shift in (("a", 0.0), ("b", 0.5)):
        res = tmp_path / name
        write_json_atomic(res / "study.json", {"name": name, "variants": {"none": {}},
                                               "protocol": {"reference": "none"}})
        for s in range(2):
            c = result("none", 1.0, s, 5.0 + shift + 0.01 * s, 5.0 + shift, study=name)
            write_json_atomic(res / c["cell"] / "result.json", c)
    data = json.loads((write_report([tmp_path / "a", tmp_path / "b"], out=tmp_path / "r") / "report.json").read_text())
    curves = data["figures"]["val_curves"]  # one panel per study: their axes are not shared
    assert set(curves) == {"a: mha", "b: mha"} and set(curves["b: mha"]) == {"none"}
    assert curves["b: mha"]["none"]["mean"][-1] == pytest.approx(5.505)
    assert curves["a: mha"]["none"]["mean"][-1] == pytest.approx(5.005)
    assert len(data["tables"]["results"]["rows"]) == 2
    assert data["sources"] == [str(tmp_path / "a"), str(tmp_path / "b")]  # what it was built from
    assert data["cells"] == sorted(f"{n}/none_lr1_s{s}" for n in "ab" for s in range(2))
    assert (tmp_path / "r" / "val_curves.png").exists()


def test_head_series_from_records_to_figure_data(tmp_path):
    """result.json's per-head series come from the diagnostics and QuacK records; the report's per-head
    figures show, per step, the median and the lowest and highest of every (layer, head) entry."""
    from qklab.report.figures import figure_data
    from qklab.study.analyze import analyze, load_results
    from qklab.study.result import head_series

    recs = [{"step": s, "diag": {"max_logit": [[s + 1.0, 2.0 * s + 1], [3.0, 4.0]], "logit_change": [[0.1, 0.2]],
                                 "wq_norm": [[1.0, 2.0], [3.0, 4.0]], "wk_norm": [[2.0, 2.0], [1.0, 1.0]]}}
            for s in range(0, 50, 10)]
    recs += [{"step": s, "loss": 1.0, "quack_wq": [[0.5, 1.0]], "quack_wk": [[2.0, 0.25]], "quack_factor_min": 0.25}
             for s in (5, 15)]
    hs = head_series(sorted(recs, key=lambda r: r["step"]))
    assert hs["diag"]["step"] == [0, 10, 20, 30, 40] and hs["diag"]["max_logit"][1] == [[11.0, 21.0], [3.0, 4.0]]
    assert hs["quack"] == {"step": [5, 15], "quack_wk": [[[2.0, 0.25]]] * 2, "quack_wq": [[[0.5, 1.0]]] * 2}

    res = tmp_path / "results"
    write_json_atomic(res / "study.json", {"name": "s", "config": "tiny", "seeds": [0, 1], "variants": {"quack": {}},
                                           "protocol": {"reference": {"mha": "quack"}, "lr_mults": [1.0]}})
    for seed in (1, 0):  # the lowest seed's series is drawn
        c = result("quack", 1.0, seed, 5.0, 5.0, controller="quack")
        c["head_series"] = hs if seed == 0 else {"diag": {"step": [0], "max_logit": [[[99.0]]],
                                                          "wq_norm": [[[1.0]]], "wk_norm": [[[1.0]]]}}
        write_json_atomic(res / c["cell"] / "result.json", c)
    data = figure_data(analyze(*load_results([res])).groups)
    ml, w, q = (data[k]["mha"]["quack"] for k in ("head_max_logit", "head_w_norms", "quack_factors"))
    assert ml["seed"] == 0 and ml["step"] == [0, 10, 20, 30, 40]
    assert (ml["mean"][1], ml["lo"][1], ml["hi"][1]) == (7.5, 3.0, 21.0)  # of 11, 21, 3, 4
    assert (w["mean"][0], w["lo"][0], w["hi"][0]) == (3.5, 2.0, 4.0)  # ||W_Q|| ||W_K||: 2, 4, 3, 4
    assert q["step"] == [5, 15] and (q["mean"][0], q["lo"][0], q["hi"][0]) == (0.75, 0.25, 2.0)


def test_stability_table_lists_every_rate_with_all_seeds(tmp_path):
    from qklab.report.render import stability_table
    from qklab.study.analyze import analyze, load_results

    res = _write(tmp_path)
    for s in range(3):  # planted loss spikes in the none x2 cells
        f = res / f"none_lr2_s{s}" / "result.json"
        r = json.loads(f.read_text())
        r["spikes"] = s + 1
        write_json_atomic(f, r)
    head, rows = stability_table(analyze(*load_results([res])).groups)
    row = {h: v for h, v in zip(head, next(r for r in rows if r[0] == "none" and "(x2)" in r[2]), strict=True)}
    sel = [5.2, 5.22, 5.19]  # every seed, the diverged one included
    mean = sum(sel) / 3
    std = (sum((x - mean) ** 2 for x in sel) / 2) ** 0.5
    assert row["n"] == "3" and row["diverged"] == "1/3" and row["failed"] == "0/3" and row["loss spikes"] == "6"
    assert row["selection loss (all seeds)"] == f"{mean:.3f} ± {std:.3f}"
    assert row["below unigram"] == f"{6.0 - mean:.3f}" and row["max logit (end)"] == "10.0"
    assert sum(r[0] == "qknorm" for r in rows) == 2  # one row per rate
    # still falling: the last evaluation interval's fall (6.0 -> 5.2 + noise), the diverged seed left out
    assert row["still falling"] == f"{((6.0 - 5.2) + (6.0 - 5.22)) / 2:.3f} (50-100)"


@pytest.mark.parametrize("growth, verdict", [(0.05, "agree"), (-0.05, "disagree"), (0.0, "inconclusive")])
def test_width_gap_claim(tmp_path, growth, verdict):
    """QuacK's gap to none by width: the narrowest width's gap minus the widest's, paired by seed."""
    from qklab.report.claims import claims_table
    from qklab.study.analyze import analyze, load_results

    res = tmp_path / "results"
    write_json_atomic(res / "study.json", {"name": "w", "config": "tiny", "seeds": [0, 1, 2],
                                           "variants": {"none": {}, "quack": {}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0]}})
    noise = [0.0, 0.013, -0.013]  # mean 0: the mean gaps are the planted ones
    for i, width in enumerate((64, 128, 256)):
        for s in range(3):
            gap = 0.02 + growth * i + (noise[s] * (i - 1) if growth == 0.0 else 0.0)
            for variant, loss in (("none", 5.0 + noise[s]), ("quack", 5.0 + noise[s] - gap)):
                c = result(variant, 1.0, s, loss, loss, controller="quack" if variant == "quack" else "none",
                           study="w")
                c["cell"] = f"{variant}_shape{width}_lr1_s{s}"
                c["point"], c["config"]["model"]["d_model"] = {"shape": width}, width
                write_json_atomic(res / c["cell"] / "result.json", c)
    row = next(r for r in claims_table(analyze(*load_results([res])).groups) if "grows with width" in r.claim)
    assert row.verdict_old == verdict and row.verdict == "underpowered", row  # 3 seeds
    assert f"64: {0.02:+.3f}" in row.measured and f"256: {0.02 + 2 * growth:+.3f}" in row.measured
    assert "gap at width 64 - gap at width 256" in row.measured


@pytest.mark.parametrize("mult_tau, verdict, note", [(0.1, "disagree", "same tau: 0.1"),
                                                    (0.3, "agree", "no pair at the same tau")])
def test_multiplier_claim_pairs_quack_at_the_same_tau(tmp_path, mult_tau, verdict, note):
    """QuacK at tau 1 beats the multiplier, QuacK at tau 0.1 loses to it: the claim compares the
    multiplier with QuacK at its own tau when that ran (the earlier grid's bias was tau 1 against 0.1)."""
    from qklab.report.claims import claims_table
    from qklab.study.analyze import analyze, load_results

    res = tmp_path / "results"
    variants = {"quack-t0.1": ("quack", 0.1, 5.2), "quack-t1": ("quack", 1.0, 4.9),
                "multiplier": ("qk_lr_multiplier", mult_tau, 5.1)}
    write_json_atomic(res / "study.json", {"name": "m", "config": "tiny", "seeds": [0, 1, 2],
                                           "variants": {v: {} for v in variants},
                                           "protocol": {"reference": "quack-t1", "lr_mults": [1.0]}})
    noise = [0.0, 0.01, -0.01]
    for v, (ctrl, tau, loss) in variants.items():
        for s in range(3):
            c = result(v, 1.0, s, loss + noise[s], loss + noise[s], controller=ctrl, study="m")
            c["config"]["qk"] = {"method": "none", "controller": ctrl, "options": {ctrl: {"tau": tau}}}
            write_json_atomic(res / c["cell"] / "result.json", c)
    row = next(r for r in claims_table(analyze(*load_results([res])).groups)
               if r.claim == "better than the fixed-multiplier ablation")
    assert row.verdict_old == verdict and row.verdict == "underpowered", row
    assert note in row.measured
    want = "quack-t0.1 - multiplier" if mult_tau == 0.1 else "quack-t1 - multiplier"
    assert row.measured.startswith(want) and f"{(5.2 if mult_tau == 0.1 else 4.9) - 5.1:+.3f}" in row.measured


def test_claims_pair_within_one_study_and_prefer_the_tuning_grid(tmp_path):
    """Combined studies: each claim pairs methods that ran in the same study (a width ladder's lower loss,
    or a Muon study's `none`, must not stand in for the study built for the claim); the stable-rate
    claim takes each method at its best option (the QK-clip threshold stable up to the higher rate)."""
    from qklab.report.claims import claims_table
    from qklab.study.analyze import analyze, load_results

    def study(name, variants, mults):
        res = tmp_path / name
        write_json_atomic(res / "study.json", {"name": name, "config": "tiny", "seeds": [0, 1, 2],
                                               "variants": {v: {} for v in variants},
                                               "protocol": {"reference": "none", "lr_mults": mults}})
        return res

    noise = [0.0, 0.01, -0.01]
    lc = study("lc", ["none", "quack", "quack-b", "clip-a", "clip-b"], [1.0, 2.0, 4.0])
    for s, n in enumerate(noise):
        for m in (1.0, 2.0, 4.0, 8.0):
            for v, ctrl, loss, logit, div in (("none", "none", 4.0, 80.0, m == 4.0),
                                              ("quack", "quack", 4.1, 20.0, False),
                                              ("quack-b", "quack", 4.6, 20.0, False),  # also at x8, worse
                                              ("clip-a", "qkclip", 4.3, 30.0, False),  # stable to x4
                                              ("clip-b", "qkclip", 4.05, 40.0, m == 4.0 and s == 0)):
                if m == 8.0 and v != "quack-b":
                    continue  # one variant's grid goes further
                c = result(v, m, s, loss + n + 0.01 * m, loss + n + 0.01 * m, controller=ctrl, max_logit=logit,
                           study="lc")
                c["diverged"], c["status"] = div, "diverged" if div else "ok"
                write_json_atomic(lc / c["cell"] / "result.json", c)
    w = study("w", ["none", "quack"], [2.0, 4.0])  # lower losses, quack's logits above none's
    qm = study("qm", ["none", "qkmap"], [1.0])  # AdamW, with probes
    for s, n in enumerate(noise):
        for m in (2.0, 4.0):
            for v, ctrl, logit in (("none", "none", 10.0), ("quack", "quack", 50.0)):
                c = result(v, m, s, 3.0 + n, 3.0 + n, controller=ctrl, max_logit=logit, study="w")
                write_json_atomic(w / c["cell"] / "result.json", c)
        for v, method, contrast in (("none", "none", 1.0), ("qkmap", "qkmap", 1.5)):
            c = result(v, 1.0, s, 4.5 + n, 4.5 + n, method=method, study="qm", probe=probe(0.1, contrast + n))
            write_json_atomic(qm / c["cell"] / "result.json", c)
    rows = {r.claim: r for r in claims_table(analyze(*load_results([lc, w, qm])).groups)}
    grids = {k: t for k, t in json.loads((write_report([lc, w, qm], out=tmp_path / "rep") / "report.json")
                                         .read_text())["tables"].items() if k.startswith("grid")}
    assert list(grids) == ["grid lc", "grid qm", "grid w"] and grids["grid w"]["head"] == ["lr", "none", "quack"]
    assert [r[0] for r in grids["grid lc"]["rows"]] == ["0.001", "0.002", "0.004", "0.008"]
    r = rows["allows a higher base learning rate than no intervention (MHA)"]  # none diverged at x4
    assert r.verdict == "agree" and "quack-b x8, none x2 (grid up to x8)" in r.measured, r
    r = rows["stable where QK-clip diverges at high rates (MHA)"]  # clip-b has the better loss, clip-a the rate
    assert r.verdict == "inconclusive" and "quack-b x8, clip-a x4" in r.measured, r
    assert r.reason == "clip-a did not run above x4"
    r = rows["competitive with QK-Norm with MHA (not worse by more than 0.05 nats)"]
    assert r.verdict == "not measurable"  # no qknorm here
    r = rows["better than the fixed-multiplier ablation"]
    assert r.verdict == "not measurable"
    r = rows["keeps attention logits smaller than no intervention (MHA)"]  # from lc (20 vs 80), not w (50 vs 10),
    assert r.verdict_old == "agree", r  # not quack-b, at x2: none diverged at x4, so x4 is not compared
    assert r.measured == "quack / none at x2: 0.25, 95% CI [0.25, 0.25], n=3; by rate: x1 0.25, x2 0.25", r
    r = rows["stronger attention contrast on relevant evidence at long context"]  # qm's probes
    assert r.verdict_old == "agree" and r.measured.startswith("none - qkmap: -0.500"), r


def test_claims_take_the_rate_tuned_variant_not_a_one_rate_ablation(tmp_path):
    """qkmap_cpu's case: an ablation run at one rate borrowed from its family (QK-MAP at T = 8, x2 only)
    whose selection loss is lower by a hair does not stand in for the method tuned on its own rate grid."""
    from qklab.report.claims import claims_table
    from qklab.study.analyze import analyze, load_results

    res = tmp_path / "qm"
    write_json_atomic(res / "study.json", {"name": "qm", "config": "tiny", "seeds": [0, 1, 2],
                                           "variants": {v: {} for v in ("none", "qkmap", "qkmap-T8")},
                                           "protocol": {"reference": "none", "lr_mults": [1.0, 2.0, 4.0]}})
    noise = [0.0, 0.01, -0.01]
    for s, n in enumerate(noise):
        cells = [("none", "none", m, 4.0 + 0.1 * abs(m - 1), 4.0) for m in (1.0, 2.0, 4.0)]
        cells += [("qkmap", "qkmap", m, 3.8 + 0.1 * abs(m - 2), 3.5) for m in (1.0, 2.0, 4.0)]
        cells += [("qkmap-T8", "qkmap", 2.0, 3.799, 3.9)]  # better on selection, worse on report
        for v, method, m, sel, rep in cells:
            c = result(v, m, s, sel + n, rep + n + (0.02 * s if v == "none" else 0), method=method, study="qm")
            write_json_atomic(res / c["cell"] / "result.json", c)
    rows = {r.claim: r for r in claims_table(analyze(*load_results([res])).groups)}
    r = rows["lower validation loss than Standard attention"]
    assert r.measured.startswith("qkmap - none: -0.520"), r
    assert r.verdict_old == "agree" and r.verdict == "underpowered"


def test_claims_take_the_study_with_more_seeds_not_a_ladder_with_a_wider_grid(tmp_path):
    """The English reports' case: a comparison run in a study built for it (here 3 seeds, 2 rates) and in a
    2-seed width ladder that tunes the same methods on a wider grid (4 rates) is read on the study with more
    paired seeds, not on the ladder's wider grid."""
    from qklab.report.claims import claims_table
    from qklab.study.analyze import analyze, load_results

    dirs = []
    for name, seeds, mults, gap in (("main", 3, (1.0, 2.0), -0.30), ("ladder", 2, (0.5, 1.0, 2.0, 4.0), +0.20)):
        res = tmp_path / name
        write_json_atomic(res / "study.json", {"name": name, "config": "tiny", "seeds": list(range(seeds)),
                                               "variants": {"none": {}, "qkmap": {}},
                                               "protocol": {"reference": "none", "lr_mults": list(mults)}})
        for s in range(seeds):
            for m in mults:
                for v, d in (("none", 0.0), ("qkmap", gap)):
                    loss = 4.0 + 0.1 * abs(m - 1) + d + 0.01 * s
                    c = result(v, m, s, loss, loss, method=v, study=name)
                    write_json_atomic(res / c["cell"] / "result.json", c)
        dirs.append(res)
    rows = {r.claim: r for r in claims_table(analyze(*load_results(dirs)).groups)}
    r = rows["lower validation loss than Standard attention"]
    assert r.measured.startswith("qkmap - none: -0.300") and "n=3" in r.measured, r


def test_header_counts_finished_cells_from_the_study_file(tmp_path):
    """Each study's line says how many of its cells (study.json's list) have results, and counts apart
    the results of cells that left the study (a grid moved mid-study)."""
    res = tmp_path / "res"
    write_json_atomic(res / "study.json", {"name": "g", "config": "tiny", "seeds": [0], "variants": {"none": {}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0, 2.0, 4.0]},
                                           "cells": ["none_lr1_s0", "none_lr2_s0", "none_lr4_s0"]})
    for m in (0.5, 1.0, 2.0):  # x0.5 is no longer in the study, x4 has not run
        c = result("none", m, 0, 4.0 + m, 4.0 + m, study="g")
        write_json_atomic(res / c["cell"] / "result.json", c)
    md = (write_report([res], out=tmp_path / "rep") / "report.md").read_text()
    assert ("- `g`: in progress: 2 of 3 cells finished (and 1 result of cells no longer in the study); "
            "base config `tiny`") in md
    # the answers open with it: every verdict there is interim
    opening = md.split("## What these results say\n\n")[1]
    assert opening.startswith("**Interim**: `g` is in progress (2 of 3 cells finished (and 1 result of cells no "
                              "longer in the study)). Every verdict and figure below is read from the cells finished "
                              "so far")
    c = result("none", 4.0, 0, 8.0, 8.0, study="g")
    write_json_atomic(res / c["cell"] / "result.json", c)
    md = (write_report([res], out=tmp_path / "rep") / "report.md").read_text()
    assert "- `g`: complete: 3 of 3 cells finished (and 1 result" in md
    assert "**Interim**" not in md


def _one_rate_groups(tmp_path, name: str, variants: tuple[str, ...], cells) -> list[dict]:
    """The analysed groups of a study of ``variants`` at one rate and two seeds, its cells ``cells(seed)``."""
    from qklab.study.analyze import analyze, load_results

    res = tmp_path / name
    write_json_atomic(res / "study.json", {"name": name, "config": "tiny", "seeds": [0, 1],
                                           "variants": {v: {} for v in variants},
                                           "protocol": {"reference": "none", "lr_mults": [1.0]}})
    for s in (0, 1):
        for c in cells(s):
            write_json_atomic(res / c["cell"] / "result.json", c)
    return analyze(*load_results([res])).groups


def test_a_gated_variant_is_not_standard_attention(tmp_path):
    """The demo's case: `gate-head` has method none and controller none, and a lower selection loss than
    `none` here; the claims about Standard attention still pair with `none`."""
    from qklab.report.claims import claims_table

    def cells(s):
        for v, method, sel, rep in (("none", "none", 4.0, 4.0), ("gate-head", "none", 3.5, 3.0),
                                    ("qkmap", "qkmap", 3.8, 3.7 + 0.01 * s)):
            c = result(v, 1.0, s, sel, rep, method=method, study="g")
            if v == "gate-head":
                c["config"]["model"]["attn_gate"] = "head"
            yield c

    groups = _one_rate_groups(tmp_path, "g", ("none", "gate-head", "qkmap"), cells)
    assert {g.variant: g.method for g in groups} == {"none": "none", "gate-head": "none+gate-head",
                                                           "qkmap": "qkmap"}
    r = {r.claim: r for r in claims_table(groups)}["lower validation loss than Standard attention"]
    assert r.measured.startswith("qkmap - none: -0.29"), r


def test_per_head_muon_is_not_the_reference(tmp_path):
    """logit_control_english's case: `muon-per-head` has method none and controller none, and a lower
    selection loss than `none`; QuacK's claims against no intervention still pair with `none`."""
    from qklab.report.claims import claims_table

    def cells(s):
        for v, ctrl, sel, logit in (("none", "none", 4.0, 40.0), ("muon-per-head", "none", 3.5, 80.0),
                                    ("quack", "quack", 3.8, 10.0)):
            c = result(v, 1.0, s, sel, sel, controller=ctrl, max_logit=logit, study="m")
            c["config"]["train"].update(optimizer="muon", muon_per_head="qk" if v == "muon-per-head" else "none")
            yield c

    groups = _one_rate_groups(tmp_path, "m", ("none", "muon-per-head", "quack"), cells)
    assert {g.variant: g.controller for g in groups} == {"none": "none", "muon-per-head": "muon-per-head-qk",
                                                               "quack": "quack"}
    row = {r.claim: r for r in claims_table(groups)}["keeps attention logits smaller than no intervention (MHA)"]
    assert row.measured.startswith("quack / none at x1: 0.25"), row


def _qkmap_study(tmp_path, seeds: int, effect: float = -0.1) -> list[dict]:
    """none, qknorm and qkmap at one rate; qkmap better than both by ``effect`` plus noise at every seed."""
    from qklab.study.analyze import analyze, load_results

    res = tmp_path / f"n{seeds}"
    write_json_atomic(res / "study.json", {"name": "n", "config": "tiny", "seeds": list(range(seeds)),
                                           "variants": {v: {} for v in ("none", "qknorm", "qkmap")},
                                           "protocol": {"reference": "none", "lr_mults": [1.0]}})
    for s in range(seeds):
        n = 0.01 * ((s * 7) % 5 - 2)  # -0.02 .. +0.02
        for v, loss, ft in (("none", 5.0, 0.2), ("qknorm", 5.0 + n / 2, 0.2),
                            ("qkmap", 5.0 + effect + n, 0.1 + n / 10)):
            c = result(v, 1.0, s, loss, loss, method=v, first_token=ft, study="n")
            write_json_atomic(res / c["cell"] / "result.json", c)
    return analyze(*load_results([res])).groups


def test_two_seed_claim_is_underpowered(tmp_path):
    """Two seeds: the smallest sign-flip p is 2/2^2 = 0.5, so the claim is underpowered whatever the interval
    says; the old rule's verdict (the interval alone) stays beside it."""
    from qklab.report.claims import claims_table

    rows = {r.claim: r for r in claims_table(_qkmap_study(tmp_path, 2, effect=-0.3))}
    r = rows["lower validation loss than Standard attention"]
    assert r.stats.n == 2 and r.stats.p_flip == pytest.approx(0.5)
    assert r.verdict == "underpowered" and r.verdict_old == "agree", r
    assert r.reason.startswith("2 paired seeds: the exact sign-flip test needs 6"), r


def test_new_rule_uses_holm_across_the_papers_claims(tmp_path):
    """Six seeds, QK-MAP ahead at every one: each sign-flip p is 2/64, but Holm over the five QK-MAP claims
    measured here makes the smallest 5 * 2/64 > 0.05: inconclusive (the old rule: agree). Eight seeds: 2/256
    times 5 is below 0.05: agree. The QuacK family is apart (none of its claims are measured here)."""
    from qklab.report.claims import claims_table
    from qklab.report.render import claims_rows

    rows = {r.claim: r for r in claims_table(_qkmap_study(tmp_path, 6))}
    fam = [r for r in rows.values() if r.stats is not None]
    assert {r.paper for r in fam} == {"QK-MAP"} and len(fam) == 5
    r = rows["lower validation loss than Standard attention"]
    assert r.stats.p_flip == pytest.approx(2 / 64) and r.p_holm == pytest.approx(5 * 2 / 64)
    assert r.q_bh == pytest.approx(2 / 64)  # BH: m p(i) / i, all five at 2/64
    assert r.verdict == "inconclusive" and r.verdict_old == "agree" and "Holm p = 0.156" in r.reason, r
    rows8 = {r.claim: r for r in claims_table(_qkmap_study(tmp_path, 8))}
    r = rows8["lower validation loss than Standard attention"]
    assert r.p_holm == pytest.approx(5 * 2 / 256) and r.verdict == "agree", r
    r = rows8["lower validation loss than QK-Norm"]
    assert r.verdict == "agree" and r.stats.df == 7, r
    head, body = claims_rows(_qkmap_study(tmp_path, 8))
    row = next(b for b in body if b[1] == "lower validation loss than Standard attention")
    got = dict(zip(head, row, strict=True))
    assert got["verdict"] == "**agree**" and got["verdict (old rule)"] == "agree" and got["n"] == "8"
    assert got["p (sign-flip)"] == f"{2 / 256:.3g}" and got["p Holm"] == f"{10 / 256:.3g}"


def test_a_chosen_rate_at_an_end_of_its_grid_is_marked():
    from qklab.study.analyze import grid_edge

    sweep = {0.5: {}, 1.0: {}, 2.0: {}}
    assert [grid_edge(m, sweep) for m in (0.5, 1.0, 2.0)] == [", bottom of grid", "", ", top of grid"]
    assert grid_edge(2.0, {1.0: {}, 2.0: {}}) == ""  # two rates: no interior to compare with


def test_a_design_amendment_is_named_in_the_header():
    from qklab.report.render import _design_amendments
    from qklab.study.plan import amend, parse_plan

    plan = parse_plan({"qkmap.val_vs_none": {}})
    sj = {"name": "p", "plan": {"claims": plan}, "protocol": {"lr_mults": [1.0]}, "cells": ["a", "b"]}
    out = amend(sj, plan, "edge", {"name": "p", "protocol": {"lr_mults": [1.0, 2.0]}, "cells": ["a", "b", "c", "d"]})
    line = _design_amendments(out)
    assert "protocol.lr_mults, cells (edge)" in line and "registered design too (its 2 cells)" in line
    assert _design_amendments(sj) == ""


def test_p_values_need_six_paired_seeds_and_absolute_intervals_carry_no_sign():
    """Below 6 paired seeds the exact sign-flip test cannot go under 2/2^n, so no p is printed as if it
    could decide; a loss's interval is printed as the loss is, without a difference's signs."""
    from qklab.report.tables import _p, abs_ci
    from qklab.study.stats import Difference

    assert _p(Difference(n=5, p=0.001)) == "n=5 too few (sign-flip floor 0.062)"
    assert _p(Difference(n=2, p=0.3)) == "n=2 too few (sign-flip floor 0.5)"
    assert _p(Difference(n=6, p=0.0012345)) == "0.00123" and _p(None) == "-"
    assert _p(Difference(n=8, p=float("nan"))) == "-"
    assert abs_ci(5.0191, 5.7573) == "[5.019, 5.757]" and abs_ci(float("nan"), 1.0) == "-"


def test_figures_with_nothing_to_show_are_named_not_drawn():
    from qklab.report.figures import nothing_to_show

    one_rate = {"mha": {"none": {"lr": [1e-3], "mean": [5.0]},
                        "qknorm": {"lr": [1e-3, 2e-3], "mean": [5.0, float("nan")]}}}  # a lost point: one rate
    two_rates = {"mha": {"none": {"lr": [1e-3, 2e-3], "mean": [5.0, 5.1]}}}
    short = {"mha": {"none": {"step": [30], "mean": [0.1]}}}
    got = nothing_to_show({"lr_sensitivity": one_rate, "logit_by_rate": two_rates, "logit_change": short,
                           "max_logit": {"mha": {"none": {"step": [10, 20], "mean": [1.0, 2.0]}}}, "probes": {}})
    assert set(got) == {"lr_sensitivity", "logit_change"}
    assert got["lr_sensitivity"].startswith("each variant ran at one learning rate")


def test_first_token_axis_fits_its_bars(tmp_path):
    """Bars of 0.01-0.02: the axis ends near them (not at 0.35) and the sink line is left out, the title says
    why; a bar near 0.3 brings the sink line back."""
    from qklab.report.figures import _first_token, _plt

    plt = _plt()
    for means, sink in (([0.012, 0.017], False), ([0.28, 0.05], True)):
        fig, ax = plt.subplots()
        series = {k: {"mean": m, "std": 0.001, "uniform": 0.02} for k, m in zip(("a", "b"), means, strict=True)}
        _first_token(ax, "mha", series, {"a": "C0", "b": "C1"})
        top = ax.get_ylim()[1]
        assert any(ln.get_ydata()[0] == 0.3 for ln in ax.lines) == sink
        assert (top >= 0.35) if sink else (0.017 < top < 0.05 and "far below" in ax.get_title())
        plt.close(fig)


def test_a_file_given_as_a_results_folder_is_named_as_a_file(tmp_path):
    """A path that exists but is a file (a result.json itself, say) is not called missing."""
    f = tmp_path / "result.json"
    f.write_text("{}")
    with pytest.raises(ConfigError) as e:
        write_report([f])
    assert str(e.value) == f"{f}: a file, not a folder; give folders holding result.json files"
    with pytest.raises(ConfigError, match="nope: no such folder"):
        write_report([tmp_path / "nope"])
