"""A run's whole config (``RunConfig``): its sections, its validation, the keys a study's cell hash leaves
out (``NEUTRAL``) and those a resumed run may change (``RESUMABLE``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from qklab.config.checks import check_head_groups, check_model, check_run_name
from qklab.config.dotted import flatten
from qklab.config.sections import ModelConfig, QKConfig, Tracker, TrainConfig, _key, ensure
from qklab.data import DataConfig, DataError
from qklab.errors import ConfigError
from qklab.fields import check_fields, field_types


@dataclass
class RunConfig:
    """A run's whole configuration: its sections and the preset it started from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    qk: QKConfig = field(default_factory=QKConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str = _key("", doc="the preset the run's config started from (a preset file's name)", resumable=True)

    def validate(self) -> RunConfig:
        m, t, q = self.model, self.train, self.qk
        check_fields("train", t)
        check_run_name(t.name, "train.name", allow_empty=True)
        check_model(m, q)
        ensure(t.seq_len <= m.max_seq_len,
               f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len")
        trackers = typing.get_args(Tracker)
        ensure(all(x in trackers for x in t.trackers) and len(set(t.trackers)) == len(t.trackers),
               f"train.trackers={t.trackers}: use a list of distinct names from {', '.join(trackers)}")
        ensure(t.muon_head_groups == 0 or t.muon_per_head != "none",
               f"train.muon_head_groups={t.muon_head_groups} groups the heads of train.muon_per_head's matrices; "
               "set train.muon_per_head=qk or qkv")
        check_head_groups(t.muon_head_groups, m.n_heads, m.kv_heads if m.attention == "mha" else m.n_heads)
        ensure(t.data_seed >= -1, f"train.data_seed={t.data_seed}: use -1 (follow train.seed) or a seed >= 0")
        try:
            self.data.validate()
        except DataError as e:
            raise ConfigError(str(e)) from None
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _keys_with(flag: str) -> frozenset[str]:
    """The dotted keys (``train.steps``, ``preset``) whose field metadata sets ``flag``."""
    out: set[str] = set()
    for f in dataclasses.fields(RunConfig):
        sub = field_types(RunConfig)[f.name]
        if dataclasses.is_dataclass(sub):
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(sub) if g.metadata.get(flag)}
        elif f.metadata.get(flag):
            out.add(f.name)
    return frozenset(out)


NEUTRAL = _keys_with("neutral")  # do not change what a run computes: left out of a study cell's hash
RESUMABLE = _keys_with("resumable")  # may differ between a run and its resumption (resume_changes)


def comparable(cfg: RunConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` with the options of the active method and controller filled in (defaults
    included): the form saved in checkpoints and compared on resume."""
    d = cfg.to_dict()
    for name in (cfg.qk.method, cfg.qk.controller):
        d["qk"]["options"][name] = dataclasses.asdict(cfg.qk.opts(name))
    return d


OPTIONS = "qk.options"  # where ``to_dict`` keeps the method options; ``--set`` names them qk.<name>.<option>


def resume_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key old -> new`` for each key that differs and may not change on resume. Keys only one side has
    (added or removed by another version of qklab) are not compared."""
    a, b = (flatten(d, lift={OPTIONS}) for d in (saved, now))
    return [f"{k} {a[k]!r} -> {b[k]!r}" for k in sorted(a.keys() & b.keys()) if k not in RESUMABLE and a[k] != b[k]]
