"""Standard attention ("none"): softmax(q k^T / sqrt(d)), no intervention."""

from __future__ import annotations

from qklab.methods.base import QKMethod


class Standard(QKMethod):
    name = "none"
