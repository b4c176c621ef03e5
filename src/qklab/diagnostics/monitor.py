"""Attention measurements on a fixed probe batch: one snapshot, and the monitor the trainer calls.

``snapshot(model, x)`` runs one fp32 forward pass on x (B, T) and measures, per layer and head: max
logit, mean ||q|| and ||k|| (after the method's transform), ||W_Q^h||_F and ||W_K^h||_F, attention
entropy and first-token attention; then a second pass on the first ``SINK_LEN`` tokens of each sequence
gives the sink measurements of the literature. Each layer is reduced to per-head numbers while the
forward runs (``qk_hooks`` + ``streamed.layer_stats``), so the pass holds one chunk of one layer's
logits at a time. ``AttentionMonitor`` keeps the previous snapshot's q and k (host memory) to add the
logit change per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from qklab.data import TokenLoader
from qklab.diagnostics import measures as M
from qklab.diagnostics.capture import (
    model_device,
    probe_mode,
    qk_hooks,
    qk_weight_norms,
)
from qklab.diagnostics.streamed import first_token_only, layer_stats, uniform_distance, uniform_first_token

PER_HEAD = ("max_logit", "q_norm", "k_norm", "wq_norm", "wk_norm", "entropy", "first_token", "distance")
SINK_LEN = 64  # the sink rate is defined on 64-token inputs (When Attention Sink Emerges, ICLR 2025)


@dataclass
class Snapshot:
    """Per-head measurements, each (L, H) fp32 on the CPU, and per layer the q (B, H, T, F) and
    k (B, Hk, T, F) they came from (CPU), the reference for the next logit change."""

    heads: dict[str, torch.Tensor]
    qk: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    sink: dict[str, object] = field(default_factory=dict)


def snapshot(model: nn.Module, x: torch.Tensor, prev: Snapshot | None = None, steps: int = 1,
             keep_qk: bool = True, consume: bool = False) -> Snapshot:
    """Measure the attention of ``model`` on the token batch x (B, T). With ``prev`` (a snapshot of the
    same batch), also ``logit_change``: mean |s - s_prev| per head divided by max(steps, 1); ``consume``
    drops each layer's reference q, k from ``prev`` once used, so one set is held, not two."""
    attns = model.attention_layers()
    rows: dict[str, list] = {k: [None] * len(attns) for k in (*PER_HEAD, "logit_change")}
    kept: list = [None] * len(attns)

    def on_layer(i: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        st = layer_stats(attn, q, k, prev.qk[i] if prev is not None else None)
        if consume and prev is not None:
            prev.qk[i] = None
        for key in ("max_logit", "q_norm", "k_norm", "entropy", "first_token", "distance"):
            rows[key][i] = st[key].cpu()
        if prev is not None:
            rows["logit_change"][i] = st["logit_abs_change"].cpu() / max(int(steps), 1)
        H = q.shape[1]
        wn = qk_weight_norms(attn)  # None: no norm function registered for this layer type
        nan = torch.full((H,), float("nan"))
        rows["wq_norm"][i] = wn[0].float().cpu() if wn is not None else nan
        rows["wk_norm"][i] = wn[1].float().cpu() if wn is not None else nan
        if keep_qk:
            kept[i] = (q.float().cpu(), k.float().cpu())

    with probe_mode(model), qk_hooks(model, on_layer):
        model(x.to(model_device(model)))
    keys = PER_HEAD + (("logit_change",) if prev is not None else ())
    heads = {k: torch.stack(rows[k]) for k in keys}  # each (L, H)
    return Snapshot(heads, kept, sink_stats(model, x))


def sink_stats(model: nn.Module, x: torch.Tensor, n: int = SINK_LEN) -> dict[str, object]:
    """First-token attention per layer and head on the first n tokens of each sequence of x, its
    uniform baseline, and the sink rate: the share of heads whose mean first-token weight exceeds 0.3."""
    n = min(n, x.shape[1])
    first: list = [None] * len(model.attention_layers())

    def on_layer(i: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        first[i] = first_token_only(attn, q, k).cpu()

    with probe_mode(model), qk_hooks(model, on_layer):
        model(x[:, :n].to(model_device(model)))
    ft = torch.stack(first)  # (L, H)
    return {"seq_len": n, "threshold": M.SINK_THRESHOLD, "first_token": ft.tolist(),
            "first_token_mean": ft.mean().item(), "first_token_baseline": uniform_first_token(n),
            "rate": M.sink_rate(ft), "rate_per_layer": (ft > M.SINK_THRESHOLD).float().mean(dim=1).tolist()}


def logit_change(model: nn.Module, x: torch.Tensor, old: Snapshot, steps: int) -> torch.Tensor:
    """Mean |logit_now - logit_old| over allowed pairs per head of ``model`` on x against an earlier
    snapshot of the same batch, divided by the optimizer steps between them (by 1 when none were taken,
    so unchanged weights give exactly 0); (L, H)."""
    return snapshot(model, x, prev=old, steps=steps, keep_qk=False).heads["logit_change"]


def summarise(heads: dict[str, torch.Tensor], sink: dict[str, object] | None = None,
              seq_len: int | None = None) -> dict[str, object]:
    """The JSON record: per-head lists (L x H) plus scalar summaries. ``sink`` (from ``sink_stats``)
    gives the sink rate on 64-token inputs; ``seq_len`` the uniform first-token baseline at T."""
    rec: dict[str, object] = {k: v.tolist() for k, v in heads.items()}
    rec["max_logit_max"] = heads["max_logit"].max().item()
    rec["entropy_mean"] = heads["entropy"].mean().item()
    rec["first_token_mean"] = heads["first_token"].mean().item()
    rec["distance_mean"] = heads["distance"].mean().item()
    if seq_len is not None:
        rec["first_token_baseline"] = uniform_first_token(seq_len)
        rec["distance_baseline"] = uniform_distance(seq_len)
    rec["sink_rate_at_T"] = M.sink_rate(heads["first_token"])  # the same threshold on the full-length batch
    if sink:
        rec["sink"] = sink
        rec["sink_rate"] = sink["rate"]
        rec["sink_rate_per_layer"] = sink["rate_per_layer"]
    if "logit_change" in heads:
        rec["logit_change_mean"] = heads["logit_change"].mean().item()
    return rec


def probe_batch(tokens: np.ndarray, batch: int, seq_len: int) -> torch.Tensor:
    """The fixed probe batch: ``batch`` windows of seq_len tokens at evenly spaced starts of the held-out
    tokens (deterministic, no RNG); (B, T) int64."""
    return TokenLoader.eval_batches(tokens, batch, seq_len, 1, name="probe")[0][0]


class AttentionMonitor:
    """Measurements every N steps during training on one fixed held-out batch x (B, T).

    Between evaluations it holds the per-head results (L x H) on the device side and, in host memory,
    the previous snapshot's q and k (L x B x (H + Hk) x T x F fp32) to report the logit change per step
    between consecutive evaluations; never a T x T tensor."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self._prev: Snapshot | None = None
        self._prev_step = 0

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, batch: int, seq_len: int) -> AttentionMonitor:
        return cls(probe_batch(tokens, batch, seq_len))

    def measure(self, model: nn.Module, step: int) -> dict[str, object]:
        methods = [a.qk for a in model.attention_layers()]
        for m in methods:  # the QK method's own stability statistics of this forward (QK-MAP: phases)
            m.record = True
        try:
            snap = snapshot(model, self.x, prev=self._prev, steps=step - self._prev_step, consume=True)
        finally:
            for m in methods:
                m.record = False
        self._prev, self._prev_step = snap, step
        rec = summarise(snap.heads, snap.sink, self.x.shape[1])
        stats = [m.stats() for m in methods]
        if any(stats):  # per layer, per head: e.g. method_stats.w_std[l][h]
            rec["method_stats"] = {k: [s.get(k) for s in stats] for k in stats[0]}
        return rec

    def state_dict(self, step: int) -> dict[str, object]:
        """For a checkpoint of ``step``: the reference of the next logit change (its step and each layer's q, k),
        {} when it was measured at ``step`` or none was (a resume then measures the same one again)."""
        if self._prev is None or self._prev_step == step:
            return {}
        return {"step": self._prev_step, "qk": [list(qk) for qk in self._prev.qk]}

    def load_state_dict(self, state: dict[str, object]) -> bool:
        """Take back the reference ``state_dict`` gave; False when there is none for this batch (another
        ``train.diag_batch``), which the caller then measures again."""
        qk = state.get("qk") if state else None
        if not qk or qk[0][0].shape[0] != self.x.shape[0]:
            return False
        self._prev, self._prev_step = Snapshot({}, [tuple(pair) for pair in qk]), int(state["step"])
        return True
