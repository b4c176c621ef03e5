"""Predictions registered before a larger run (qklab.report.predictions): write them from a width ladder's
results, record their hash in a study.json, check a run's results against them, or plant results to check
the checker (the GPU script's dry run).

  python scripts/predictions.py write docs/results/ladder_english docs/results/predictions/scale_v1.json \\
      --regime "..." --record docs/results/scale_english/study.json
  python scripts/predictions.py check docs/results/predictions/scale_v1.json RESULTS_DIR [--payload NAME] \\
      [--target LABEL] [--same-regime] [--study-json docs/results/scale_english/study.json]
  python scripts/predictions.py plant docs/results/predictions/scale_v1.json OUT_DIR   # then check OUT_DIR

check prints one line per prediction (HIT, MISS, NOT TESTED) and exits 0 whatever they say; 2 when the
predictions file is not the one the study.json recorded. --payload gpu_scale reads the target that payload
measures, in the fits' regime, and its results as a rate grid (where their study.json came with them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from qklab.report.predictions import (
    SAME_REGIME,
    check,
    first_target,
    format_checks,
    logit_hit_interval,
    make_predictions,
    ranking,
    write_predictions,
)
from qklab.study.analyze import analyze, load_results
from qklab.study.result import write_json_atomic


def _write(a) -> int:
    results, studies = load_results([a.results])
    pred = make_predictions(analyze(results, studies).groups, a.regime, f"{a.results} ({len(results)} cells)")
    sha = write_predictions(pred, Path(a.out))
    if a.record:
        path = Path(a.record)
        data = json.loads(path.read_text())
        entry = {"file": a.out, "sha256": sha, "written": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "source": pred["source"]}
        data["predictions"] = [*(data.get("predictions") or []), entry]
        write_json_atomic(path, data)
    print(f"{a.out}: sha256 {sha}")
    return 0


def _check(a) -> int:
    text = Path(a.predictions).read_bytes()
    if a.study_json:
        rec = [p.get("sha256") for p in json.loads(Path(a.study_json).read_text()).get("predictions") or []]
        sha = hashlib.sha256(text).hexdigest()
        if sha not in rec:
            print(f"error: {a.predictions} (sha256 {sha[:12]}) is not a predictions file {a.study_json} recorded",
                  file=sys.stderr)
            return 2
    pred = json.loads(text)
    target = a.target or first_target(pred, a.payload)
    if target is None:  # a file written before that payload existed: nothing of it to check
        print(f"{a.predictions} has no target that {a.payload} measures: nothing checked")
        return 0
    if target not in pred["targets"]:
        print(f"error: {a.predictions} predicts nothing for {target!r}; its targets: "
              + "; ".join(pred["targets"]), file=sys.stderr)
        return 2
    same_regime = a.same_regime or (a.payload in SAME_REGIME)
    # every result.json as it is (a run's payload cells, or planted ones with only the fields a check reads);
    # where the run's study.json came with them, its analysed groups too (a rate grid is read as a grid)
    folder = Path(a.results)
    results = [json.loads(f.read_text()) for f in sorted(folder.rglob("result.json"))]
    groups = analyze(*load_results([folder])).groups if results and any(folder.rglob("study.json")) else None
    print(f"predictions {a.predictions} for {target}, against {len(results)} result file(s) in {a.results}"
          f" ({'same regime' if same_regime else 'another regime: values not tested, orders checked'})")
    for line in format_checks(check(pred, results, target, same_regime, groups)):
        print(line)
    return 0


def _plant(a) -> int:
    """Minimal result files for the file's first target: every method at its predicted max logit, except the
    one predicted highest, planted ten times above where one run hits (so no order breaks); report losses at
    their predicted high-rate values (or, where none is predicted, in the predicted high-rate order)."""
    pred = json.loads(Path(a.predictions).read_text())
    t = pred["targets"][first_target(pred)]
    ranked = ranking(t["high_rate_loss_order"])
    high = t.get("high_rate_loss") or {}
    loss = {m: high[m]["value"] if m in high else 6.0 - 0.1 * i for i, m in enumerate(ranked)}
    out = Path(a.out)
    top = max(t["max_logit"], key=lambda m: t["max_logit"][m]["value"])  # above it, it breaks no order
    for m, v in sorted(t["max_logit"].items()):
        method, controller = ("none", m) if m in ("quack", "qkclip", "qk_lr_multiplier") else (m, "none")
        final = {"max_logit": logit_hit_interval(v, 1)[1] * 10 if m == top else v["value"],
                 "report_loss": loss.get(m, 5.0)}
        cell = f"planted-{m}_s0"
        (out / cell).mkdir(parents=True, exist_ok=True)
        (out / cell / "result.json").write_text(json.dumps(
            {"schema": 1, "study": "planted", "cell": cell, "variant": m, "seed": 0, "lr_mult": 1.0, "status": "ok",
             "diverged": False, "method": method, "controller": controller, "final": final, "point": {}}))
    print(f"planted {len(t['max_logit'])} result files in {out}: {top} (the highest predicted max logit) ten times "
          "above where one run hits (a miss), the rest at their predicted values (hits)")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("results")
    w.add_argument("out")
    w.add_argument("--regime", required=True)
    w.add_argument("--record", help="a study.json whose 'predictions' list gets the file and its sha256")
    c = sub.add_parser("check")
    c.add_argument("predictions")
    c.add_argument("results")
    c.add_argument("--target", help="a target label of the file (default: its first)")
    c.add_argument("--payload", help="the payload study the results are from (e.g. gpu_scale): its target, "
                   "in its regime (default: the first target, another regime unless --same-regime)")
    c.add_argument("--same-regime", action="store_true")
    c.add_argument("--study-json")
    pl = sub.add_parser("plant")
    pl.add_argument("predictions")
    pl.add_argument("out")
    a = p.parse_args(argv)
    return {"write": _write, "check": _check, "plant": _plant}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
