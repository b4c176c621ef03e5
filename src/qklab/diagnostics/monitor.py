"""Attention measurements on a fixed probe batch: one snapshot, and the monitor the trainer calls.

``snapshot(model, x)`` runs one fp32 eager forward pass on x (B, T) and measures, per layer and head:
max logit, mean ||q|| and ||k|| (after the method's transform), ||W_Q^h||_F and ||W_K^h||_F, attention
entropy and first-token attention; plus the sink rate. ``AttentionMonitor`` keeps the previous
snapshot's logits to add the logit change per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from qklab.data import TokenLoader
from qklab.diagnostics import measures as M
from qklab.diagnostics.capture import attention_layers, capturing, model_device, probe_mode, qk_weight_norms

PER_HEAD = ("max_logit", "q_norm", "k_norm", "wq_norm", "wk_norm", "entropy", "first_token")


@dataclass
class Snapshot:
    """Per-head measurements, each (L, H) in fp32 on the CPU, and the masked logits for the change."""

    heads: dict[str, torch.Tensor]
    logits: list[torch.Tensor] = field(repr=False)  # per layer (B, H, T, T), on the model's device
    masks: list[torch.Tensor] = field(repr=False)  # per layer (T, T)


def snapshot(model: nn.Module, x: torch.Tensor) -> Snapshot:
    """Measure the attention of ``model`` on the token batch x (B, T)."""
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in PER_HEAD}
    logits, masks = [], []
    with probe_mode(model), capturing(model) as caps:
        model(x.to(model_device(model)))
        for attn, cap in zip(attention_layers(model), caps, strict=True):
            s, p, mask = cap["logits"].float(), cap["probs"], cap["mask"]  # (B, H, T, T) x2, (T, T)
            H = s.shape[1]
            rows["max_logit"].append(M.max_logit(s, mask))
            rows["q_norm"].append(M.mean_norm(cap["q"], H))
            rows["k_norm"].append(M.mean_norm(cap["k"], H))
            wn = qk_weight_norms(attn)
            nan = torch.full((H,), float("nan"), device=s.device)
            rows["wq_norm"].append(wn[0] if wn is not None else nan)  # nan: no norm function registered
            rows["wk_norm"].append(wn[1] if wn is not None else nan)
            rows["entropy"].append(M.entropy(p, mask))
            rows["first_token"].append(M.first_token(p, mask))
            logits.append(s)
            masks.append(mask)
    heads = {k: torch.stack([r.cpu() for r in v]) for k, v in rows.items()}  # each (L, H)
    return Snapshot(heads, logits, masks)


def logit_change(new: Snapshot, old: Snapshot, steps: int) -> torch.Tensor:
    """Mean |logit_new - logit_old| over allowed pairs per head, divided by the optimizer steps between
    the two snapshots (by 1 when none were taken, so unchanged weights give exactly 0); (L, H)."""
    per_layer = [M.mean_abs_change(a, b, m) for a, b, m in zip(new.logits, old.logits, new.masks, strict=True)]
    return torch.stack(per_layer).cpu() / max(int(steps), 1)


def summarise(heads: dict[str, torch.Tensor]) -> dict[str, object]:
    """The JSON record: per-head lists (L x H) plus scalar summaries."""
    rec: dict[str, object] = {k: v.tolist() for k, v in heads.items()}
    rec["max_logit_max"] = heads["max_logit"].max().item()
    rec["entropy_mean"] = heads["entropy"].mean().item()
    rec["first_token_mean"] = heads["first_token"].mean().item()
    rec["sink_rate"] = M.sink_rate(heads["first_token"])
    rec["sink_rate_per_layer"] = (heads["first_token"] > M.SINK_THRESHOLD).float().mean(dim=1).tolist()
    if "logit_change" in heads:
        rec["logit_change_mean"] = heads["logit_change"].mean().item()
    return rec


def probe_batch(tokens: np.ndarray, batch: int, seq_len: int) -> torch.Tensor:
    """The fixed probe batch: ``batch`` windows of seq_len tokens at evenly spaced starts of the held-out
    tokens (deterministic, no RNG); (B, T) int64."""
    return TokenLoader.eval_batches(tokens, batch, seq_len, 1, name="probe")[0][0]


class AttentionMonitor:
    """Measurements every N steps during training on one fixed held-out batch x (B, T).

    Holds the previous snapshot's logits (L x (B, H, T, T) fp32 on the model's device) to report the
    logit change per step between consecutive evaluations."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self._prev: Snapshot | None = None
        self._prev_step = 0

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, batch: int, seq_len: int) -> AttentionMonitor:
        return cls(probe_batch(tokens, batch, seq_len))

    def measure(self, model: nn.Module, step: int) -> dict[str, object]:
        snap = snapshot(model, self.x)
        heads = dict(snap.heads)
        if self._prev is not None:
            heads["logit_change"] = logit_change(snap, self._prev, step - self._prev_step)
        self._prev, self._prev_step = snap, step
        return summarise(heads)
