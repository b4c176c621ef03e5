"""The claims table: every claim of both papers (shared/specs/), the measurement that tests it here, and
a verdict with its reason, by the rule in VERDICT_RULE (the one statement of it; the report prints it).

Each loss comparison uses the methods' cells at their own chosen rates (selection split), report-split
losses, and seeds paired across methods; the logit claim compares the two at the same rate, since at the
tuned rate there is little for a control to do. Beside the verdict, each paired claim carries its
statistics (n, df, mean difference, t-interval, bootstrap interval, effect size mean / sd, the t and the
exact sign-flip p-values, and the sign-flip p-value adjusted across its family by Holm and by
Benjamini-Hochberg), and the verdict of the rule used before (the whole 95% t-interval on one side) for
comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from qklab.report import controls
from qklab.report.scale_claims import MEASURES as SCALE_MEASURES
from qklab.study.analyze import best_by_place, highest_within, place
from qklab.study.plan import (
    CATALOGUE,
    OWN_CLAIMS,
    OWN_PAPERS,
    T_TEST,
    defaults,
    design,
    registered_design,
    registered_plan,
    stored_plan,
)
from qklab.study.stats import benjamini_hochberg, difference_stats, fmt_ci, holm, min_seeds, paired_difference

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
    '**not measurable**: the study has no cells, probes or rate grid that could test it. The effect size is '
    '(mean difference - margin) / sd of the differences; for the logit claims the statistics are of log10 of '
    "the ratio. The column 'verdict (old rule)' gives the rule used before, for comparison: agree or disagree"
    ' when the whole 95% t-interval lies on one side, inconclusive when it contains zero (or the margin) or '
    'one seed was run.')


def _name(kind: tuple) -> str:
    """(attention, method, controller) -> 'MLA quack', 'MHA qknorm', 'MHA none'."""
    att, method, ctrl = kind
    return f"{att.upper()} {ctrl if ctrl != 'none' else method}"


def _find(groups: list[dict], attention: str, method: str = "none", controller: str = "none") -> list[dict]:
    """Groups of one kind (several when, e.g., two taus were run): the best by selection loss first."""
    gs = [g for g in groups if g["attention"] == attention and g["method"] == method
          and g["controller"] == controller and g["chosen"] is not None]
    return sorted(gs, key=lambda g: g["sweep"][g["chosen"]]["select"]["mean"])


def _option(g: dict, key: str):
    """The value of the group's controller option ``key`` (e.g. QuacK's tau), or None."""
    return (g.get("qk_options") or {}).get(g["controller"], {}).get(key)


def _places(groups, a: tuple, b: tuple) -> tuple[list[tuple[dict, dict]], str]:
    """Pairs (x of kind a, y of kind b) that ran in the same study and grid point, so that they share the
    data, the shape and the optimizer: the pairs with the most paired seeds first (the study built to test
    the two, not a 2-seed width ladder that tunes them too), then the widest rate grids (not a ladder at
    two fixed rates; within a study, variants that tuned their own rate, not an ablation run at one rate
    borrowed from its family), then by selection loss. Else [] and why not."""
    ga, gb = _find(groups, *a), _find(groups, *b)
    if not ga or not gb:
        missing = [_name(x) for x, g in ((a, ga), (b, gb)) if not g]
        return [], f"no finished cells of {' and '.join(missing)} in these results"
    pairs = [(x, y) for x in ga for y in gb if x["study"] == y["study"] and x["point"] == y["point"]]
    if not pairs:
        return [], "the two methods never ran in the same study and grid point"
    width: dict[tuple, int] = {}  # (study, point) -> the most rates any group of either kind ran there
    for g in ga + gb:
        k = (g["study"], g["point"])  # the point is its label, a string
        width[k] = max(width.get(k, 0), len(g["sweep"]))
    def seeds(x: dict, y: dict) -> int:  # seeds with both at their chosen rate
        return len(x["at_chosen"]["report_loss"].keys() & y["at_chosen"]["report_loss"].keys())

    pairs.sort(key=lambda p: (-seeds(*p), -width[(p[0]["study"], p[0]["point"])],  # stable: selection order kept
                              -min(len(p[0]["sweep"]), len(p[1]["sweep"]))))
    return pairs, ""


def _pair(groups, a: tuple, b: tuple, metric: str, match: str | None = None) -> tuple[dict | None, str]:
    """Paired difference a - b of ``metric`` (same study and grid point), or None and why not. With
    ``match``, the best pair whose controllers share that option's value (QuacK against the multiplier
    at the same tau) comes first; without such a pair, the best of each, said in the measurement."""
    pairs, why = _places(groups, a, b)
    if not pairs:
        return None, why
    note = ""
    if match:
        same = [(x, y) for x, y in pairs if _option(x, match) is not None and _option(x, match) == _option(y, match)]
        if same:
            pairs, note = same, f" (same {match}: {_option(same[0][0], match):g})"
        else:
            note = f" (no pair at the same {match}: each at its best)"
    x, y = pairs[0]
    d = paired_difference(x["at_chosen"][metric], y["at_chosen"][metric])
    d["a"], d["b"], d["note"], d["study"] = x["variant"], y["variant"], note, x["study"]
    return d, ""


def _test(d: dict, margin: float) -> dict:
    """The statistics of a paired claim a < b + margin: the interval of a - b, the tests of mean = margin."""
    shifted = difference_stats([x - margin for x in d["diffs"]])
    return {k: d[k] for k in ("n", "df", "mean", "ci_lo", "ci_hi", "boot_lo", "boot_hi")} | {
        "a": d.get("a"), "b": d.get("b"), "margin": margin, "effect": shifted["effect"], "p": shifted["p"],
        "p_flip": shifted["p_flip"]}


def _verdict_less(d: dict | None, why: str, what: str, margin: float = 0.0) -> tuple:
    """Claim: a < b + margin (d = a - b). (old-rule verdict, measured, reason, the claim's statistics)."""
    if d is None:
        return "not measurable", "-", why, None
    if d["n"] == 0:
        return "not measurable", "-", f"no seed has a finite {what} for both", None
    meas = f"{d['a']} - {d['b']}: {d['mean']:+.3f}, 95% CI {fmt_ci(d['ci_lo'], d['ci_hi'])}, n={d['n']}" + (
        f", p={d['p']:.3g}" if math.isfinite(d["p"]) else "") + d.get("note", "")
    st = _test(d, margin)
    if d["n"] < 2:
        return "inconclusive", meas, "one seed: no interval", st
    if d["ci_hi"] < margin:
        return "agree", meas, f"the whole interval is below {margin:g}", st
    if d["ci_lo"] > margin:
        return "disagree", meas, f"the whole interval is above {margin:g}", st
    return "inconclusive", meas, "the interval contains " + (f"{margin:+g}" if margin else "0"), st


def _less(a, b, metric, what):
    """Claim a < b + margin on ``metric``, each at its tuned rate; pairing "same-tau": a pair whose
    controllers share tau first (QuacK against the multiplier)."""
    def test(groups, p):
        d, why = _pair(groups, a, b, metric, "tau" if p.get("pairing") == "same-tau" else None)
        return (*_verdict_less(d, why, what, p.get("margin", 0.0)), _used(groups, d, chosen=True))
    return test


def _used(groups: list[dict], d: dict | None, chosen: bool) -> list[str]:
    """The result files of the two variants a paired difference read (at their chosen rates, or all)."""
    if d is None:
        return []
    out = []
    for g in groups:
        if g["variant"] in (d.get("a"), d.get("b")) and (not d.get("study") or g["study"] == d["study"]):
            rates = [g["chosen"]] if chosen and g["chosen"] is not None else list(g.get("cells", {}))
            out += [c["path"] for m in rates for c in g.get("cells", {}).get(m, []) if c.get("path")]
    return out


def _stable_rate(a: tuple, b: tuple) -> Callable:
    """Claim: a tolerates a higher base rate than b: the highest rate that holds, each method at its best
    option (e.g. QuacK's best tau, QK-clip's best threshold) within one study and grid point. A rate holds
    by the registered rule: "entropy", no seed diverged (its final loss below the unigram entropy);
    "delta", besides, the mean selection loss within delta nats of the variant's own best rate; "near-best",
    within delta nats of the best variant of that study, grid point and attention type."""
    def test(groups, p):
        v, meas, why, used = _stable(groups, p)
        return v, meas, why, None, used

    def _stable(groups, p):
        rule, delta = p.get("stable", "entropy"), p.get("delta", 0.1)

        top = best_by_place(groups)  # (study, point, attention) -> the best variant's selection loss

        def holds(g):
            if rule == "entropy":
                return g["highest_stable"]
            if rule == "near-best":
                return highest_within(g, delta, top.get(place(g)))
            return highest_within(g, delta)

        pairs, why = _places(groups, a, b)
        if not pairs:
            return "not measurable", "-", why, []
        x0, y0 = pairs[0]
        here = [g for g in groups if g["study"] == x0["study"] and g["point"] == x0["point"]]
        xs = [g for g in _find(here, *a) if len(g["sweep"]) >= 2]
        ys = [g for g in _find(here, *b) if len(g["sweep"]) >= 2]
        if not xs or not ys:
            return "not measurable", "-", "needs a learning-rate grid (one rate per method was run)", []

        def best(gs):  # the variant that holds up to the highest rate (None: no rate holds for any variant)
            g = max(gs, key=lambda g: -math.inf if holds(g) is None else holds(g))
            return g, holds(g)

        (x, hx), (y, hy) = best(xs), best(ys)
        used = [c["path"] for g in (x, y) for cs in g.get("cells", {}).values() for c in cs if c.get("path")]
        tops = {max(g["sweep"]) for g in xs + ys}
        rx, ry = (f"x{h:g}" if h is not None else "none" for h in (hx, hy))
        how = ("with no diverged seed" if rule == "entropy"
               else f"within {delta:g} nats of the best method there, no seed diverged" if rule == "near-best"
               else f"within {delta:g} nats of its own best, no seed diverged")
        meas = f"highest rate {how}: {x['variant']} {rx}, {y['variant']} {ry} (grid up to x{max(tops):g})"
        if hx is None or hy is None:
            return "inconclusive", meas, "a method held at no rate", used
        if hx == hy and hx in tops:
            return "inconclusive", meas, "both held up to the top of the grid; extend it upward", used
        if hx == hy:
            return "inconclusive", meas, "both held up to the same rate: a tie", used
        lo, g_lo = (hy, y) if hx > hy else (hx, x)
        if max(g_lo["sweep"]) <= lo:  # the less stable one never ran above the rate where it held
            return "inconclusive", meas, f"{g_lo['variant']} did not run above x{lo:g}", used
        return ("agree", meas, "holds at a higher rate", used) if hx > hy else (
            "disagree", meas, "does not hold at a higher rate", used)
    return test


def _as_ratio(reason: str) -> str:
    """A reason about log10 of a ratio, said of the ratio."""
    return reason.replace("below 0", "below a ratio of 1").replace("above 0", "above a ratio of 1").replace(
        "contains 0", "contains a ratio of 1")


def _logits_at_same_rate(a: tuple, b: tuple) -> Callable:
    """Claim: a keeps the max attention logit below b's. Rate "highest-shared-stable": read at the highest
    rate of the grid where both ran and no seed of either diverged (where the control has the most to do
    and both runs still train), as the paired ratio a / b over seeds (a difference of log10, since logits
    differ by decades across rates); the ratio at every shared stable rate is listed. Rate "tuned": each
    at its own chosen rate."""
    def test(groups, p):
        pairs, why = _places(groups, a, b)
        if not pairs:
            return "not measurable", "-", why, None, []
        x, y = pairs[0]
        used = [c["path"] for g in (x, y) for cs in g.get("cells", {}).values() for c in cs if c.get("path")]
        if p.get("rate") == "tuned":
            lx, ly = ({s: math.log10(v) for s, v in g["at_chosen"]["max_logit"].items() if math.isfinite(v) and v > 0}
                      for g in (x, y))
            d = {**paired_difference(lx, ly), "a": x["variant"], "b": y["variant"]}
            verdict, _, reason, st = _verdict_less(d, "", "max logit")
            meas = (f"{x['variant']} / {y['variant']} at their tuned rates (x{x['chosen']:g}, x{y['chosen']:g}): "
                    f"{10 ** d['mean']:.3g}" + (f", 95% CI [{10 ** d['ci_lo']:.3g}, {10 ** d['ci_hi']:.3g}]"
                                                 if d["n"] >= 2 else "") + f", n={d['n']}") if d["n"] else "-"
            if st is not None:
                st["log_ratio"] = True
            return verdict, meas, _as_ratio(reason), st, _used(groups, {**d, "study": x["study"]}, chosen=True)

        def logs(g, m):
            return {s: math.log10(v) for s, v in g["sweep"][m].get("max_logit_by_seed", {}).items()
                    if math.isfinite(v) and v > 0}

        shared = [m for m in sorted(x["sweep"].keys() & y["sweep"].keys())
                  if x["sweep"][m]["diverged"] == 0 and y["sweep"][m]["diverged"] == 0
                  and paired_difference(logs(x, m), logs(y, m))["n"] > 0]
        if not shared:
            return ("not measurable", "-", "no rate at which both ran with no diverged seed and a finite max logit",
                    None, [])
        by_rate = {m: paired_difference(logs(x, m), logs(y, m)) for m in shared}
        top = shared[-1]
        d = {**by_rate[top], "a": x["variant"], "b": y["variant"]}
        verdict, _, reason, st = _verdict_less(d, "", "max logit")
        meas = (f"{x['variant']} / {y['variant']} at x{top:g}: {10 ** d['mean']:.3g}"
                + (f", 95% CI [{10 ** d['ci_lo']:.3g}, {10 ** d['ci_hi']:.3g}]" if d["n"] >= 2 else "")
                + f", n={d['n']}; by rate: " + ", ".join(f"x{m:g} {10 ** by_rate[m]['mean']:.2g}" for m in shared))
        if st is not None:
            st["log_ratio"] = True
        return verdict, meas, _as_ratio(reason), st, used
    return test


def _elsewhere(reason: str) -> Callable:
    """A claim that study results cannot test; the reason says where it is measured instead."""
    return lambda groups, p: ("not measurable", "-", reason, None, [])


def _probe_value(probe: dict, key: str, context: int):
    """A probe's ``key``: from its summary (context 0: at the training length), else the retrieval entry at
    ``context`` tokens."""
    if context and key in ("log_contrast", "contrast"):
        return next((r.get(key) for r in probe.get("retrieval") or [] if int(r["length"]) == context), None)
    return probe["summary"].get(key)


def _probe_claim(key: str, a: tuple, b: tuple, higher: bool) -> Callable:
    def test(groups, p):
        context = int(p.get("context", 0) or 0)
        pairs, why = _places(groups, a, b)
        if not pairs:
            return "not measurable", "-", why, None, []
        probed = [(x, y) for x, y in pairs if x["probe_by_seed"] and y["probe_by_seed"]]  # the study that probed
        x, y = (probed or pairs)[0]
        sa, sb = ({s: float(v) for s, pr in g["probe_by_seed"].items()
                   if (v := _probe_value(pr, key, context)) is not None} for g in (x, y))
        if not sa or not sb:
            return "not measurable", "-", ("no attention probes in these results (set [protocol] probe = 1 or more)"
                                           if not probed else f"the probes have no '{key}'"
                                           + (f" at {context} tokens" if context else "")), None, []
        d = paired_difference(sb, sa) if higher else paired_difference(sa, sb)
        d["a"], d["b"] = (y["variant"], x["variant"]) if higher else (x["variant"], y["variant"])
        d["study"] = x["study"]
        return (*_verdict_less(d, "", key, p.get("margin", 0.0)), _used(groups, d, chosen=True))
    return test


def _width_gap(a: tuple, b: tuple) -> Callable:
    """Claim: a's advantage over b (b - a, report loss, paired by seed, each at its chosen rate) is larger
    at the widest width of a study's grid than at the narrowest."""
    def test(groups, p):
        gaps: dict[str, dict[int, dict[int, float]]] = {}  # study -> width -> seed -> b - a
        for x in _find(groups, *a):
            for y in _find(groups, *b):
                if x["study"] == y["study"] and x["point"] == y["point"] and x.get("d_model"):
                    ya, xa = y["at_chosen"]["report_loss"], x["at_chosen"]["report_loss"]
                    gaps.setdefault(x["study"], {})[int(x["d_model"])] = {s: ya[s] - xa[s] for s in xa.keys() & ya}
        study = max(gaps, key=lambda k: len(gaps[k]), default=None)
        if study is None or len(gaps[study]) < 2:
            return "not measurable", "-", (f"needs {_name(a)} and {_name(b)} at two or more widths in one study "
                                           "(studies/logit_control_width.toml)"), None, []
        by_w = gaps[study]
        lo, hi = min(by_w), max(by_w)
        d = paired_difference(by_w[lo], by_w[hi])  # gap at the narrowest - gap at the widest: < 0 if it grows
        d["a"], d["b"] = f"gap at width {lo}", f"gap at width {hi}"
        verdict, meas, reason, st = _verdict_less(d, "", "report loss")
        means = ", ".join(f"{w}: {np.mean(list(g.values())):+.3f}" if g else f"{w}: -" for w, g in sorted(by_w.items()))
        used = [c["path"] for g in groups if g["study"] == study and g in (*_find(groups, *a), *_find(groups, *b))
                for c in g.get("cells", {}).get(g["chosen"], []) if c.get("path")]
        return verdict, f"{meas}; mean gap ({_name(b)} - {_name(a)}) by width: {means}", reason, st, used
    return test


def _new_verdict(old: str, reason: str, st: dict | None, p_holm: float, alpha: float = ALPHA,
                 test: str | None = None) -> tuple[str, str]:
    """VERDICT_RULE, from the old rule's verdict and reason, the claim's statistics and its Holm p (of the
    t-test's p for a claim registered with test = "t")."""
    if test == T_TEST and st is not None and old != "not measurable" and st["n"] < 2:
        return "underpowered", f"{st['n']} seed: the paired t-test needs 2 or more (old rule: {reason})"
    if test == T_TEST and st is not None and old != "not measurable":
        side = "below" if st["ci_hi"] < st["margin"] else "above" if st["ci_lo"] > st["margin"] else None
        if p_holm < alpha and side:
            return ("agree" if side == "below" else "disagree"), (
                f"paired t-test, Holm p = {p_holm:.3g} < {alpha:g}: {reason}")
        return "inconclusive", (f"paired t-test, Holm p = {p_holm:.3g} is not below {alpha:g}" if p_holm >= alpha
                                else f"paired t-test: {reason}")
    verdict, why = _new_verdict_raw(old, reason, st, p_holm, alpha)
    return verdict, (_as_ratio(why) if st and st.get("log_ratio") and st["n"] >= min_seeds(alpha) else why)


def _new_verdict_raw(old: str, reason: str, st: dict | None, p_holm: float, alpha: float) -> tuple[str, str]:
    if st is None or old == "not measurable":  # a grid-rule claim, or nothing to test
        return old, reason
    need = min_seeds(alpha)
    if st["n"] < need:
        return "underpowered", (f"{st['n']} paired seed{'s' * (st['n'] > 1)}: the exact sign-flip test needs "
                                f"{need} to reach p < {alpha:g} (old rule: {reason})")
    side = "below" if st["ci_hi"] < st["margin"] else "above" if st["ci_lo"] > st["margin"] else None
    if p_holm < alpha and side:
        return ("agree" if side == "below" else "disagree"), (
            f"Holm p = {p_holm:.3g} < {alpha:g} and the whole interval is {side} {st['margin']:g}")
    if p_holm >= alpha:
        return "inconclusive", f"Holm p = {p_holm:.3g} is not below {alpha:g}"
    return "inconclusive", "the interval contains " + (f"{st['margin']:+g}" if st["margin"] else "0")


MHA, MLA = "mha", "mla"
QKMAP, STD, QKN = (MHA, "qkmap", "none"), (MHA, "none", "none"), (MHA, "qknorm", "none")
QUACK, MLA_QUACK, MLA_STD = (MHA, "none", "quack"), (MLA, "none", "quack"), (MLA, "none", "none")

# claim id (study.plan.CATALOGUE: its paper, kind, text, measurement) -> its test(groups, parameters)
MEASURE: dict[str, Callable] = {
    "qkmap.val_vs_none": _less(QKMAP, STD, "report_loss", "report loss"),
    "qkmap.val_vs_qknorm": _less(QKMAP, QKN, "report_loss", "report loss"),
    "qkmap.train_vs_none": _less(QKMAP, STD, "train_loss", "train loss"),
    "qkmap.train_vs_qknorm": _less(QKMAP, QKN, "train_loss", "train loss"),
    "qkmap.first_token": _less(QKMAP, STD, "first_token", "first-token attention"),
    "qkmap.val_vs_quest": _less(QKMAP, (MHA, "quest", "none"), "report_loss", "report loss"),
    "qkmap.first_token_vs_gate": _less(QKMAP, (MHA, "none+gate-head", "none"), "first_token", "first-token attention"),
    "qkmap.input_scale": _probe_claim("magnitude_js_a4", QKMAP, QKN, higher=True),
    "qkmap.evidence": _probe_claim("log_contrast", QKMAP, STD, higher=True),
    "qkmap.evidence_contrast": _probe_claim("contrast", QKMAP, STD, higher=True),
    "qkmap.evidence_contrast_vs_qknorm": _probe_claim("contrast", QKMAP, QKN, higher=True),
    "control.retrieval_learned": controls.accuracy_control(STD),
    "quack.stable_mha": _stable_rate(QUACK, STD),
    "quack.stable_mla": _stable_rate(MLA_QUACK, MLA_STD),
    "quack.vs_qkclip_stable_mha": _stable_rate(QUACK, (MHA, "none", "qkclip")),
    "quack.vs_qkclip_stable_mla": _stable_rate(MLA_QUACK, (MLA, "none", "qkclip")),
    "quack.mla_vs_none": _less(MLA_QUACK, MLA_STD, "report_loss", "report loss"),
    "quack.mla_vs_qknorm": _less(MLA_QUACK, (MLA, "qknorm", "none"), "report_loss", "report loss"),
    "quack.mla_vs_qkclip": _less(MLA_QUACK, (MLA, "none", "qkclip"), "report_loss", "report loss"),
    "quack.competitive_qknorm": _less(QUACK, QKN, "report_loss", "report loss"),
    "quack.speed": _elsewhere("study cells share the machine, so the CPU time of the same work varies by up to 30% "
                              "between cells; benchmarks/step_time.py measures it (README, Benchmarks)"),
    "quack.vs_multiplier": _less(QUACK, (MHA, "none", "qk_lr_multiplier"), "report_loss", "report loss"),
    "quack.logits_mha": _logits_at_same_rate(QUACK, STD),
    "quack.logits_mla": _logits_at_same_rate(MLA_QUACK, MLA_STD),
    "quack.width_gap": _width_gap(QUACK, STD),
    **SCALE_MEASURES,
}
assert MEASURE.keys() == CATALOGUE.keys()


def _claim_text(cid: str, p: dict) -> str:
    text = CATALOGUE[cid][2]
    if cid == "quack.competitive_qknorm":
        text = f"competitive with QK-Norm with MHA (not worse by more than {p.get('margin', 0):g} nats)"
    return text


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


def _row(cid: str, groups: list[dict], p: dict, study: str | None, registered: bool) -> dict[str, Any]:
    paper, kind, _, measurement = CATALOGUE[cid]
    here = [g for g in groups if g["study"] == study] if study else groups
    verdict, measured, reason, st, used = MEASURE[cid](here, p)
    shows, not_shows = _scope(kind, p)
    return {"id": cid, "paper": paper, "claim": _claim_text(cid, p), "measurement": measurement,
            "measured": measured, "verdict_old": verdict, "reason_old": reason, "stats": st,
            "p_holm": float("nan"), "q_bh": float("nan"), "params": p, "study": study,
            "family": p.get("family") or paper, "alpha": p.get("alpha", ALPHA),
            "status": "confirmatory" if registered else "exploratory",
            "cells": used, "shows": shows, "not_shows": not_shows}


def _table(groups: list[dict], plans: dict[str, dict] | None) -> list[dict[str, Any]]:
    """One row per catalogue claim. ``plans`` (study -> its registered plan, or None): a claim registered
    by a study is read on that study's groups with its parameters (confirmatory); else on every group with
    the catalogue's parameters (exploratory). ``plans`` None: every claim as if registered by default."""
    rows = []
    for cid in CATALOGUE:
        regs = sorted((s, pl[cid]) for s, pl in (plans or {}).items() if pl and cid in pl)
        if not regs and (CATALOGUE[cid][0] in OWN_PAPERS or cid in OWN_CLAIMS):  # listed where registered
            continue
        if regs:
            rows.append(_row(cid, groups, regs[0][1], regs[0][0], True))
            rows[-1]["also_registered_by"] = [s for s, _ in regs[1:]]
        else:
            rows.append(_row(cid, groups, defaults(cid), None, plans is None))
    for family in dict.fromkeys(r["family"] for r in rows):
        fam = [r for r in rows if r["family"] == family and r["stats"] is not None and r["status"] == "confirmatory"]
        ps = [r["stats"]["p" if r["params"].get("test") == T_TEST else "p_flip"] for r in fam]
        for r, h, q in zip(fam, holm(ps), benjamini_hochberg(ps), strict=True):
            r["p_holm"], r["q_bh"] = h, q
    for r in rows:
        if r["status"] == "exploratory":
            r["verdict"] = "exploratory"
            r["reason"] = "not registered in any study's [claims]: the numbers describe, they do not test"
        else:
            r["verdict"], r["reason"] = _new_verdict(r["verdict_old"], r["reason_old"], r["stats"], r["p_holm"],
                                                     r["alpha"], r["params"].get("test"))
    return controls.gate(rows)


def claims_table(groups: list[dict[str, Any]], studies: dict[str, dict] | None = None,
                 registered_groups: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per claim: verdict and reason by VERDICT_RULE, the old rule's verdict (verdict_old), and the
    statistics of a paired claim (stats: None for the others) with its family's Holm and BH adjustments
    of the sign-flip p-value (p_holm, q_bh), the result files it read (cells), its status (confirmatory:
    registered in a study's [claims]; exploratory) and, for a claim of a study whose plan was amended
    after results, ``amended`` and its verdict under the plan first registered (verdict_registered).
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
        before = {r["id"]: r for r in _table(groups if registered_groups is None else registered_groups, first)}
        for r in rows:
            b = before[r["id"]]
            if r["study"] in amended or b["study"] in amended:
                r["amended"] = True
                r["verdict_registered"], r["reason_registered"] = b["verdict"], b["reason"]
                r["measured_registered"] = b["measured"]
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
