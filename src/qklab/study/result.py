"""One cell's ``result.json``: a small, self-contained record of a finished (or failed) training run.

Everything a report needs is in it (config, git SHA, corpus fingerprint, losses on both held-out parts,
downsampled curves, per-head values at the end and over time, speed, the divergence verdict), so a
report can be rebuilt from committed result files alone. Files are written atomically (temporary file, fsync, rename).

Divergence rule (shared/specs/analyses.md, item 7): a cell diverged if a loss or gradient was non-finite
(recorded as an event, or the run stopped on it), or if its final selection-split loss is above the
unigram entropy of the selection tokens (it learned nothing beyond token frequencies). A diverged cell
is a result; a failed cell (any other exception) is not, and is run again on the next invocation.

What a user reads tells the two kinds of diverged cell apart (``CellOutcome``): *diverged*, a run that blew
up (a non-finite value, or a selection loss that ended far above its own best), and *not learned*, one that
ended above the unigram entropy without blowing up (a short run, or a rate too high to learn beyond token
frequencies). Both stay ``status: "diverged"``, ``diverged: true``, and the statistics (eligible and
stable rates, claims) count both as today; results record the outcome as ``outcome``, and one without it
(written before) gets it from the fields it holds (``cell_outcome``).

``schema``: the format of the file; a file of another schema (a newer qklab's) is unusable here, named and
never counted as done (``result_problem``). A file without ``schema`` is read as schema 1: every qklab has
written the field, so a file without it is hand-made or trimmed, not of another format.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from qklab.atomic import atomic_write_text
from qklab.diagnostics.stability import stability_summary
from qklab.methods import HEAD_SERIES

SCHEMA = 1
CURVE_POINTS = 64
HEAD_KEYS = ("max_logit", "logit_change", "first_token", "entropy", "distance", "q_norm", "k_norm", "wq_norm",
             "wk_norm")
SERIES_KEYS = ("max_logit", "logit_change", "wq_norm", "wk_norm")  # per head over time (head_series)
SERIES_POINTS = 32
DIVERGENCE_RULE = ("diverged = a non-finite loss or gradient was met, or the final selection-split loss is above "
                   "the unigram entropy of the selection tokens (it learned nothing beyond token frequencies)")
NONFINITE = "non-finite loss or gradient"  # how the divergence reason of a run that met one begins


class CellOutcome(StrEnum):
    """How a cell ended, as a user reads it. ``ok`` and ``failed`` are its status; a diverged cell
    (``DIVERGENCE_RULE``) is ``diverged`` when it blew up (a non-finite loss or gradient, a non-finite final
    selection loss, or a final selection loss more than ``BLOWUP_NATS`` above the run's best) and ``not
    learned`` otherwise: it ended above the unigram entropy of the selection tokens without blowing up."""

    OK = "ok"
    DIVERGED = "diverged"
    NOT_LEARNED = "not learned"
    FAILED = "failed"


BLOWUP_NATS = 1.0
"""Nats above the run's best selection loss at which a final selection loss counts as blown up. A nat is a
factor e (2.7) in the probability the model gives each held-out token: three times the evaluation noise of
the committed studies, whose selection loss rises by at most 0.31 nats from one evaluation to the next (0.21
in a run that learned) and ends at most 0.12 above its best (mla-none at x100 in logit_control_mla_cpu; in a
run that learned, 0.02). Of the 753 committed finished cells, 747 are ok, 6 not learned (standard attention
at x30-x100, on MHA and MLA: a plateau at token frequencies, never below it) and none blew up."""

OUTCOME_RULE = (f"diverged = it blew up: a non-finite loss or gradient, or a final selection-split loss more than "
                f"{BLOWUP_NATS:g} nat{'s' * (BLOWUP_NATS != 1)} above the run's best; not learned = its final "
                "selection-split loss is above the unigram entropy without either; the rates and claims count both "
                "as diverged")


def classify(status: str, diverged: bool, nonfinite: bool, final_val: float, best_val: float) -> CellOutcome:
    """The outcome of a cell from its status, its registered ``diverged`` flag, whether it met a non-finite
    loss or gradient, and its final and best selection losses (NaN: none). ``ok`` exactly when the
    registered rule says it did not diverge: the outcome only names what ``diverged`` counts."""
    if status == "failed":
        return CellOutcome.FAILED
    if not diverged:
        return CellOutcome.OK
    best = min(best_val, final_val) if math.isfinite(best_val) else final_val
    if nonfinite or not math.isfinite(final_val) or final_val - best > BLOWUP_NATS:
        return CellOutcome.DIVERGED
    return CellOutcome.NOT_LEARNED


_AGREES = {"ok": (CellOutcome.OK,), "diverged": (CellOutcome.DIVERGED, CellOutcome.NOT_LEARNED),
           "failed": (CellOutcome.FAILED,)}


def cell_outcome(res: Mapping[str, Any]) -> CellOutcome:
    """A result's outcome: the ``outcome`` it records where that agrees with its status, else derived from
    what every result file holds (status, ``diverged``, the divergence reason, ``nonfinite_steps``, the final
    and best selection losses, the selection curve), so results written before ``outcome`` need no rewrite."""
    status = res.get("status")
    agrees = _AGREES.get(status, ())
    if res.get("outcome") in agrees:
        return CellOutcome(res["outcome"])
    if status == "failed" or not res.get("diverged"):
        return classify(status, False, False, float("nan"), float("nan"))
    steps = res.get("nonfinite_steps")
    nonfinite = str(res.get("divergence") or "").startswith(NONFINITE) or (_is_num(steps) and num(steps) > 0)
    return classify(status, True, nonfinite, *_final_best(res))


def _final_best(res: Mapping[str, Any]) -> tuple[float, float]:
    """A finished result's final selection loss and its best (of ``best_val_loss`` and the selection curve)."""
    final = res.get("final") if isinstance(res.get("final"), dict) else {}
    curve = ((res.get("curves") or {}).get("val") or {}).get("val_loss") or []
    curve = curve if isinstance(curve, list) else []
    best = min((x for x in map(num, [res.get("best_val_loss"), *curve]) if math.isfinite(x)), default=float("nan"))
    return num(final.get("val_loss")), best


def outcome_line(res: Mapping[str, Any]) -> str:
    """'not learned (final selection loss 6.85 above the unigram entropy 6.21)': a result's outcome and why
    (for a rise above its best, how far), as the runner prints it; a failure is the caller's to word."""
    how, why = cell_outcome(res), res.get("divergence")
    final, best = _final_best(res)
    if how is CellOutcome.DIVERGED and not str(why or "").startswith(NONFINITE) and math.isfinite(final - best):
        why = f"{why}; {final - best:.2f} nats above its best {best:.4f}"
    return f"{how} ({why})" if why else str(how)


def tally(outcomes) -> str:
    """'3 ok, 1 diverged, 2 not learned, 0 failed': how many of each outcome (an iterable of them)."""
    counts = {o: 0 for o in CellOutcome}
    for o in outcomes:
        counts[CellOutcome(o)] += 1
    return ", ".join(f"{n} {o}" for o, n in counts.items())


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
    for prefix, name in HEAD_SERIES.items():  # a controller's per-head factors (QKController.head_series_prefix)
        ctrl = downsample([r for r in records if any(k.startswith(prefix) and isinstance(v, list)
                                                     for k, v in r.items())], SERIES_POINTS)
        if ctrl:
            keys = sorted(k for k, v in ctrl[-1].items() if k.startswith(prefix) and isinstance(v, list))
            out[name] = {"step": [r["step"] for r in ctrl], **{k: [r.get(k) for r in ctrl] for k in keys}}
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
    best = min((num(r["val_loss"]) for r in evals), default=float("nan"))
    reason = None
    if nonfinite:
        reason = NONFINITE + (f" ({stopped})" if stopped else "")
    elif not math.isfinite(final_val) or final_val > unigram:
        reason = f"final selection loss {final_val:.4f} above the unigram entropy {unigram:.4f}"
    tail = losses[-max(1, len(losses) // 10):]
    last_diag = diags[-1]["diag"] if diags else {}
    heads = {k: last_diag[k] for k in HEAD_KEYS if k in last_diag}
    prefixes = tuple(HEAD_SERIES)
    ctrl = next((r for r in reversed(records) if any(k.startswith(prefixes) for k in r)), {}) if prefixes else {}
    heads.update({k: v for k, v in ctrl.items() if k.startswith(prefixes) and isinstance(v, list)})
    tps = [num(r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    steady = tps[len(tps) // 5:] or tps
    m, q = info["model"], info["qk"]
    status = "diverged" if reason else "ok"
    return {**header, "status": status, "diverged": bool(reason), "divergence": reason,
            "outcome": classify(status, bool(reason), nonfinite, final_val, best).value, "failure": None,
            "cell_hash": cell_hash, "git_sha": info.get("git_sha"), "corpus": info.get("corpus"),
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
            "best_val_loss": best,
            "curves": {"train": _curve(records, "loss"), "val": _curve(evals, "val_loss"),
                       "max_logit": _curve(evals, "max_logit"),
                       "logit_change": _curve([{"step": r["step"], **r["diag"]} for r in diags], "logit_change_mean"),
                       "first_token": _curve([{"step": r["step"], **r["diag"]} for r in diags], "first_token_mean")},
            "heads": heads, "head_series": head_series(records),
            "tokens_per_s": statistics.median(steady) if steady else float("nan"),
            "spikes": len(stab["spikes"]), "nonfinite_steps": len(stab["nonfinite_steps"]),
            "seconds": seconds, "probe": None}


def failed_result(header: dict[str, Any], message: str, cell_hash: str | None, seconds: float) -> dict[str, Any]:
    return {**header, "status": "failed", "diverged": False, "divergence": None, "outcome": CellOutcome.FAILED.value,
            "failure": message, "cell_hash": cell_hash, "seconds": seconds}


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


def schema_problem(res: dict[str, Any]) -> str | None:
    """None for a result of the schema this qklab reads (or none recorded: schema 1); else which it is."""
    schema = res.get("schema", SCHEMA)
    if type(schema) is int and schema == SCHEMA:
        return None
    newer = " (written by a newer qklab?)" if type(schema) is int and schema > SCHEMA else ""
    return f"schema {json.dumps(schema)[:40]}, which this qklab does not read{newer}"


def result_problem(res: Any) -> str | None:
    """None for a result a report and the runner can use; otherwise what is wrong with it, in a few words."""
    if not isinstance(res, dict):
        return f"a JSON {type(res).__name__}, not a result object"
    if (schema := schema_problem(res)) is not None:
        return schema
    missing = [k for k in ("cell", "variant", "lr_mult", "seed", "status") if k not in res]
    if missing:
        return f"no {', '.join(missing)} field{'s' if len(missing) > 1 else ''}"
    if not (isinstance(res["cell"], str) and res["cell"] and isinstance(res["variant"], str) and res["variant"]):
        return "cell and variant must be names"
    if res["status"] not in STATUSES:
        return f"status {res['status']!r} is none of {', '.join(STATUSES)}"
    if res.get("outcome") in tuple(CellOutcome) and res["outcome"] not in _AGREES[res["status"]]:
        return f"outcome {res['outcome']!r} disagrees with status {res['status']!r}"
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
