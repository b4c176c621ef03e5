"""The claims table: every claim of the catalogue (``study.catalogue``), measured on a study's groups
(``study.measures``), with a verdict and its reason by the rule in VERDICT_RULE (the one statement of it;
the report prints it). Beside the verdict, each paired claim carries its
statistics (n, df, mean difference, t-interval, bootstrap interval, effect size mean / sd, the t and the
exact sign-flip p-values, and the p-value of its registered test (sign-flip, or the t-test for a claim
registered with test = "t") adjusted across its family by Holm and by Benjamini-Hochberg), and the
verdict of the rule used before (the whole 95% t-interval on one side) for comparison.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from qklab.report import controls
from qklab.report.claim_row import ClaimRow
from qklab.study.analyze import Group
from qklab.study.catalogue import CATALOGUE, T_TEST
from qklab.study.measures import NOT_MEASURABLE, as_ratio
from qklab.study.plan import design, registered_design, registered_plan, stored_plan
from qklab.study.stats import benjamini_hochberg, holm, min_seeds

ALPHA = 0.05
MIN_SEEDS = min_seeds(ALPHA)  # 6: with n seeds the smallest two-sided sign-flip p is 2 / 2^n, 0.0625 at n = 5

VERDICT_RULE = (
    'Verdict rule. A paired claim (a mean difference over seeds, each seed pairing the two methods) is tested'
    ' against zero, or against its stated margin, by the exact sign-flip (permutation) test over seeds: the '
    'two-sided p-value is the share of all 2^n sign assignments of the paired differences whose mean is at '
    'least as far from zero as the observed one. Only the claims a study registered in its [claims] before '
    'its first cell (or in the open since, with qklab study amend) get a verdict; the others are '
    '**exploratory**: their numbers describe, they do not test. The registered claims of one family (by '
    "default one paper's: QK-MAP's claims one, QuacK's another) have their sign-flip p-values (every paired "
    "claim that could be measured, whatever its number of seeds) adjusted by Holm's step-down method "
    '(family-wise error; the verdicts use it) and by Benjamini-Hochberg (false discovery rate; shown as a '
    f'column, not used by the verdicts). A claim with fewer than {MIN_SEEDS} paired seeds is **underpowered**:'
    f' with n seeds the smallest two-sided sign-flip p is 2/2^n, which is not below alpha = {ALPHA:g} for n < '
    f'{MIN_SEEDS} (a claim registered at another alpha uses its own), so no outcome could support or refute '
    'it. Otherwise it is **agree** when the Holm-adjusted p is below alpha and the whole 95% t-interval lies '
    'on the claimed side of zero (or of the margin), **disagree** when the Holm-adjusted p is below it and '
    'the interval lies on the other side, and **inconclusive** else. Claims read from the learning-rate grid '
    '(the highest rate with no diverged seed, or the registered stability rule) are not a test over seeds: '
    'they keep the grid rule, stay outside the families, and their verdict is the same under both rules. '
    'A claim registered with test = "t" (the scale and recency claims) is tested by the paired t-test in place '
    "of the sign-flip test: its two-sided t p-value is what Holm and Benjamini-Hochberg adjust (the columns "
    "'p Holm' and 'q BH' adjust each claim's registered test's p), from 2 paired seeds (a t-test can reach "
    'alpha there, with little power), and it is agree or disagree as above. '
    '**not measurable**: the study has no cells, probes or rate grid that could test it. The effect size is '
    '(mean difference - margin) / sd of the differences; for the logit claims the statistics are of log10 of '
    "the ratio. The column 'verdict (old rule)' gives the rule used before, for comparison: agree or disagree"
    ' when the whole 95% t-interval lies on one side, inconclusive when it contains zero (or the margin) or '
    'one seed was run.')


def _new_verdict(old: str, reason: str, st: dict | None, p_holm: float, alpha: float = ALPHA,
                 test: str | None = None) -> tuple[str, str]:
    """VERDICT_RULE, from the old rule's verdict and reason, the claim's statistics and its Holm p (of the
    t-test's p for a claim registered with test = "t")."""
    if test == T_TEST and st is not None and old != NOT_MEASURABLE and st.n < 2:
        return "underpowered", f"{st.n} seed: the paired t-test needs 2 or more (old rule: {reason})"
    if test == T_TEST and st is not None and old != NOT_MEASURABLE:
        side = "below" if st.ci_hi < st.margin else "above" if st.ci_lo > st.margin else None
        if p_holm < alpha and side:
            return ("agree" if side == "below" else "disagree"), (
                f"paired t-test, Holm p = {p_holm:.3g} < {alpha:g}: {reason}")
        return "inconclusive", (f"paired t-test, Holm p = {p_holm:.3g} is not below {alpha:g}" if p_holm >= alpha
                                else f"paired t-test: {reason}")
    verdict, why = _new_verdict_raw(old, reason, st, p_holm, alpha)
    return verdict, (as_ratio(why) if st and st.log_ratio and st.n >= min_seeds(alpha) else why)


def _new_verdict_raw(old: str, reason: str, st: dict | None, p_holm: float, alpha: float) -> tuple[str, str]:
    if st is None or old == NOT_MEASURABLE:  # a grid-rule claim, or nothing to test
        return old, reason
    need = min_seeds(alpha)
    if st.n < need:
        return "underpowered", (f"{st.n} paired seed{'s' * (st.n > 1)}: the exact sign-flip test needs "
                                f"{need} to reach p < {alpha:g} (old rule: {reason})")
    side = "below" if st.ci_hi < st.margin else "above" if st.ci_lo > st.margin else None
    if p_holm < alpha and side:
        return ("agree" if side == "below" else "disagree"), (
            f"Holm p = {p_holm:.3g} < {alpha:g} and the whole interval is {side} {st.margin:g}")
    if p_holm >= alpha:
        return "inconclusive", f"Holm p = {p_holm:.3g} is not below {alpha:g}"
    return "inconclusive", "the interval contains " + (f"{st.margin:+g}" if st.margin else "0")


def _scope(kind: str, p: dict) -> tuple[str, str]:
    """(what the measurement shows, what it does not), one sentence each."""
    scale = ("whether it carries over to larger models, other data or longer training than this study's "
             "(its model, corpus and steps)")
    if kind == "loss":
        return ("The paired difference over seeds, each method at its own tuned rate (selection split), read on "
                "the report split.", f"It does not show {scale}.")
    if kind == "probe":
        ctx = f"{p['context']} tokens" if p.get("context") else "the training length"
        return (f"The paired difference of a probe measure at {ctx} on held-out inputs, each method at its tuned rate.",
                f"It does not show an effect on downstream tasks, nor {scale}.")
    if kind == "logits":
        return ("The paired ratio of the final max attention logit at the same base rate." if p.get("rate") !=
                "tuned" else "The paired ratio of the final max attention logit, each at its tuned rate.",
                f"It does not show whether the smaller logits change the loss, nor {scale}.")
    if kind == "control":
        return controls.scope(p)
    if kind == "stable":
        rule = {"delta": f"its mean selection loss within {p.get('delta', 0.1):g} nats of its own best",
                "near-best": f"its mean selection loss within {p.get('delta', 0.1):g} nats of the best method's"
                }.get(p.get("stable"), "no seed ending above the unigram entropy")
        return (f"The highest rate of the grid that holds ({rule}).",
                "It is a grid reading, not a test over seeds; it does not show stability beyond the grid.")
    if kind == "scale":
        return ("A slope per seed across the study's widths (or rates), tested over seeds (paired where it is a "
                "difference to `none`).", "It does not show the trend beyond the widths run, nor after more "
                "training than the study's (early training: a fixed number of steps at every width).")
    if kind == "width":
        return ("How the gap at the chosen rate changes from the narrowest to the widest width of the ladder.",
                "It does not show the trend beyond the widths run.")
    return ("Nothing: study cells cannot measure it.", "See the reason.")


def _row(cid: str, groups: list[Group], p: dict, study: str | None, registered: bool) -> ClaimRow:
    claim = CATALOGUE[cid]
    here = [g for g in groups if g.study == study] if study else groups
    m = claim.measure(here, p)
    shows, not_shows = _scope(claim.kind, p)
    return ClaimRow(id=cid, paper=claim.paper, claim=claim.text_for(p), measurement=claim.measurement,
                    measured=m.measured, verdict_old=m.verdict, reason_old=m.reason, stats=m.stats, params=p,
                    study=study, family=p.get("family") or claim.paper, alpha=p.get("alpha", ALPHA),
                    status="confirmatory" if registered else "exploratory", cells=list(m.cells), shows=shows,
                    not_shows=not_shows)


def _table(groups: list[Group], plans: dict[str, dict] | None) -> list[ClaimRow]:
    """One row per catalogue claim. ``plans`` (study -> its registered plan, or None): a claim registered
    by a study is read on that study's groups with its parameters (confirmatory); else on every group with
    the catalogue's parameters (exploratory). ``plans`` None: every claim as if registered by default."""
    rows = []
    for cid in CATALOGUE:
        regs = sorted((s, pl[cid]) for s, pl in (plans or {}).items() if pl and cid in pl)
        if not regs and CATALOGUE[cid].own:  # listed where registered
            continue
        if regs:
            rows.append(replace(_row(cid, groups, regs[0][1], regs[0][0], True),
                                also_registered_by=[s for s, _ in regs[1:]]))
        else:
            rows.append(_row(cid, groups, CATALOGUE[cid].params(), None, plans is None))
    adjusted: dict[str, tuple[float, float]] = {}  # claim id -> (Holm p, BH q) within its family
    for family in dict.fromkeys(r.family for r in rows):
        fam = [r for r in rows if r.family == family and r.stats is not None and r.status == "confirmatory"]
        ps = [(r.stats.p if r.params.get("test") == T_TEST else r.stats.p_flip) for r in fam]
        adjusted |= {r.id: (h, q) for r, h, q in zip(fam, holm(ps), benjamini_hochberg(ps), strict=True)}
    out = []
    for r in rows:
        h, q = adjusted.get(r.id, (math.nan, math.nan))
        if r.status == "exploratory":
            verdict = ("exploratory", "not registered in any study's [claims]: the numbers describe, they do not test")
        else:
            verdict = _new_verdict(r.verdict_old, r.reason_old, r.stats, h, r.alpha, r.params.get("test"))
        out.append(replace(r, p_holm=h, q_bh=q, verdict=verdict[0], reason=verdict[1]))
    return controls.gate(out)


def claims_table(groups: list[Group], studies: dict[str, dict] | None = None,
                 registered_groups: list[Group] | None = None) -> list[ClaimRow]:
    """One row per claim: verdict and reason by VERDICT_RULE, the old rule's verdict (verdict_old), and the
    statistics of a paired claim (stats: None for the others) with its family's Holm and BH adjustments of its
    registered test's p-value (p_holm, q_bh: sign-flip, or the t-test's under test = "t"), the result files it read
    (cells), its status (confirmatory: registered in a study's [claims]; exploratory) and, for a claim of a study
    whose plan was amended after results, ``amended`` and its verdict under the plan first registered
    (verdict_registered).
    ``studies`` (name -> study.json, as the report reads them): None reads every claim as registered with
    the catalogue's parameters (the verdict rule on its own). ``registered_groups``: the groups of the cells
    of each study's registered design (``registered_results``), when an amendment changed a design; the
    verdicts under the registered plan are read on them."""
    if studies is None:
        return _table(groups, None)
    now = {name: stored_plan(s) for name, s in studies.items()}
    rows = _table(groups, now)
    amended = {name for name, s in studies.items() if s.get("plan_history")}
    if amended:
        first = {name: registered_plan(s) if name in amended else now[name] for name, s in studies.items()}
        before = {r.id: r for r in _table(groups if registered_groups is None else registered_groups, first)}
        rows = [replace(r, amended=True, verdict_registered=b.verdict, reason_registered=b.reason,
                        measured_registered=b.measured) if r.study in amended or b.study in amended else r
                for r in rows for b in [before[r.id]]]
    return rows


def registered_results(results: list[dict[str, Any]], studies: dict[str, dict]) -> list[dict[str, Any]] | None:
    """The results of each study's registered design: a study whose design an amendment changed keeps only
    the cells its first design named. None when no design was changed."""
    first = {name: registered_design(s).get("cells") for name, s in studies.items()}
    moved = {name for name, s in studies.items() if first[name] != design(s).get("cells")}
    if not moved:
        return None
    keep = {name: set(first[name] or []) for name in moved}
    return [r for r in results if r.get("study") not in moved or r.get("cell") in keep[r.get("study")]]
