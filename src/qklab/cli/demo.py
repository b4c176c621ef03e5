"""The main job: a small study of every QK method family on the built-in corpus, a short table, and
the report (``studies/demo.toml``: MHA none, qknorm, softcap, qkmap, quack, qkclip and the fixed
multiplier; MLA none, qknorm and quack)."""

from __future__ import annotations

import math
from pathlib import Path

from qklab.cli.study import resolve_study, run_and_report, workers_for
from qklab.config import ConfigError
from qklab.study.spec import parse_sets, parse_study, read_study


def run_demo(study: str = "demo", methods: str | None = None, overrides: list[str] | None = None,
             workers: int | None = None, out: str | None = None) -> Path | None:
    path = resolve_study(study)
    raw = read_study(path)  # the study's TOML: --methods and --set change it before it is parsed
    if methods:  # a subset of the study's variants, all checked before anything trains
        wanted = [m.strip() for m in methods.split(",") if m.strip()]
        known = list(raw.get("variants", {}))
        bad = [m for m in wanted if m not in known]
        if bad:
            raise ConfigError(f"--methods: {', '.join(bad)} not in {path.name}; choose from {', '.join(known)}")
        raw["variants"] = {k: v for k, v in raw["variants"].items() if k in wanted}
        ref = raw.get("protocol", {}).get("reference")
        if isinstance(ref, dict):
            raw["protocol"]["reference"] = {a: r for a, r in ref.items() if r in wanted}
        elif ref not in wanted:
            raw.get("protocol", {}).pop("reference", None)
    raw.setdefault("study", {}).setdefault("set", {}).update(parse_sets(overrides or [], "--set"))
    s = parse_study(raw, path.stem, path)
    outcome, report = run_and_report(s, out or Path("runs") / s.name, None, workers_for(s, workers))
    _print_table(outcome.results.values())
    if report is not None:
        print(f"\nreport: {report / 'report.html'}  (also report.md)")
    return report


def _print_table(results) -> None:
    from qklab.study.stats import describe

    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["variant"], []).append(r)
    print(f"\n{'variant':<18} {'attn':<4} {'n':>2} {'report loss':>16} {'max logit':>10} {'first tok':>9} "
          f"{'tok/s':>7}  status")
    for label, rs in by.items():
        ok = [r for r in rs if r["status"] == "ok"]
        rep = describe([float(r["final"]["report_loss"]) for r in ok])
        ml = describe([float(r["final"]["max_logit"]) for r in ok])
        ft = describe([float(r["final"]["first_token"]) for r in ok])
        tps = describe([float(r["tokens_per_s"]) for r in ok])
        loss = f"{rep['mean']:.4f}" + (f" ± {rep['std']:.4f}" if math.isfinite(rep["std"]) else "")
        status = ", ".join(f"{sum(r['status'] == s for r in rs)} {s}" for s in ("ok", "diverged", "failed")
                           if any(r["status"] == s for r in rs))
        att = rs[0].get("attention", "?")
        print(f"{label:<18} {att:<4} {len(ok):>2} {loss:>16} {ml['mean']:>10.2f} {ft['mean']:>9.3f} "
              f"{tps['mean']:>7,.0f}  {status}")
