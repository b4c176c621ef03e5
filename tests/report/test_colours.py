"""One colour per method: every figure draws a method in the colour that figures.colours gives its name,
in every panel (two studies: the same names in two panels of each figure)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from qklab.report import figures
from qklab.study.analyze import analyze, load_results
from qklab.study.result import write_json_atomic
from tests.study.synthetic import probe, result

VARIANTS = ("none", "qknorm", "qkmap", "quack")


def _analysis(tmp_path) -> dict:
    dirs = []
    for name in ("a", "b"):
        res = tmp_path / name
        write_json_atomic(res / "study.json", {"name": name, "variants": {v: {} for v in VARIANTS},
                                               "protocol": {"reference": "none", "lr_mults": [1.0, 2.0]}})
        for s in range(2):
            for m in (1.0, 2.0):
                for i, v in enumerate(VARIANTS):
                    c = result(v, m, s, 5.0 + 0.1 * i + 0.01 * s, 5.0 + 0.1 * i, study=name, probe=probe(0.1, 1.0),
                               method=v if v in ("qknorm", "qkmap") else "none",
                               controller="quack" if v == "quack" else "none")
                    write_json_atomic(res / c["cell"] / "result.json", c)
        dirs.append(res)
    analysis = analyze(*load_results(dirs))
    return dataclasses.replace(analysis, groups=[dataclasses.replace(g, multi=True) for g in analysis.groups])


def _hex(artist) -> str:
    """The colour an artist is drawn in: a line's, a bar's face, a band's face or an error bar's edge."""
    if isinstance(artist, Line2D):
        return mcolors.to_hex(artist.get_color())
    if isinstance(artist, Patch):
        return mcolors.to_hex(artist.get_facecolor())
    rgba = artist.get_edgecolor() if isinstance(artist, LineCollection) else artist.get_facecolor()
    return mcolors.to_hex(np.atleast_2d(rgba)[0])


def test_a_method_has_one_colour_in_every_panel(tmp_path, monkeypatch):
    data = figures.figure_data(_analysis(tmp_path).groups)
    mapping = figures.colours(data)
    assert list(mapping) == sorted(VARIANTS)  # the report's names, sorted, take the palette in turn
    assert list(mapping.values()) == figures.PALETTE[:4]
    drawn = []
    plt = figures._plt()
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figures that draw() closes
    figs = figures.draw(data, tmp_path / "out")
    assert len(drawn) == len(figs) >= 6
    seen = defaultdict(set)  # name -> {(figure, panel title)}
    for fig, name in zip(drawn, figs, strict=True):
        for ax in fig.axes:
            for artist in ax.findobj(lambda a: a.get_gid() in mapping):
                assert _hex(artist) == mapping[artist.get_gid()], (name, ax.get_title(), artist)
                seen[artist.get_gid()].add((name, ax.get_title()))
            legend = ax.get_legend()
            for line, text in zip(legend.get_lines() if legend else [], legend.get_texts() if legend else [],
                                  strict=True):
                label = text.get_text().split(" (")[0]
                if label in mapping:
                    assert mcolors.to_hex(line.get_color()) == mapping[label], (name, label)
    for v in VARIANTS:  # each method in both studies' panels of every figure
        panels = {title for _, title in seen[v]}
        assert any(t.endswith("a: MHA") for t in panels) and any(t.endswith("b: MHA") for t in panels), v
        assert {f for f, _ in seen[v]} >= {"val_curves", "lr_sensitivity", "max_logit", "first_token", "probes"}, v
    bars = [p for ax in drawn[list(figs).index("first_token")].axes for p in ax.patches if p.get_gid()]
    assert {p.get_gid(): _hex(p) for p in bars} == mapping  # bars too, one colour each
