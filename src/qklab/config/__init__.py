"""Typed run configuration: dataclasses loaded from TOML, overridden by ``--set key=value``.

Every mistake a user can make in a config (unknown key, wrong type, impossible shape, unknown method,
missing data) raises ``ConfigError`` with one line that names the key and says how to fix it.

What is known about a key sits on its field: a ``typing.Literal`` type lists its choices, and the
field's metadata its meaning, its valid range, whether it is neutral (does not change what a run
computes: a study's cell hash leaves it out) and whether it is resumable (may change on resume). One
check reads ranges and choices, for these sections and each method's options alike
(``qklab.fields``, which the methods' ``Options`` share: methods/ never imports the config).

    sections.py  the model, qk and train sections, their fields' metadata, ``from_dict``
    checks.py    rules across keys (``check_model``, Group Muon's heads), run names
    run.py       ``RunConfig``, ``NEUTRAL`` and ``RESUMABLE``, what a resumed run may change
    load.py      presets and ``--set`` items -> a validated ``RunConfig`` (``load_config``)
    dotted.py    dotted keys: key=value items (``parse_set``), set in a nested dict, ``flatten``
    keys.py      every key as ``qklab config`` and docs/config.md list it
"""

from __future__ import annotations

from qklab.config.checks import check_head_groups, check_model, check_run_name
from qklab.config.dotted import flatten, parse_set, parse_sets, parse_value, set_key, split_set
from qklab.config.keys import REFERENCE, KeyInfo, config_keys, keys_markdown, keys_text, select_keys, toml_value
from qklab.config.load import (
    PRESET_DIR,
    load_config,
    packaged,
    preset_names,
    read_preset,
    resolve_named_file,
    resolve_preset,
)
from qklab.config.run import NEUTRAL, RESUMABLE, RunConfig, comparable, resume_changes
from qklab.config.sections import MLADims, ModelConfig, QKConfig, Tracker, TrainConfig, from_dict, from_table
from qklab.data import DataConfig
from qklab.errors import ConfigError

__all__ = [
    "NEUTRAL", "PRESET_DIR", "REFERENCE", "RESUMABLE", "ConfigError", "DataConfig", "KeyInfo", "MLADims",
    "ModelConfig", "QKConfig", "RunConfig", "Tracker", "TrainConfig", "check_head_groups", "check_model",
    "check_run_name", "comparable", "config_keys", "flatten", "from_dict", "from_table", "keys_markdown", "keys_text",
    "load_config", "packaged", "parse_set", "parse_sets", "parse_value", "preset_names", "read_preset",
    "resolve_named_file", "resolve_preset", "resume_changes", "select_keys", "set_key", "split_set", "toml_value",
]
