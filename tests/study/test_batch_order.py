"""[protocol] data_seed = "seed": each cell's batch order follows its seed, and seed 0's cells keep the config
(and hash) of a study that fixes data_seed = 0, so that such a study's cells can be reused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from qklab.config import ConfigError
from qklab.study.spec import parse_study, read_study

FILE = Path(__file__).parents[2] / "studies" / "scale_english.toml"


def _small(raw: dict, data_seed) -> dict:
    raw = copy.deepcopy(raw)
    raw.pop("claims", None)
    raw["grid"]["shape"] = raw["grid"]["shape"][:1]
    raw["variants"] = {"none": raw["variants"]["none"]}
    raw["protocol"] = {"reference": "none", "lr_mults": [1.0], "data_seed": data_seed}
    return raw


def test_seed_order_sets_each_cells_data_seed_and_keeps_seed_zero_hashes():
    raw = read_study(FILE)
    by_seed = parse_study(_small(raw, "seed"), "x").cells
    fixed = parse_study(_small(raw, 0), "x").cells
    assert [c.cfg.train.data_seed for c in by_seed] == [0, 1, 2]
    assert [c.cfg.train.data_seed for c in fixed] == [0, 0, 0]
    assert by_seed[0].hash == fixed[0].hash  # seed 0: the same batches, the same config
    assert by_seed[1].hash != fixed[1].hash and by_seed[2].hash != fixed[2].hash


def test_scale_english_varies_the_batch_order_with_the_seed():
    s = parse_study(read_study(FILE), "scale_english")
    assert s.protocol.data_seed == "seed" and {c.cfg.train.data_seed == c.seed for c in s.cells} == {True}


@pytest.mark.parametrize("bad", ["order", -2, 1.5])
def test_other_values_are_one_line_errors(bad):
    with pytest.raises(ConfigError, match="data_seed"):
        parse_study(_small(read_study(FILE), bad), "x")
