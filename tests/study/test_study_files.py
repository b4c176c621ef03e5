"""Every study file shipped in studies/ parses and every one of its cells is a valid config."""

from __future__ import annotations

from pathlib import Path

import pytest

from qklab.config import ConfigError
from qklab.study import load_study
from qklab.study.spec import Protocol, batch_order_seed, parse_study

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


@pytest.mark.parametrize("section, values, match", [
    ("study", {"workers": -1}, r"^\[study\] workers=-1 is out of range"),
    ("study", {"seeds": [0, 0]}, r"^\[study\] seeds=\[0, 0\] is out of range: it must be a non-empty list of distinct"),
    ("study", {"seeds": [True]}, r"^'\[study\] seeds' must be int, got bool"),
    ("study", {"name": "a b"}, r"^\[study\] name='a b' is out of range: it must be a plain name"),
    ("study", {"colour": 1}, r"^unknown key '\[study\] colour'; known keys here: config, name, seeds, set, workers"),
    ("protocol", {"lr_mults": [0]}, r"^\[protocol\] lr_mults=\[0.0\] is out of range: it must be a non-empty list"),
    ("protocol", {"lr_mults": [float("inf")]}, r"^'\[protocol\] lr_mults' must be a finite number"),
    ("protocol", {"lr_mults_for": {"a": [-1]}}, r"^\[protocol\] lr_mults_for=\{'a': \[-1.0\]\} is out of range"),
    ("protocol", {"lr_mults_for": {"b": [1]}}, r"^\[protocol\] lr_mults_for: 'b' is not a variant; variants: a"),
    ("protocol", {"reference": "b"}, r"^\[protocol\] reference: 'b' is not a variant"),
    ("protocol", {"data_seed": -2}, r"^\[protocol\] data_seed=-2 is out of range: it must be a seed >= 0"),
    ("protocol", {"data_seed": 0.5}, r"^'\[protocol\] data_seed' must be int or str, got float 0.5"),
    ("protocol", {"probe": -1}, r"^\[protocol\] probe=-1 is out of range"),
    ("protocol", {"lr_key": "lr"}, r"^\[protocol\] lr_key='lr' is out of range: it must be a float config key"),
    ("protocol", {"reuse": "x"}, r"^'\[protocol\] reuse' must be list, got str"),
])
def test_a_bad_study_or_protocol_key_is_one_line_naming_it(section, values, match):
    """[study] and [protocol] are checked as the run config is: the types by ``from_dict``, each field's range
    from its metadata by ``check_fields``; every message one line naming the key."""
    raw = {"study": {"config": "tiny", "seeds": [0]}, "variants": {"a": {}}}
    raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError, match=match) as e:
        parse_study(raw, "t")
    assert "\n" not in str(e.value)


def test_a_protocol_as_the_file_gives_it_reads_back_the_same():
    """Every [protocol] key given, in the types a TOML file has (ints where floats are meant): the parsed
    protocol is the one built by hand, its numbers floats, so the design it registers is unchanged."""
    raw = {"study": {"config": "tiny", "seeds": [0, 1], "workers": 0}, "variants": {"a": {}, "b": {}},
           "protocol": {"reference": "a", "lr_mults": [1, 2], "lr_mults_for": {"b": [0.5, 4]}, "lr_key": "train.lr",
                        "data_seed": "seed", "probe": 2, "reuse": ["x"]}}
    s = parse_study(raw, "t")
    want = Protocol(reference={"*": "a"}, lr_mults=[1.0, 2.0], lr_mults_for={"b": [0.5, 4.0]}, data_seed="seed",
                    probe=2, reuse=["x"])
    assert s.protocol == want and all(type(x) is float for x in s.protocol.lr_mults)
    assert (s.name, s.seeds, s.workers) == ("t", [0, 1], 0) and len(s.cells) == 2 * 2 + 2 * 2


def test_gpu_scale_is_scale_english_one_width_further():
    """gpu_scale tests the scale predictions in the fits' own regime: each of its cells is scale_english's
    cell of the same variant, rate multiple and seed at width 512, with the width, heads, Q/K init and anchor
    rate of the next step of its ladder (the anchor halving as the width doubles), and the checkpoint cadence
    (which computes nothing) alone changed."""
    from dataclasses import asdict, replace

    from qklab.report.predictions import TARGETS

    root = Path(__file__).parents[2] / "studies"
    scale = {(c.variant, c.lr_mult, c.seed): c for c in load_study(root / "scale_english.toml").cells
             if c.cfg.model.d_model == 512}
    gpu = load_study(root / "gpu_scale.toml")
    assert gpu.protocol.lr_mults == load_study(root / "scale_english.toml").protocol.lr_mults
    assert len(gpu.cells) == 30
    for c in gpu.cells:
        ref = scale[(c.variant, c.lr_mult, c.seed)]
        a, b = asdict(ref.cfg), asdict(c.cfg)
        assert (b["model"]["d_model"], b["model"]["n_heads"]) == (1024, 16)
        assert b["model"]["qk_init_std"] == pytest.approx(1024 ** -0.5)
        assert b["train"]["lr"] == pytest.approx(a["train"]["lr"] / 2)
        for cfg in (a, b):
            cfg["model"].update(d_model=None, n_heads=None, qk_init_std=None)
            cfg["train"].update(lr=None, ckpt_every=None)
        assert a == b
    # the target it measures: its model's non-embedding parameters, exactly
    import torch

    from qklab.model.gpt import GPT
    from qklab.study.sensitivity import non_embedding

    label = next(x for x in TARGETS if "gpu_scale" in x)
    with torch.device("meta"):
        model = GPT(replace(gpu.cells[0].cfg.model, vocab_size=4096), gpu.cells[0].cfg.qk)
    assert non_embedding(sum(p.numel() for p in model.parameters()), 4096, 1024) == TARGETS[label]
