"""Run a grid of variants x seeds at equal tokens and summarise it (mean +- std over seeds).

    qklab sweep --config small --seeds 0,1,2 --out runs/sweeps/qkmap \\
        --variant none:qk.method=none --variant qknorm:qk.method=qknorm \\
        --variant "qkmap-M2:qk.method=qkmap,qk.qkmap.n_freqs=2"

Each variant is ``label:key=value,key=value``. Finished runs are not run again, so an interrupted
sweep continues where it stopped. Writes ``summary.json`` and ``summary.md`` in the output folder.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from qklab.config import ConfigError, load_config
from qklab.data import prepare_data
from qklab.diagnostics.stability import diverged
from qklab.train.checkpoint import latest_checkpoint
from qklab.train.metrics import read_metrics
from qklab.train.trainer import Trainer


@dataclass
class Variant:
    label: str
    overrides: list[str]


def parse_variant(spec: str) -> Variant:
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise ConfigError(f"--variant '{spec}' must look like label:key=value,key=value")
    return Variant(label, [kv for kv in rest.split(",") if kv])


def _finished(run_dir: Path, steps: int) -> bool:
    ck = latest_checkpoint(run_dir / "ckpt")
    return ck is not None and ck.name == f"step_{steps:07d}"


def run_sweep(preset: str, variants: list[Variant], seeds: list[int], out: Path, common: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {(v.label, s): load_config(preset, [*common, *v.overrides, f"train.seed={s}",
                                               f"train.out_dir='{out}'", f"train.name={v.label}-s{s}",
                                               "train.progress=false"])
            for s in seeds for v in variants}  # validate all first; seed-major so a partial sweep is balanced
    data = prepare_data(next(iter(cfgs.values())).data)
    results: dict[str, list[dict]] = {v.label: [] for v in variants}
    for (label, seed), cfg in cfgs.items():
        run_dir = out / f"{label}-s{seed}"
        if not _finished(run_dir, cfg.train.steps):
            print(f"== {label} seed {seed}", flush=True)
            try:
                Trainer(cfg, overwrite=True, data=data, log=lambda s: None).run()
            except (RuntimeError, FloatingPointError) as e:  # a diverged run is a result, not a crash
                print(f"   {label} seed {seed} failed: {e}")
        recs = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        evals = [r for r in recs if "val_loss" in r]
        last = evals[-1] if evals else {}
        results[label].append({"seed": seed, "val_loss": _f(last.get("val_loss")),
                               "max_logit": _f(last.get("max_logit")),
                               "diverged": diverged(recs) or not evals,
                               "tokens_per_s": statistics.median([r["tokens_per_s"] for r in recs
                                                                  if "tokens_per_s" in r] or [0.0])})
    summary = {"preset": preset, "seeds": seeds, "common": common,
               "variants": {v.label: v.overrides for v in variants}, "runs": results,
               "table": [_row(label, rs) for label, rs in results.items()]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary["table"]))
    print(markdown_table(summary["table"]))
    return summary


def _f(x) -> float:
    return float(x) if x is not None else float("nan")


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _row(label: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if not r["diverged"]]
    vl, vs = _mean_std([r["val_loss"] for r in ok])
    ml, ms = _mean_std([r["max_logit"] for r in ok])
    return {"variant": label, "val_loss": vl, "val_loss_std": vs, "max_logit": ml, "max_logit_std": ms,
            "n": len(runs), "diverged": len(runs) - len(ok),
            "tokens_per_s": statistics.fmean([r["tokens_per_s"] for r in runs])}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | val loss (mean ± std) | max logit (mean ± std) | diverged | tokens/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} | "
                     f"{r['max_logit']:.2f} ± {r['max_logit_std']:.2f} | {r['diverged']}/{r['n']} | "
                     f"{r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def lr_grid_table(summary: dict) -> str:
    """A method x learning-rate table from a sweep whose labels are ``<method>-x<multiplier>``: final
    val loss (max logit), diverged runs marked, and each method's stable range (rates within 0.05 nats
    of its best, shared/specs/analyses.md item 7)."""
    cells: dict[str, dict[float, dict]] = {}
    for row in summary["table"]:
        method, _, mult = row["variant"].rpartition("-x")
        cells.setdefault(method, {})[float(mult)] = row
    mults = sorted({m for c in cells.values() for m in c})
    lines = ["| method | " + " | ".join(f"lr x{m:g}" for m in mults) + " | stable range |",
             "|---|" + "---|" * (len(mults) + 1)]
    for method, c in cells.items():
        ok = {m: r["val_loss"] for m, r in c.items() if not r["diverged"] and math.isfinite(r["val_loss"])}
        best = min(ok.values()) if ok else float("nan")
        stable = [f"x{m:g}" for m in mults if m in ok and ok[m] <= best + 0.05]
        row = []
        for m in mults:
            r = c.get(m)
            if r is None:
                row.append("not run")
            elif r["diverged"]:
                row.append("**diverged**")
            else:
                row.append(f"{r['val_loss']:.3f} ({r['max_logit']:.0f})")
        lines.append(f"| {method} | " + " | ".join(row) + f" | {', '.join(stable) or '-'} |")
    return "\n".join(lines) + "\n"
