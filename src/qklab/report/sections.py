"""The report's sections, in reading order (``SECTIONS``): the answer first (what each variant reached and
the registered questions' answers), then the tables, the predictions, the figures, how the results were
made, the claims table, the claims beside another corpus's, the verdict rule and the cells behind the
numbers. Each section is one function of the ``Report`` that ``render.build`` computes once; reordering
the report is reordering ``SECTIONS``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qklab.report.beside import intro as beside_intro
from qklab.report.claims import VERDICT_RULE, ClaimRow
from qklab.report.figures import CAPTIONS, variant_name
from qklab.report.holdout import INTRO as HELD_OUT_INTRO
from qklab.report.ladder import INTRO as LADDER_INTRO
from qklab.report.predictions import gpu_results, predictions_lines
from qklab.report.scale import INTRO as SCALE_INTRO
from qklab.report.scale import control_lines
from qklab.report.tables import (
    Cells,
    Table,
    abs_ci,
    cell_paths,
    claims_rows,
    collapsed_claims,
    has_numbers,
    md_table,
    md_text,
    unstable,
)
from qklab.study.analyze import Group, grid_edge
from qklab.study.stats import fmt_ci


@dataclass
class Report:
    """What the sections read, computed once (``render.build``) before the first is written. ``links``:
    table name -> its number links (``tables.results_links``, ``claims_links``), made before any section, so
    the cells behind the numbers are listed in the order the tables cite them."""

    title: str
    header: list[str]  # the one-line summary of the sources, then how the results were made
    groups: list[Group]
    studies: dict[str, dict[str, Any]]
    tables: dict[str, Table]
    grids: list[str]  # the names in ``tables`` of the studies' grids, in report order
    probes: list[str]  # and of their probe tables
    scale: bool  # three widths or more: LR sensitivity and its trends across scale
    figs: dict[str, Path]
    empty: dict[str, str]  # figures not drawn -> why
    claim_rows: list[ClaimRow]
    links: dict[str, Any]
    cells: Cells
    beside: tuple[str, str, list[str]] | None = None  # (here, there, the folders) of the claims set beside
    in_progress: dict[str, str] = field(default_factory=dict)  # study -> "246 of 360 cells finished"

    @property
    def numbered(self) -> list[ClaimRow]:
        """The claims with a number; the rest collapse to one line under the table."""
        return [r for r in self.claim_rows if has_numbers(r)]


def summary_lines(groups: list[Group], cells: Cells, limit: int = 12) -> list[str]:
    """The opening block, per variant at its chosen rate: the report loss with its interval and its paired
    difference to the reference; ordered by report loss, at most ``limit`` (the rest: the results table).
    Where the groups span several grid points (widths, say) or studies, one bullet per point of each study, in
    their order, with its variants ranked under it: one ranking across them would mix model sizes, settings
    or data."""
    points = list(dict.fromkeys((g.study, g.point) for g in groups))
    if len(points) < 2:
        return _ranked(groups, cells, limit, point=True)
    lines = []
    for study, point in points:
        members = [g for g in groups if (g.study, g.point) == (study, point)]
        at = f" at **{md_text(point)}**" if point else ""
        lines.append(f"- `{study}`{at}:" if members[0].multi else f"-{at or ' at **no grid point**'}:")
        lines += ["  " + line for line in _ranked(members, cells, limit, point=False)]
    return lines


def _ranked(groups: list[Group], cells: Cells, limit: int, point: bool) -> list[str]:
    """``summary_lines``'s bullets for ``groups``, best report loss first; ``point``: name the grid point."""
    ranked = sorted(groups, key=lambda g: (g.chosen is None, g.stats["report_loss"].mean
                                           if g.stats["report_loss"].n else math.inf))
    lines = []
    for g in ranked[:limit]:
        full, st, ch = variant_name(g, study=False), g.stats["report_loss"], g.chosen
        name = full if point else g.variant
        where = f" (`{g.study}`)" if g.multi and point else ""
        if ch is None or not st.n:
            lines.append(f"- **{md_text(name)}**{where}: no rate eligible (every rate diverged, did not learn or "
                         "failed)")
            continue
        at = cells.link(cell_paths(g, ch), f"{full} ({g.study}) at its chosen rate x{ch:g}")
        loss = f"report loss {st.mean:.3f}, 95% CI {abs_ci(st.ci_lo, st.ci_hi)}, n={st.n}"
        line = (f"- **{md_text(name)}**{where} at {g.chosen_lr:.3g} (x{ch:g}{grid_edge(ch, g.sweep)}): "
                + (f"[{md_text(loss)}]({at})" if at else md_text(loss)))
        d = g.paired.get("report_loss")
        if d and d.n and g.reference != g.variant:
            line += (f"; {d.mean:+.3f} vs {md_text(str(g.reference))}, 95% CI "
                     f"{md_text(fmt_ci(d.ci_lo, d.ci_hi))}")
        sw = g.sweep.values()
        bad = ", ".join(f"{n} {what}" for what, n in unstable(sum(x.diverged for x in sw),
                                                                 sum(x.not_learned for x in sw)))
        lines.append(line + (f" ({bad} over its rates)" if bad else ""))
    if len(ranked) > limit:
        lines.append(f"- ... and {len(ranked) - limit} more variants: the results table below")
    return lines


def _sentence(s: str) -> str:
    s = s.strip().rstrip(".")
    return s[:1].upper() + s[1:] + "." if s else ""


def answers(rows: list[ClaimRow], cells: Cells) -> list[str]:
    """The opening section: one short answer per registered question (a confirmatory claim): its verdict
    (both, when the plan was amended), interval and n, what it shows and what it does not."""
    conf = [r for r in rows if r.status == "confirmatory"]
    if not conf:
        return ["No claim of these results is marked confirmatory (a registered question); the claims table "
                "lists every claim."]
    lines = ["One answer per registered question (a confirmatory claim), by the verdict rule of the claims "
             "table; the exploratory claims are in that table only.", ""]
    for r in conf:
        verdict = f"**{r.verdict}**"
        if r.amended:
            verdict += f" under the amended plan; **{r.verdict_registered or '-'}** under the registered plan"
        st = r.stats
        holm = f", Holm p {r.p_holm:.3g}" if math.isfinite(r.p_holm) else ""
        if st and st.log_ratio:
            what = f"{st.a} / {st.b}: " if st.a else "ratio "
            num = (f"{what}{10 ** st.mean:.3g}, 95% CI [{10 ** st.ci_lo:.3g}, {10 ** st.ci_hi:.3g}], "
                   f"n={st.n}{holm}")
        elif st and "0" in (st.a, st.b):  # a quantity against zero (a slope, say): the quantity itself
            sign, what = (-1, st.b) if st.a == "0" else (1, st.a)
            lo, hi = sorted((sign * st.ci_lo, sign * st.ci_hi))
            num = f"{what}: {sign * st.mean:+.3f}, 95% CI {fmt_ci(lo, hi)}, n={st.n}{holm}"
        elif st:
            what = f"{st.a} - {st.b}: " if st.a else "mean difference "
            num = f"{what}{st.mean:+.3f}, 95% CI {fmt_ci(st.ci_lo, st.ci_hi)}, n={st.n}{holm}"
        else:
            num = f"measured: {r.measured}" if r.measured != "-" else "nothing measured"
        to = cells.link(r.cells or [], f"{r.paper}: {r.claim}")
        num = f"[{md_text(num)}]({to})" if to and (st or r.measured != "-") else md_text(num)
        shows = r.shows or f"{r.measurement}: {r.reason}"
        limits = r.not_shows or f"it does not show the claim beyond this measurement ({r.measurement})"
        ident = f" ({md_text(r.id)})" if r.id else ""
        lines.append(f"- **{md_text(r.paper + ': ' + r.claim)}**{ident}: {verdict}; {num}. "
                     f"*Shows:* {md_text(_sentence(shows))} *Limits:* {md_text(_sentence(limits))}")
    return lines


def title(r: Report) -> list[str]:
    return [f"# {r.title}", "", r.header[0], ""]


def opening(r: Report) -> list[str]:
    """The answer first: what each variant reached, and the registered questions' answers."""
    control = control_lines(r.claim_rows)  # first, under a heading of its own, when the study registered one
    interim = [f"**Interim**: {', '.join(f'`{n}` is in progress ({p})' for n, p in sorted(r.in_progress.items()))}."
               " Every verdict and figure below is read from the cells finished so far, at the seeds they have, "
               "and may change when the study is complete.", ""] if r.in_progress else []
    md = ["## What these results say", "", *interim, *control,
          *(["### Each variant at its chosen rate", ""] if control else []), *summary_lines(r.groups, r.cells), ""]
    if any(c.status == "confirmatory" for c in r.claim_rows):
        return md + ["### Registered questions", "", *answers(r.claim_rows, r.cells), ""]
    return md + ["No question of these results was registered: every claim in the [claims table](#claims) is "
                 "exploratory or not measurable here.", ""]


def _table_sections(r: Report) -> list[tuple[str, str]]:
    """(heading, table name) of the result tables, in order."""
    return [("Results (report split)", "results"),
            *([("The width ladder: gap to the reference by width, each at its chosen rate", "ladder")]
              if "ladder" in r.tables else []),
            *([("Learning-rate sensitivity across scale", "scale_sensitivity"),
               ("Trends across scale: slopes against log10 non-embedding parameters", "scale_trends")]
              if r.scale else []),
            *([("The widest width held out: each trend fitted on the narrower widths, extrapolated to it "
                "(exploratory)", "scale_held_out")] if "scale_held_out" in r.tables else []),
            *((f"The grid of {k[5:]}: selection loss (mean ± std over seeds) / max logit, by learning rate", k)
              for k in r.grids),
            *((f"Attention probes of {k[7:]} at the chosen rates: mean ± std over seeds (difference to the "
               "reference, paired over seeds, 95% CI)", k) for k in r.probes),
            ("Learning-rate sensitivity (selection split)", "sensitivity"),
            ("Stability by learning rate (selection split, every seed)", "stability"),
            ("Highest stable rate by both rules, and near the best method", "stable_rates"),
            ("Throughput", "throughput"),
            *([("Failed cells", "failures")] if r.tables["failures"][1] else [])]


INTROS = {"ladder": LADDER_INTRO, "scale_sensitivity": SCALE_INTRO, "scale_held_out": HELD_OUT_INTRO}


def result_tables(r: Report) -> list[str]:
    """Every result table under its heading; the loss curves right under the numbers they end at."""
    md: list[str] = []
    for name, key in _table_sections(r):
        md += [f"## {name}", "", *([INTROS[key], ""] if key in INTROS else []),
               md_table(r.tables[key], r.links.get(key))]
        if key == "results" and "val_curves" in r.figs:
            md += [f"![val_curves]({r.figs['val_curves'].name})", "", CAPTIONS["val_curves"], ""]
    return md


def predictions(r: Report) -> list[str]:
    """A study's predictions for larger models, checked against a larger run's results or not yet."""
    return predictions_lines(r.studies, gpu_results())


def figures(r: Report) -> list[str]:
    md = ["## Figures", ""]
    for k, p in r.figs.items():
        if k != "val_curves":
            md += [f"![{k}]({p.name})", "", CAPTIONS[k], ""]
    return md + [f"Not drawn: {k}, {why}." for k, why in r.empty.items()] + ([""] if r.empty else [])


def provenance(r: Report) -> list[str]:
    return ["## How these results were made", "", *r.header[1:], ""]


def claims(r: Report) -> list[str]:
    numbered = r.numbered
    return ['## <a id="claims"></a>Claims', "",
            "Each claim of the papers as these results can read it, by [the verdict rule](#verdict-rule).", "",
            md_table(claims_rows(r.groups, numbered), r.links["claims"]) if numbered
            else "No claim has a number here.",
            "", *collapsed_claims([c for c in r.claim_rows if not has_numbers(c)]), ""]


def beside(r: Report) -> list[str]:
    if r.beside is None:
        return []
    here, there, folders = r.beside
    return [f"## Beside: the same claims on {there}", "", beside_intro(here, there, folders), "",
            md_table(r.tables["beside"])]


def verdict_rule(r: Report) -> list[str]:
    return ['## <a id="verdict-rule"></a>The verdict rule', "", VERDICT_RULE, ""]


def cells_behind(r: Report) -> list[str]:
    if not r.cells.sets:
        return []
    return ["## Cells behind the numbers", "", "A number of the tables above that came from several cells "
            "links here, to the result.json of each (a number from one cell links to its file).", "",
            *r.cells.section(), ""]


SECTIONS: tuple[Callable[[Report], list[str]], ...] = (
    title, opening, result_tables, predictions, figures, provenance, claims, beside, verdict_rule, cells_behind)


def markdown(r: Report) -> str:
    return "\n".join(line for section in SECTIONS for line in section(r))
