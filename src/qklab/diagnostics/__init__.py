"""Attention diagnostics (definitions: docs/diagnostics.md): per-head measurements during training and on
checkpoints, sinks, magnitude sensitivity, the retrieval and induction tests of evidence contrast, and run
stability; ``probe_summary`` gives a probe result's headline numbers."""

from __future__ import annotations

from qklab.diagnostics.capture import (
    capturing,
    probe_mode,
    qk_hooks,
    qk_weight_norms,
    register_qk_weight_norms,
    rope_length,
)
from qklab.diagnostics.evidence import evidence_contrast
from qklab.diagnostics.monitor import AttentionMonitor, logit_change, sink_stats, snapshot
from qklab.diagnostics.retrieval import retrieval_test
from qklab.diagnostics.sensitivity import magnitude_sensitivity
from qklab.diagnostics.series import head_series
from qklab.diagnostics.stability import (
    NonFiniteError,
    SpikeDetector,
    diverged,
    find_spikes,
    stability_summary,
)
from qklab.diagnostics.summary import probe_summary

__all__ = [
    "AttentionMonitor",
    "NonFiniteError",
    "SpikeDetector",
    "capturing",
    "diverged",
    "evidence_contrast",
    "find_spikes",
    "head_series",
    "logit_change",
    "magnitude_sensitivity",
    "probe_mode",
    "probe_summary",
    "qk_hooks",
    "qk_weight_norms",
    "register_qk_weight_norms",
    "retrieval_test",
    "rope_length",
    "sink_stats",
    "snapshot",
    "stability_summary",
]
