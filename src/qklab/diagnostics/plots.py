"""PNG plots of a probe result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

HEAD_PANELS = ("max_logit", "logit_change", "entropy", "first_token", "q_norm", "k_norm", "wq_norm", "wk_norm")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, title: str, path: Path) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_heads(heads: dict[str, Any], title: str, path: Path) -> Path:
    """One heatmap (layer x head) per per-head measurement."""
    plt = _pyplot()
    keys = [k for k in HEAD_PANELS if k in heads]
    cols = 4
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        a = np.asarray(heads[key], dtype=float)  # (L, H)
        im = ax.imshow(a, aspect="auto", cmap="viridis")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_xticks(range(a.shape[1]))
        ax.set_yticks(range(a.shape[0]))
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    return _save(plt, fig, title, path)


def plot_magnitude(mag: dict[str, Any], title: str, path: Path) -> Path:
    """JS divergence vs the input scale (one line per layer, mean over heads), and the q/k transform's
    cosine and norm ratio."""
    plt = _pyplot()
    scales = np.asarray(mag["scales"], dtype=float)
    order = np.argsort(scales)
    js = np.asarray(mag["js"], dtype=float)  # (S, L, H)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for layer in range(js.shape[1]):
        a1.plot(scales[order], js[order, layer].mean(axis=1), marker="o", label=f"layer {layer}")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("input scale a")
    a1.set_ylabel("mean JS(attn_a, attn_1) [nats]")
    a1.legend(fontsize=7)
    for key, style in (("cos_q", "-o"), ("cos_k", "--o")):
        a2.plot(scales[order], np.asarray(mag[key + "_mean"])[order], style, label=key)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("input scale a")
    a2.set_ylabel("cos(phi(z), phi(a z))")
    a3 = a2.twinx()
    a3.plot(scales[order], np.asarray(mag["norm_ratio_q_mean"])[order], ":s", color="gray", label="||q_a||/||q_1||")
    a3.set_yscale("log", base=2)
    a3.set_ylabel("norm ratio", color="gray")
    a2.legend(fontsize=7, loc="lower left")
    return _save(plt, fig, title, path)


def plot_evidence(ev: dict[str, Any], title: str, path: Path) -> Path:
    """Evidence contrast of the best layer and next-token accuracy on the repeat vs context length."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p in ev["depths"]:
        cells = sorted((c for c in ev["cells"] if c["depth"] == p), key=lambda c: c["length"])
        n = [c["length"] for c in cells]
        a1.plot(n, [c["contrast_best_layer"] for c in cells], marker="o", label=f"depth {p}")
        a2.plot(n, [c["accuracy"] for c in cells], marker="o", label=f"depth {p}")
    for ax, lab in ((a1, "log contrast (best head, best layer)"), (a2, "next-token accuracy on the repeat")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length N")
        ax.set_ylabel(lab)
        ax.legend(fontsize=7)
    a1.axhline(0.0, color="gray", lw=0.8)
    return _save(plt, fig, title, path)
