"""``qklab probe --compare run1 run2 ...``: several runs' probe results on shared scales.

Each run's latest probe result (``<run>/probes/<latest checkpoint>/probes.json``) is read, or measured
first when missing; then one figure puts their per-head heatmaps on one colour scale per measurement,
one overlays their retrieval tests, and ``compare.json`` holds each run's ``probe_summary``. Runs whose
names differ only in a ``-s<seed>`` suffix (the trainer's default names) form a group: the group's mean
and std over seeds go into ``compare.json`` (``groups``) and ``compare_seeds.png`` (retrieval test vs N,
error bars over seeds).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from qklab.diagnostics import plots
from qklab.diagnostics.probe import SCHEMA, ProbeError, ProbeOptions, default_out, run_probe
from qklab.diagnostics.summary import probe_summary
from qklab.rundir.load import resolve_target


def cached_problem(data: Any, opts: ProbeOptions) -> str | None:
    """None when a cached probes.json can stand for a measurement with ``opts``; else why not."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return f"not a {SCHEMA} result"
    heads = data.get("heads")
    ml = heads.get("max_logit") if isinstance(heads, dict) else None
    if not (isinstance(ml, list) and ml and all(isinstance(r, list) and r for r in ml)):
        return "no per-head measurements"
    if data.get("options") != opts.key():
        return "measured with other options" if "options" in data else "measured with unrecorded options"
    return None


def load_or_probe(path: str | Path, opts: ProbeOptions, log=print, warn=None) -> dict[str, Any]:
    """A run's cached probe result of its newest good checkpoint, or a new measurement when there is none,
    or the cached one is damaged (named through ``warn``) or measured with other options."""
    warn = warn or log
    target = resolve_target(path, warn=warn, unverified=opts.unverified)
    f = default_out(target) / "probes.json"
    if f.is_file():
        data, problem = None, None
        try:
            data = json.loads(f.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problem = f"not valid JSON ({type(e).__name__})"
        problem = problem or cached_problem(data, opts)
        if problem is None:
            return data
        warn(f"warning: {f}: {problem}; measuring it again")
    else:
        log(f"{path}: no probe result for {target.ckpt.name} yet, measuring it")
    return run_probe(target.ckpt, None, opts, log=lambda s: None, warn=warn)


def compare_runs(paths: list[str], out: str | Path, opts: ProbeOptions | None = None, log=print,
                 warn=None) -> dict[str, Any]:
    if len(paths) < 2:
        raise ProbeError("--compare needs at least two runs, e.g. qklab probe --compare runs/a runs/b")
    opts = opts or ProbeOptions()
    opts.check()
    results: dict[str, dict[str, Any]] = {}
    for p in paths:
        label = Path(p).resolve().name
        while label in results:
            label += "'"
        results[label] = load_or_probe(p, opts, log, warn)
    shapes = {(len(r["heads"]["max_logit"]), len(r["heads"]["max_logit"][0])) for r in results.values()}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    if len(shapes) == 1:
        files.append(plots.plot_compare(results, out_dir / "compare_heads.png"))
    else:
        log(f"runs have different layer x head shapes {sorted(shapes)}: no shared heatmap")
    with_rt = {k: r["retrieval"] for k, r in results.items() if (r.get("retrieval") or {}).get("lengths")}
    if with_rt:
        first = next(iter(with_rt.values()))
        files.append(plots.plot_retrieval(first, "retrieval test", out_dir / "compare_retrieval.png", runs=with_rt))
    summary = {k: probe_summary(r) for k, r in results.items()}
    groups = seed_groups(summary)
    if groups:
        by_group = {g: {k: results[k]["retrieval"] for k in members if k in with_rt} for g, members in groups.items()}
        files.append(plots.plot_seeds({g: rt for g, rt in by_group.items() if len(rt) >= 2},
                                      out_dir / "compare_seeds.png"))
    (out_dir / "compare.json").write_text(json.dumps({"runs": summary, "groups": {
        g: group_stats([summary[k] for k in members]) for g, members in groups.items()}}, indent=1) + "\n")
    keys = ("step", "max_logit", "first_token", "first_token_baseline", "sink_rate", "evidence_mass",
            "log_contrast", "retrieval_accuracy", "magnitude_js_a4")
    width = max(len(k) for k in summary)
    log(f"{'run':<{width}} " + " ".join(f"{k:>14}" for k in keys))
    for label, s in summary.items():
        log(f"{label:<{width}} " + " ".join(f"{_cell(s[k]):>14}" for k in keys))
    log(f"wrote {out_dir / 'compare.json'} and {len(files)} plots")
    return {"runs": summary, "groups": groups, "files": [str(f) for f in files]}


def seed_groups(summary: dict[str, Any]) -> dict[str, list[str]]:
    """{name without -s<seed>: [run labels]} for names that occur with at least two seeds."""
    groups: dict[str, list[str]] = {}
    for label in summary:
        m = re.fullmatch(r"(.+)-s\d+", label)
        if m:
            groups.setdefault(m.group(1), []).append(label)
    return {g: v for g, v in groups.items() if len(v) >= 2}


def group_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and std over seeds (population) of every numeric headline number; n = runs."""
    out: dict[str, Any] = {"n": len(rows)}
    for key in rows[0]:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if len(vals) == len(rows):
            out[key] = float(np.mean(vals))
            out[key + "_seed_std"] = float(np.std(vals))
    return out


def _cell(v: Any) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
