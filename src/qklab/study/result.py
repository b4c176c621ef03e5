"""One cell's ``result.json``: a small, self-contained record of a finished (or failed) training run.

Everything a report needs is in it (config, git SHA, corpus fingerprint, losses on both held-out parts,
downsampled curves, per-head values at the end and over time, speed, the divergence verdict), so a
report can be rebuilt from committed result files alone. Files are written atomically (temporary file, fsync, rename).

Divergence rule (shared/specs/analyses.md, item 7): a cell diverged if a loss or gradient was non-finite
(recorded as an event, or the run stopped on it), or if its final selection-split loss is above the
unigram entropy of the selection tokens (it learned nothing beyond token frequencies). A diverged cell
is a result; a failed cell (any other exception) is not, and is run again on the next invocation.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from qklab.atomic import atomic_write_text
from qklab.diagnostics.stability import stability_summary

SCHEMA = 1
CURVE_POINTS = 64
HEAD_KEYS = ("max_logit", "logit_change", "first_token", "entropy", "q_norm", "k_norm", "wq_norm", "wk_norm")
SERIES_KEYS = ("max_logit", "logit_change", "wq_norm", "wk_norm")  # per head over time (head_series)
SERIES_POINTS = 32
DIVERGENCE_RULE = ("diverged = a non-finite loss or gradient was met, or the final selection-split loss is above "
                   "the unigram entropy of the selection tokens (analyses.md item 7)")


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(_finite(data), indent=1) + "\n")


def _finite(v: Any) -> Any:
    """NaN/inf as strings, so the file is strict JSON; read_result turns them back into floats."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def num(v: Any) -> float:
    """A number from a record or result file (NaN/inf are stored as strings); NaN if it is not one."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def downsample(xs: list, n: int = CURVE_POINTS) -> list:
    """At most n evenly spaced entries of xs, the first and last always kept."""
    if len(xs) <= n:
        return list(xs)
    idx = sorted({round(i * (len(xs) - 1) / (n - 1)) for i in range(n)})
    return [xs[i] for i in idx]


def _curve(records: list[dict], key: str) -> dict[str, list]:
    pts = [(r["step"], num(r[key])) for r in records if key in r]
    pts = downsample(pts)
    return {"step": [p[0] for p in pts], key: [p[1] for p in pts]}


def head_series(records: list[dict]) -> dict[str, Any]:
    """Per-head values over training, each (layers x heads) per step, at most SERIES_POINTS steps: the
    diagnostics' max logit, logit change and W_Q / W_K norms, and QuacK's per-head factors."""
    diags = downsample([r for r in records if "diag" in r], SERIES_POINTS)
    out: dict[str, Any] = {"diag": {"step": [r["step"] for r in diags],
                                    **{k: [r["diag"].get(k) for r in diags] for k in SERIES_KEYS}}}
    ctrl = downsample([r for r in records if any(k.startswith("quack_") and isinstance(v, list)
                                                 for k, v in r.items())], SERIES_POINTS)
    if ctrl:
        keys = sorted(k for k, v in ctrl[-1].items() if k.startswith("quack_") and isinstance(v, list))
        out["quack"] = {"step": [r["step"] for r in ctrl], **{k: [r.get(k) for r in ctrl] for k in keys}}
    return out


def cell_header(cell, study: str, log_path: Path) -> dict[str, Any]:
    return {"schema": SCHEMA, "study": study, "cell": cell.id, "variant": cell.variant,
            "point": {k: v for k, v in cell.point}, "lr_mult": cell.lr_mult, "seed": cell.seed,
            "log": str(log_path)}


def build_result(header: dict[str, Any], run_dir: Path, records: list[dict], unigram: float,
                 cell_hash: str, seconds: float, stopped: str | None = None) -> dict[str, Any]:
    """The result of a cell whose training ended (normally, or stopped on a non-finite value)."""
    info = json.loads((run_dir / "config.json").read_text())
    evals = [r for r in records if "val_loss" in r]
    diags = [r for r in records if "diag" in r]
    losses = [num(r["loss"]) for r in records if "loss" in r]
    stab = stability_summary(records)
    final_val = num(evals[-1]["val_loss"]) if evals else float("nan")
    report = next((num(r["report_loss"]) for r in reversed(records) if "report_loss" in r), float("nan"))
    nonfinite = bool(stopped) or bool(stab["nonfinite_steps"]) or any(not math.isfinite(x) for x in losses)
    reason = None
    if nonfinite:
        reason = "non-finite loss or gradient" + (f" ({stopped})" if stopped else "")
    elif not math.isfinite(final_val) or final_val > unigram:
        reason = f"final selection loss {final_val:.4f} above the unigram entropy {unigram:.4f}"
    tail = losses[-max(1, len(losses) // 10):]
    last_diag = diags[-1]["diag"] if diags else {}
    heads = {k: last_diag[k] for k in HEAD_KEYS if k in last_diag}
    ctrl = next((r for r in reversed(records) if any(k.startswith("quack_") for k in r)), {})
    heads.update({k: v for k, v in ctrl.items() if k.startswith("quack_") and isinstance(v, list)})
    tps = [num(r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    steady = tps[len(tps) // 5:] or tps
    m, q = info["model"], info["qk"]
    return {**header, "status": "diverged" if reason else "ok", "diverged": bool(reason), "divergence": reason,
            "failure": None, "cell_hash": cell_hash, "git_sha": info.get("git_sha"), "corpus": info.get("corpus"),
            "config": {k: info[k] for k in ("model", "qk", "data", "train", "preset") if k in info},
            "versions": info.get("versions"), "n_params": info.get("n_params"), "device": info.get("device"),
            "machines": info.get("machines"),
            "attention": m["attention"], "method": q["method"], "controller": q["controller"],
            "lr": info["train"]["lr"], "unigram_entropy": unigram,
            "final": {"step": records[-1]["step"] if records else 0, "val_loss": final_val, "report_loss": report,
                      "train_loss": statistics.fmean(tail) if tail else float("nan"),
                      "max_logit": num(evals[-1].get("max_logit")) if evals else float("nan"),
                      "first_token": num(last_diag.get("first_token_mean")),
                      "sink_rate": num(last_diag.get("sink_rate")),
                      "logit_change": num(last_diag.get("logit_change_mean"))},
            "best_val_loss": min((num(r["val_loss"]) for r in evals), default=float("nan")),
            "curves": {"train": _curve(records, "loss"), "val": _curve(evals, "val_loss"),
                       "max_logit": _curve(evals, "max_logit"),
                       "logit_change": _curve([{"step": r["step"], **r["diag"]} for r in diags], "logit_change_mean"),
                       "first_token": _curve([{"step": r["step"], **r["diag"]} for r in diags], "first_token_mean")},
            "heads": heads, "head_series": head_series(records),
            "tokens_per_s": statistics.median(steady) if steady else float("nan"),
            "spikes": len(stab["spikes"]), "nonfinite_steps": len(stab["nonfinite_steps"]),
            "seconds": seconds, "probe": None}


def failed_result(header: dict[str, Any], message: str, cell_hash: str | None, seconds: float) -> dict[str, Any]:
    return {**header, "status": "failed", "diverged": False, "divergence": None, "failure": message,
            "cell_hash": cell_hash, "seconds": seconds}


def read_json(path: Path) -> tuple[Any, str | None]:
    """A JSON file's value and None, or (None, what is wrong in a few words) when it is missing (``"missing"``),
    unreadable, not UTF-8 or not JSON."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror or type(e).__name__})"
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    try:
        return json.loads(text, parse_constant=float), None
    except (json.JSONDecodeError, RecursionError) as e:
        return None, f"not valid JSON ({str(e).splitlines()[0][:80]})"


def read_result(path: Path) -> dict[str, Any] | None:
    """A JSON object from a file, or None when it is missing, unreadable or not an object (then a cell
    counts as not done)."""
    data, _ = read_json(path)
    return data if isinstance(data, dict) else None


STATUSES = ("ok", "diverged", "failed")


def _is_num(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    return isinstance(v, str) and v in ("nan", "inf", "-inf")


def result_problem(res: Any) -> str | None:
    """None for a result a report and the runner can use; otherwise what is wrong with it, in a few words."""
    if not isinstance(res, dict):
        return f"a JSON {type(res).__name__}, not a result object"
    missing = [k for k in ("cell", "variant", "lr_mult", "seed", "status") if k not in res]
    if missing:
        return f"no {', '.join(missing)} field{'s' if len(missing) > 1 else ''}"
    if not (isinstance(res["cell"], str) and res["cell"] and isinstance(res["variant"], str) and res["variant"]):
        return "cell and variant must be names"
    if res["status"] not in STATUSES:
        return f"status {res['status']!r} is none of {', '.join(STATUSES)}"
    if not _is_num(res["lr_mult"]) or type(res["seed"]) is not int:
        return "lr_mult must be a number and seed an integer"
    if not isinstance(res.get("point", {}), dict) or not isinstance(res.get("study", ""), str):
        return "point must be an object and study a name"
    if res["status"] == "failed":
        return None
    final = res.get("final")
    if not isinstance(final, dict) or not all(_is_num(final.get(k)) for k in ("val_loss", "report_loss")):
        return "a finished result without final val_loss and report_loss"
    if not isinstance(res.get("diverged"), bool) or not _is_num(res.get("lr")):
        return "a finished result without diverged (true/false) and lr"
    if not isinstance(res.get("curves", {}), dict) or not isinstance(res.get("cell_hash", ""), str | None):
        return "curves must be an object and cell_hash a string"
    return None


def load_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(result, None) for a usable result file, (None, None) when there is none, and (None, problem) when the
    file is damaged: the caller names it and skips it, never counting it as done."""
    data, problem = read_json(path)
    if problem == "missing":
        return None, None
    problem = problem or result_problem(data)
    return (None, f"{path}: {problem}") if problem else (data, None)
