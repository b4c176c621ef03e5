"""Attention diagnostics (definitions: docs/diagnostics.md): per-head measurements during training and on
checkpoints, magnitude sensitivity, evidence contrast, and run stability."""

from __future__ import annotations

from qklab.diagnostics.capture import capturing, probe_mode, qk_weight_norms, register_qk_weight_norms
from qklab.diagnostics.evidence import evidence_contrast
from qklab.diagnostics.monitor import AttentionMonitor, logit_change, snapshot
from qklab.diagnostics.sensitivity import magnitude_sensitivity
from qklab.diagnostics.stability import (
    NonFiniteError,
    SpikeDetector,
    diverged,
    find_spikes,
    stability_summary,
    stable_lr_range,
)

__all__ = [
    "AttentionMonitor",
    "NonFiniteError",
    "SpikeDetector",
    "capturing",
    "diverged",
    "evidence_contrast",
    "find_spikes",
    "logit_change",
    "magnitude_sensitivity",
    "probe_mode",
    "qk_weight_norms",
    "register_qk_weight_norms",
    "snapshot",
    "stability_summary",
    "stable_lr_range",
]
