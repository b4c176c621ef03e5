"""PNG plots of probe results (matplotlib, Agg backend: no display needed).

Heatmaps print each cell's value and share one colour scale per measurement across every panel drawn
for it (several runs in ``--compare``); first-token panels mark the uniform baseline and the 0.3 sink
threshold on their colour bar. Line plots use the real context lengths as ticks, mark the training
length and the uniform / chance levels, and draw the spread over contexts (or seeds) as error bars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

HEAD_PANELS = ("max_logit", "logit_change", "entropy", "first_token", "distance", "q_norm", "k_norm", "wq_norm",
               "wk_norm")
SINK_THRESHOLD = 0.3


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


def _fmt(v: float) -> str:
    if not np.isfinite(v):
        return "nan"
    a = abs(v)
    return f"{v:.0e}" if 0 < a < 1e-2 else (f"{v:.2f}" if a < 10 else f"{v:.0f}" if a >= 100 else f"{v:.1f}")


def heatmap(ax, fig, a: np.ndarray, key: str, vmin: float, vmax: float, baseline: float | None = None) -> None:
    """One (L, H) heatmap with its values written in the cells, on the colour scale [vmin, vmax]."""
    im = ax.imshow(a, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax)
    ax.set_title(key, fontsize=9)
    ax.set_xlabel("head", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.set_xticks(range(a.shape[1]))
    ax.set_yticks(range(a.shape[0]))
    ax.tick_params(labelsize=7)
    mid = (vmin + vmax) / 2
    small = 6 if a.size > 48 else 7
    for (i, j), v in np.ndenumerate(a):
        ax.text(j, i, _fmt(v), ha="center", va="center", fontsize=small, color="black" if v > mid else "white")
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.ax.tick_params(labelsize=7)
    if key in ("first_token", "distance"):  # reference levels on the colour bar, named in the title (no tick labels)
        shown = []
        levels = [(baseline, ":", "dotted: uniform")]
        if key == "first_token":
            levels.append((SINK_THRESHOLD, "--", "dashed: sink 0.3"))
        for level, style, lab in levels:
            if level is not None and vmin <= level <= vmax:
                cb.ax.axhline(level, color="red", ls=style, lw=1.2)
                shown.append(lab)
        if shown:
            ax.set_title(f"{key} ({', '.join(shown)})", fontsize=9)


def shared_range(arrays: list[np.ndarray], key: str) -> tuple[float, float]:
    """One colour scale for a measurement over several panels: [min, max] of all finite values; first-token
    attention on [0, 2 max] (at least [0, 0.05]), so that 0.01 differences do not look large and cells still
    differ in colour; the 0.3 sink threshold shows on the bar only when a value comes near it."""
    vals = np.concatenate([a[np.isfinite(a)].ravel() for a in arrays] or [np.zeros(1)])
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    if key == "first_token":
        return 0.0, min(1.0, max(0.05, 2 * hi))
    if key == "entropy":
        lo = 0.0
    return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)


def plot_heads(heads: dict[str, Any], title: str, path: Path, seq_len: int | None = None) -> Path:
    """One heatmap (layer x head) per per-head measurement, plus the first-token attention on 64-token
    inputs (the sink measurement) when present."""
    plt = _pyplot()
    panels = [(k, np.asarray(heads[k], dtype=float), heads.get(f"{k}_baseline")) for k in HEAD_PANELS
              if k in heads]  # a uniform-attention baseline: first_token's and distance's
    sink = heads.get("sink")
    if sink:
        panels.insert(4, ("first_token", np.asarray(sink["first_token"], dtype=float), sink["first_token_baseline"]))
    cols = 3
    rows = -(-len(panels) // cols)
    L, H = panels[0][1].shape
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 + 0.55 * H * cols + 1.5 * cols, 0.5 + (0.35 * L + 1.0) * rows),
                             squeeze=False)
    first_range = shared_range([a for k, a, _ in panels if k == "first_token"], "first_token")
    for n, (ax, (key, a, base)) in enumerate(zip(axes.flat, panels, strict=False)):
        vmin, vmax = first_range if key == "first_token" else shared_range([a], key)
        heatmap(ax, fig, a, key, vmin, vmax, base)
        if key == "first_token":
            at = f"{sink['seq_len']} tokens" if sink and n == 4 else f"T={seq_len}" if seq_len else "T"
            ax.set_title(f"first_token ({at}; uniform {base:.3f})" if base is not None else key, fontsize=9)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    return _save(plt, fig, title, path)


def plot_magnitude(mag: dict[str, Any], title: str, path: Path) -> Path:
    """JS divergence vs the input scale (one line per layer, mean over heads), and the q/k transform's
    cosine and norm ratio, all in one legend."""
    plt = _pyplot()
    scales = np.asarray(mag["scales"], dtype=float)
    order = np.argsort(scales)
    js = np.asarray(mag["js"], dtype=float)  # (S, L, H)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for layer in range(js.shape[1]):
        per_head = js[order, layer]  # (S, H)
        a1.errorbar(scales[order], per_head.mean(axis=1), yerr=per_head.std(axis=1), marker="o", capsize=2,
                    label=f"layer {layer} (mean, std over heads)")
    a1.set_xscale("log", base=2)
    a1.set_xticks(scales[order], [f"{a:g}" for a in scales[order]])
    a1.set_xlabel("input scale a")
    a1.set_ylabel("mean JS(attn_a, attn_1) [nats]")
    a1.axhline(np.log(2), color="gray", ls=":", lw=0.8, label="ln 2 (maximum)")
    a1.legend(fontsize=7)
    lines = []
    for key, style in (("cos_q", "-o"), ("cos_k", "--o")):
        lines += a2.plot(scales[order], np.asarray(mag[key + "_mean"])[order], style, label=key)
    a2.set_xscale("log", base=2)
    a2.set_xticks(scales[order], [f"{a:g}" for a in scales[order]])
    a2.set_xlabel("input scale a")
    a2.set_ylabel("cos(phi(z), phi(a z))")
    a3 = a2.twinx()
    for key, style in (("norm_ratio_q", ":s"), ("norm_ratio_k", ":^")):
        lines += a3.plot(scales[order], np.asarray(mag[key + "_mean"])[order], style, color="gray",
                         label=key.replace("norm_ratio_", "||") + "_a|| / ||" + key[-1] + "_1|| (right)")
    a3.set_yscale("log", base=2)
    a3.set_ylabel("norm ratio", color="gray")
    a2.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower left")
    return _save(plt, fig, title, path)


def _length_axis(ax, lengths: list[int], train_len: int | None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length N")
    lo, hi = min(lengths + [train_len or lengths[0]]) / 1.3, max(lengths + [train_len or 0]) * 1.3
    ax.set_xlim(lo, hi)
    if train_len:
        ax.axvline(train_len, color="black", ls="--", lw=0.8, label=f"training length T={train_len}")
        ax.axvspan(train_len, hi, color="gray", alpha=0.08)  # extrapolation


def plot_retrieval(rt: dict[str, Any], title: str, path: Path, runs: dict[str, dict[str, Any]] | None = None) -> Path:
    """Retrieval test vs N: evidence mass (with uniform), log-contrast (0 = no preference over the control
    pair), mean top-1 rank (with random order) and accuracy (with chance); error bars: std over contexts.
    ``runs`` {label: retrieval result} overlays several runs; the shaded part is extrapolation."""
    plt = _pyplot()
    runs = runs or {"": rt}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    lengths = sorted({r["length"] for res in runs.values() for r in res["lengths"]})
    for label, res in runs.items():
        rows = sorted(res["lengths"], key=lambda r: r["length"])
        n = [r["length"] for r in rows]
        hd = res["head"]
        lab = (label + " " if label else "") + f"head L{hd['layer']}.H{hd['head']}"
        for ax, key in zip(axes[:3], ("mass", "log_contrast", "rank"), strict=True):
            y, sd = np.asarray([r[key] for r in rows]), np.asarray([r[key + "_std"] for r in rows])
            floor = {"rank": 1.0, "mass": 0.0}.get(key)  # ranks stay >= 1 (log axis), masses >= 0
            low = sd if floor is None else np.minimum(sd, y - floor)
            ax.errorbar(n, y, yerr=[low, sd], marker="o", capsize=3, label=lab)
        axes[3].plot(n, [r["accuracy"] for r in rows], marker="o", label=lab)
    base = sorted(rt["lengths"], key=lambda r: r["length"])
    axes[0].plot([r["length"] for r in base], [r["uniform_mass"] for r in base], "k:", label="uniform attention")
    axes[1].axhline(0.0, color="black", ls=":", lw=0.8, label="no preference (0)")
    axes[2].plot([r["length"] for r in base], [r["chance_rank"] for r in base], "k:", label="random order")
    axes[2].set_yscale("log")
    axes[3].axhline(1.0 / rt["n_pairs"], color="black", ls=":", lw=0.8, label=f"1/{rt['n_pairs']} (a random value)")
    for ax, lab in zip(axes, ("attention mass on the evidence", "log-contrast vs a control pair",
                              "rank of the evidence (1 = top)", "retrieval accuracy"), strict=True):
        _length_axis(ax, lengths, rt.get("train_seq_len"))
        ax.set_ylabel(lab, fontsize=8)
        ax.legend(fontsize=6)
    axes[3].set_ylim(-0.02, 1.02)
    return _save(plt, fig, title, path)


def plot_evidence(ev: dict[str, Any], title: str, path: Path) -> Path:
    """Induction test: contrast of the chosen head (std over contexts) and accuracy on the repeat vs N."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for p in ev["depths"]:
        cells = sorted((c for c in ev["cells"] if c["depth"] == p), key=lambda c: c["length"])
        n = [c["length"] for c in cells]
        a1.errorbar(n, [c["contrast"] for c in cells], yerr=[c["contrast_std"] for c in cells], marker="o",
                    capsize=3, label=f"depth {p}")
        a2.plot(n, [c["accuracy"] for c in cells], marker="o", label=f"depth {p}")
    hd = ev["head"]
    a1.axhline(0.0, color="black", ls=":", lw=0.8, label="uniform attention (0)")
    a2.axhline(ev["chance_accuracy"], color="black", ls=":", lw=0.8, label="chance")
    for ax, lab in ((a1, f"induction contrast, head L{hd['layer']}.H{hd['head']}"),
                    (a2, "next-token accuracy on the repeat")):
        _length_axis(ax, ev["lengths"], ev.get("train_seq_len"))
        ax.set_ylabel(lab, fontsize=8)
        ax.legend(fontsize=7)
    return _save(plt, fig, title, path)


def plot_series(series: dict[str, dict[str, np.ndarray]], title: str, path: Path, upto: int | None = None) -> Path:
    """Per-head time series over training: one panel per quantity, one line per head (colour by layer)."""
    plt = _pyplot()
    keys = list(series)
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, key in zip(axes.flat, keys, strict=False):
        steps, v = series[key]["steps"], series[key]["values"]  # (S,), (S, L, H)
        for layer in range(v.shape[1]):
            for h in range(v.shape[2]):
                ax.plot(steps, v[:, layer, h], color=cmap(layer % 10), lw=0.9, alpha=0.8,
                        label=f"layer {layer}" if h == 0 else None)
        if key == "first_token":
            ax.axhline(SINK_THRESHOLD, color="red", ls="--", lw=0.8, label="sink 0.3")
        if upto is not None:
            ax.axvline(upto, color="black", ls=":", lw=0.8, label=f"probed step {upto}")
        ax.set_title(key + " (one line per head)", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    return _save(plt, fig, title, path)


def plot_seeds(groups: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path:
    """Retrieval test vs N per group of seeds: mean over seeds, error bars the std over seeds."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    lengths, train_len = set(), None
    for label, runs in groups.items():
        per_run = [{r["length"]: r for r in rt["lengths"]} for rt in runs.values()]
        common = sorted(set.intersection(*(set(p) for p in per_run)))
        lengths |= set(common)
        train_len = next(iter(runs.values())).get("train_seq_len")
        for ax, key in zip(axes, ("mass", "log_contrast", "accuracy"), strict=True):
            v = np.asarray([[p[n][key] for n in common] for p in per_run])  # (seeds, N)
            ax.errorbar(common, v.mean(axis=0), yerr=v.std(axis=0), marker="o", capsize=3,
                        label=f"{label} ({len(per_run)} seeds)")
    for ax, lab in zip(axes, ("attention mass on the evidence", "log-contrast vs a control pair",
                              "retrieval accuracy"), strict=True):
        _length_axis(ax, sorted(lengths), train_len)
        ax.set_ylabel(lab + " (mean, std over seeds)", fontsize=8)
        ax.legend(fontsize=6)
    axes[1].axhline(0.0, color="black", ls=":", lw=0.8)
    return _save(plt, fig, "retrieval test over seeds", path)


def plot_compare(results: dict[str, dict[str, Any]], path: Path, keys=("max_logit", "first_token", "entropy")) -> Path:
    """Several runs' per-head heatmaps, one row per run, one shared colour scale per measurement."""
    plt = _pyplot()
    labels = list(results)
    fig, axes = plt.subplots(len(labels), len(keys), figsize=(4.2 * len(keys), 0.6 + 2.4 * len(labels)),
                             squeeze=False)
    for j, key in enumerate(keys):
        arrays = [np.asarray(results[lab]["heads"][key], dtype=float) for lab in labels]
        vmin, vmax = shared_range(arrays, key)
        for i, lab in enumerate(labels):
            heatmap(axes[i, j], fig, arrays[i], key, vmin, vmax, results[lab]["heads"].get(f"{key}_baseline"))
            axes[i, j].set_title(f"{lab}: {key}", fontsize=8)
    return _save(plt, fig, "runs on one colour scale per measurement", path)
