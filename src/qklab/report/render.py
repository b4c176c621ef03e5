"""``qklab report DIR...``: read result files (never train), write report.md, report.html (the same Markdown
rendered, figures embedded, self-contained), report.json (the data behind every figure and table) and the
PNGs. Every number of the results and claims tables links to the result.json files it came from."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from qklab.errors import ReportError
from qklab.report.beside import beside_table, corpus_label
from qklab.report.claims import VERDICT_RULE, ClaimRow, claims_table, registered_results
from qklab.report.figures import colours, draw, figure_data, nothing_to_show
from qklab.report.holdout import held_out, held_out_data, held_out_table
from qklab.report.html import page
from qklab.report.ladder import ladder_table
from qklab.report.probes import probes_tables
from qklab.report.scale import (
    draw_scale,
    method_scales,
    scale_data,
    scale_sensitivity_table,
    trends_table,
)
from qklab.report.sections import Report, markdown
from qklab.report.tables import (
    Cells,
    claims_links,
    claims_rows,
    failures_table,
    grid_table,
    results_links,
    results_table,
    sensitivity_table,
    stability_table,
    stable_rates_table,
    throughput_table,
)
from qklab.study.analyze import Analysis, Group, analyze, load_results
from qklab.study.plan import registered_design
from qklab.study.result import DIVERGENCE_RULE, OUTCOME_RULE, write_json_atomic

IN_PROGRESS = "in progress"


def _progress(name: str, study: dict, results: list[dict]) -> str:
    """'12 of 55 cells finished' from the study's cell list (study.json), with results of cells that are
    no longer in it (a grid changed mid-study) counted apart; '' for a study.json without a cell list."""
    ids = set(study.get("cells") or [])
    if not ids:
        return ""
    have = {r["cell"] for r in results if r.get("study") == name}
    extra = len(have - ids)
    state = "complete" if ids <= have else IN_PROGRESS
    return (f" {state}: {len(ids & have)} of {len(ids)} cells finished"
            + (f" (and {extra} result{'s' * (extra > 1)} of cells no longer in the study)" if extra else "") + ";")


def _header(analysis: Analysis, dirs: list[str], results: list[dict], skipped: list[str]) -> list[str]:
    studies = analysis.studies
    lines = [f"Results: {analysis.n_results} cells from {', '.join(dirs)}; studies: "
             f"{', '.join(sorted(studies)) or '-'}."
             + (f" Skipped {len(skipped)} damaged or duplicate file(s): "
                + "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else "") + "." if skipped else "")]
    for name, s in sorted(studies.items()):
        p = s.get("protocol", {})
        per_variant = f" (per variant: {p.get('lr_mults_for')})" if p.get("lr_mults_for") else ""
        lines.append(f"- `{name}`:{_progress(name, s, results)} base config `{s.get('config')}`, seeds "
                     f"{s.get('seeds')}, rate multiples {p.get('lr_mults')}{per_variant}, reference "
                     f"{p.get('reference')}, " + (f"batch order seed {p.get('data_seed')} (every cell sees the same "
                     "tokens in the same order)." if isinstance(p.get("data_seed"), int) and p["data_seed"] >= 0
                     else "batch order varied with the seed (each seed its own order of the same tokens).")
                     + _design_amendments(s))
    lines += ["",
              "Protocol: each variant's learning rate is chosen on the *selection* half of the held-out text "
              "(lowest mean final loss over seeds among rates where no seed diverged); every reported loss comes "
              "from the *report* half, read once at the end. Intervals are 95% t-intervals over seeds; paired "
              "differences compare two variants on the same seeds, each at its own chosen rate (paired t-test "
              "and a percentile bootstrap over seeds; in the claims table also the exact sign-flip test, "
              "adjusted across each paper's claims). A chosen rate at the top or bottom of its variant's grid (of "
              "three rates or more) is marked so: its optimum may lie beyond the grid.", "",
              f"Divergence rule: {DIVERGENCE_RULE}. The tables show its two kinds apart: {OUTCOME_RULE}."]
    lines += code_lines(results)  # per study
    return lines


def _design_amendments(study_json: dict) -> str:
    """" Its design was amended ...": what each design amendment changed, and why, from plan_history."""
    hist = study_json.get("plan_history") if isinstance(study_json.get("plan_history"), list) else []
    moved = [e for e in hist if isinstance(e, dict) and isinstance(e.get("design"), dict)]
    if not moved:
        return ""
    parts = [f"{e.get('at', '?')}: {', '.join(e['design'].get('changed') or [])} ({e.get('why', '')})" for e in moved]
    n_first = len((moved[0]["design"].get("old") or {}).get("cells") or [])
    return (f" Its design was amended after results, in the open: {'; '.join(parts)}. The claims are read under "
            f"the registered design too (its {n_first} cells).")


def code_version_of(r: dict) -> str:
    """The code that trained a cell: the commit its study process imported (``code``; "+diff <sha>" for a
    dirty tree), else the HEAD its cell recorded (``git_sha``, results from before ``code`` existed)."""
    c = r.get("code") if isinstance(r.get("code"), dict) else None
    if c and c.get("commit"):
        return str(c["commit"])[:12] + (f"+diff {str(c.get('diff_sha256'))[:12]}" if c.get("dirty") else "")
    return str(r.get("git_sha") or "unknown")[:12] + (" (HEAD at the cell's start)" if r.get("git_sha") else "")


def code_lines(results: list[dict]) -> list[str]:
    """Per study, the code versions that trained its cells, with a warning when there are several."""
    if all(code_version_of(r) == "unknown" for r in results):
        return ["", "Code version: unknown (the cells recorded no commit: qklab ran from an installed package, "
                    "not a git checkout)."]
    by_study: dict[str, Counter] = {}
    for r in results:
        by_study.setdefault(r.get("study", ""), Counter())[code_version_of(r)] += 1
    out = []
    for study, versions in sorted(by_study.items()):
        listed = ", ".join(f"{v} ({n})" for v, n in sorted(versions.items(), key=lambda x: (-x[1], x[0])))
        warn = (f" **Warning: {len(versions)} code versions trained this study's cells**; numbers of cells trained "
                "by different code may differ for that reason alone." if len(versions) > 1 else "")
        out += ["", f"Code versions of `{study or '?'}` (cells): {listed}.{warn}"]
    return out


def registered_groups(results: list[dict], studies: dict[str, dict]) -> list[Group] | None:
    """The analysis groups of the cells of each study's registered design, when an amendment changed one
    (the claims under the registered plan are read on them); None else."""
    first = registered_results(results, studies)
    if first is None:
        return None
    # read against each study's registered design too: its rate grid (LR sensitivity counts a seed only where
    # it finished every registered rate, and the amended grid's added rates never ran in the first design)
    return analyze(first, {name: {**s, **registered_design(s)} for name, s in studies.items()}).groups


def _load(dirs: list[str | Path], problems: list[str]) -> tuple[list[dict], dict[str, dict]]:
    """The results and studies of ``dirs`` (damaged or duplicate files named in ``problems``); a ReportError
    for a missing folder or no result at all."""
    for d in dirs:
        if not Path(d).is_dir():
            what = "a file, not a folder" if Path(d).exists() else "no such folder"
            raise ReportError(f"{d}: {what}; give folders holding result.json files")
    results, studies = load_results(dirs, problems)
    if not results:  # one line: the error, naming the first damaged file
        raise ReportError(f"no result.json under {', '.join(map(str, dirs))}"
                          + (f" ({len(problems)} damaged or duplicate file(s) skipped; {problems[0]})" if problems
                             else "") + "; run `qklab study run` first")
    return results, studies


def claims_of(results: list[dict], studies: dict[str, dict]) -> list[ClaimRow]:
    """The claims table (claims.claims_table rows) of one set of results, as the report reads it: each
    study's registered plan, and an amended design's claims also on its registered cells."""
    groups = analyze(results, studies).groups
    return claims_table(groups, studies, registered_groups(results, studies))


Loaded = tuple[list[dict], dict[str, dict]]  # (results, studies) of a set of folders


def build(dirs: list[str | Path], loaded: Loaded, out: Path, title: str, problems: list[str],
          beside: list[str | Path] | None = None, other: Loaded | None = None) -> tuple[Report, dict[str, Any]]:
    """Everything the report's sections read, and report.json's provenance and figure data; the figures
    drawn into ``out``. ``other``: the results and studies of the ``beside`` folders."""
    results, studies = loaded
    analysis = analyze(results, studies)
    groups = analysis.groups
    data = figure_data(groups)
    figs = draw(data, out)
    empty = nothing_to_show(data)  # figures not drawn (one rate per variant, no curve of two points), named
    names = list(dict.fromkeys(g.study for g in groups))  # one grid table per study, in report order
    grids = {f"grid {n}": grid_table([g for g in groups if g.study == n]) for n in names}
    probes = probes_tables(groups)
    # each study's registered plan: confirmatory or not (an amended design: also on the registered cells)
    claim_rows = claims_table(groups, studies, registered_groups(results, studies))
    tables = {"results": results_table(groups), **grids, **probes, "sensitivity": sensitivity_table(groups),
              "throughput": throughput_table(groups), "claims": claims_rows(groups, claim_rows),
              "stability": stability_table(groups), "stable_rates": stable_rates_table(groups, studies),
              "failures": failures_table(groups)}
    ladder = ladder_table(groups)
    if ladder[1]:  # a study with a width grid
        tables["ladder"] = ladder
    scale_rows = method_scales(groups)  # three widths or more: LR sensitivity and trends across scale
    held = held_out(scale_rows)  # four widths or more: the widest held out of each trend
    if scale_rows:
        tables["scale_sensitivity"] = scale_sensitivity_table(scale_rows)
        tables["scale_trends"] = trends_table(scale_rows)
        if held:
            tables["scale_held_out"] = held_out_table(held)
        data["scale_sensitivity"] = scale_data(scale_rows)
        if fig := draw_scale(data["scale_sensitivity"], out / "scale_sensitivity.png", colours(data)):
            figs["scale_sensitivity"] = fig
    side = None
    if other is not None:  # the headers name the corpora in short; the same corpus twice: "here" and "beside"
        short = (corpus_label(results, short=True), corpus_label(other[0], short=True))
        tables["beside"] = beside_table(claim_rows, claims_of(*other),
                                        *(short if short[0] != short[1] else ("here", "beside")))
        side = (corpus_label(results), corpus_label(other[0]), [str(d) for d in beside or []])
    cells = Cells(out)
    report = Report(title=title, header=_header(analysis, [str(d) for d in dirs], results, problems), groups=groups,
                    studies=studies, tables=tables, grids=list(grids), probes=list(probes), scale=bool(scale_rows),
                    figs=figs, empty=empty, claim_rows=claim_rows, links={}, cells=cells, beside=side,
                    in_progress={n: p.strip(" ;")[len(IN_PROGRESS) + 2:] for n, s in studies.items()
                                 if (p := _progress(n, s, results)).strip().startswith(IN_PROGRESS)})
    report.links.update(results=results_links(groups, cells), claims=claims_links(report.numbered, cells))
    made_from = {"sources": [str(d) for d in dirs], "skipped": problems,
                 "cells": sorted(f"{r.get('study', '')}/{r['cell']}" for r in results),
                 **({"beside": {"sources": [str(d) for d in beside or []],
                                "cells": sorted(f"{r.get('study', '')}/{r['cell']}" for r in other[0])}}
                    if other is not None else {})}
    return report, {**made_from, "verdict_rule": VERDICT_RULE, "figures": data, "colours": colours(data),
                    **({"held_out": held_out_data(held)} if held else {})}


def write_report(dirs: list[str | Path], out: str | Path | None = None, title: str = "qklab report",
                 warn=None, beside: list[str | Path] | None = None) -> Path:
    """Write report.{md,html,json} and the figures to ``out`` (default: the first folder's report/). Damaged
    files and duplicate cells are named through ``warn`` (one line each), skipped, and counted in the report.
    ``beside``: folders of other results (another corpus, say) whose claims table is set beside this one's,
    each read on its own (``beside.beside_table``)."""
    problems: list[str] = []
    loaded = _load(dirs, problems)
    other = _load(beside, problems) if beside else None
    for msg in problems:
        (warn or (lambda m: None))(f"warning: {msg}")
    out = Path(out) if out else Path(dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    report, made_from = build(dirs, loaded, out, title, problems, beside, other)
    md = markdown(report)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(page(md, title, {p.name: p for p in report.figs.values()}))
    # what the report was built from, so that it can be checked against those files while a study goes on
    write_json_atomic(out / "report.json", {**made_from, "tables": {k: {"head": h, "rows": r}
                                                                    for k, (h, r) in report.tables.items()}})
    return out
