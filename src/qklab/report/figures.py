"""The data behind every figure of a report, and the figures drawn from that data (matplotlib, Agg).

``figure_data(groups)`` returns plain series (checked by the tests, committed as ``report.json``);
``draw(data, out)`` only draws them, so what a figure shows is exactly what the data says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from qklab.study.analyze import Group, natural_key
from qklab.study.result import num


def uniform_first_token(seq_len: int) -> float:
    """First-token attention of uniform causal attention: mean over query positions i = 1..T-1 of 1/(i+1)."""
    if not seq_len or seq_len < 2:
        return float("nan")
    return float(np.mean(1.0 / np.arange(2, seq_len + 1)))


def _band(curves: list[dict[str, list]], key: str) -> dict[str, list[float]]:
    """Mean, min and max over seeds of curves that share their steps (the shortest run sets the length)."""
    if not curves:
        return {"step": [], "mean": [], "lo": [], "hi": [], "n": 0}
    n = min(len(c["step"]) for c in curves)
    if n == 0:
        return {"step": [], "mean": [], "lo": [], "hi": [], "n": len(curves)}
    y = np.array([[num(v) for v in c[key][:n]] for c in curves], dtype=np.float64)  # (seeds, n)
    with np.errstate(all="ignore"):
        return {"step": list(curves[0]["step"][:n]), "mean": np.nanmean(y, axis=0).tolist(),
                "lo": np.nanmin(y, axis=0).tolist(), "hi": np.nanmax(y, axis=0).tolist(), "n": len(curves)}


def figure_data(groups: list[Group]) -> dict[str, Any]:
    """Series per figure, keyed by panel then variant. A panel is an attention type ('mha', 'mla'); in a
    report of several studies it is a study and attention type ('qkmap_cpu: mha'), since studies differ in
    optimizer, schedule and length and their curves do not share axes; and a grid point (a width of a
    ladder) is a panel of its own ('mha [d_model=64]'), where its variants compete, as in the tables, each
    named by its variant alone, so that a method keeps one colour at every point."""
    data: dict[str, Any] = {"val_curves": {}, "train_curves": {}, "lr_sensitivity": {}, "logit_by_rate": {},
                            "max_logit": {},
                            "logit_change": {}, "first_token": {}, "probes": {}, "head_max_logit": {},
                            "head_w_norms": {}, "quack_factors": {}}
    for g in groups:
        att, label = _panel(g), g.variant
        data["val_curves"].setdefault(att, {})[label] = _band([c["val"] for c in g.curves], "val_loss")
        data["train_curves"].setdefault(att, {})[label] = _band([c["train"] for c in g.curves], "loss")
        data["max_logit"].setdefault(att, {})[label] = _band([c["max_logit"] for c in g.curves], "max_logit")
        data["logit_change"].setdefault(att, {})[label] = _band(
            [c["logit_change"] for c in g.curves], "logit_change_mean")
        mults = sorted(g.sweep)
        data["lr_sensitivity"].setdefault(att, {})[label] = {
            "lr": [g.sweep[m].lr for m in mults], "lr_mult": mults,
            "mean": [g.sweep[m].select.mean for m in mults],
            "std": [g.sweep[m].select.std for m in mults],
            "diverged": [g.sweep[m].diverged for m in mults], "n": [g.sweep[m].n for m in mults],
            "chosen_lr": g.chosen_lr}
        data["logit_by_rate"].setdefault(att, {})[label] = {  # every finished seed, diverged ones included
            "lr": [g.sweep[m].lr for m in mults], "lr_mult": mults,
            "mean": [g.sweep[m].max_logit.mean for m in mults],
            "std": [g.sweep[m].max_logit.std for m in mults],
            "diverged": [g.sweep[m].diverged for m in mults], "n": [g.sweep[m].n for m in mults]}
        ft = g.stats["first_token"]
        data["first_token"].setdefault(att, {})[label] = {
            "mean": ft.mean, "std": ft.std, "n": ft.n, "uniform": uniform_first_token(g.seq_len or 0)}
        if g.probe_by_seed:
            data["probes"].setdefault(att, {})[label] = _probe_series(list(g.probe_by_seed.values()))
        if g.head_series:  # the lowest seed's run at the chosen rate: its heads' spread over time
            seed, hs = min(g.head_series, key=lambda x: x[0])
            d = hs["diag"]
            data["head_max_logit"].setdefault(att, {})[label] = _head_band(d["step"], d["max_logit"], seed)
            wqk = [None if a is None or b is None else (np.asarray(a, float) * np.asarray(b, float)).tolist()
                   for a, b in zip(d["wq_norm"], d["wk_norm"], strict=True)]
            data["head_w_norms"].setdefault(att, {})[label] = _head_band(d["step"], wqk, seed)
            for q in (v for k, v in hs.items() if k != "diag"):  # a controller's per-head factors (QuacK's)
                both = [[v for k in q if k != "step" for v in np.ravel(np.asarray(q[k][i], float))]
                        for i in range(len(q["step"]))]
                data["quack_factors"].setdefault(att, {})[label] = _head_band(q["step"], both, seed)
    return data


def _head_band(steps: list[int], values: list, seed: int) -> dict[str, Any]:
    """Median, min and max over every (layer, head) entry at each step (steps without values dropped)."""
    keep = [(s, np.ravel(np.asarray(v, dtype=np.float64))) for s, v in zip(steps, values, strict=True)
            if v is not None and np.size(v)]
    return {"step": [s for s, _ in keep], "mean": [float(np.nanmedian(v)) for _, v in keep],
            "lo": [float(np.nanmin(v)) for _, v in keep], "hi": [float(np.nanmax(v)) for _, v in keep],
            "seed": seed, "heads": int(keep[0][1].size) if keep else 0}


def variant_name(g: Group, study: bool = True) -> str:
    """A group's name in a report (table rows and columns): the variant, its grid point, and its study when
    the report has several (``study=False`` where a column or heading names the study already)."""
    return g.variant + (f" [{g.point}]" if g.point else "") + (f" ({g.study})" if study and g.multi else "")


def _panel(g: Group) -> str:
    """A group's figure panel: its attention type, prefixed by its study in a multi-study report and
    followed by its grid point, if any."""
    key = f"{g.study}: {g.attention}" if g.multi else g.attention
    return f"{key} [{g.point}]" if g.point else key


def _panel_title(key: str) -> str:
    """'mha' -> 'MHA', 'qkmap_cpu: mha' -> 'qkmap_cpu: MHA', 'mha [d_model=64]' -> 'MHA' and, on a line of
    its own, '[d_model=64]'."""
    key, bracket, point = key.partition(" [")
    study, _, att = key.rpartition(": ")
    return (f"{study}: {att.upper()}" if study else att.upper()) + ("\n[" + point if bracket else "")


def _probe_series(probes: list[dict]) -> dict[str, Any]:
    """Means over seeds (and the band from the lowest to the highest seed): the numeric headline numbers,
    retrieval against context length, and the attention change (JS divergence) against input scale."""
    out: dict[str, Any] = {"n": len(probes)}
    keys = sorted({k for p in probes for k, v in p["summary"].items() if isinstance(v, int | float)})
    for k in keys:
        out[k] = _nanmean([p["summary"].get(k) for p in probes])
    lengths = sorted({r["length"] for p in probes for r in p.get("retrieval") or []})
    rows = [[r for p in probes for r in p.get("retrieval") or [] if r["length"] == n] for n in lengths]
    out["retrieval"] = {"length": lengths, "extrapolation": [any(r.get("extrapolation") for r in rs) for rs in rows],
                        **{k: [_nanmean([r.get(k) for r in rs]) for rs in rows]
                           for k in ("log_contrast", "mass", "uniform_mass", "accuracy")},
                        **{f"{k}_{e}": [_nanext([r.get(k) for r in rs], e) for rs in rows]
                           for k in ("log_contrast", "mass") for e in ("lo", "hi")}}
    scales = next((p["magnitude"]["scales"] for p in probes if (p.get("magnitude") or {}).get("scales")), [])
    js = [[(p.get("magnitude") or {}).get("js_mean", [None] * len(scales))[i] for p in probes]
          for i in range(len(scales))]  # (scale, seed)
    out["magnitude"] = {"scale": scales, "js": [_nanmean(x) for x in js], "js_lo": [_nanext(x, "lo") for x in js],
                        "js_hi": [_nanext(x, "hi") for x in js]}
    return out


def _nanext(xs: list, end: str) -> float:
    """The lowest ("lo") or highest ("hi") finite value of xs: the band over seeds."""
    vals = [v for v in (num(x) for x in xs if x is not None) if math.isfinite(v)]
    return float((min if end == "lo" else max)(vals)) if vals else float("nan")


def _nanmean(xs: list) -> float:
    vals = [num(x) for x in xs if x is not None]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


# ---------------------------------------------------------------------------------------------------
# drawing


# One colour per method across every panel and figure: the legend names of the whole report, sorted, take
# the palette in turn (tab10, then Dark2; it repeats after 18 names).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]


def colours(data: dict[str, Any]) -> dict[str, str]:
    """Legend name (a variant) -> colour, for every name in any panel of any figure of ``data``."""
    names = sorted({label for fig in data.values() if isinstance(fig, dict)
                    for panel in fig.values() if isinstance(panel, dict) for label in panel})
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(series: dict[str, dict], path: Path, panel, colour: dict[str, str], sharey: bool = False) -> Path | None:
    """One panel per key of ``series`` (attention type, or study and attention type, and grid point), two
    to a row, each drawn by ``panel(ax, key, its series, colour)``."""
    if not any(series.values()):
        return None
    plt = _plt()
    keys = sorted(series, key=natural_key)  # d_model=64 before d_model=128
    cols = min(2, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False, sharey=sharey)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        panel(ax, key, series[key], colour)
        if " [" in key:  # a grid point's long label, on a second line of the title (_panel_title)
            ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curves(title: str, ylabel: str, log_y: bool = False, heads: bool = False):
    """Per variant a line and its band: over seeds (mean, min-max), or with ``heads`` over a run's heads
    (median, lowest to highest head)."""
    def panel(ax, att, series, colour):
        for label, s in series.items():
            if not s["step"]:
                continue
            c = colour[label]
            ax.plot(s["step"], s["mean"], color=c, gid=label,
                    label=f"{label} (seed {s['seed']})" if heads else f"{label} (n={s['n']})")
            if heads or s["n"] > 1:
                ax.fill_between(s["step"], s["lo"], s["hi"], color=c, alpha=0.15 if heads else 0.2, gid=label)
        ax.set_title(f"{title}: {_panel_title(att)}", fontsize=9 if heads else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
    return panel


def _by_rate(title: str, ylabel: str, log_y: bool = False):
    """A panel of a final value against the learning rate (mean +- std over seeds; x: a seed diverged)."""
    def panel(ax, att, series, colour) -> None:
        _rate_lines(ax, series, colour)
        ax.set_title(f"{title}: {_panel_title(att)} (x: a seed diverged)", fontsize=9)
        ax.set_ylabel(ylabel)
        if log_y and _any_positive(series, "mean"):
            ax.set_yscale("log")
    return panel


def _any_positive(series, key: str) -> bool:
    """Whether any series has a finite value > 0 (a log axis needs one: failed cells have none)."""
    return any(np.any(np.nan_to_num(np.array(s[key], dtype=float), nan=0.0, posinf=0.0) > 0) for s in series.values())


def _rate_lines(ax, series, colour) -> None:
    for label, s in series.items():
        x = np.array(s["lr"], dtype=float)
        y = np.array(s["mean"], dtype=float)
        e = np.nan_to_num(np.array(s["std"], dtype=float))
        c = colour[label]
        ax.plot(x, y, "o-", label=label, color=c, gid=label)
        ax.errorbar(x, y, yerr=e, fmt="none", color=c, ecolor=c, capsize=3, gid=label)
        bad = [xi for xi, d in zip(x, s["diverged"], strict=True) if d]
        if bad:
            top = np.nanmax(y) if np.isfinite(y).any() else 1.0
            ax.plot(bad, [top] * len(bad), "x", color=c, markersize=10, gid=label)
    if _any_positive(series, "lr"):
        ax.set_xscale("log")
    ax.set_xlabel("learning rate")


def _first_token(ax, att, series, colour) -> None:
    labels = list(series)
    means = [series[k]["mean"] for k in labels]
    errs = [0.0 if not math.isfinite(series[k]["std"]) else series[k]["std"] for k in labels]
    bars = ax.bar(range(len(labels)), means, yerr=errs, capsize=3, color=[colour[k] for k in labels])
    for b, m, e, k in zip(bars, means, errs, labels, strict=True):
        b.set_gid(k)
        if math.isfinite(m):  # above its error bar, so that it never sits on the bar's own whisker
            ax.text(b.get_x() + b.get_width() / 2, m + e, f"{m:.3f}", ha="center", va="bottom", fontsize=7)
    uni = next((s["uniform"] for s in series.values() if math.isfinite(s["uniform"])), float("nan"))
    if math.isfinite(uni):
        ax.axhline(uni, color="k", ls="--", lw=1, label=f"uniform attention ({uni:.3f})")
    # the axis fits the bars and the uniform line; the 0.3 sink threshold is drawn only when a bar comes near it
    tops = [m + e for m, e in zip(means, errs, strict=True) if math.isfinite(m)]
    top = 1.3 * max([*tops, uni if math.isfinite(uni) else 0.0, 1e-3])
    if top >= 0.25:
        ax.axhline(0.3, color="0.4", ls=":", lw=1, label="sink threshold 0.3")
        top = max(top, 0.35)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(f"first-token attention at the end: {_panel_title(att)}"
                 + ("" if top >= 0.35 else " (every bar far below the 0.3 sink threshold)"), fontsize=9)
    ax.set_ylim(0, top)


def _probes(series: dict[str, dict], path: Path, colour: dict[str, str]) -> Path | None:
    """Per attention type: retrieval log-contrast and evidence mass against context length (hollow
    markers: longer than the training length), and the attention change against input scale."""
    if not any(series.values()):
        return None
    plt = _plt()
    atts = sorted(series)
    fig, axes = plt.subplots(len(atts), 3, figsize=(16, 4 * len(atts)), squeeze=False)
    for row, att in zip(axes, atts, strict=True):
        uniform = None
        for label, s in series[att].items():
            rt, mg, c = s["retrieval"], s["magnitude"], colour[label]
            if rt["length"]:
                row[0].plot(rt["length"], rt["log_contrast"], "-", color=c, gid=label, label=f"{label} (n={s['n']})")
                for ax, key in ((row[0], "log_contrast"), (row[1], "mass")):
                    if s["n"] > 1:  # band: lowest to highest seed
                        ax.fill_between(rt["length"], rt[f"{key}_lo"], rt[f"{key}_hi"], color=c, alpha=0.12, lw=0,
                                        gid=label)
                    for n, y, ext in zip(rt["length"], rt[key], rt["extrapolation"], strict=True):
                        ax.plot([n], [y], "o", color=c, mfc="none" if ext else c, gid=label)
                row[1].plot(rt["length"], rt["mass"], "-", color=c, label=label, gid=label)
                uniform = (rt["length"], rt["uniform_mass"])
            if mg["scale"]:
                row[2].plot(mg["scale"], mg["js"], "o-", color=c, label=label, gid=label)
                if s["n"] > 1:
                    row[2].fill_between(mg["scale"], mg["js_lo"], mg["js_hi"], color=c, alpha=0.12, lw=0, gid=label)
        if uniform is not None:
            row[1].plot(*uniform, "k:", lw=1, label="uniform attention")
        for ax, title, ylab in ((row[0], "retrieval log-contrast (evidence vs control)", "log ratio"),
                                (row[1], "attention mass on the evidence", "mass"),
                                (row[2], "attention change under input scale a", "JS divergence vs a = 1")):
            ax.set_title(f"{title}: {_panel_title(att)}", fontsize=9)
            ax.set_ylabel(ylab)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        for ax in row[:2]:
            ax.set_xlabel("context length N (hollow: N > training length)")
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        row[2].set_xlabel("input scale a")
        row[2].xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BY_RATE = ("lr_sensitivity", "logit_by_rate")
# figure name -> its caption in the report
CAPTIONS = {"val_curves": "Selection-split loss over training at each variant's chosen rate (mean, band: "
                          "min-max over seeds).",
            "lr_sensitivity": "Final selection-split loss against the learning rate (mean +- std over seeds).",
            "logit_by_rate": "Final max attention logit on the held-out batch against the learning rate "
                             "(mean +- std over every finished seed, diverged ones included).",
            "max_logit": "Max attention logit on the held-out batch over training.",
            "logit_change": "Mean absolute logit change per optimizer step between diagnostics.",
            "first_token": "First-token attention at the last diagnostics step, with the uniform-attention "
                           "baseline, and the 0.3 sink threshold where a bar comes near it.",
            "probes": "Attention probes of the final checkpoints (qklab probe; mean over seeds, band: lowest to "
                      "highest seed): retrieval "
                      "evidence contrast and mass against context length, and magnitude sensitivity.",
            "head_max_logit": "Max logit of each head (all layers) over training, at each variant's chosen "
                              "rate, lowest seed: median line, band from the lowest to the highest head.",
            "head_w_norms": "The norm product ‖W_Q,h‖ ‖W_K,h‖ of each head over training (a head's logits "
                            "scale with it), same runs: median and band over heads.",
            "scale_sensitivity": "LR sensitivity against non-embedding parameters (mean over seeds, band: 95% "
                                 "t-interval), one line per method; the legend gives each fit's slope per decade.",
            "quack_factors": "QuacK's per-head learning-rate factors (W_Q and W_K of every layer) over "
                             "training, same runs: median and band."}

CURVES = ("val_curves", "max_logit", "logit_change", "head_max_logit", "head_w_norms", "quack_factors")


def _points(s: dict[str, list], x: str) -> int:
    """How many points of a series have a finite x and a finite mean."""
    return sum(1 for a, b in zip(s.get(x) or [], s.get("mean") or [], strict=False)
               if a is not None and b is not None and math.isfinite(a) and math.isfinite(b))


def nothing_to_show(data: dict[str, Any]) -> dict[str, str]:
    """Figures with data but nothing to draw, and why: a value against the learning rate where no variant
    has two rates, a curve over training where no series has two points (a run shorter than the
    measurement's interval)."""
    out = {}
    for key in BY_RATE + CURVES:
        series = [s for panel in (data.get(key) or {}).values() for s in panel.values()]
        if not series:
            continue
        x = "lr" if key in BY_RATE else "step"
        if max(_points(s, x) for s in series) < 2:
            out[key] = ("each variant ran at one learning rate (a line needs two)" if key in BY_RATE else
                        "no series has two measured steps (the runs were shorter than the measurement's interval)")
    return out


def draw(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Draw every figure that has data and something to show (``nothing_to_show``: not drawn, and no PNG of
    it left from an earlier build), each method in its colour (``colours(data)``) in every panel; returns
    name -> PNG path."""
    out.mkdir(parents=True, exist_ok=True)
    c = colours(data)
    makers = {
        "val_curves": lambda: _figure(data["val_curves"], out / "val_curves.png",
                                      _curves("selection-split loss", "loss (nats)"), c),
        "lr_sensitivity": lambda: _figure(data["lr_sensitivity"], out / "lr_sensitivity.png",
                                          _by_rate("learning-rate sensitivity", "final selection-split loss"), c),
        "logit_by_rate": lambda: _figure(data["logit_by_rate"], out / "logit_by_rate.png",
                                         _by_rate("final max attention logit", "max logit", log_y=True), c),
        "max_logit": lambda: _figure(data["max_logit"], out / "max_logit.png",
                                     _curves("max attention logit", "max logit", True), c),
        "logit_change": lambda: _figure(data["logit_change"], out / "logit_change.png",
                                        _curves("logit change per step", "mean |d logit| / step", True), c),
        "first_token": lambda: _figure(data["first_token"], out / "first_token.png", _first_token, c, sharey=True),
        "probes": lambda: _probes(data["probes"], out / "probes.png", c),
        "head_max_logit": lambda: _figure(
            data["head_max_logit"], out / "head_max_logit.png",
            _curves("max logit per head (median, band: lowest to highest head)", "max logit", True, heads=True), c),
        "head_w_norms": lambda: _figure(
            data["head_w_norms"], out / "head_w_norms.png",
            _curves("||W_Q,h|| ||W_K,h|| per head (median, band over heads)", "norm product", True, heads=True), c),
        "quack_factors": lambda: _figure(
            data["quack_factors"], out / "quack_factors.png",
            _curves("QuacK learning-rate factor per head and matrix", "factor", True, heads=True), c),
    }
    empty = nothing_to_show(data)
    figs = {}
    for name, make in makers.items():
        if name in empty:
            (out / f"{name}.png").unlink(missing_ok=True)
        elif (path := make()) is not None:
            figs[name] = path
    return figs
