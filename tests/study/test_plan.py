"""Pre-registered claims: the study file's [claims] are hashed into study.json before the first cell trains;
a change after results is refused without `qklab study amend`, which keeps both plans, the reason and the
time; the report reads registered claims as confirmatory (amended ones under both plans) and the others as
exploratory."""

from __future__ import annotations

import hashlib
import json

import pytest

from qklab.cli import main
from qklab.config import ConfigError
from qklab.report.claims import claims_table, registered_results
from qklab.study.analyze import Group, RateOutcome
from qklab.study.catalogue import CATALOGUE
from qklab.study.plan import (
    amend,
    check_plan,
    design,
    parse_plan,
    plan_hash,
    registered_design,
    registered_plan,
    stored_plan,
)
from qklab.study.result import read_result
from qklab.study.stats import Summary

SETS = {"train.steps": 4, "train.lr": 1e-2, "train.eval_every": 2, "train.ckpt_every": 2, "train.diag_every": 0,
        "data.max_files": 20}


def _file(tmp_path, claims: str, protocol: str = "") -> str:
    f = tmp_path / "p.toml"
    sets = "".join(f'"{k}" = {json.dumps(v)}\n' for k, v in {**SETS, "data.cache_dir": str(tmp_path / "cache")}.items())
    f.write_text(f'[study]\nname = "p"\nconfig = "tiny"\nseeds = [0]\n[study.set]\n{sets}'
                 f'[variants.none]\n"qk.method" = "none"\n[variants.qkmap]\n"qk.method" = "qkmap"\n'
                 + (f"[protocol]\n{protocol}\n" if protocol else "") + claims)
    return str(f)


PLAN_A = '[claims]\nalpha = 0.05\n[claims."qkmap.val_vs_none"]\nfamily = "QK-MAP"\n'
PLAN_B = '[claims]\nalpha = 0.01\n[claims."qkmap.val_vs_none"]\nfamily = "QK-MAP"\n'


def _run(tmp_path, f) -> int:
    return main(["study", "run", f, "--out", str(tmp_path / "o"), "--workers", "0", "--no-report"])


def test_parse_fills_every_parameter_and_hashes_them():
    plan = parse_plan({"alpha": 0.01, "delta": 0.2, "qkmap.val_vs_none": {}, "quack.stable_mha": {"stable": "entropy"},
                       "quack.competitive_qknorm": {"margin": 0.1}})
    assert plan["qkmap.val_vs_none"] == {"alpha": 0.01, "test": "sign-flip", "family": "QK-MAP", "rate": "tuned",
                                         "margin": 0.0, "pairing": "best"}
    assert plan["quack.stable_mha"] == {"test": "grid", "stable": "entropy", "delta": 0.2, "family": "QuacK"}
    assert plan["quack.competitive_qknorm"]["margin"] == 0.1
    want = hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert plan_hash(plan) == want
    assert plan_hash(parse_plan({"alpha": 0.01, "delta": 0.2, "qkmap.val_vs_none": {},
                                 "quack.stable_mha": {"stable": "entropy"},
                                 "quack.competitive_qknorm": {"margin": 0.2}})) != want


@pytest.mark.parametrize("raw, match", [
    ({"qkmap.nothing": {}}, "no such claim"),
    ({"qkmap.val_vs_none": {"delta": 1}}, "unknown key"),
    ({"qkmap.val_vs_none": {"alpha": 2}}, "between 0 and 1"),
    ({"qkmap.val_vs_none": {"test": "wilcoxon"}}, "sign-flip"),
    ({"quack.stable_mha": {"test": "t"}}, "grid"),
    ({"quack.logits_mha": {"rate": "fast"}}, "highest-shared-stable"),
    ({"colour": "red", "qkmap.val_vs_none": {}}, "unknown key"),
    ({"alpha": 0.05}, "registers no claim"),
])
def test_a_bad_plan_is_one_clear_line(raw, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_plan(raw)
    assert "\n" not in str(e.value)


def test_plan_change_after_results_is_refused_until_amended(tmp_path, capsys):
    f = _file(tmp_path, PLAN_A)
    assert _run(tmp_path, f) == 0
    sj = read_result(tmp_path / "o" / "results" / "study.json")
    plan_a = parse_plan({"alpha": 0.05, "qkmap.val_vs_none": {"family": "QK-MAP"}})
    assert sj["plan"]["sha256"] == plan_hash(plan_a) and stored_plan(sj) == plan_a
    assert sj["plan"]["claims"]["qkmap.val_vs_none"]["claim"] == CATALOGUE["qkmap.val_vs_none"].text
    before = (tmp_path / "o" / "results" / "study.json").read_bytes()
    assert _run(tmp_path, f) == 0  # the same plan: study.json stays byte for byte
    assert (tmp_path / "o" / "results" / "study.json").read_bytes() == before

    f = _file(tmp_path, PLAN_B)  # alpha moved after results are in
    capsys.readouterr()
    assert _run(tmp_path, f) == 2
    err = capsys.readouterr().err.strip()
    assert "changes its registered claims after 2 cell(s)" in err and "qklab study amend" in err and "\n" not in err
    assert (tmp_path / "o" / "results" / "study.json").read_bytes() == before
    # amend needs a reason, then records both plans
    assert main(["study", "amend", f, "--out", str(tmp_path / "o")]) == 2
    assert main(["study", "amend", f, "--out", str(tmp_path / "o"), "--why", "a stricter level"]) == 0
    sj = read_result(tmp_path / "o" / "results" / "study.json")
    (entry,) = sj["plan_history"]
    assert entry["why"] == "a stricter level" and entry["old"]["sha256"] == plan_hash(plan_a)
    assert entry["new"]["sha256"] == sj["plan"]["sha256"] != plan_hash(plan_a)
    assert registered_plan(sj) == plan_a and stored_plan(sj)["qkmap.val_vs_none"]["alpha"] == 0.01
    capsys.readouterr()
    assert main(["study", "status", f, "--out", str(tmp_path / "o")]) == 0
    assert "amended 1 time(s); the file's [claims] match it" in capsys.readouterr().out
    assert main(["study", "status", _file(tmp_path, PLAN_A), "--out", str(tmp_path / "o")]) == 0
    assert "the file's [claims] differ: a run is refused" in capsys.readouterr().out
    f = _file(tmp_path, PLAN_B)
    assert _run(tmp_path, f) == 0  # the amended plan is the study's now
    assert main(["study", "amend", f, "--out", str(tmp_path / "o"), "--why", "again"]) == 2  # nothing to amend


def test_design_change_after_results_is_refused_until_amended(tmp_path, capsys):
    """One more rate on the grid after results is a change of design: refused in one line, then recorded by
    amend (old and new design, what changed), with the registered plan read on the registered cells."""
    f = _file(tmp_path, PLAN_A, "lr_mults = [1.0]")
    assert _run(tmp_path, f) == 0
    res = tmp_path / "o" / "results"
    before = (res / "study.json").read_bytes()
    f = _file(tmp_path, PLAN_A, "lr_mults = [1.0, 2.0]")
    capsys.readouterr()
    assert _run(tmp_path, f) == 2
    err = capsys.readouterr().err.strip()
    assert "changes its design (protocol.lr_mults, cells) after 2 cell(s)" in err and "\n" not in err
    assert (res / "study.json").read_bytes() == before
    capsys.readouterr()
    assert main(["study", "status", f, "--out", str(tmp_path / "o")]) == 0
    assert "the file's design differs (protocol.lr_mults, cells): a run is refused" in capsys.readouterr().out
    assert main(["study", "amend", f, "--out", str(tmp_path / "o"), "--why", "the best rate sat on the edge"]) == 0
    assert "design changed (protocol.lr_mults, cells)" in capsys.readouterr().out
    sj = read_result(res / "study.json")
    (entry,) = sj["plan_history"]
    assert entry["old"] == entry["new"] == sj["plan"]  # the claims stay registered as they were
    assert entry["design"]["changed"] == ["protocol.lr_mults", "cells"]
    assert entry["design"]["old"]["cells"] == ["none_lr1_s0", "qkmap_lr1_s0"]
    assert registered_design(sj)["protocol"]["lr_mults"] == [1.0]
    assert design(sj)["protocol"]["lr_mults"] == [1.0, 2.0]
    assert _run(tmp_path, f) == 0  # the amended design is the study's now: its new cells train
    assert sorted(p.name for p in res.iterdir() if (p / "result.json").is_file()) == [
        "none_lr1_s0", "none_lr2_s0", "qkmap_lr1_s0", "qkmap_lr2_s0"]
    results = [read_result(p) for p in sorted(res.glob("*/result.json"))]
    first = registered_results(results, {"p": sj})
    assert sorted(r["cell"] for r in first) == ["none_lr1_s0", "qkmap_lr1_s0"]
    assert registered_results(results, {"p": {**sj, "plan_history": []}}) is None  # no design moved


def test_the_registered_plan_is_read_on_the_registered_designs_groups():
    now = _groups("p", [-0.3, -0.25, -0.35, -0.3, -0.28, -0.32])  # the amended grid: qkmap ahead at every seed
    first = _groups("p", [0.3, -0.25, 0.35, -0.3, 0.28, -0.32])  # the registered one: mixed signs
    a = parse_plan({"qkmap.val_vs_none": {}})
    sj = amend({"name": "p", "plan": {"claims": a}, "cells": ["x"]}, a, "grid", {"name": "p", "cells": ["x", "y"]})
    r = {r.id: r for r in claims_table(now, {"p": sj}, first)}["qkmap.val_vs_none"]
    assert r.amended and r.verdict == "agree" and r.verdict_registered == "inconclusive"
    assert r.measured_registered != r.measured


def test_before_any_result_the_plan_may_change_freely(tmp_path):
    res = tmp_path / "r"
    res.mkdir()
    sj = {"name": "p", "plan": {"sha256": "x", "claims": {}}}
    assert check_plan(sj, parse_plan({"qkmap.val_vs_none": {}}), 0) == "register"
    with pytest.raises(ConfigError, match="registers claims after 3"):
        check_plan({"name": "p"}, parse_plan({"qkmap.val_vs_none": {}}), 3)
    with pytest.raises(ConfigError, match="--why"):
        amend({"name": "p"}, parse_plan({"qkmap.val_vs_none": {}}), " ")


def _groups(study: str, diffs: list[float]) -> list[Group]:
    """Planted analysis groups of qkmap and none in one study: report losses differing by ``diffs``."""
    def group(variant, method, losses):
        at = {k: {} for k in ("report_loss", "train_loss", "max_logit", "first_token")}
        at["report_loss"] = dict(enumerate(losses))
        sweep = {1.0: RateOutcome(select=Summary(n=len(losses), mean=4.0), n=len(losses))}
        cells = {1.0: [{"seed": s, "cell": f"{variant}_s{s}", "path": f"/r/{variant}_s{s}/result.json"}
                       for s in range(len(losses))]}
        return Group(study=study, variant=variant, point="", attention="mha", method=method, controller="none",
                     chosen=1.0, sweep=sweep, cells=cells, at_chosen=at, highest_stable=1.0)
    return [group("qkmap", "qkmap", [4.0 + d for d in diffs]), group("none", "none", [4.0] * len(diffs))]


def test_report_reads_registered_claims_as_confirmatory_and_the_rest_as_exploratory():
    groups = _groups("p", [-0.3, -0.25, -0.35, -0.3, -0.28, -0.32])
    plan = {"qkmap.val_vs_none": parse_plan({"qkmap.val_vs_none": {}})["qkmap.val_vs_none"]}
    studies = {"p": {"name": "p", "plan": {"claims": plan}}}
    rows = {r.id: r for r in claims_table(groups, studies)}
    r = rows["qkmap.val_vs_none"]
    assert r.status == "confirmatory" and r.verdict == "agree"  # 6 seeds, all below: p = 2/64, alone
    assert r.p_holm == pytest.approx(2 / 64)
    assert sorted(r.cells) == sorted(f"/r/{v}_s{s}/result.json" for v in ("qkmap", "none") for s in range(6))
    e = rows["qkmap.train_vs_none"]
    assert e.status == "exploratory" and e.verdict == "exploratory"
    assert not {"agree", "disagree", "inconclusive"} & set(e.reason.split())
    # with nothing registered every claim is exploratory
    assert {r.verdict for r in claims_table(groups, {"p": {"name": "p"}})} == {"exploratory"}


def test_amended_plan_is_marked_with_both_verdicts():
    groups = _groups("p", [-0.3, -0.25, -0.35, -0.3, -0.28, -0.32])
    a = parse_plan({"qkmap.val_vs_none": {}})
    b = parse_plan({"alpha": 0.01, "qkmap.val_vs_none": {}})  # 2/64 = 0.031 is not below 0.01
    sj = amend({"name": "p", "plan": {"claims": a}}, b, "stricter")
    r = {r.id: r for r in claims_table(groups, {"p": sj})}["qkmap.val_vs_none"]
    assert r.amended and r.verdict_registered == "agree"
    assert r.verdict == "underpowered"  # alpha 0.01 needs 8 seeds (2/2^n < 0.01)


def test_a_family_the_seeds_cannot_resolve_is_named():
    from qklab.study.plan import family_power

    plan = parse_plan({"qkmap.val_vs_none": {}, "qkmap.val_vs_qknorm": {}, "quack.stable_mha": {}})
    # two sign-flip claims in QK-MAP's family: 2/2^n * 2 < 0.05 first at n = 7 (0.03125); grid claims don't count
    assert family_power(plan, 7) == []
    (line,) = family_power(plan, 6)
    assert line.startswith("family QK-MAP: 2 registered sign-flip claim(s) at alpha 0.05 need 7 paired seeds")


def test_recency_claims_read_alibi_against_none_and_qkmap_by_the_paired_t_test():
    """studies/recency_english.toml's two claims on planted losses: the paired t-test's p (df 2: the closed
    form 1 - |t| / sqrt(t^2 + 2)), Holm over the family of two, and the verdicts the registered reading needs."""
    def group(variant, losses):
        g = _groups("r", [0.0] * len(losses))[1]  # a `none` group, renamed and refilled
        at = {**g.at_chosen, "report_loss": dict(enumerate(losses))}
        return Group(**{**g.__dict__, "variant": variant, "method": variant, "at_chosen": at})
    none = [4.0, 4.1, 3.9]
    alibi = [n + d for n, d in zip(none, [-0.30, -0.25, -0.35], strict=True)]
    qkmap = [a + d for a, d in zip(alibi, [-0.01, 0.02, -0.02], strict=True)]
    groups = [group("none", none), group("alibi", alibi), group("qkmap", qkmap)]
    plan = parse_plan({"recency.alibi_vs_none": {"test": "t"}, "recency.qkmap_vs_alibi": {"test": "t"}})
    rows = {r.id: r for r in claims_table(groups, {"r": {"name": "r", "plan": {"claims": plan}}})}

    def p_t(diffs):
        n = len(diffs)
        mean = sum(diffs) / n
        sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5
        t = mean / (sd / n ** 0.5)
        return 1 - abs(t) / (t * t + 2) ** 0.5
    p1, p2 = p_t([-0.30, -0.25, -0.35]), p_t([-0.01, 0.02, -0.02])
    a, b = rows["recency.alibi_vs_none"], rows["recency.qkmap_vs_alibi"]
    assert a.family == b.family == "Recency prior" and a.status == b.status == "confirmatory"
    assert a.stats.mean == pytest.approx(-0.30) and b.stats.mean == pytest.approx(-0.01 / 3)
    assert a.stats.p == pytest.approx(p1, rel=1e-6) and b.stats.p == pytest.approx(p2, rel=1e-6)
    assert a.p_holm == pytest.approx(2 * p1) and b.p_holm == pytest.approx(max(2 * p1, p2))
    assert a.verdict == "agree" and b.verdict == "inconclusive"  # the prior alone, by the registered reading
