"""The same claims on two sets of results side by side (``qklab report DIR... --beside DIR...``): each set is
read on its own, by the same verdict rule, with its own families and registered plans, and one row per claim
that either set registered gives both verdicts, what each measured, its n and its test. The usual use: the
studies on one corpus beside the same questions asked earlier on another."""

from __future__ import annotations

import math
from typing import Any

from qklab.report.claim_row import ClaimRow

Table = tuple[list[str], list[list[str]]]

CORPUS_NAMES = {"pystdlib": "Python source", "english": "natural English"}


def corpus_label(results: list[dict[str, Any]], short: bool = False) -> str:
    """What the results trained on, from their configs: 'natural English (`english`)' ('natural English'
    when ``short``); several sources joined with ' + ', in order of first appearance."""
    sources = dict.fromkeys(((r.get("config") or {}).get("data") or {}).get("source") for r in results
                            if r.get("status") != "failed")
    names = [(CORPUS_NAMES.get(s, s), s) if s else ("an unrecorded corpus", None) for s in sources]
    return " + ".join(n if short or s is None else f"{n} (`{s}`)" for n, s in names) or "no corpus"


def _test(r: ClaimRow | None) -> str:
    """n, the test and its family-adjusted p, in a few words."""
    if r is None:
        return "-"
    st = r.stats
    if st is None:
        return "grid rule" if r.measured != "-" else "-"
    holm = r.p_holm
    adj = f", Holm p {holm:.3g}" if isinstance(holm, float) and math.isfinite(holm) else ""
    return f"n={st.n}, sign-flip p {st.p_flip:.3g}{adj}"


def _verdict(r: ClaimRow | None) -> str:
    """The verdict by the current rule (bold); for an amended plan, the registered plan's beside it. A claim
    the set did not register is 'exploratory' where its cells measure it and 'not run' where they do not."""
    if r is None:
        return "not run"
    if r.status != "confirmatory":
        return "exploratory" if r.measured != "-" else "not run"
    v = f"**{r.verdict}**"
    if r.amended and r.verdict_registered not in (None, r.verdict):
        v += f" (registered plan: {r.verdict_registered})"
    return v


def beside_table(here: list[ClaimRow], there: list[ClaimRow], here_label: str,
                 there_label: str) -> Table:
    """One row per claim registered (confirmatory) in either claims table (``claims.claims_table`` rows):
    its verdict, measurement and test on each, and the other set's verdict by the old rule."""
    by_id = {r.id: r for r in there}
    head = ["paper", "claim", f"verdict, {here_label}", f"measured, {here_label}", f"n and test, {here_label}",
            f"verdict, {there_label}", f"measured, {there_label}", f"n and test, {there_label}",
            f"old rule, {there_label}"]
    body = []
    for r in here:
        o = by_id.get(r.id)
        if "confirmatory" not in (r.status, o.status if o else None):
            continue
        body.append([r.paper, r.claim, _verdict(r), r.measured, _test(r), _verdict(o),
                     o.measured if o else "-", _test(o), o.verdict_old if o else "-"])
    return head, body


def intro(here_label: str, there_label: str, there_dirs: list[str]) -> str:
    return (f"Every claim registered in either set of results, its verdict here (on {here_label}) beside the one "
            f"the results of {', '.join(there_dirs)} give (on {there_label}). Each set is read on its own cells by "
            "the verdict rule of the claims table, with its own registered plans and its own families (Holm within "
            "each), so a row compares two answers, not a pooled one. 'old rule': the verdict those results were "
            "first published with (the whole 95% interval on one side). Where the two verdicts differ, the claim "
            "depends on the corpus, on the seeds or on the design at this scale; the measured columns say which.")
