"""``qklab report DIR...``: read result files (never train), write report.md, report.html (the same Markdown
rendered, figures embedded, self-contained), report.json (the data behind every figure and table) and the
PNGs. Every number of the results and claims tables links to the result.json files it came from."""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from urllib.parse import quote

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
from qklab.study.analyze import (
    DELTA,
    analyze,
    best_by_place,
    best_select,
    grid_edge,
    highest_within,
    load_results,
    place,
)
from qklab.study.plan import stored_plan
from qklab.study.result import DIVERGENCE_RULE, OUTCOME_RULE, write_json_atomic
from qklab.study.stats import fmt_ci, fmt_mean_std

Table = tuple[list[str], list[list[str]]]
Links = list[dict[int, str | None]]  # per table row: column -> the link target of its number


class Cells:
    """Where the report's numbers came from. A number from one cell links to its result.json (a path
    relative to the report's folder); a number from several links to their list in the report's last
    section (``section``), one entry per set of cells."""

    def __init__(self, out: Path):
        self.out = out
        self.sets: dict[tuple[str, ...], tuple[str, str]] = {}  # paths -> (anchor, what they are)

    def rel(self, path: str) -> str:
        return quote(os.path.relpath(os.path.abspath(path), os.path.abspath(self.out)).replace(os.sep, "/"))

    def link(self, paths: list[str], what: str) -> str | None:
        paths = tuple(dict.fromkeys(str(p) for p in paths if p))
        if len(paths) < 2:
            return self.rel(paths[0]) if paths else None
        if paths not in self.sets:
            self.sets[paths] = (f"cells-{len(self.sets) + 1}", what)
        return "#" + self.sets[paths][0]

    def section(self) -> list[str]:
        return [f'- <a id="{anchor}"></a>{_md_text(what)}: '
                + ", ".join(f"[{_md_text(Path(p).parent.name)}]({self.rel(p)})" for p in paths)
                for paths, (anchor, what) in self.sets.items()]


def _md_text(s: str) -> str:
    """Text that Markdown shows as it is (never read as a link, code, emphasis or HTML)."""
    return "".join("\\" + ch if ch in "\\[]`*<" else ch for ch in s)


def _paths(g: dict | None, mult: float | None = None) -> list[str]:
    """The result.json paths of a group's cells (analysis ``g["cells"]``) at one rate multiple, or at every
    rate (None), by rate and seed."""
    cells = (g or {}).get("cells") or {}
    ms = sorted(cells) if mult is None else [mult] if mult in cells else []
    return [c["path"] for m in ms for c in sorted(cells[m], key=lambda c: c["seed"])]


def results_table(groups: list[dict]) -> Table:
    head = ["variant", "attn", "method", "controller", "lr (chosen)", "n", "selection loss", "report loss",
            "95% CI", "vs reference (paired)", "95% CI", "bootstrap 95%", "p", "max logit", "first token",
            "diverged", "not learned", "failed"]
    rows = []
    for g in groups:
        st, sw = g["stats"], g["sweep"]
        d = g["paired"].get("report_loss")
        ch = g["chosen"]
        sel = sw[ch]["select"] if ch is not None else None
        nl = sum(s.get("not_learned", 0) for s in sw.values())
        div = sum(s["diverged"] for s in sw.values()) - nl
        rows.append([
            variant_name(g), g["attention"], g["method"] or "-",
            g["controller"] or "-", f"{g['chosen_lr']:.3g} (x{ch:g}{grid_edge(ch, sw)})" if ch is not None
            else "none eligible",
            str(st["report_loss"]["n"]), fmt_mean_std(sel) if sel else "-", fmt_mean_std(st["report_loss"]),
            abs_ci(st["report_loss"]["ci_lo"], st["report_loss"]["ci_hi"]),
            f"{d['mean']:+.3f} vs {g['reference']}" if d and d["n"] else "-",
            fmt_ci(d["ci_lo"], d["ci_hi"]) if d else "-", fmt_ci(d["boot_lo"], d["boot_hi"]) if d else "-",
            _p(d),
            fmt_mean_std(st["max_logit"], 1), fmt_mean_std(st["first_token"]),
            f"{div}/{g['n_cells']}", f"{nl}/{g['n_cells']}", f"{len(g['failed'])}/{g['n_cells']}"])
    return head, rows


FEW_SEEDS = 6  # below this many paired seeds no p-value is printed as if it could decide (sign-flip floor 2/2^n)


def abs_ci(lo: float, hi: float, digits: int = 3) -> str:
    """'[5.019, 5.757]': an interval of an absolute value (a loss), without the signs of a difference's."""
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) and math.isfinite(hi) else "-"


def _p(d: dict | None) -> str:
    """A paired difference's p-value, or why none is shown: with fewer than FEW_SEEDS seeds the exact
    sign-flip test cannot go below 2/2^n (0.0625 at 5), so a t-test's small p would claim more than the
    seeds can."""
    if not d or not math.isfinite(d.get("p", math.nan)):
        return "-"
    if d["n"] < FEW_SEEDS:
        return f"n={d['n']} too few (sign-flip floor {2 / 2 ** d['n']:.2g})"
    return f"{d['p']:.3g}"


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
            lines.append(f"- **{_md_text(name)}**{where}: no rate eligible (every rate diverged, did not learn or "
                         "failed)")
            continue
        at = cells.link(_paths(g, ch), f"{name} ({g['study']}) at its chosen rate x{ch:g}")
        loss = f"report loss {st['mean']:.3f}, 95% CI {abs_ci(st['ci_lo'], st['ci_hi'])}, n={st['n']}"
        line = (f"- **{_md_text(name)}**{where} at {g['chosen_lr']:.3g} (x{ch:g}{grid_edge(ch, g['sweep'])}): "
                + (f"[{_md_text(loss)}]({at})" if at else _md_text(loss)))
        d = g["paired"].get("report_loss")
        if d and d["n"] and g.get("reference") != g["variant"]:
            line += (f"; {d['mean']:+.3f} vs {_md_text(str(g['reference']))}, 95% CI "
                     f"{_md_text(fmt_ci(d['ci_lo'], d['ci_hi']))}")
        sw = g["sweep"].values()
        total = {"diverged": sum(x["diverged"] for x in sw), "not_learned": sum(x.get("not_learned", 0) for x in sw)}
        bad = ", ".join(f"{n} {what}" for what, n in unstable(total))
        lines.append(line + (f" ({bad} over its rates)" if bad else ""))
    if len(ranked) > limit:
        lines.append(f"- ... and {len(ranked) - limit} more variants: the results table below")
    return lines


def unstable(s: dict) -> list[tuple[str, int]]:
    """[("diverged", 1), ("not learned", 2)]: a rate's seeds that blew up and that did not learn (the
    registered rule's diverged seeds, ``analyze``'s sweep), those it has."""
    nl = s.get("not_learned", 0)
    return [(what, n) for what, n in (("diverged", s["diverged"] - nl), ("not learned", nl)) if n]


def results_links(groups: list[dict], cells: Cells) -> Links:
    """The results table's numbers: those at the chosen rate from its cells, the paired ones from those
    and the reference's, the diverged, not learned and failed counts from every cell of the variant."""
    by_key = {(g["study"], g["point"], g["variant"]): g for g in groups}
    out = []
    for g in groups:
        name, ch = f"{variant_name(g)} ({g['study']})", g["chosen"]
        if ch is None:
            at = paired = None
        else:
            at = cells.link(_paths(g, ch), f"{name} at its chosen rate x{ch:g}")
            ref = by_key.get((g["study"], g["point"], g.get("reference")))
            paired_ok = ref is not None and ref is not g and ref["chosen"] is not None
            both = _paths(g, ch) + (_paths(ref, ref["chosen"]) if paired_ok else [])
            paired = cells.link(both, f"{name} and its reference {g.get('reference')}, each at its chosen rate")
        every = cells.link(_paths(g), f"{name} at every rate")
        out.append({**dict.fromkeys((4, 5, 6, 7, 8, 13, 14), at), **dict.fromkeys((9, 10, 11, 12), paired),
                    15: every, 16: every, 17: every})
    return out


def sensitivity_table(groups: list[dict]) -> Table:
    mults = sorted({m for g in groups for m in g["sweep"]})
    head = ["variant", "attn", *[f"x{m:g}" for m in mults], "chosen", "highest stable"]
    rows = []
    for g in groups:
        cells = []
        for m in mults:
            s = g["sweep"].get(m)
            if s is None:
                cells.append("not run")
            elif s["diverged"] and s["diverged"] == s["n"] - s["failed"]:
                cells.append(", ".join(f"{what} ({n}/{s['n']})" for what, n in unstable(s)))
            else:
                cells.append(fmt_mean_std(s["select"]) + "".join(f", {n} {what}" for what, n in unstable(s))
                             + (f", {s['failed']} failed" if s["failed"] else ""))
        hs = g["highest_stable"]
        rows.append([g["variant"], g["attention"], *cells, f"x{g['chosen']:g}" if g["chosen"] is not None else "-",
                     f"x{hs:g}" if hs is not None else "-"])
    return head, rows


def _late(s: dict) -> str:
    """'0.102 (1750-2000)': the mean fall of the selection loss over the last evaluation interval, over
    the seeds that did not diverge; a run that still falls fast at the end has not converged."""
    d, st = s.get("late_drop") or {"n": 0}, s.get("late_steps")
    return f"{d['mean']:.3f} ({st[0]}-{st[1]})" if d["n"] and st else "-"


def stability_table(groups: list[dict]) -> Table:
    """Every variant at every rate: selection loss (all finished seeds) and its margin below the unigram
    entropy (0 or less: a plateau at token frequencies, not learned, which the rules count as diverged), how
    far it still fell over the last evaluation interval, final max logit, loss spikes, and the seeds that
    diverged (blew up), did not learn, failed."""
    head = ["variant", "attn", "lr", "n", "selection loss (all seeds)", "below unigram", "still falling",
            "max logit (end)", "loss spikes", "diverged", "not learned", "failed"]
    rows = []
    for g in groups:
        uni = g.get("unigram_entropy", float("nan"))
        for m, s in sorted(g["sweep"].items()):
            sel = s.get("select_all", s["select"])
            ml = s.get("max_logit") or {"mean": float("nan"), "n": 0}
            rows.append([g["variant"], g["attention"], f"{s['lr']:.3g} (x{m:g})", str(s["n"]), fmt_mean_std(sel),
                         f"{uni - sel['mean']:.3f}" if sel["n"] else "-", _late(s),
                         f"{ml['mean']:.1f}" if ml["n"] else "-", str(s.get("spikes", 0)),
                         f"{s['diverged'] - s.get('not_learned', 0)}/{s['n']}",
                         f"{s.get('not_learned', 0)}/{s['n']}", f"{s['failed']}/{s['n']}"])
    return head, rows


def _delta(study: dict | None) -> float:
    """The delta a study registered for its stability claims (``[claims] delta``), else analyze's default."""
    plan = stored_plan(study) or {}
    return next((p["delta"] for p in plan.values() if "delta" in p), DELTA)


def stable_rates_table(groups: list[dict], studies: dict[str, dict]) -> Table:
    """Each variant's highest rate that holds, by both rules: the entropy rule (no seed diverged, i.e. ended
    above the unigram entropy) and the delta rule (besides, its mean selection loss within delta nats of its
    own best rate), and the highest rate at which it is within delta of the best variant at its place
    (study, grid point, attention type). Delta: the study's registered one, else the default."""
    head = ["variant", "attn", "study", "delta (nats)", "best selection loss", "highest stable: entropy rule",
            "highest stable: delta rule", "highest within delta of the best variant"]
    best = best_by_place(groups)
    rows = []
    for g in groups:
        d, b = _delta(studies.get(g["study"])), best.get(place(g))

        def rate(m, g=g):
            return f"{g['sweep'][m]['lr']:.3g} (x{m:g})" if m is not None else "none"
        own = best_select(g)
        rows.append([variant_name(g), g["attention"], g["study"], f"{d:g}", f"{own:.3f}" if math.isfinite(own) else "-",
                     rate(g["highest_stable"]), rate(highest_within(g, d)),
                     rate(highest_within(g, d, b)) if b is not None else "none"])
    return head, rows


def grid_table(groups: list[dict]) -> Table:
    """The whole grid at a glance, one row per learning rate and one column per variant: final
    selection-split loss over every finished seed (mean ± std) / mean final max logit, and how many seeds
    diverged or did not learn. Give it one study's groups: a column per variant and grid point."""
    lrs = sorted({round(s["lr"], 12) for g in groups for s in g["sweep"].values() if math.isfinite(s["lr"])})
    head = ["lr", *map(variant_name, groups)]
    rows = []
    for lr in lrs:
        row = [f"{lr:.3g}"]
        for g in groups:
            s = next((s for s in g["sweep"].values() if round(s["lr"], 12) == lr), None)
            if s is None or s["n"] == s["failed"]:
                row.append("-" if s is None else f"failed ({s['failed']}/{s['n']})")
                continue
            ml, bad = s["max_logit"], ", ".join(f"{k}/{s['n']} {what}" for what, k in unstable(s))
            row.append(fmt_mean_std(s.get("select_all", s["select"]), 2)
                       + (f" / {ml['mean']:.0f}" if ml["n"] else "") + (f" ({bad})" if bad else ""))
        rows.append(row)
    return head, rows


def throughput_table(groups: list[dict]) -> Table:
    ref = {}
    for g in groups:
        if g["variant"] == g.get("reference"):
            ref[(g["study"], g["point"], g["attention"])] = g["stats"]["tokens_per_s"]["mean"]
    head = ["variant", "attn", "tokens/s (mean over seeds)", "relative to reference", "CPU s per cell"]
    rows = []
    for g in groups:
        t = g["stats"]["tokens_per_s"]["mean"]
        r = ref.get((g["study"], g["point"], g["attention"]))
        cpu = g["stats"]["cpu_seconds"]["mean"]
        rows.append([g["variant"], g["attention"], f"{t:,.0f}" if math.isfinite(t) else "-",
                     f"{t / r:.2f}x" if r and math.isfinite(t) and math.isfinite(r) else "-",
                     f"{cpu:,.0f}" if math.isfinite(cpu) else "-"])
    return head, rows


def failures_table(groups: list[dict]) -> Table:
    return ["cell", "failure", "log"], [[f["cell"], f["failure"] or "", f["log"] or ""]
                                        for g in groups for f in g["failed"]]


def _g(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if x is not None and math.isfinite(x) else "-"


def _verdict(r: dict) -> str:
    """The verdict column: the verdict in bold; an exploratory claim's reads 'exploratory' alone."""
    return "exploratory" if "exploratory" in (r.get("status"), r["verdict"]) else f"**{r['verdict']}**"


def _reason(r: dict) -> str:
    """The reason; for an amended plan, also the verdict and reason under the registered one."""
    if not r.get("amended"):
        return r["reason"]
    why = f" ({r['reason_registered']})" if r.get("reason_registered") else ""
    return f"{r['reason']} (amended plan); under the registered plan: {r.get('verdict_registered') or '-'}{why}"


def claims_rows(groups: list[dict], rows: list[dict] | None = None, studies: dict | None = None) -> Table:
    """The claims table: the verdict by claims.VERDICT_RULE, the old rule's, and each paired claim's
    statistics (its family is its paper). ``rows``: claims_table(groups, studies), if already made; the
    report passes the studies (their registered plans), as write_report does."""
    rows = claims_table(groups, studies) if rows is None else rows
    head = ["paper", "claim", "measurement", "measured here", "verdict", "reason", "verdict (old rule)", "n", "df",
            "mean difference", "95% t-interval", "bootstrap 95%", "effect (mean/sd)", "p (t)", "p (sign-flip)",
            "p Holm (sign-flip)", "q BH (sign-flip)"]
    body = []
    for r in rows:
        st = r["stats"]
        cols = (["-"] * 10 if st is None else
                [str(st["n"]), str(st["df"]), f"{st['mean']:+.3f}", fmt_ci(st["ci_lo"], st["ci_hi"]),
                 fmt_ci(st["boot_lo"], st["boot_hi"]), _g(st["effect"]), _g(st["p"]), _g(st["p_flip"]),
                 _g(r["p_holm"]), _g(r["q_bh"])])
        body.append([r["paper"], r["claim"], r["measurement"], r["measured"], _verdict(r), _reason(r),
                     r["verdict_old"], *cols])
    return head, body


def has_numbers(r: dict) -> bool:
    """Whether a claims row carries a measurement (the rest collapse to one line in the report)."""
    return r["stats"] is not None or r["measured"] != "-"


def collapsed_claims(rows: list[dict]) -> list[str]:
    """One line for the claims without a number here, grouped by verdict (not measurable, exploratory)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(_verdict(r).strip("*"), []).append(f"{r['paper']}: {r['claim']}")
    return [f"Without a number in these results ({len(rows)}), {verdict} ({len(names)}): "
            + "; ".join(_md_text(n) for n in names) + "." for verdict, names in by.items()]


def claims_links(rows: list[dict], cells: Cells) -> Links:
    """Every number of a claim's row (what it measured, its statistics) from the claim's cells."""
    return [dict.fromkeys((3, *range(7, 17)), cells.link(r.get("cells") or [], f"{r['paper']}: {r['claim']}"))
            for r in rows]


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
        num = f"[{_md_text(num)}]({to})" if to and (st or r["measured"] != "-") else _md_text(num)
        shows = r.get("shows") or f"{r['measurement']}: {r['reason']}"
        limits = r.get("not_shows") or f"it does not show the claim beyond this measurement ({r['measurement']})"
        ident = f" ({_md_text(r['id'])})" if r.get("id") else ""
        lines.append(f"- **{_md_text(r['paper'] + ': ' + r['claim'])}**{ident}: {verdict}; {num}. "
                     f"*Shows:* {_md_text(_sentence(shows))} *Limits:* {_md_text(_sentence(limits))}")
    return lines


def md_table(t: Table, links: Links | None = None) -> str:
    """A Markdown table; with ``links``, a cell that holds a number links to where it came from."""
    head, rows = t

    def cell(c: str, to: str | None) -> str:
        c = f"[{_md_text(c)}]({to})" if to and any(ch.isdigit() for ch in c) else c
        return c.replace("|", "\\|")
    body = [[cell(c, links[i].get(j) if links else None) for j, c in enumerate(r)] for i, r in enumerate(rows)]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r) + " |" for r in body)]) + "\n"


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
    empty = nothing_to_show(data)  # figures not drawn: one rate per variant, no curve of two points
    for k in empty:  # not drawn: no PNG of it stays (a file from an earlier build included)
        (out / f"{k}.png").unlink(missing_ok=True)
    figs = {k: v for k, v in figs.items() if k not in empty}
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
