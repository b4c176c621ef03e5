"""``qklab probe <run dir or checkpoint dir>``: every attention measurement on a trained checkpoint.

Loads the model from ``config.json`` (or the checkpoint's saved config) and ``model.safetensors``, takes
the held-out tokens of the run's data config, and writes ``probes.json`` (schema in docs/diagnostics.md)
and PNG plots into ``<run>/probes/<checkpoint>/``: per-head measurements on the training diagnostics'
probe batch (with the logit change since the previous checkpoint when one is kept), sinks, magnitude
sensitivity, the retrieval test and the induction test, and the run's per-head time series.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qklab.data import prepare_data
from qklab.data.mqar import MQARData
from qklab.data.retrieval import N_PAIRS, seen_pool
from qklab.diagnostics import plots
from qklab.diagnostics.evidence import DEPTHS, SEG_LEN, evidence_contrast
from qklab.diagnostics.monitor import probe_batch, snapshot, summarise
from qklab.diagnostics.mqar import mqar_evidence
from qklab.diagnostics.retrieval import retrieval_test
from qklab.diagnostics.sensitivity import SCALES, magnitude_sensitivity
from qklab.diagnostics.series import head_series
from qklab.errors import ProbeError
from qklab.rundir.checkpoint import complete_checkpoints, step_of, verify_checkpoint
from qklab.rundir.load import Target, load_model, load_run_config, resolve_target

SCHEMA = "qklab.probes/2"
MULTS = (1, 2, 4, 8, 16, 32)  # --max-mult: the longest probed context, in training lengths
MAX_BATCH, MAX_SAMPLES = 1024, 1024


@dataclass
class ProbeOptions:
    """What ``qklab probe`` measures; ``batch`` None: the run's ``train.diag_batch`` (the batch its
    training diagnostics used, so both read the same tokens)."""

    batch: int | None = None
    samples: int = 8  # contexts per (length, depth) cell of the retrieval and induction tests
    seg_len: int = SEG_LEN  # induction test: length of the repeated segment
    max_mult: int = 8  # longest context, in training lengths (> 1: extrapolation lengths)
    evidence: bool = True
    device: str = "cpu"
    unverified: bool = False  # accept a checkpoint without a manifest (--allow-unverified)

    def key(self) -> dict[str, Any]:
        """What decides a probe result's numbers: a cached probes.json measured otherwise is measured again."""
        return {"batch": self.batch, "samples": self.samples, "seg_len": self.seg_len, "max_mult": self.max_mult,
                "evidence": self.evidence}

    def check(self, seq_len: int | None = None) -> None:
        """Raise ProbeError (one line) for a setting that cannot work."""
        if self.batch is not None and not 1 <= self.batch <= MAX_BATCH:
            raise ProbeError(f"--batch {self.batch}: use 1 to {MAX_BATCH} probe sequences, e.g. --batch 4")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ProbeError(f"--samples {self.samples}: use 1 to {MAX_SAMPLES} contexts per cell, e.g. --samples 8")
        if self.max_mult not in MULTS:
            raise ProbeError(f"--max-mult {self.max_mult}: contexts are probed at 1, 2, 4, 8, 16 and 32 training "
                             f"lengths; use one of {', '.join(map(str, MULTS))}")
        if self.seg_len < 2:
            raise ProbeError(f"--seg-len {self.seg_len}: the repeated segment needs at least 2 tokens")
        if seq_len is not None and self.evidence and 4 * self.seg_len > seq_len:
            raise ProbeError(f"--seg-len {self.seg_len}: a segment and its repeat do not fit in the training "
                             f"length {seq_len} with text around them (needs 4 x seg_len <= {seq_len}); "
                             f"use --seg-len {max(2, seq_len // 4)} or less")
        if self.device not in ("cpu", "cuda", "auto") and not self.device.startswith("cuda:"):
            raise ProbeError(f"--device {self.device!r}: use cpu, cuda or auto")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ProbeError(f"--device {self.device}: no CUDA device is available; use --device cpu or auto")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def probe_lengths(T: int, max_mult: int, minimum: int) -> list[int]:
    """The main grid T/4, T/2, T (those >= minimum), then 2T, 4T, .. up to max_mult x T (extrapolation)."""
    main = [n for n in (T // 4, T // 2, T) if n >= minimum]
    return sorted(set(main + [T * m for m in (2, 4, 8, 16, 32) if m <= max_mult]))


def default_out(target: Target) -> Path:
    """``<run>/probes/<checkpoint name>``: every checkpoint gets its own folder, nothing is overwritten."""
    return (target.run_dir or target.ckpt.parent.parent) / "probes" / target.ckpt.name


def run_probe(path: str | Path, out: str | Path | None = None, opts: ProbeOptions | None = None,
              log=print, warn=None) -> dict[str, Any]:
    """Probe a run's newest good checkpoint (a damaged newer one is named through ``warn``, default ``log``)
    or the checkpoint ``path`` names; write probes.json and the plots."""
    t0 = time.time()
    opts = opts or ProbeOptions()
    opts.check()
    target = resolve_target(path, warn=warn or log, unverified=opts.unverified)
    cfg = load_run_config(target, opts.unverified)
    T = cfg.train.seq_len
    opts.check(T)
    dev = opts.torch_device()
    model, step = load_model(cfg, target.ckpt, dev, opts.unverified)
    out_dir = Path(out) if out else default_out(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(cfg.data, log=lambda s: None)
    val = data.val_tokens()
    x = probe_batch(val, opts.batch or cfg.train.diag_batch, T)  # (B, T): the training diagnostics' batch

    prev_snap, change_from = None, None
    at = step_of(target.ckpt)
    earlier = [c for c in complete_checkpoints(target.ckpt.parent)  # by step: step_10000000 follows step_9999999
               if at is not None and step_of(c) < at and verify_checkpoint(c, opts.unverified) is None]
    if earlier:  # the logit change since the previous kept checkpoint (that verifies)
        prev_model, prev_step = load_model(cfg, earlier[-1], dev, opts.unverified)
        if prev_step < step:
            prev_snap, change_from = snapshot(prev_model, x), prev_step
        del prev_model
    snap = snapshot(model, x, prev=prev_snap, steps=step - (change_from or 0), keep_qk=False)
    del prev_snap
    result: dict[str, Any] = {
        "schema": SCHEMA, "checkpoint": str(target.ckpt), "step": step,
        "run_dir": str(target.run_dir) if target.run_dir else None,
        "qk_method": cfg.qk.method, "qk_controller": cfg.qk.controller, "train_seq_len": T,
        "max_seq_len": cfg.model.max_seq_len, "probe_batch": list(x.shape), "logit_change_from_step": change_from,
        "options": opts.key(),
        "heads": summarise(snap.heads, snap.sink, T),
        "magnitude": magnitude_sensitivity(model, x, SCALES),
    }
    if opts.evidence and isinstance(data, MQARData):  # the task it trained on: the MQAR evidence test alone
        result["retrieval"] = mqar_evidence(model, data.spec, T, [m for m in MULTS if m <= opts.max_mult],
                                            batch=max(1, min(opts.batch or 8, 8)))
        result["induction"] = {"cells": [], "skipped": [{"length": T, "reason": "no text: data.source is mqar"}]}
    elif opts.evidence:
        pool = seen_pool(data.train_tokens(), cfg.model.vocab_size, (data.eot_id,))
        batch = max(1, min(opts.batch or 4, 4))
        result["retrieval"] = retrieval_test(model, val, pool, probe_lengths(T, opts.max_mult, 2 * (2 * N_PAIRS + 1)),
                                             T, DEPTHS, n_samples=opts.samples, batch=batch, seed=0)
        result["induction"] = evidence_contrast(model, val, probe_lengths(T, opts.max_mult, 4 * opts.seg_len),
                                                DEPTHS, seg_len=opts.seg_len, n_samples=opts.samples, batch=batch,
                                                seed=0, pool=pool, train_len=T)
    name = (target.run_dir or target.ckpt).name
    title = f"{name}  step {step}  qk.method={cfg.qk.method}"
    files = [plots.plot_heads(result["heads"], title, out_dir / "probe_heads.png", seq_len=T),
             plots.plot_magnitude(result["magnitude"], title, out_dir / "probe_magnitude.png")]
    if opts.evidence and result["retrieval"]["lengths"]:
        files.append(plots.plot_retrieval(result["retrieval"], title, out_dir / "probe_retrieval.png"))
    if opts.evidence and result["induction"]["cells"]:
        files.append(plots.plot_evidence(result["induction"], title, out_dir / "probe_induction.png"))
    series = head_series(target.run_dir / "metrics.jsonl") if target.run_dir else {}
    if series:
        files.append(plots.plot_series(series, title, out_dir / "probe_series.png", upto=step))
    result["files"] = [str(f) for f in files]
    result["seconds"] = round(time.time() - t0, 1)
    tmp = out_dir / "probes.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out_dir / "probes.json")
    log(summary_table(result))
    log(f"wrote {out_dir / 'probes.json'} and {len(files)} plots in {result['seconds']:.0f} s")
    return result


def summary_table(r: dict[str, Any]) -> str:
    h = r["heads"]
    lines = [f"probe: {r['checkpoint']}  step {r['step']}  qk.method={r['qk_method']}",
             f"{'layer':>5} {'max logit':>10} {'entropy':>8} {'1st tok':>8} {'dist':>7} {'sinks':>6} {'|q|':>7} "
             f"{'|k|':>7}"
             + (f" {'dlogit/step':>12}" if "logit_change" in h else "")]
    for i in range(len(h["max_logit"])):
        row = (f"{i:>5} {max(h['max_logit'][i]):>10.2f} {_mean(h['entropy'][i]):>8.3f} "
               f"{_mean(h['first_token'][i]):>8.3f} {_dist(h, i):>7} {h['sink_rate_per_layer'][i]:>6.2f} "
               f"{_mean(h['q_norm'][i]):>7.2f} {_mean(h['k_norm'][i]):>7.2f}")
        if "logit_change" in h:
            row += f" {_mean(h['logit_change'][i]):>12.2e}"
        lines.append(row)
    sk = h["sink"]
    if "distance" in h:
        lines.append(f"mean attention distance (mean over heads) {h['distance_mean']:.1f} tokens, uniform "
                     f"{h['distance_baseline']:.1f} at T={r['train_seq_len']}")
    lines.append(f"first-token attention (mean over heads) {h['first_token_mean']:.3f}, uniform "
                 f"{h['first_token_baseline']:.3f} at T={r['train_seq_len']}; at {sk['seq_len']} tokens "
                 f"{sk['first_token_mean']:.3f} (uniform {sk['first_token_baseline']:.3f}), sink rate "
                 f"{sk['rate']:.3f} (share of heads > {sk['threshold']})")
    m = r["magnitude"]
    lines.append("magnitude sensitivity, mean JS vs a=1: "
                 + "  ".join(f"a={a:g}: {js:.4f}" for a, js in zip(m["scales"], m["js_mean"], strict=True)))
    rt = r.get("retrieval")
    if rt and rt["lengths"]:
        hd = rt["head"]
        lines.append(f"retrieval ({rt['n_pairs']} key-value pairs; head L{hd['layer']}.H{hd['head']} chosen on "
                     f"separate contexts at N={hd['selected_at_length']}; mean +- std over contexts):")
        lines.append(f"{'N':>6} {'evidence mass':>17} {'uniform':>8} {'rank':>13} {'top-1':>6} "
                     f"{'log-contrast':>14} {'accuracy':>8}")
        for c in rt["lengths"]:
            lines.append(f"{c['length']:>6} {c['mass']:>8.3f} +- {c['mass_std']:<5.3f} {c['uniform_mass']:>8.4f} "
                         f"{c['rank']:>6.1f} +- {c['rank_std']:<4.1f} {c['top1']:>6.2f} "
                         f"{c['log_contrast']:>6.2f} +- {c['log_contrast_std']:<5.2f} {c['accuracy']:>8.2f}"
                         + ("  (extrapolation)" if c["extrapolation"] else ""))
    ev = r.get("induction")
    if ev and ev["cells"]:
        hd = ev["head"]
        lines.append(f"induction copy test, head L{hd['layer']}.H{hd['head']} (contrast; accuracy on the repeat):")
        lines.append(f"{'N':>6} " + " ".join(f"{'p=' + str(p):>16}" for p in ev["depths"]))
        for n in ev["lengths"]:
            cells = {c["depth"]: c for c in ev["cells"] if c["length"] == n}
            lines.append(f"{n:>6} " + " ".join(f"{cells[p]['contrast']:>8.2f} ({cells[p]['accuracy']:.2f})"
                                               for p in ev["depths"])
                         + ("  (extrapolation)" if n > ev["train_seq_len"] else ""))
    for key in ("retrieval", "induction"):
        for sk in (r.get(key) or {}).get("skipped", []):
            lines.append(f"{key}: skipped N={sk['length']}: {sk['reason']}")
    return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _dist(h: dict[str, Any], layer: int) -> str:
    """The layer's mean attention distance, '-' in a probes.json written before it was measured."""
    return f"{_mean(h['distance'][layer]):.1f}" if "distance" in h else "-"
