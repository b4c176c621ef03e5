"""``qklab report DIR...``: read result files (never train), write report.md, report.html (the same Markdown
rendered, figures embedded, self-contained), report.json (the data behind every figure and table) and the
PNGs. Every number of the results and claims tables links to the result.json files it came from."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from qklab.errors import ReportError
from qklab.report.beside import beside_table, corpus_label
from qklab.report.beside import intro as beside_intro
from qklab.report.claims import VERDICT_RULE, claims_table, registered_results
from qklab.report.figures import colours, draw, figure_data, nothing_to_show, variant_name
from qklab.report.html import page
from qklab.report.ladder import INTRO as LADDER_INTRO
from qklab.report.ladder import ladder_table
from qklab.report.predictions import gpu_results, predictions_lines
from qklab.report.probes import probes_tables
from qklab.report.scale import INTRO as SCALE_INTRO
from qklab.report.scale import (
    control_lines,
    draw_scale,
    method_scales,
    scale_data,
    scale_sensitivity_table,
    trends_table,
)
from qklab.report.tables import (
    Cells,
    abs_ci,
    cell_paths,
    claims_links,
    claims_rows,
    collapsed_claims,
    failures_table,
    grid_table,
    has_numbers,
    md_table,
    md_text,
    results_links,
    results_table,
    sensitivity_table,
    stability_table,
    stable_rates_table,
    throughput_table,
    unstable,
)
from qklab.study.analyze import (
    analyze,
    grid_edge,
    load_results,
)
from qklab.study.result import DIVERGENCE_RULE, OUTCOME_RULE, write_json_atomic
from qklab.study.stats import fmt_ci


def summary_lines(groups: list[dict], cells: Cells, limit: int = 12) -> list[str]:
    """The opening block, per variant at its chosen rate: the report loss with its interval and its paired
    difference to the reference; ordered by report loss, at most ``limit`` (the rest: the results table)."""
    ranked = sorted(groups, key=lambda g: (g["chosen"] is None, g["stats"]["report_loss"]["mean"]
                                           if g["stats"]["report_loss"]["n"] else math.inf))
    lines = []
    for g in ranked[:limit]:
        name, st, ch = variant_name(g), g["stats"]["report_loss"], g["chosen"]
        where = f" (`{g['study']}`)" if g.get("multi") else ""
        if ch is None or not st["n"]:
            lines.append(f"- **{md_text(name)}**{where}: no rate eligible (every rate diverged, did not learn or "
                         "failed)")
            continue
        at = cells.link(cell_paths(g, ch), f"{name} ({g['study']}) at its chosen rate x{ch:g}")
        loss = f"report loss {st['mean']:.3f}, 95% CI {abs_ci(st['ci_lo'], st['ci_hi'])}, n={st['n']}"
        line = (f"- **{md_text(name)}**{where} at {g['chosen_lr']:.3g} (x{ch:g}{grid_edge(ch, g['sweep'])}): "
                + (f"[{md_text(loss)}]({at})" if at else md_text(loss)))
        d = g["paired"].get("report_loss")
        if d and d["n"] and g.get("reference") != g["variant"]:
            line += (f"; {d['mean']:+.3f} vs {md_text(str(g['reference']))}, 95% CI "
                     f"{md_text(fmt_ci(d['ci_lo'], d['ci_hi']))}")
        sw = g["sweep"].values()
        total = {"diverged": sum(x["diverged"] for x in sw), "not_learned": sum(x.get("not_learned", 0) for x in sw)}
        bad = ", ".join(f"{n} {what}" for what, n in unstable(total))
        lines.append(line + (f" ({bad} over its rates)" if bad else ""))
    if len(ranked) > limit:
        lines.append(f"- ... and {len(ranked) - limit} more variants: the results table below")
    return lines




































def _sentence(s: str) -> str:
    s = s.strip().rstrip(".")
    return s[:1].upper() + s[1:] + "." if s else ""


def answers(rows: list[dict], cells: Cells) -> list[str]:
    """The opening section: one short answer per registered question (a confirmatory claim): its verdict
    (both, when the plan was amended), interval and n, what it shows and what it does not."""
    conf = [r for r in rows if r.get("status") == "confirmatory"]
    if not conf:
        return ["No claim of these results is marked confirmatory (a registered question); the claims table "
                "lists every claim."]
    lines = ["One answer per registered question (a confirmatory claim), by the verdict rule of the claims "
             "table; the exploratory claims are in that table only.", ""]
    for r in conf:
        verdict = f"**{r['verdict']}**"
        if r.get("amended"):
            verdict += f" under the amended plan; **{r.get('verdict_registered') or '-'}** under the registered plan"
        st = r["stats"]
        holm = f", Holm p {r['p_holm']:.3g}" if math.isfinite(r.get("p_holm", math.nan)) else ""
        if st and st.get("log_ratio"):
            what = f"{st['a']} / {st['b']}: " if st.get("a") else "ratio "
            num = (f"{what}{10 ** st['mean']:.3g}, 95% CI [{10 ** st['ci_lo']:.3g}, {10 ** st['ci_hi']:.3g}], "
                   f"n={st['n']}{holm}")
        elif st:
            what = f"{st['a']} - {st['b']}: " if st.get("a") else "mean difference "
            num = f"{what}{st['mean']:+.3f}, 95% CI {fmt_ci(st['ci_lo'], st['ci_hi'])}, n={st['n']}{holm}"
        else:
            num = f"measured: {r['measured']}" if r["measured"] != "-" else "nothing measured"
        to = cells.link(r.get("cells") or [], f"{r['paper']}: {r['claim']}")
        num = f"[{md_text(num)}]({to})" if to and (st or r["measured"] != "-") else md_text(num)
        shows = r.get("shows") or f"{r['measurement']}: {r['reason']}"
        limits = r.get("not_shows") or f"it does not show the claim beyond this measurement ({r['measurement']})"
        ident = f" ({md_text(r['id'])})" if r.get("id") else ""
        lines.append(f"- **{md_text(r['paper'] + ': ' + r['claim'])}**{ident}: {verdict}; {num}. "
                     f"*Shows:* {md_text(_sentence(shows))} *Limits:* {md_text(_sentence(limits))}")
    return lines




def _progress(name: str, study: dict, results: list[dict]) -> str:
    """'12 of 55 cells finished' from the study's cell list (study.json), with results of cells that are
    no longer in it (a grid changed mid-study) counted apart; '' for a study.json without a cell list."""
    ids = set(study.get("cells") or [])
    if not ids:
        return ""
    have = {r["cell"] for r in results if r.get("study") == name}
    extra = len(have - ids)
    state = "complete" if ids <= have else "in progress"
    return (f" {state}: {len(ids & have)} of {len(ids)} cells finished"
            + (f" (and {extra} result{'s' * (extra > 1)} of cells no longer in the study)" if extra else "") + ";")


def _header(analysis: dict, dirs: list[str], results: list[dict]) -> list[str]:
    studies = analysis["studies"]
    skipped = analysis.get("skipped") or []
    lines = [f"Results: {analysis['n_results']} cells from {', '.join(dirs)}; studies: "
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
    lines += code_lines(results)  # per study (analysis["git_shas"] keeps the HEAD each cell recorded)
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


def registered_groups(results: list[dict], studies: dict[str, dict]) -> list[dict] | None:
    """The analysis groups of the cells of each study's registered design, when an amendment changed one
    (the claims under the registered plan are read on them); None else."""
    first = registered_results(results, studies)
    if first is None:
        return None
    groups = analyze(first, studies)["groups"]
    for g in groups:
        g["multi"] = len(studies) > 1
    return groups


def _load(dirs: list[str | Path], problems: list[str]) -> tuple[list[dict], dict[str, dict]]:
    """The results and studies of ``dirs`` (damaged or duplicate files named in ``problems``); a ReportError
    for a missing folder or no result at all."""
    for d in dirs:
        if not Path(d).is_dir():
            raise ReportError(f"{d}: no such folder; give folders holding result.json files")
    results, studies = load_results(dirs, problems)
    if not results:  # one line: the error, naming the first damaged file
        raise ReportError(f"no result.json under {', '.join(map(str, dirs))}"
                          + (f" ({len(problems)} damaged or duplicate file(s) skipped; {problems[0]})" if problems
                             else "") + "; run `qklab study run` first")
    return results, studies


def claims_of(results: list[dict], studies: dict[str, dict]) -> list[dict]:
    """The claims table (claims.claims_table rows) of one set of results, as the report reads it: each
    study's registered plan, and an amended design's claims also on its registered cells."""
    groups = analyze(results, studies)["groups"]
    for g in groups:
        g["multi"] = len(studies) > 1
    return claims_table(groups, studies, registered_groups(results, studies))


def write_report(dirs: list[str | Path], out: str | Path | None = None, title: str = "qklab report",
                 warn=None, beside: list[str | Path] | None = None) -> Path:
    """Write report.{md,html,json} and the figures to ``out`` (default: the first folder's report/). Damaged
    files and duplicate cells are named through ``warn`` (one line each), skipped, and counted in the report.
    ``beside``: folders of other results (another corpus, say) whose claims table is set beside this one's,
    each read on its own (``beside.beside_table``)."""
    problems: list[str] = []
    results, studies = _load(dirs, problems)
    other: tuple[list[dict], dict[str, dict]] | None = _load(beside, problems) if beside else None
    for msg in problems:
        (warn or (lambda m: None))(f"warning: {msg}")
    analysis = analyze(results, studies)
    analysis["skipped"] = problems
    for g in analysis["groups"]:
        g["multi"] = len(studies) > 1
    analysis["git_shas"] = dict(Counter(str(r["git_sha"]) for r in results if r.get("git_sha")))
    out = Path(out) if out else Path(dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    groups = analysis["groups"]
    data = figure_data(analysis)
    figs = draw(data, out)
    empty = nothing_to_show(data)  # figures not drawn (one rate per variant, no curve of two points), named
    names = list(dict.fromkeys(g["study"] for g in groups))  # one grid table per study, in report order
    grids = {f"grid {n}": grid_table([g for g in groups if g["study"] == n]) for n in names}
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
    if scale_rows:
        tables["scale_sensitivity"] = scale_sensitivity_table(scale_rows)
        tables["scale_trends"] = trends_table(scale_rows)
        data["scale_sensitivity"] = scale_data(scale_rows)
        if fig := draw_scale(data["scale_sensitivity"], out / "scale_sensitivity.png", colours(data)):
            figs["scale_sensitivity"] = fig
    here_label = corpus_label(results)
    if other is not None:  # the headers name the corpora in short; the same corpus twice: "here" and "beside"
        there_label = corpus_label(other[0])
        short = (corpus_label(results, short=True), corpus_label(other[0], short=True))
        tables["beside"] = beside_table(claim_rows, claims_of(*other),
                                        *(short if short[0] != short[1] else ("here", "beside")))
    header = _header(analysis, [str(d) for d in dirs], results)
    captions = {"val_curves": "Selection-split loss over training at each variant's chosen rate (mean, band: "
                              "min-max over seeds).",
                "lr_sensitivity": "Final selection-split loss against the learning rate (mean +- std over seeds).",
                "logit_by_rate": "Final max attention logit on the held-out batch against the learning rate "
                                 "(mean +- std over every finished seed, diverged ones included).",
                "max_logit": "Max attention logit on the held-out batch over training.",
                "logit_change": "Mean absolute logit change per optimizer step between diagnostics.",
                "first_token": "First-token attention at the last diagnostics step, with the uniform-attention "
                               "baseline, and the 0.3 sink threshold where a bar comes near it.",
                "probes": "Attention probes of the final checkpoints (qklab probe; mean over seeds, band: lowest to "
                          "highest seed): retrieval "
                          "evidence contrast and mass against context length, and magnitude sensitivity.",
                "head_max_logit": "Max logit of each head (all layers) over training, at each variant's chosen "
                                  "rate, lowest seed: median line, band from the lowest to the highest head.",
                "head_w_norms": "The norm product ‖W_Q,h‖ ‖W_K,h‖ of each head over training (a head's logits "
                                "scale with it), same runs: median and band over heads.",
                "scale_sensitivity": "LR sensitivity against non-embedding parameters (mean over seeds, band: 95% "
                                     "t-interval), one line per method; the legend gives each fit's slope per decade.",
                "quack_factors": "QuacK's per-head learning-rate factors (W_Q and W_K of every layer) over "
                                 "training, same runs: median and band."}
    sections = [("Results (report split)", "results"),
                *([("The width ladder: gap to the reference by width, each at its chosen rate", "ladder")]
                  if "ladder" in tables else []),
                *([("Learning-rate sensitivity across scale", "scale_sensitivity"),
                   ("Trends across scale: slopes against log10 non-embedding parameters", "scale_trends")]
                  if scale_rows else []),
                *((f"The grid of {k[5:]}: selection loss (mean ± std over seeds) / max logit, by learning rate", k)
                  for k in grids),
                *((f"Attention probes of {k[7:]} at the chosen rates: mean ± std over seeds (difference to the "
                   "reference, paired over seeds, 95% CI)", k) for k in probes),
                ("Learning-rate sensitivity (selection split)", "sensitivity"),
                ("Stability by learning rate (selection split, every seed)", "stability"),
                ("Highest stable rate by both rules, and near the best method", "stable_rates"),
                ("Throughput", "throughput")]
    if tables["failures"][1]:
        sections.append(("Failed cells", "failures"))
    cells = Cells(out)
    numbered = [r for r in claim_rows if has_numbers(r)]  # the rest collapse to one line under the table
    links = {"results": results_links(groups, cells), "claims": claims_links(numbered, cells)}
    conf = [r for r in claim_rows if r.get("status") == "confirmatory"]
    # the answer first: what each variant reached, the registered questions' answers; how it was made, last
    md = [f"# {title}", "", header[0], "", "## What these results say", "", *control_lines(claim_rows),
          *summary_lines(groups, cells), ""]
    if conf:
        md += ["### Registered questions", "", *answers(claim_rows, cells), ""]
    else:
        md += ["No question of these results was registered: every claim in the [claims table](#claims) is "
               "exploratory or not measurable here.", ""]
    intros = {"ladder": LADDER_INTRO, "scale_sensitivity": SCALE_INTRO}
    for name, key in sections:
        md += [f"## {name}", "", *([intros[key], ""] if key in intros else []), md_table(tables[key], links.get(key))]
        if key == "results" and "val_curves" in figs:  # the loss curves right under the numbers they end at
            md += [f"![val_curves]({figs['val_curves'].name})", "", captions["val_curves"], ""]
    md += predictions_lines(studies, gpu_results())  # a study's predictions for larger models, checked or not
    md += ["## Figures", ""]
    for k, p in figs.items():
        if k != "val_curves":
            md += [f"![{k}]({p.name})", "", captions[k], ""]
    md += [f"Not drawn: {k}, {why}." for k, why in empty.items()] + ([""] if empty else [])
    md += ["## How these results were made", "", *header[1:], ""]
    md += ['## <a id="claims"></a>Claims', "",
           "Each claim of the papers as these results can read it, by [the verdict rule](#verdict-rule).", "",
           md_table(claims_rows(groups, numbered), links["claims"]) if numbered else "No claim has a number here.",
           "", *collapsed_claims([r for r in claim_rows if not has_numbers(r)]), ""]
    if other is not None:
        md += [f"## Beside: the same claims on {there_label}", "",
               beside_intro(here_label, there_label, [str(d) for d in beside]), "", md_table(tables["beside"])]
    md += ['## <a id="verdict-rule"></a>The verdict rule', "", VERDICT_RULE, ""]
    if cells.sets:
        md += ["## Cells behind the numbers", "", "A number of the tables above that came from several cells "
               "links here, to the result.json of each (a number from one cell links to its file).", "",
               *cells.section(), ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(page("\n".join(md), title, {p.name: p for p in figs.values()}))
    # what the report was built from, so that it can be checked against those files while a study goes on
    made_from = {"sources": [str(d) for d in dirs], "skipped": problems,
                 "cells": sorted(f"{r.get('study', '')}/{r['cell']}" for r in results),
                 **({"beside": {"sources": [str(d) for d in beside],
                                "cells": sorted(f"{r.get('study', '')}/{r['cell']}" for r in other[0])}}
                    if other is not None else {})}
    write_json_atomic(out / "report.json", {**made_from, "verdict_rule": VERDICT_RULE, "figures": data,
                                            "colours": colours(data),
                                            "tables": {k: {"head": h, "rows": r} for k, (h, r) in tables.items()}})
    return out
