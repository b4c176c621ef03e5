"""Predictions registered before a larger run: written from a width ladder's fits (report.scale) into a
committed file whose hash the study's ``study.json`` records, then checked against whatever a larger run
measures, prediction by prediction: hit, miss, or not tested (with why).

What is predicted, at each target size (non-embedding parameters), for every method the ladder ran, each
value with its interval and what a check needs to widen it by a new run's own seed noise:
* ``max_logit``: the final max attention logit at 4x the method's tuned rate (log-log fit); and the order of
  the methods by it;
* ``high_rate_loss``: the final report loss at 4x the tuned rate (log-linear fit; a loss capped at L0 =
  ln(vocab), a blow-up counted as L0, as LR sensitivity reads it), and the order of the methods by it;
* ``sensitivity``: LR sensitivity (log-linear fit), and the order of the methods by it.
Each value: ``value``, the mean of the seeds' own fits at the target; ``lo``, ``hi``, its t-interval over
seeds; ``seeds``, ``sd``, the spread of the seeds' fits there; ``run_sd``, ``run_df``, the spread of seeds
within one size (``within_spread``); ``run_lo``, ``run_hi``, where one new run should fall if the fit held
(``run_interval``: t sqrt(sd^2/n + run_sd^2/k) for k runs, t at Welch-Satterthwaite's df, never narrower than
the mean's interval). A measured value hits within that interval for the seeds it has (their mean; for a max
logit, their geometric mean). A value whose interval is not finite (fewer than three sizes, one seed, no size
with two seeds) is not written. An order names every pair of methods "above" only where the two methods'
one-run intervals do not overlap, so that one run of each can test it, else "tied"; a check counts only the
pairs predicted apart.
``scale_1.json``, written before (schema 1), has a bootstrap of each size's seeds for its intervals (far too
narrow: docs/results/predictions/README.md), no seed spread, and orders over neighbours in the ranking only:
it is checked as it was written. Every prediction carries the regime of the fits (optimizer, corpus, depth,
steps): a run in another regime can check only what the prediction says carries across regimes (the orders),
and a value prediction reads "not tested" there.
Each target names the payload study that measures it (``payload``; in older files, the label's
parentheses). ``gpu_scale`` continues the fits' own ladder one width further in their regime, every method on
the whole rate grid, so it tests the values: its cells are read as the fits read the ladder (the rate chosen
on the selection split, the max logit and loss at 4x it, LR sensitivity over the grid). ``gpu_payload`` (depth
12, Muon at one shared rate) is another regime: its orders are observations beside the prediction.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from qklab.report.scale import MethodScale, method_scales
from qklab.study.analyze import Group, analyze, load_results
from qklab.study.result import num
from qklab.study.sensitivity import (
    capped_loss,
    fit_scale,
    grid_final,
    group_sensitivity,
    rate_grid,
    run_interval,
    trend,
    within_spread,
)

GPU_RESULTS = Path("docs/results")  # a GPU run's payload results are committed under here, one folder each
HIGH = 4.0  # the high rate: this multiple of each method's tuned rate
MIN_SIZES = 3  # a fit needs three sizes
# target label -> non-embedding parameters; the label's "(NAME: ...)" names the payload study that measures it.
# gpu_scale continues the fits' own ladder (depth 4, one more width) in their regime, so it tests the values;
# the other two are at depth 12, another regime (gpu_payload runs Muon at one shared rate): orders only.
TARGETS = {"51M (gpu_scale: width 1024, 4 layers)": 50_603_008,  # the GPT's count at that shape, exactly
           "38M (gpu_payload: width 512, 12 layers)": 12 * 12 * 512 ** 2,
           "124M (GPT-2 small: width 768, 12 layers; 85M non-embedding)": 12 * 12 * 768 ** 2}
SAME_REGIME = ("gpu_scale",)  # the payload studies that run in the fits' regime
# what a value prediction is read against in a run: prediction key -> (measured key, its run count, log scale)
VALUES = {"max_logit": ("max_logit", "runs", True), "high_rate_loss": ("report_loss", "loss_runs", False),
          "sensitivity": ("sensitivity", "sensitivity_runs", False)}


@dataclass(frozen=True)
class Check:
    """One prediction against a measurement: outcome "hit", "miss" or "not tested"."""

    id: str
    outcome: str
    predicted: str
    measured: str
    why: str = ""


def method_key(method: str | None, controller: str | None) -> str:
    """The method a result stands for, whatever its variant is called: 'quack', 'qknorm', 'none', ..."""
    return controller if controller and controller != "none" else (method or "none")


def _predict(sizes: list[float], vals: list[dict[int, float]], size: float, log_y: bool,
             bounds: tuple[float, float] | None = None) -> dict[str, Any] | None:
    """One value predicted at ``size`` from per-size seed -> value maps (module docstring), or None where
    its intervals are not finite; ``bounds``: the least and most the quantity can be (0 and +inf for LR
    sensitivity, -inf and L0 for a loss), which the value and its intervals are held within (the stored value
    is then no longer the mean of the fits, where that lay outside)."""
    if len(sizes) < MIN_SIZES:
        return None
    t = trend(sizes, vals, log_y=log_y)
    value, lo, hi = t.at(size)
    n, sd = t.spread(size)
    run_sd, run_df = within_spread(vals, log_y)
    run_lo, run_hi = run_interval(fit_scale(log_y)(value), n, sd, run_sd, run_df, 1, log_y)
    if not all(math.isfinite(x) for x in (value, lo, hi, run_lo, run_hi)):
        return None
    out = {"value": value, "lo": lo, "hi": hi, "seeds": n, "sd": sd, "run_sd": run_sd, "run_df": run_df,
           "run_lo": run_lo, "run_hi": run_hi, "scale": "log10" if log_y else "linear"}
    if bounds is not None:
        out |= {k: min(max(out[k], bounds[0]), bounds[1]) for k in ("value", "lo", "hi", "run_lo", "run_hi")}
    return out


def _high_rate(r: MethodScale, groups: dict[tuple, dict], key: str) -> tuple[list[float], list[dict[int, float]]]:
    """sizes and per-seed ``final[key]`` at HIGH x each width's tuned rate (widths whose grid has it). A loss
    is read as LR sensitivity reads it: capped at L0 = ln(vocab), a cell that stopped non-finite at L0 (so a
    blow-up at the high rate counts against its method instead of leaving its seed out of the fit)."""
    sizes, vals = [], []
    for w, size in zip(r.widths, r.sizes, strict=True):
        g = groups[(r.study, r.variant, w)]
        m = g.chosen * HIGH if g.chosen is not None else None
        got = grid_final(g, key).get(m) if m in g.sweep else None  # None: every cell at that rate failed
        if got is not None:
            if key == "report_loss" and g.vocab_size:
                got = {s: capped_loss(v, math.log(float(g.vocab_size))) for s, v in got.items()}
            sizes.append(size)
            vals.append(got)
    return sizes, vals


def _order(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Every pair of methods, ranked from the highest predicted value down (method -> [value, lo, hi], the
    one-run interval): "above" when the upper one's interval lies wholly above the lower one's, else "tied".
    Every pair, not only neighbours in the ranking: a chain of overlapping neighbours can hold two methods far
    apart (``scale_1.json``, written before, lists neighbours only)."""
    ranked = sorted(values, key=lambda k: -values[k][0])
    return [{"upper": a, "lower": b, "relation": "above" if values[a][1] > values[b][2] else "tied"}
            for i, a in enumerate(ranked) for b in ranked[i + 1:]]


def ranking(order: list[dict[str, Any]]) -> list[str]:
    """The predicted ranking an order's pairs were listed in (every pair, or neighbours only)."""
    out: list[str] = []
    for p in order:
        out += [m for m in (p["upper"], p["lower"]) if m not in out]
    return out


def order_text(order: list[dict[str, Any]]) -> str:
    """'ranking a, b, c; apart: a > c (the other pairs tied)', or '...; no pair apart'."""
    apart = [f"{p['upper']} > {p['lower']}" for p in order if p["relation"] == "above"]
    rest = len(order) - len(apart)
    return (f"ranking {', '.join(ranking(order))}; "
            + (f"apart: {', '.join(apart)}" + (f" ({rest} other pair(s) tied)" if rest else "") if apart
               else "no pair apart"))


def make_predictions(groups: list[Group], regime: str, source: str) -> dict[str, Any]:
    """The predictions file's content from the analysed groups of one width ladder (``analyze``)."""
    rows = method_scales(groups)
    by_key = {(g.study, g.variant, int(g.d_model)): g for g in groups if g.d_model}
    out: dict[str, Any] = {"schema": 2, "source": source, "regime": regime, "high_rate": HIGH, "targets": {},
                           "note": "intervals: over seeds of each seed's own fit (and, run_lo/run_hi, a new "
                                   "run's seed noise), not over how far the fitted law holds beyond the sizes "
                                   "it was fitted on"}
    for label, size in TARGETS.items():
        got: dict[str, dict[str, dict[str, Any]]] = {"max_logit": {}, "high_rate_loss": {}, "sensitivity": {}}
        for r in rows:
            g0 = by_key[(r.study, r.variant, r.widths[0])]
            m = method_key(g0.method, g0.controller)
            l0 = math.log(float(g0.vocab_size)) if g0.vocab_size else math.inf
            for key, what, log_y, bounds in (("max_logit", "max_logit", True, None),
                                             ("high_rate_loss", "report_loss", False, (-math.inf, l0))):
                if (p := _predict(*_high_rate(r, by_key, what), size, log_y, bounds)) is not None:
                    got[key][m] = p
            if (p := _predict(r.sizes, r.sensitivity, size, False, (0.0, math.inf))) is not None:
                got["sensitivity"][m] = p  # it cannot fall below 0: a fit that does reads as 0
        payload = payload_of(label, {})
        out["targets"][label] = {"non_embedding_parameters": size, "payload": payload,
                                 "same_regime": payload in SAME_REGIME, **got, **{
            f"{key}_order": _order({m: [v["value"], v["run_lo"], v["run_hi"]] for m, v in got[key].items()})
            for key in got}}
    return out


def write_predictions(pred: dict[str, Any], path: Path) -> str:
    """Write the file (sorted keys, two-space indent, a final newline) and return its sha256."""
    text = json.dumps(pred, indent=2, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def _measured(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """method -> what a run measured at its one rate: ``max_logit``, the geometric mean over its seeds (the
    scale it is predicted on), with ``runs`` the seeds in it; ``report_loss``, the mean over seeds, each capped
    at L0 = ln(vocab) and a non-finite one counted as L0 (as the predictions read losses), with ``loss_runs``.
    A method whose cells ran at several rate multiples (or in several variants or grid points) gets
    ``{"rates": n}`` alone: one run of each method is read, over its seeds (a rate grid: ``_measured_grid``)."""
    by: dict[str, dict[tuple[str, str, float], dict[int, dict[str, Any]]]] = {}
    for r in results:
        if r.get("status") != "failed":
            m = method_key(r.get("method"), r.get("controller"))
            run = (str(r.get("variant", m)), str(r.get("point", "")), float(r.get("lr_mult", 1.0)))
            by.setdefault(m, {}).setdefault(run, {})[int(r.get("seed", 0))] = r
    out: dict[str, dict[str, float]] = {}
    for m, rates in by.items():
        if len(rates) > 1:  # several rates, variants or grid points of one method: which one is predicted?
            out[m] = {"rates": len(rates)}
            continue
        cells = next(iter(rates.values())).values()
        vocab = [((r.get("config") or {}).get("model") or {}).get("vocab_size") for r in cells]
        out[m] = _at_rate([num((r.get("final") or {}).get("max_logit")) for r in cells],
                          [num((r.get("final") or {}).get("report_loss")) for r in cells],
                          math.log(vocab[0]) if vocab and all(v == vocab[0] for v in vocab) and vocab[0] else None)
    return out


def _at_rate(logits: list[float], losses: list[float], l0: float | None) -> dict[str, float]:
    """What the seeds of one run measured at one rate: their max logits' geometric mean (``runs`` of them, the
    finite positive ones; ``logit_lost`` counts the seeds whose max logit is not finite, a blow-up) and their
    losses' mean (``loss_runs``), a loss capped at ``l0`` and a non-finite one counted as ``l0`` (without an
    L0, the finite losses alone)."""
    logs = [math.log10(x) for x in logits if math.isfinite(x) and x > 0]
    kept = [capped_loss(x, l0) for x in losses] if l0 is not None else [x for x in losses if math.isfinite(x)]
    out = {"report_loss": sum(kept) / len(kept), "loss_runs": len(kept)} if kept else {}
    if lost := sum(1 for x in logits if not math.isfinite(x)):  # blew up: no max logit to read
        out["logit_lost"] = lost
    return out | ({"max_logit": 10 ** (sum(logs) / len(logs)), "runs": len(logs)} if logs else {})


def _measured_grid(groups: list[Group]) -> dict[str, dict[str, float]]:
    """method -> what a run on a rate grid measured, read as the fits read the ladder: LR sensitivity over
    the grid (``group_sensitivity``, the mean over the seeds that finished every rate, ``sensitivity_runs``
    of them), and, at HIGH x the rate chosen on the selection split, the max logit and the report loss
    (``_at_rate``). Only a group whose every registered rate has a finished cell is read (a rate chosen from
    part of the grid is not the tuned rate); else ``{"grid": "k of n rates"}``. A method run as several
    groups (variants, grid points) gets ``{"rates": n}``; methods run at one rate are ``_measured``'s."""
    by: dict[str, list[Group]] = {}
    for g in groups:
        if len(g.sweep) > 1 or len(g.grid) > 1:
            by.setdefault(method_key(g.method, g.controller), []).append(g)
    out: dict[str, dict[str, Any]] = {}
    for m, gs in by.items():
        if len(gs) > 1:
            out[m] = {"rates": len(gs)}
            continue
        g = gs[0]
        grid = rate_grid(g)
        done = [x for x in grid if grid_final(g, "report_loss").get(x)]
        if len(done) < len(grid):
            out[m] = {"grid": f"{len(done)} of {len(grid)} rates finished"}
            continue
        l0 = math.log(float(g.vocab_size)) if g.vocab_size else None
        high = g.chosen * HIGH if g.chosen is not None else None
        got = _at_rate(list(grid_final(g, "max_logit").get(high, {}).values()),
                       list(grid_final(g, "report_loss").get(high, {}).values()), l0) if high in g.sweep else {}
        if sens := group_sensitivity(g):
            got |= {"sensitivity": sum(sens.values()) / len(sens), "sensitivity_runs": len(sens)}
        out[m] = got | {"chosen": g.chosen}
    return out


def hit_interval(v: dict[str, float], runs: int, log_y: bool) -> tuple[float, float]:
    """Where the mean of ``runs`` seeds' measurements (for a max logit, their geometric mean) hits a value
    prediction: ``run_interval`` for that many runs, where the file gives the seeds' spread (schema 2);
    ``scale_1.json`` gives only the interval it registered. (NaN, NaN) where it cannot be had."""
    if "run_sd" not in v:
        return v["lo"], v["hi"]
    mid = math.log10(v["value"]) if log_y else v["value"]
    return run_interval(mid, int(v["seeds"]), v["sd"], v["run_sd"], int(v["run_df"]), runs, log_y=log_y)


def logit_hit_interval(v: dict[str, float], runs: int) -> tuple[float, float]:
    """``hit_interval`` of a max-logit prediction (log10 scale)."""
    return hit_interval(v, runs, log_y=True)


def _check_order(pid: str, order: list[dict], measured: dict[str, dict[str, float]], key: str) -> Check:
    apart = [p for p in order if p["relation"] == "above" and p["upper"] in measured and p["lower"] in measured
             and key in measured[p["upper"]] and key in measured[p["lower"]]]
    text = order_text(order)
    if not apart:
        return Check(pid, "not tested", text, "-", "no pair predicted apart was measured")
    wrong = [p for p in apart if not measured[p["upper"]][key] > measured[p["lower"]][key]]
    got = ", ".join(f"{p['upper']} {measured[p['upper']][key]:.4g} vs {p['lower']} {measured[p['lower']][key]:.4g}"
                    for p in apart)
    return Check(pid, "miss" if wrong else "hit", text, got,
                 f"{len(apart) - len(wrong)} of {len(apart)} pairs predicted apart in the predicted order")


def _check_value(pid: str, v: dict[str, float], got: dict[str, Any], key: str, same_regime: bool) -> Check:
    """One value prediction (``VALUES[key]``) against what a run measured for its method (``got``)."""
    what, count, log_y = VALUES[key]
    shown = (f"{v['value']:.3g} [{v['lo']:.3g}, {v['hi']:.3g}]" if log_y else
             f"{v['value']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]")
    if not same_regime:
        return Check(pid, "not tested", shown, "-", "the run is in another regime than the fits")
    if "rates" in got:
        return Check(pid, "not tested", shown, "-", f"ran at {got['rates']} rates, variants or grid points; a "
                                                    "check reads one run (or one rate grid) per method")
    if "grid" in got:
        return Check(pid, "not tested", shown, "-", f"its rate grid is incomplete ({got['grid']})")
    lost = got.get("logit_lost", 0) if what == "max_logit" else 0  # seeds that blew up: no max logit
    if what not in got:
        chosen = got.get("chosen", math.nan)
        where = f"at {HIGH:g}x its chosen rate (x{HIGH * got['chosen']:g})" if got.get("chosen") else "at its rate"
        why = ("LR sensitivity needs the method on a rate grid" if key == "sensitivity" else
               f"every seed ({lost}) blew up {where}: no finite max logit to compare (a blow-up is above any "
               "finite value predicted, so it is no hit; it is not counted as a miss)" if lost else
               "no finished cell" if "chosen" not in got else
               "no rate chosen: every rate diverged or did not learn" if chosen is None else
               f"{HIGH:g}x its chosen rate (x{chosen:g}) is not on the grid or did not finish")
        return Check(pid, "not tested", shown, "-", why)
    x, runs = got[what], int(got[count])
    lo, hi = hit_interval(v, runs, log_y)
    if key == "sensitivity":  # it cannot fall below 0 (the interval's part below says nothing)
        lo = max(lo, 0.0)
    measured = (f"{x:.4g}" if log_y else f"{x:.3f}") + (
        f" ({'geometric ' if log_y else ''}mean of {runs} seeds)" if runs > 1 else "") + (
        f" ({lost} more seed(s) blew up: no finite max logit, left out)" if lost else "")
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return Check(pid, "not tested", shown, measured, "no hit interval: the file gives too few seeds")
    why = (f"hit interval for {runs} run(s), their own seed noise added: "
           + (f"[{lo:.3g}, {hi:.3g}]" if log_y else f"[{lo:.3f}, {hi:.3f}]")
           if "run_sd" in v else "the interval as registered: the file gives no seed spread")
    return Check(pid, "hit" if lo <= x <= hi else "miss", shown, measured, why)


def check(pred: dict[str, Any], results: list[dict[str, Any]], target: str, same_regime: bool,
          groups: list[Group] | None = None) -> list[Check]:
    """Each prediction for ``target`` against a run's result files: value predictions only in the same regime
    (else "not tested"), orders in any. A method run at one rate is read there (``_measured``); one run on a
    rate grid (``groups``: the run's analysed groups) as the fits read the ladder (``_measured_grid``), which
    is what LR sensitivity needs."""
    t = pred["targets"][target]
    measured = _measured(results) | (_measured_grid(groups) if groups else {})
    out = [_check_value(f"{key} {m} @ {target}", v, measured.get(m, {}), key, same_regime)
           for key in VALUES for m, v in (t.get(key) or {}).items()]
    orders = [_check_order(f"max_logit_order @ {target}", t["max_logit_order"], measured, "max_logit"),
              _check_order(f"high_rate_loss_order @ {target}", t["high_rate_loss_order"], measured, "report_loss")]
    if any("sensitivity" in v for v in measured.values()):
        orders.append(_check_order(f"sensitivity_order @ {target}", t["sensitivity_order"], measured, "sensitivity"))
    if not same_regime:  # e.g. one shared rate for every method, where the prediction is at 4x each one's own
        orders = [replace(c, why=f"{c.why}; another regime: an observation beside the prediction, not its test")
                  for c in orders]
    if len(orders) == 2:
        orders.append(Check(f"sensitivity_order @ {target}", "not tested", order_text(t["sensitivity_order"]), "-",
                            "LR sensitivity needs each method on a rate grid"))
    return out + orders


def format_checks(checks: list[Check]) -> list[str]:
    """One line per prediction: outcome, id, predicted, measured, why."""
    return [f"{c.outcome.upper():10s} {c.id}: predicted {c.predicted}; measured {c.measured}"
            + (f" ({c.why})" if c.why else "") for c in checks]


def as_json(checks: list[Check]) -> list[dict[str, str]]:
    return [asdict(c) for c in checks]


def erratum(path: Path) -> str | None:
    """Where a registered predictions file's erratum is, if one was written: a section "Erratum to NAME" in
    the README.md beside it (the file itself stays as registered, its hash on record)."""
    readme = path.parent / "README.md"
    try:
        text = readme.read_text()
    except OSError:
        return None
    head = f"## Erratum to {path.name}"
    if head not in text:
        return None
    line = text[text.index(head):].splitlines()[0]
    return f"`{readme}`, section \"{line[3:]}\""


@dataclass(frozen=True)
class LargerRun:
    """A larger run's committed results: its result files, its analysed groups (a rate grid is read as the
    fits read the ladder), and whether it runs in the fits' regime (value predictions are tested only there)."""

    name: str
    results: list[dict[str, Any]]
    groups: list[Group]
    same_regime: bool


def target_labels(pred: dict[str, Any]) -> list[str]:
    """A file's targets in the order of ``TARGETS`` (files are written with sorted keys), any others after."""
    return [*[x for x in TARGETS if x in pred["targets"]], *[x for x in pred["targets"] if x not in TARGETS]]


def first_target(pred: dict[str, Any], payload: str | None = None) -> str | None:
    """The target a check reads by default: the first the file predicts (``target_labels``), or, given
    ``payload``, the first that payload study measures; None where the file has none such."""
    return next((x for x in target_labels(pred) if payload is None or payload_of(x, pred["targets"][x]) == payload),
                None)


def payload_of(label: str, target: dict[str, Any]) -> str | None:
    """The payload study that measures a target: the file's ``payload`` where it names one, else the name in
    the label's parentheses ("38M (gpu_payload: width 512, 12 layers)" -> "gpu_payload"), else None."""
    if target.get("payload"):
        return str(target["payload"])
    m = re.search(r"\((\w+):", label)
    return m.group(1) if m else None


def larger_run(folder: Path, name: str) -> LargerRun | None:
    """The results committed in ``folder`` as the payload study ``name``'s run, or None while there are none."""
    if not folder.is_dir():
        return None
    results, studies = load_results([folder])
    if not results:
        return None
    return LargerRun(name, results, analyze(results, studies).groups, name in SAME_REGIME)


def gpu_results(root: Path = GPU_RESULTS) -> dict[str, LargerRun]:
    """payload study -> its GPU run's committed results (``root``/NAME), for the payloads the targets name."""
    names = {n for label in TARGETS if (n := payload_of(label, {})) is not None}
    return {n: run for n in sorted(names) if (run := larger_run(root / n, n)) is not None}


def predictions_lines(studies: dict[str, dict[str, Any]], runs: dict[str, LargerRun] | None = None) -> list[str]:
    """The report's section: each predictions file a study.json records (its hash checked), its predictions
    for every target, and beside them the check against the run of the payload study that measures that
    target (``runs``: payload name -> its committed results), or "not yet tested" while there is none."""
    lines: list[str] = []
    for name, s in sorted(studies.items()):
        for rec in s.get("predictions") or []:
            path = Path(rec.get("file", ""))
            try:
                text = path.read_bytes()
            except OSError:
                lines.append(f"- `{name}` recorded predictions `{path}`, which is not here.")
                continue
            ok = hashlib.sha256(text).hexdigest() == rec.get("sha256")
            pred = json.loads(text)
            lines.append(f"- `{path}` ({'sha256 as recorded' if ok else '**sha256 differs from the record**'}, "
                         f"written {rec.get('written')}, from {pred.get('source')}); regime: {pred.get('regime')}")
            if (note := erratum(path)) is not None:
                lines.append(f"  - **Erratum** (written after it, the file unchanged): {note}")
            for target in target_labels(pred):
                run = (runs or {}).get(payload_of(target, pred["targets"][target]) or "")
                checks = (check(pred, run.results, target, run.same_regime, run.groups) if run else
                          [Check(c.id, "not yet tested", c.predicted, "-", "no larger run yet")
                           for c in check(pred, [], target, same_regime=False)])
                lines += [f"  - {line}" for line in format_checks(checks)]
    return ["## Predictions for larger models", "", *lines, ""] if lines else []
