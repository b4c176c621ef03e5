"""The main job: a small study of every QK method family on the built-in corpus, a short table, and
the report (``studies/demo.toml``: MHA none, qknorm, softcap, qkmap, quest, the head gate, quack, qkclip, the
fixed multiplier, slowed upper-layer Q/K and QK-Guard; MLA none, qknorm and quack)."""

from __future__ import annotations

import math
from pathlib import Path

from qklab.cli.study import exit_code, resolve_study, run_and_report, warn, workers_for
from qklab.config import ConfigError, parse_sets
from qklab.study.spec import parse_study, read_study


def run_demo(study: str = "demo", methods: str | None = None, overrides: list[str] | None = None,
             workers: int | None = None, out: str | None = None, threads: int | None = None) -> int:
    """Run the demo study (or a subset of its variants); returns the exit code (``cli.study.exit_code``)."""
    path = resolve_study(study)
    raw = read_study(path)  # the study's TOML: --methods and --set change it before it is parsed
    variants = raw.get("variants", {})
    if methods is not None and not isinstance(variants, dict):
        raise ConfigError(f"{path.name}: [variants] must be a table of [variants.<label>] tables")
    if methods is not None:  # a subset of the study's variants, all checked before anything trains
        wanted = [m.strip() for m in methods.split(",") if m.strip()]
        known = list(variants)
        if not wanted:
            raise ConfigError(f"--methods {methods!r} names no variant; give labels such as "
                              f"{','.join(known[:3])} (or leave --methods out to run all)")
        bad = [m for m in wanted if m not in known]
        if bad:
            raise ConfigError(f"--methods: {', '.join(bad)} not in {path.name}; choose from {', '.join(known)}")
        raw["variants"] = {k: v for k, v in variants.items() if k in wanted}
        proto = raw.get("protocol", {})
        ref = proto.get("reference") if isinstance(proto, dict) else None
        if isinstance(ref, dict):
            proto["reference"] = {a: r for a, r in ref.items() if r in wanted}
        elif isinstance(proto, dict) and ref not in wanted:
            proto.pop("reference", None)
    if overrides:
        st = raw.setdefault("study", {})
        if not isinstance(st, dict) or not isinstance(st.setdefault("set", {}), dict):
            raise ConfigError(f"{path.name}: [study] and [study] set must be tables")
        st["set"].update(parse_sets(overrides, "--set"))
    s = parse_study(raw, path.stem, path, note=warn)
    outcome, report = run_and_report(s, out or Path("runs") / s.name, None, workers_for(s, workers), threads=threads)
    _print_table(outcome.results.values())
    if report is not None:
        print(f"\nreport: {report / 'report.html'}  (also report.md)")
    return exit_code(s, outcome)


def _print_table(results) -> None:
    """One row per variant: the means over its seeds that learned (ok) and those that did not learn (real
    losses, above the unigram entropy: too few steps), the status counting each outcome; a seed that blew up
    or failed has no numbers to show. A note under the table says what not learned means."""
    from qklab.study.result import CellOutcome, cell_outcome, num
    from qklab.study.stats import describe

    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["variant"], []).append(r)
    print(f"\n{'variant':<18} {'attn':<4} {'n':>2} {'report loss':>16} {'max logit':>10} {'first tok':>9} "
          f"{'tok/s':>7}  status")
    shown = (CellOutcome.OK, CellOutcome.NOT_LEARNED)
    unlearned = []
    for label, rs in by.items():
        how = [cell_outcome(r) for r in rs]
        ok = [r for r, o in zip(rs, how, strict=True) if o in shown]
        unlearned += [r for r, o in zip(rs, how, strict=True) if o is CellOutcome.NOT_LEARNED]
        rep = describe([num(r["final"].get("report_loss")) for r in ok])
        ml = describe([num(r["final"].get("max_logit")) for r in ok])
        ft = describe([num(r["final"].get("first_token")) for r in ok])
        tps = describe([num(r.get("tokens_per_s")) for r in ok])
        loss = f"{rep.mean:.4f}" + (f" ± {rep.std:.4f}" if math.isfinite(rep.std) else "")
        status = ", ".join(f"{how.count(o)} {o}" for o in CellOutcome if o in how)
        att = rs[0].get("attention", "?")
        print(f"{label:<18} {att:<4} {len(ok):>2} {loss:>16} {ml.mean:>10.2f} {ft.mean:>9.3f} "
              f"{tps.mean:>7,.0f}  {status}")
    if unlearned:
        uni = num(unlearned[0].get("unigram_entropy"))
        steps = unlearned[0].get("final", {}).get("step")
        print(f"\nnot learned: {len(unlearned)} cell(s) ended with a selection loss above the unigram entropy of "
              f"the selection tokens ({uni:.4f} nats) without blowing up: after {steps} steps they predict no better "
              "than token frequencies (train longer: --set train.steps=N); their losses are shown above, and a study's "
              "rate rules count them as diverged")
