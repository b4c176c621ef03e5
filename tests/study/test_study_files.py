"""Every study file shipped in studies/ parses and every one of its cells is a valid config."""

from __future__ import annotations

from pathlib import Path

import pytest

from qklab.study import load_study
from qklab.study.spec import batch_order_seed, parse_study

STUDIES = sorted((Path(__file__).parents[2] / "studies").glob("*.toml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_study_file_is_valid(path):
    s = load_study(path)
    assert s.cells and len({c.id for c in s.cells}) == len(s.cells)
    for c in s.cells:
        cfg = c.cfg
        assert cfg.train.seed == c.seed and cfg.train.data_seed == batch_order_seed(s.protocol, c.seed)


def test_demo_covers_every_method_family():
    s = load_study(Path(__file__).parents[2] / "studies" / "demo.toml")
    kinds = {(c.cfg.model.attention, c.cfg.qk.method, c.cfg.qk.controller, c.cfg.model.attn_gate) for c in s.cells}
    assert kinds == {("mha", m, "none", "none") for m in ("none", "qknorm", "softcap", "qkmap", "quest", "qkguard")} | {
        ("mha", "none", c, "none") for c in ("quack", "qkclip", "qk_lr_multiplier", "upper_qk_slowdown")} | {
        ("mha", "none", "none", "head"),
        ("mla", "none", "none", "none"), ("mla", "qknorm", "none", "none"), ("mla", "none", "quack", "none")}


def test_grid_table_values_set_several_keys():
    raw = {"study": {"config": "tiny"},
           "grid": {"shape": [{"model.d_model": 64, "model.n_heads": 1}, {"model.d_model": 128, "model.n_heads": 2}],
                    "train.lr": [1e-3]},
           "variants": {"a": {}}}
    s = parse_study(raw, "g")
    assert [c.id for c in s.cells] == ["a_shape64-1_lr0.001_lr1_s0", "a_shape128-2_lr0.001_lr1_s0"]
    cfg = s.cells[1].cfg
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.lr) == (128, 2, 1e-3)
