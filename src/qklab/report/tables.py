"""The report's tables as data (head, rows of text) and as Markdown, and where their numbers came from: each
number links to the result.json files behind it (``Cells``). ``render.write_report`` puts them in order."""

from __future__ import annotations

import math
import os
from pathlib import Path
from urllib.parse import quote

from qklab.report.claims import ClaimRow, claims_table
from qklab.report.figures import variant_name
from qklab.study.analyze import DELTA, Group, RateOutcome, best_by_place, best_select, grid_edge, highest_within, place
from qklab.study.plan import stored_plan
from qklab.study.stats import Difference, fmt_ci, fmt_mean_std

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
        return [f'- <a id="{anchor}"></a>{md_text(what)}: '
                + ", ".join(f"[{md_text(Path(p).parent.name)}]({self.rel(p)})" for p in paths)
                for paths, (anchor, what) in self.sets.items()]


def md_text(s: str) -> str:
    """Text that Markdown shows as it is (never read as a link, code, emphasis or HTML)."""
    return "".join("\\" + ch if ch in "\\[]`*<" else ch for ch in s)


def cell_paths(g: Group | None, mult: float | None = None) -> list[str]:
    """The result.json paths of a group's cells (analysis ``g.cells``) at one rate multiple, or at every
    rate (None), by rate and seed."""
    cells = g.cells if g is not None else {}
    ms = sorted(cells) if mult is None else [mult] if mult in cells else []
    return [c["path"] for m in ms for c in sorted(cells[m], key=lambda c: c["seed"])]


# the results table's columns, each with the cells its numbers come from (results_links): those at the
# chosen rate, those and the reference's (a paired difference), every cell of the variant, or none
RESULT_COLUMNS = (("variant", None), ("attn", None), ("method", None), ("controller", None),
                  ("lr (chosen)", "chosen"), ("n", "chosen"), ("selection loss", "chosen"), ("report loss", "chosen"),
                  ("95% CI", "chosen"), ("vs reference (paired)", "paired"), ("95% CI", "paired"),
                  ("bootstrap 95%", "paired"), ("p", "paired"), ("max logit", "chosen"), ("first token", "chosen"),
                  ("diverged", "every"), ("not learned", "every"), ("failed", "every"))


def _links(columns: tuple[tuple[str, str | None], ...], targets: dict[str, str | None]) -> dict[int, str | None]:
    """One row's links: each column whose numbers come from a source -> that source's link target."""
    return {i: targets[src] for i, (_, src) in enumerate(columns) if src is not None}


def results_table(groups: list[Group]) -> Table:
    head = [name for name, _ in RESULT_COLUMNS]
    rows = []
    for g in groups:
        st, sw = g.stats, g.sweep
        d = g.paired.get("report_loss")
        ch = g.chosen
        sel = sw[ch].select if ch is not None else None
        nl = sum(s.not_learned for s in sw.values())
        div = sum(s.diverged for s in sw.values()) - nl
        rows.append([
            variant_name(g), g.attention, g.method or "-",
            g.controller or "-", f"{g.chosen_lr:.3g} (x{ch:g}{grid_edge(ch, sw)})" if ch is not None
            else "none eligible",
            str(st["report_loss"].n), fmt_mean_std(sel) if sel else "-", fmt_mean_std(st["report_loss"]),
            abs_ci(st["report_loss"].ci_lo, st["report_loss"].ci_hi),
            f"{d.mean:+.3f} vs {g.reference}" if d and d.n else "-",
            fmt_ci(d.ci_lo, d.ci_hi) if d else "-", fmt_ci(d.boot_lo, d.boot_hi) if d else "-",
            _p(d),
            fmt_mean_std(st["max_logit"], 1), fmt_mean_std(st["first_token"]),
            f"{div}/{g.n_cells}", f"{nl}/{g.n_cells}", f"{len(g.failed)}/{g.n_cells}"])
    return head, rows


FEW_SEEDS = 6  # below this many paired seeds no p-value is printed as if it could decide (sign-flip floor 2/2^n)


def abs_ci(lo: float, hi: float, digits: int = 3) -> str:
    """'[5.019, 5.757]': an interval of an absolute value (a loss), without the signs of a difference's."""
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) and math.isfinite(hi) else "-"


def _p(d: Difference | None) -> str:
    """A paired difference's p-value, or why none is shown: with fewer than FEW_SEEDS seeds the exact
    sign-flip test cannot go below 2/2^n (0.0625 at 5), so a t-test's small p would claim more than the
    seeds can."""
    if not d or not math.isfinite(d.p):
        return "-"
    if d.n < FEW_SEEDS:
        return f"n={d.n} too few (sign-flip floor {2 / 2 ** d.n:.2g})"
    return f"{d.p:.3g}"


def unstable(diverged: int, not_learned: int) -> list[tuple[str, int]]:
    """[("diverged", 1), ("not learned", 2)]: of the seeds the registered rule counts as diverged (a rate's,
    ``RateOutcome``, or a variant's over its rates), those that blew up and those that did not learn,
    where there are any."""
    return [(what, n) for what, n in (("diverged", diverged - not_learned), ("not learned", not_learned)) if n]


def results_links(groups: list[Group], cells: Cells) -> Links:
    """The results table's numbers: those at the chosen rate from its cells, the paired ones from those
    and the reference's, the diverged, not learned and failed counts from every cell of the variant."""
    by_key = {(g.study, g.point, g.variant): g for g in groups}
    out = []
    for g in groups:
        name, ch = f"{variant_name(g, study=False)} ({g.study})", g.chosen
        if ch is None:
            at = paired = None
        else:
            at = cells.link(cell_paths(g, ch), f"{name} at its chosen rate x{ch:g}")
            ref = by_key.get((g.study, g.point, g.reference))
            paired_ok = ref is not None and ref is not g and ref.chosen is not None
            both = cell_paths(g, ch) + (cell_paths(ref, ref.chosen) if paired_ok else [])
            paired = cells.link(both, f"{name} and its reference {g.reference}, each at its chosen rate")
        every = cells.link(cell_paths(g), f"{name} at every rate")
        out.append(_links(RESULT_COLUMNS, {"chosen": at, "paired": paired, "every": every}))
    return out


def sensitivity_table(groups: list[Group]) -> Table:
    mults = sorted({m for g in groups for m in g.sweep})
    head = ["variant", "attn", *[f"x{m:g}" for m in mults], "chosen", "highest stable"]
    rows = []
    for g in groups:
        cells = []
        for m in mults:
            s = g.sweep.get(m)
            if s is None:
                cells.append("not run")
            elif s.diverged and s.diverged == s.n - s.failed:
                cells.append(", ".join(f"{what} ({n}/{s.n})" for what, n in unstable(s.diverged, s.not_learned)))
            else:
                cells.append(fmt_mean_std(s.select) + "".join(f", {n} {what}" for what, n in
                                                              unstable(s.diverged, s.not_learned))
                             + (f", {s.failed} failed" if s.failed else ""))
        hs = g.highest_stable
        rows.append([variant_name(g), g.attention, *cells, f"x{g.chosen:g}" if g.chosen is not None else "-",
                     f"x{hs:g}" if hs is not None else "-"])
    return head, rows


def _late(s: RateOutcome) -> str:
    """'0.102 (1750-2000)': the mean fall of the selection loss over the last evaluation interval, over
    the seeds that did not diverge; a run that still falls fast at the end has not converged."""
    d, st = s.late_drop, s.late_steps
    return f"{d.mean:.3f} ({st[0]}-{st[1]})" if d.n and st else "-"


def stability_table(groups: list[Group]) -> Table:
    """Every variant at every rate: selection loss (all finished seeds) and its margin below the unigram
    entropy (0 or less: a plateau at token frequencies, not learned, which the rules count as diverged), how
    far it still fell over the last evaluation interval, final max logit, loss spikes, and the seeds that
    diverged (blew up), did not learn, failed."""
    head = ["variant", "attn", "lr", "n", "selection loss (all seeds)", "below unigram", "still falling",
            "max logit (end)", "loss spikes", "diverged", "not learned", "failed"]
    rows = []
    for g in groups:
        uni = g.unigram_entropy
        for m, s in sorted(g.sweep.items()):
            sel = s.select_all
            ml = s.max_logit or {"mean": float("nan"), "n": 0}
            rows.append([variant_name(g), g.attention, f"{s.lr:.3g} (x{m:g})", str(s.n), fmt_mean_std(sel),
                         f"{uni - sel.mean:.3f}" if sel.n else "-", _late(s),
                         f"{ml.mean:.1f}" if ml.n else "-", str(s.spikes),
                         f"{s.diverged - s.not_learned}/{s.n}", f"{s.not_learned}/{s.n}", f"{s.failed}/{s.n}"])
    return head, rows


def _delta(study: dict | None) -> float:
    """The delta a study registered for its stability claims (``[claims] delta``), else analyze's default."""
    plan = stored_plan(study) or {}
    return next((p["delta"] for p in plan.values() if "delta" in p), DELTA)


def stable_rates_table(groups: list[Group], studies: dict[str, dict]) -> Table:
    """Each variant's highest rate that holds, by both rules: the entropy rule (no seed diverged, i.e. ended
    above the unigram entropy) and the delta rule (besides, its mean selection loss within delta nats of its
    own best rate), and the highest rate at which it is within delta of the best variant at its place
    (study, grid point, attention type). Delta: the study's registered one, else the default."""
    head = ["variant", "attn", "study", "delta (nats)", "best selection loss", "highest stable: entropy rule",
            "highest stable: delta rule", "highest within delta of the best variant"]
    best = best_by_place(groups)
    rows = []
    for g in groups:
        d, b = _delta(studies.get(g.study)), best.get(place(g))

        def rate(m, g=g):
            return f"{g.sweep[m].lr:.3g} (x{m:g})" if m is not None else "none"
        own = best_select(g)
        rows.append([variant_name(g, study=False), g.attention, g.study, f"{d:g}",
                     f"{own:.3f}" if math.isfinite(own) else "-",
                     rate(g.highest_stable), rate(highest_within(g, d)),
                     rate(highest_within(g, d, b)) if b is not None else "none"])
    return head, rows


def grid_table(groups: list[Group]) -> Table:
    """The whole grid at a glance, one row per learning rate and one column per variant: final
    selection-split loss over every finished seed (mean ± std) / mean final max logit, and how many seeds
    diverged or did not learn. Give it one study's groups: a column per variant and grid point."""
    lrs = sorted({round(s.lr, 12) for g in groups for s in g.sweep.values() if math.isfinite(s.lr)})
    head = ["lr", *(variant_name(g, study=False) for g in groups)]
    rows = []
    for lr in lrs:
        row = [f"{lr:.3g}"]
        for g in groups:
            s = next((s for s in g.sweep.values() if round(s.lr, 12) == lr), None)
            if s is None or s.n == s.failed:
                row.append("-" if s is None else f"failed ({s.failed}/{s.n})")
                continue
            ml, bad = s.max_logit, ", ".join(f"{k}/{s.n} {what}" for what, k in unstable(s.diverged, s.not_learned))
            row.append(fmt_mean_std(s.select_all, 2)
                       + (f" / {ml.mean:.0f}" if ml.n else "") + (f" ({bad})" if bad else ""))
        rows.append(row)
    return head, rows


def throughput_table(groups: list[Group]) -> Table:
    ref = {}
    for g in groups:
        if g.variant == g.reference:
            ref[(g.study, g.point, g.attention)] = g.stats["tokens_per_s"].mean
    head = ["variant", "attn", "tokens/s (mean over seeds)", "relative to reference", "CPU s per cell"]
    rows = []
    for g in groups:
        t = g.stats["tokens_per_s"].mean
        r = ref.get((g.study, g.point, g.attention))
        cpu = g.stats["cpu_seconds"].mean
        rows.append([variant_name(g), g.attention, f"{t:,.0f}" if math.isfinite(t) else "-",
                     f"{t / r:.2f}x" if r and math.isfinite(t) and math.isfinite(r) else "-",
                     f"{cpu:,.0f}" if math.isfinite(cpu) else "-"])
    return head, rows


def failures_table(groups: list[Group]) -> Table:
    return ["cell", "failure", "log"], [[f["cell"], f["failure"] or "", f["log"] or ""]
                                        for g in groups for f in g.failed]


def _g(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if x is not None and math.isfinite(x) else "-"


def _verdict(r: ClaimRow) -> str:
    """The verdict column: the verdict in bold; an exploratory claim's reads 'exploratory' alone."""
    return "exploratory" if "exploratory" in (r.status, r.verdict) else f"**{r.verdict}**"


def _reason(r: ClaimRow) -> str:
    """The reason; for an amended plan, also the verdict and reason under the registered one."""
    if not r.amended:
        return r.reason
    why = f" ({r.reason_registered})" if r.reason_registered else ""
    return f"{r.reason} (amended plan); under the registered plan: {r.verdict_registered or '-'}{why}"


# the claims table's columns: what it measured and its statistics come from the claim's cells
CLAIM_COLUMNS = (("paper", None), ("claim", None), ("measurement", None), ("measured here", "claim"), ("verdict", None),
                 ("reason", None), ("verdict (old rule)", None), *((name, "claim") for name in (
                     "n", "df", "mean difference", "95% t-interval", "bootstrap 95%", "effect (mean/sd)", "p (t)",
                     "p (sign-flip)", "p Holm", "q BH")))  # Holm and BH of the registered test's p (verdict rule)


def claims_rows(groups: list[Group], rows: list[ClaimRow] | None = None, studies: dict | None = None) -> Table:
    """The claims table: the verdict by claims.VERDICT_RULE, the old rule's, and each paired claim's
    statistics (its family is its paper). ``rows``: claims_table(groups, studies), if already made; the
    report passes the studies (their registered plans), as write_report does."""
    rows = claims_table(groups, studies) if rows is None else rows
    head = [name for name, _ in CLAIM_COLUMNS]
    body = []
    for r in rows:
        st = r.stats
        cols = (["-"] * 10 if st is None else
                [str(st.n), str(st.df), f"{st.mean:+.3f}", fmt_ci(st.ci_lo, st.ci_hi),
                 fmt_ci(st.boot_lo, st.boot_hi), _g(st.effect), _g(st.p), _g(st.p_flip),
                 _g(r.p_holm), _g(r.q_bh)])
        body.append([r.paper, r.claim, r.measurement, r.measured, _verdict(r), _reason(r),
                     r.verdict_old, *cols])
    return head, body


def has_numbers(r: ClaimRow) -> bool:
    """Whether a claims row carries a measurement (the rest collapse to one line in the report)."""
    return r.stats is not None or r.measured != "-"


def collapsed_claims(rows: list[ClaimRow]) -> list[str]:
    """One line for the claims without a number here, grouped by verdict (not measurable, exploratory)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(_verdict(r).strip("*"), []).append(f"{r.paper}: {r.claim}")
    return [f"Without a number in these results ({len(rows)}), {verdict} ({len(names)}): "
            + "; ".join(md_text(n) for n in names) + "." for verdict, names in by.items()]


def claims_links(rows: list[ClaimRow], cells: Cells) -> Links:
    """Every number of a claim's row (what it measured, its statistics) from the claim's cells."""
    return [_links(CLAIM_COLUMNS, {"claim": cells.link(r.cells or [], f"{r.paper}: {r.claim}")}) for r in rows]


def md_table(t: Table, links: Links | None = None) -> str:
    """A Markdown table; with ``links``, a cell that holds a number links to where it came from."""
    head, rows = t

    def cell(c: str, to: str | None) -> str:
        c = f"[{md_text(c)}]({to})" if to and any(ch.isdigit() for ch in c) else c
        return c.replace("|", "\\|")
    body = [[cell(c, links[i].get(j) if links else None) for j, c in enumerate(r)] for i, r in enumerate(rows)]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r) + " |" for r in body)]) + "\n"

