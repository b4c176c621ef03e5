"""Plots: values written in the cells, one colour scale across runs, real N ticks, baseline marks."""

from __future__ import annotations

import numpy as np

from qklab.diagnostics import plots


def _ax():
    plt = plots._pyplot()
    fig, ax = plt.subplots()
    return plt, fig, ax


def test_heatmap_writes_every_value_on_the_given_scale():
    plt, fig, ax = _ax()
    a = np.array([[0.012, 0.015, 0.3], [0.5, 0.02, 0.03]])
    plots.heatmap(ax, fig, a, "first_token", 0.0, 0.35, baseline=0.0235)
    assert [t.get_text() for t in ax.texts] == ["0.01", "0.01", "0.30", "0.50", "0.02", "0.03"]
    assert ax.images[0].get_clim() == (0.0, 0.35)
    cbar_lines = [ln.get_ydata()[0] for ln in fig.axes[1].lines]
    assert sorted(cbar_lines) == [0.0235, 0.3]  # uniform baseline and the sink threshold on the colour bar
    assert ax.get_title() == "first_token (dotted: uniform, dashed: sink 0.3)"  # named in the title, not by the ticks
    assert not fig.axes[1].texts
    plt.close(fig)


def test_distance_heatmap_marks_its_own_uniform_baseline():
    plt, fig, ax = _ax()
    plots.heatmap(ax, fig, np.array([[8.9, 60.0], [12.0, 70.0]]), "distance", 0.0, 80.0, baseline=64.0)
    assert [ln.get_ydata()[0] for ln in fig.axes[1].lines] == [64.0]  # T / 4; no sink threshold here
    assert ax.get_title() == "distance (dotted: uniform)"
    plt.close(fig)


def test_heads_plot_gives_each_panel_its_own_baseline(tmp_path, monkeypatch):
    seen = {}
    real = plots.heatmap
    monkeypatch.setattr(plots, "heatmap", lambda ax, fig, a, key, vmin, vmax, base=None: (
        seen.setdefault(key, base), real(ax, fig, a, key, vmin, vmax, base)))
    heads = {"max_logit": [[1.0, 2.0]], "entropy": [[1.0, 1.5]], "first_token": [[0.1, 0.2]], "distance": [[3.0, 9.0]],
             "first_token_baseline": 0.05, "distance_baseline": 16.0}
    plots.plot_heads(heads, "t", tmp_path / "h.png", seq_len=64)
    assert seen == {"max_logit": None, "entropy": None, "first_token": 0.05, "distance": 16.0}


def test_shared_range_covers_all_runs_and_keeps_first_token_absolute():
    a, b = np.array([[1.0, 2.0]]), np.array([[5.0, np.nan]])
    assert plots.shared_range([a, b], "max_logit") == (1.0, 5.0)
    # from 0 (0.003 apart: no zoom onto the difference), to twice the largest (cells still differ in colour)
    assert plots.shared_range([np.array([[0.012, 0.015]])], "first_token") == (0.0, 0.05)
    assert plots.shared_range([np.array([[0.012, 0.045]])], "first_token") == (0.0, 0.09)
    assert plots.shared_range([np.array([[0.2, 0.9]])], "first_token") == (0.0, 1.0)


def test_length_axis_uses_the_real_lengths_and_marks_t():
    plt, fig, ax = _ax()
    plots._length_axis(ax, [64, 128, 256, 512], 128)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256", "512"]
    assert any(ln.get_xdata()[0] == 128 for ln in ax.lines)
    plt.close(fig)


def test_compare_and_series_plots_are_written(tmp_path):
    heads = {"max_logit": [[1.0, 2.0]], "first_token": [[0.1, 0.2]], "entropy": [[1.0, 1.5]],
             "first_token_baseline": 0.05}
    out = plots.plot_compare({"a": {"heads": heads}, "b": {"heads": heads}}, tmp_path / "c.png")
    assert out.stat().st_size > 1000
    series = {"max_logit": {"steps": np.array([0, 10]), "values": np.ones((2, 1, 2))}}
    assert plots.plot_series(series, "t", tmp_path / "s.png", upto=10).stat().st_size > 1000
