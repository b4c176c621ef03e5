"""The published results stay true to the code: each committed reproduction study (logit control on MHA
and MLA, its width ladder, QK-MAP), once complete and analysed by the current code, gives the claims
table its committed report shows and the verdicts docs/results/README.md states. A change to the
analysis or the claims that moves a published verdict fails here, and the report must be rebuilt
(`qklab report docs/results/<study> --out docs/results/<study>/report`) and the text revised with it.
Every committed report, complete or not, must also hold the claims and results tables that its
committed result files give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qklab.report.claims import claims_table
from qklab.report.render import claims_rows, registered_groups
from qklab.study.analyze import analyze, load_results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
STUDIES = {  # study -> cells when complete
    "logit_control_cpu": 90,  # 7 variants on their rate grids, 2 seeds
    "logit_control_mla_cpu": 66,  # 5 variants on their rate grids, 2 seeds
    "qkmap_cpu": 65,  # 3 variants on their rate grids and 2 matched-range ablations at x2, 5 seeds
    "logit_control_width": 24,  # none and QuacK at 3 widths x 2 rates, 2 seeds (8 reused cells)
}
RATE_SWEEPS = ("logit_control_cpu", "logit_control_mla_cpu", "qkmap_cpu")  # the width ladder tunes no rate
EXPECT = {  # study -> {claim: (verdict, verdict by the old rule, figure)}: claims.VERDICT_RULE; the old rule is
    # the verdict docs/results/README.md's study sections state (the whole interval on one side). Paired claims
    # at 2 (logit control) or 5 (QK-MAP) seeds are underpowered; the grid-rule ones keep their verdict.
    "logit_control_cpu": {
        # the grid claims by the amended plan's near-best rule (within 0.1 nats of the best method, no divergence)
        "allows a higher base learning rate than no intervention (MHA)":
            ("inconclusive", "inconclusive", "quack-t1 x0.3, none x0.3"),
        "stable where QK-clip diverges at high rates (MHA)": ("inconclusive", "inconclusive", "qkclip-1.5x x0.3"),
        "competitive with QK-Norm with MHA (not worse by more than 0.05 nats)":
            ("underpowered", "inconclusive", "quack-t1 - qknorm: +0.130, 95% CI [-0.099, +0.359]"),
        "better than the fixed-multiplier ablation":
            ("underpowered", "disagree", "quack-t0.1 - multiplier-t0.1: +0.024, 95% CI [+0.010, +0.038]"),
        "keeps attention logits smaller than no intervention (MHA)":
            ("underpowered", "inconclusive", "quack-t1 / none at x30: 0.325, 95% CI [0.0899, 1.18]"),
    },
    "logit_control_mla_cpu": {
        "allows a higher base learning rate than no intervention (MLA)":
            ("agree", "agree", "mla-quack-t1 x1, mla-none x0.3"),
        "stable where QK-clip diverges at high rates (MLA)": ("agree", "agree", "mla-qkclip-1.5x x0.3"),
        "outperforms no intervention in the MLA setting":
            ("underpowered", "inconclusive", "mla-quack-t1 - mla-none: +0.045, 95% CI [-0.245, +0.336]"),
        "outperforms QK-Normed MLA in the MLA setting":
            ("underpowered", "inconclusive", "mla-quack-t1 - mla-qknorm: +0.000, 95% CI [-0.172, +0.172]"),
        "outperforms QK-clip in the MLA setting":
            ("underpowered", "inconclusive", "mla-quack-t1 - mla-qkclip-1.5x: +0.049, 95% CI [-0.202, +0.299]"),
        "keeps attention logits smaller than no intervention (MLA)":
            ("underpowered", "agree", "mla-quack-t1 / mla-none at x10: 0.0267, 95% CI [0.0191, 0.0374]"),
    },
    "qkmap_cpu": {
        "lower validation loss than Standard attention":
            ("underpowered", "agree", "qkmap - none: -0.330, 95% CI [-0.575, -0.084]"),
        "lower validation loss than QK-Norm":
            ("underpowered", "inconclusive", "qkmap - qknorm: -0.167, 95% CI [-0.475, +0.142]"),
        "lower training loss than Standard attention":
            ("underpowered", "agree", "qkmap - none: -0.242, 95% CI [-0.421, -0.063]"),
        "lower training loss than QK-Norm":
            ("underpowered", "inconclusive", "qkmap - qknorm: -0.119, 95% CI [-0.343, +0.104]"),
        "less attention on the first token than Standard attention":
            ("underpowered", "agree", "qkmap - none: -0.006, 95% CI [-0.008, -0.004]"),
        "keeps sensitivity to input scale (unlike QK-Norm)":
            ("underpowered", "agree", "qknorm - qkmap: -0.453, 95% CI [-0.476, -0.430]"),
        "stronger attention contrast on relevant evidence at long context":
            ("underpowered", "inconclusive", "none - qkmap: -1.620, 95% CI [-3.795, +0.554]"),
    },
    "logit_control_width": {
        "its advantage over no intervention grows with width (the paper's argument)":
            ("underpowered", "agree", "gap at width 64 - gap at width 256: -0.364, 95% CI [-0.442, -0.286]"),
    },
}


def _complete(study: str) -> bool:
    d = RESULTS / study
    return (d / "study.json").exists() and len(list(d.glob("*/result.json"))) == STUDIES[study]


@pytest.fixture(scope="module", params=[
    pytest.param(s, marks=pytest.mark.skipif(not _complete(s), reason=f"{s}: not complete in docs/results"))
    for s in STUDIES])
def study(request):
    return request.param


@pytest.fixture(scope="module")
def groups(study):
    results, studies = load_results([RESULTS / study])
    assert len(results) == STUDIES[study]
    return analyze(results, studies).groups


@pytest.fixture(scope="module")
def rows(study, groups):
    return claims_rows(groups, studies=load_results([RESULTS / study])[1])


def test_published_chosen_rates_are_interior(study, groups):
    """docs/results/README.md: every variant's chosen rate has a worse rate run above it and, except at
    the bottom of QK-clip's grid (below its threshold it is the reference run), below it. Variants run at
    one rate only (qkmap_cpu's matched-range ablations) have no sweep to be interior to."""
    if study not in RATE_SWEEPS:
        pytest.skip(f"{study} runs two fixed rates, not a rate sweep")
    for g in groups:
        if study == "logit_control_cpu":
            assert g.chosen_lr == pytest.approx(3e-3), g.variant
        sweep = g.sweep
        mults = sorted(sweep)
        if len(mults) == 1:
            continue
        i = mults.index(g.chosen)
        best = sweep[g.chosen].select.mean
        assert sweep[mults[i + 1]].select.mean > best, g.variant
        if "qkclip" in g.variant:
            assert i == 0
        else:
            assert i > 0 and sweep[mults[i - 1]].select.mean > best, g.variant


def test_committed_report_matches_the_code(study, rows):
    committed = json.loads((RESULTS / study / "report" / "report.json").read_text())["tables"]["claims"]
    assert [committed["head"], committed["rows"]] == [rows[0], rows[1]]


ROOT = RESULTS.parents[1]
COMMITTED = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("report.json"))  # every report, combined too


def _named(report: Path, made_from: dict) -> tuple[list, dict]:
    """The results and studies a report was built from: the folders it names (else the one beside it), only
    the cells it names where it names them (a combined report is a snapshot while a study goes on), every
    one of which must still be there."""
    sources = [ROOT / s for s in made_from.get("sources", [])] or [report.parents[1]]
    results, studies = load_results(sources)
    if "cells" in made_from:
        have = {f"{r['study']}/{r['cell']}": r for r in results}
        missing = sorted(set(made_from["cells"]) - set(have))
        assert not missing, f"{report}: built from cells that are no longer there: {missing[:5]}"
        results = [have[c] for c in made_from["cells"]]
    return results, studies


def _rebuilt_tables(report: Path) -> tuple[dict, list, dict, list | None]:
    """The committed report.json's tables, and what the current code makes of the result files it was
    built from (``_named``)."""
    committed = json.loads(report.read_text())
    results, studies = _named(report, committed)
    groups = analyze(results, studies).groups
    return committed["tables"], groups, studies, registered_groups(results, studies)


@pytest.mark.parametrize("report_json", COMMITTED)
def test_every_committed_report_matches_its_results(report_json):
    """Any committed report, complete or in progress (the demo's and the combined one too): its claims
    and results tables (its width-ladder, scale and beside tables too, where it has them) are what the current
    code makes of the result files it was built from. Fails when a cell was committed without rebuilding the
    report, or when a change to the analysis moves a published number."""
    from qklab.report.holdout import held_out, held_out_table
    from qklab.report.ladder import ladder_table
    from qklab.report.render import results_table
    from qklab.report.scale import method_scales, scale_sensitivity_table, trends_table

    tables, groups, studies, first = _rebuilt_tables(RESULTS / report_json)
    rows = claims_table(groups, studies, first)
    want = {"claims": claims_rows(groups, rows), "results": results_table(groups)}
    ladder = ladder_table(groups)
    if ladder[1] or "ladder" in tables:  # a study with a width grid: its gap by width
        want["ladder"] = ladder
    scale = method_scales(groups)
    if scale or "scale_sensitivity" in tables:  # a width ladder of three or more widths: its trends
        want["scale_sensitivity"], want["scale_trends"] = scale_sensitivity_table(scale), trends_table(scale)
        held = held_out(scale)  # four widths or more: the widest held out of each trend
        if held or "scale_held_out" in tables:
            want["scale_held_out"] = held_out_table(held)
    beside = json.loads((RESULTS / report_json).read_text()).get("beside")
    if beside is not None:  # the claims of other results set beside these (qklab report --beside)
        from qklab.report.beside import beside_table
        from qklab.report.render import claims_of

        head = tables["beside"]["head"]
        there = claims_of(*_named(RESULTS / report_json, beside))
        want["beside"] = beside_table(rows, there, head[2].split(", ", 1)[1], head[5].split(", ", 1)[1])
    for name, (head, body) in want.items():
        assert [tables[name]["head"], tables[name]["rows"]] == [head, body], f"{report_json}: {name} table"


REGISTERED = {  # table -> the columns of the registered statistics (None: every column)
    "claims": None, "stable_rates": None, "results": ("variant", "attn", "lr (chosen)", "n"),
    "sensitivity": ("variant", "attn", "chosen", "highest stable")}


def _columns(table: dict | list, names: tuple[str, ...] | None) -> list[list[str]]:
    head, rows = (table["head"], table["rows"]) if isinstance(table, dict) else table
    idx = [head.index(n) for n in names] if names is not None else range(len(head))
    return [[head[i] for i in idx], *([r[i] for i in idx] for r in rows)]


@pytest.mark.parametrize("report_json", COMMITTED)
def test_committed_verdicts_and_rates_do_not_move(report_json):
    """What the registered rules decide from the committed result files, whatever the tables show besides:
    every claim's verdict (the claims table), each variant's chosen rate and highest stable rate by every rule
    (the results, sensitivity and stable-rates tables' columns of them) are those its report.json records. A
    change to how outcomes are shown (diverged apart from not learned) leaves them where they are."""
    from qklab.report.render import results_table, sensitivity_table, stable_rates_table

    tables, groups, studies, first = _rebuilt_tables(RESULTS / report_json)
    now = {"claims": claims_rows(groups, claims_table(groups, studies, first)), "results": results_table(groups),
           "sensitivity": sensitivity_table(groups), "stable_rates": stable_rates_table(groups, studies)}
    for name, cols in REGISTERED.items():
        assert _columns(now[name], cols) == _columns(tables[name], cols), f"{report_json}: {name} table"


def test_published_verdicts(study, rows):
    got = {r[1]: (r[4], r[3], r[6]) for r in rows[1]}
    for claim, (verdict, old, figure) in EXPECT[study].items():
        assert got[claim][0] == f"**{verdict}**", (claim, got[claim])
        assert got[claim][2] == old, (claim, got[claim])
        assert figure in got[claim][1], (claim, got[claim])


CODE_CLAIMS = "### Claims of both papers: where each stands"
ENGLISH_CLAIMS = "### Claims on natural English beside Python source"


def _readme_section(heading: str) -> list[list[str]]:
    """docs/results/README.md's table rows of one claim (paper first) under ``heading``, up to the next heading."""
    rows, inside = [], False
    for line in (RESULTS / "README.md").read_text().splitlines():
        if line.startswith("#"):
            inside = line.strip() == heading
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if inside and len(cells) >= 4 and cells[0] in ("QK-MAP", "QuacK"):
            rows.append(cells)
    return rows


def _verdict_of(cell: str) -> str:
    """The verdict a cell starts with ('**agree** (old rule: ...)' -> 'agree')."""
    return cell.split("**")[1] if cell.startswith("**") else cell


def _readme_claims() -> dict[str, str]:
    """docs/results/README.md's claims table of the code studies: claim -> the verdict its row starts with."""
    return {r[1]: _verdict_of(r[3]) for r in _readme_section(CODE_CLAIMS)}


@pytest.mark.skipif(not (RESULTS / "report" / "report.json").exists(), reason="no combined report committed")
def test_results_readme_states_the_combined_reports_verdicts():
    """The claims table of docs/results/README.md has a row for every claim of the combined report
    (docs/results/report/), with the verdict that report gives it."""
    committed = json.loads((RESULTS / "report" / "report.json").read_text())["tables"]["claims"]["rows"]
    readme = _readme_claims()
    want = {r[1]: r[4].strip("*") for r in committed}
    assert {c: readme.get(c) for c in want} == want


@pytest.mark.skipif(not (RESULTS / "report_english" / "report.json").exists(),
                    reason="no combined English report committed yet (the English studies are running)")
def test_results_readme_states_the_english_verdicts_beside_the_code_ones():
    """docs/results/README.md's English claims table: a row for every claim of the combined English report's
    beside table, its third column starting with the English verdict and its fourth with the Python-source
    verdict, as that table gives them."""
    beside = json.loads((RESULTS / "report_english" / "report.json").read_text())["tables"]["beside"]
    want = {r[1]: (_verdict_of(r[2]), _verdict_of(r[5])) for r in beside["rows"]}
    readme = {r[1]: (_verdict_of(r[2]), _verdict_of(r[3])) for r in _readme_section(ENGLISH_CLAIMS)}
    assert {c: readme.get(c) for c in want} == want


ROW_KEYS = {  # table -> the columns that name one row: a group (variant, grid point, study), at a rate
    "results": ("variant", "attn"), "sensitivity": ("variant", "attn"), "throughput": ("variant", "attn"),
    "stability": ("variant", "attn", "lr")}


@pytest.mark.parametrize("report_json", COMMITTED)
def test_every_row_of_a_committed_report_names_its_group(report_json):
    """A reader tells the rows apart: in a study with a grid of widths or a report of several studies, a row
    carries its grid point and study, so no two rows of a table read alike (the sensitivity, stability and
    throughput tables once named the variant alone: `none | mha` four times in the width ladder's)."""
    tables = json.loads((RESULTS / report_json).read_text())["tables"]
    for name, cols in ROW_KEYS.items():
        if name in tables:
            keys = [tuple(r) for r in _columns(tables[name], cols)[1:]]
            assert len(set(keys)) == len(keys), f"{report_json}: {name}: {[k for k in keys if keys.count(k) > 1]}"
