"""``qklab probe <run dir or checkpoint dir>``: every attention measurement on a trained checkpoint.

Loads the model from ``config.json`` (or the checkpoint's saved config) and ``model.safetensors``, takes
the held-out tokens of the run's data config, and writes ``probes.json`` and PNG plots: per-head
measurements (with the logit change since the previous checkpoint when one is kept), magnitude
sensitivity and the evidence-contrast grid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qklab.config import ConfigError, RunConfig, from_dict
from qklab.data import prepare_data
from qklab.diagnostics import plots
from qklab.diagnostics.evidence import DEPTHS, SEG_LEN, evidence_contrast
from qklab.diagnostics.monitor import logit_change, probe_batch, snapshot, summarise
from qklab.diagnostics.sensitivity import SCALES, magnitude_sensitivity
from qklab.train.checkpoint import complete_checkpoints, latest_checkpoint, load_checkpoint

CONFIG_KEYS = ("model", "qk", "data", "train", "preset")


class ProbeError(ConfigError):
    """Bad input to ``qklab probe``; the message is one line (the CLI exits with code 2)."""


@dataclass
class Target:
    ckpt: Path  # ckpt/step_XXXXXXX
    run_dir: Path | None  # the run folder holding config.json, when known


def resolve_target(path: str | Path) -> Target:
    """A run folder, its ckpt/ folder or one checkpoint folder -> the checkpoint to probe."""
    p = Path(path)
    if not p.exists():
        raise ProbeError(f"{p}: no such run or checkpoint folder")
    if not p.is_dir():
        raise ProbeError(f"{p}: not a folder; give a run folder (runs/<name>) or a checkpoint (ckpt/step_*)")
    if (p / "model.safetensors").is_file():
        if not (p / "state.pt").is_file():
            raise ProbeError(f"{p}: incomplete checkpoint (no state.pt)")
        run_dir = p.parent.parent if p.parent.name == "ckpt" else None
        return Target(p, run_dir)
    ckpt_dir, run_dir = (p, p.parent) if p.name == "ckpt" else (p / "ckpt", p)
    ck = latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    if ck is None:
        raise ProbeError(f"{p}: no checkpoint found (expected {ckpt_dir}/step_*/model.safetensors); "
                         "train the run first")
    return Target(ck, run_dir)


def load_run_config(target: Target) -> RunConfig:
    """The run's RunConfig from config.json, else from the config saved in the checkpoint's state."""
    cfg_file = target.run_dir / "config.json" if target.run_dir is not None else None
    if cfg_file is not None and cfg_file.is_file():
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ProbeError(f"{cfg_file}: not valid JSON ({e})") from None
    else:
        raw = torch.load(target.ckpt / "state.pt", weights_only=False).get("config")
        if not isinstance(raw, dict):
            raise ProbeError(f"{target.ckpt}: no config.json next to it and none saved in state.pt")
    raw = {k: raw[k] for k in CONFIG_KEYS if k in raw}
    qk = dict(raw.get("qk", {}))
    qk.update(qk.pop("options", None) or {})  # saved as {"options": {name: {...}}}, read as [qk.<name>]
    raw["qk"] = qk
    return from_dict(RunConfig, raw).validate()


def load_model(cfg: RunConfig, ckpt: Path, device: torch.device) -> tuple[torch.nn.Module, int]:
    from qklab.model import GPT

    model = GPT(cfg.model, cfg.qk)
    try:
        state = load_checkpoint(ckpt, model)
    except (RuntimeError, KeyError, OSError) as e:
        raise ProbeError(f"{ckpt}: weights do not match the run's config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), int(state.get("step", 0))


def run_probe(path: str | Path, out: str | Path | None = None, batch: int = 8, samples: int = 8,
              seg_len: int = SEG_LEN, max_mult: int = 8, evidence: bool = True, device: str = "cpu",
              log=print) -> dict[str, Any]:
    t0 = time.time()
    target = resolve_target(path)
    cfg = load_run_config(target)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    model, step = load_model(cfg, target.ckpt, dev)
    out_dir = Path(out) if out else (target.run_dir or target.ckpt)
    out_dir.mkdir(parents=True, exist_ok=True)
    val = prepare_data(cfg.data, log=lambda s: None).val_tokens()
    T = cfg.train.seq_len
    x = probe_batch(val, batch, T)  # (B, T)

    snap = snapshot(model, x)
    heads, change_from = dict(snap.heads), None
    done = complete_checkpoints(target.ckpt.parent)
    earlier = [c for c in done if c.name < target.ckpt.name]
    if earlier:  # the logit change since the previous kept checkpoint
        prev_model, prev_step = load_model(cfg, earlier[-1], dev)
        if prev_step < step:
            heads["logit_change"] = logit_change(snap, snapshot(prev_model, x), step - prev_step)
            change_from = prev_step
        del prev_model
    del snap
    result: dict[str, Any] = {
        "checkpoint": str(target.ckpt), "step": step, "run_dir": str(target.run_dir) if target.run_dir else None,
        "qk_method": cfg.qk.method, "qk_controller": cfg.qk.controller, "train_seq_len": T,
        "max_seq_len": cfg.model.max_seq_len, "probe_batch": list(x.shape), "logit_change_from_step": change_from,
        "heads": summarise(heads),
        "magnitude": magnitude_sensitivity(model, x, SCALES),
    }
    if evidence:
        mults = [m for m in (1, 2, 4, 8, 16, 32) if m <= max_mult]
        result["evidence"] = evidence_contrast(model, val, [T * m for m in mults], DEPTHS, seg_len=seg_len,
                                               n_samples=samples, batch=max(1, min(batch, 4)), seed=0)
    title = f"{(target.run_dir or target.ckpt).name}  step {step}  qk.method={cfg.qk.method}"
    files = [plots.plot_heads(result["heads"], title, out_dir / "probe_heads.png"),
             plots.plot_magnitude(result["magnitude"], title, out_dir / "probe_magnitude.png")]
    if evidence and result["evidence"]["cells"]:
        files.append(plots.plot_evidence(result["evidence"], title, out_dir / "probe_evidence.png"))
    result["files"] = [str(f) for f in files]
    result["seconds"] = round(time.time() - t0, 1)
    (out_dir / "probes.json").write_text(json.dumps(result, indent=1) + "\n")
    log(summary_table(result))
    log(f"wrote {out_dir / 'probes.json'} and {len(files)} plots in {result['seconds']:.0f} s")
    return result


def summary_table(r: dict[str, Any]) -> str:
    h = r["heads"]
    lines = [f"probe: {r['checkpoint']}  step {r['step']}  qk.method={r['qk_method']}",
             f"{'layer':>5} {'max logit':>10} {'entropy':>8} {'1st tok':>8} {'sinks':>6} {'|q|':>7} {'|k|':>7}"
             + (f" {'dlogit/step':>12}" if "logit_change" in h else "")]
    for i in range(len(h["max_logit"])):
        row = (f"{i:>5} {max(h['max_logit'][i]):>10.2f} {_mean(h['entropy'][i]):>8.3f} "
               f"{_mean(h['first_token'][i]):>8.3f} {h['sink_rate_per_layer'][i]:>6.2f} "
               f"{_mean(h['q_norm'][i]):>7.2f} {_mean(h['k_norm'][i]):>7.2f}")
        if "logit_change" in h:
            row += f" {_mean(h['logit_change'][i]):>12.2e}"
        lines.append(row)
    lines.append(f"sink rate {h['sink_rate']:.3f}   first-token attention (mean over heads) "
                 f"{h['first_token_mean']:.3f}")
    m = r["magnitude"]
    lines.append("magnitude sensitivity, mean JS vs a=1: "
                 + "  ".join(f"a={a:g}: {js:.4f}" for a, js in zip(m["scales"], m["js_mean"], strict=True)))
    ev = r.get("evidence")
    if ev and ev["cells"]:
        lines.append("evidence contrast, best head of the best layer (accuracy on the repeat):")
        lines.append(f"{'N':>6} " + " ".join(f"{'p=' + str(p):>16}" for p in ev["depths"]))
        for n in ev["lengths"]:
            cells = {c["depth"]: c for c in ev["cells"] if c["length"] == n}
            lines.append(f"{n:>6} " + " ".join(f"{cells[p]['contrast_best_layer']:>8.2f} ({cells[p]['accuracy']:.2f})"
                                               for p in ev["depths"]))
        for s in ev["skipped"]:
            lines.append(f"skipped N={s['length']}: {s['reason']}")
    return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
