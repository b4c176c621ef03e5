"""Typed run configuration: dataclasses loaded from TOML, overridden by ``--set key=value``.

Every mistake a user can make in a config (unknown key, wrong type, impossible shape, unknown method,
missing data) raises ``ConfigError`` with one line that names the key and says how to fix it.

What is known about a key sits on its field: a ``typing.Literal`` type lists its choices, and the
field's metadata (see ``_key``) its meaning, its valid range, whether it is neutral (does not change what
a run computes: a study's cell hash leaves it out) and whether it is resumable (may change on resume).
``qklab config`` and docs/config.md (``keys_markdown``) list every key from there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from qklab.data import DataConfig, DataError
from qklab.errors import ConfigError
from qklab.methods import CONTROLLERS, METHODS, AttnShape


class MLADims(typing.NamedTuple):
    q_rank: int  # 0: no query latent
    kv_rank: int
    nope: int
    rope: int
    v: int


Range = tuple[Callable[[Any], bool], str]  # (is the value valid, what a valid value is: "> 0, e.g. 3e-3")


def _between(lo: float, hi: float, hi_open: bool = False, note: str = "") -> Range:
    text = f"in [{lo}, {hi}{')' if hi_open else ']'}{note}"
    return (lambda v: lo <= v < hi) if hi_open else (lambda v: lo <= v <= hi), text


def _at_least(lo: float, note: str = "") -> Range:
    return (lambda v: v >= lo), f">= {lo}{note}"


def _above(lo: float, note: str = "") -> Range:
    return (lambda v: v > lo), f"> {lo}{note}"


def _key(default: Any = dataclasses.MISSING, rng: Range | None = None, *, doc: str, allowed: str = "",
         factory: Any = dataclasses.MISSING, neutral: bool = False, resumable: bool = False) -> Any:
    """A config field and what is known about it, in its metadata:
    doc: its meaning in one line (``qklab config``, docs/config.md);
    range: (check, text), the valid values (types are checked on loading, non-finite floats refused);
    allowed: the valid values as text, where a rule across keys checks them (``validate``, ``check_model``);
    neutral: does not change what a run computes (where it writes, how it shows progress, its threads);
    resumable: may differ between a run and its resumption (see ``RESUMABLE``)."""
    meta = {k: v for k, v in (("doc", doc), ("range", rng), ("allowed", allowed), ("neutral", neutral),
                              ("resumable", resumable)) if v}
    return field(default=default, default_factory=factory, metadata=meta)


_MLA_WIDTH = _at_least(0, " (0: the default)")


@dataclass
class ModelConfig:
    """The GPT: its shape, its attention and its positions."""

    vocab_size: int = _key(0, _at_least(0, " (0: the tokenizer's vocabulary)"),
                           doc="tokens the embedding and the head cover; 0: taken from the tokenizer")
    d_model: int = _key(256, _above(0), doc="width of the residual stream")
    n_layers: int = _key(4, _above(0), doc="transformer blocks")
    n_heads: int = _key(4, _above(0), doc="query heads per layer (they divide d_model; head_dim = d_model / n_heads)")
    n_kv_heads: int = _key(0, _at_least(0, " (0: same as n_heads)"),
                           doc="key/value heads: 0, the same as n_heads (MHA); fewer, dividing n_heads: GQA")
    d_ff: int = _key(0, _at_least(0, " (0: 8/3 * d_model)"),
                     doc="SwiGLU width; 0: 8/3 * d_model rounded up to 64s")
    max_seq_len: int = _key(1024, _above(1), doc="longest context: RoPE tables and the KV cache are sized from this")
    rope_theta: float = _key(10000.0, _above(0, ", e.g. 10000"), doc="RoPE base: pair i turns by "
                                                                     "theta^(-2i/head_dim) radians a position")
    tie_embeddings: bool = _key(True, doc="the output head shares the token embedding's weights")
    norm_eps: float = _key(1e-6, _above(0, ", e.g. 1e-6"), doc="epsilon of the RMSNorms")
    init_std: float = _key(0.02, _above(0, ", e.g. 0.02"), doc="std of the normal init of the weight matrices")
    qk_init_std: float = _key(0.0, _at_least(0, " (0: the QK method's own init rule), e.g. 1/sqrt(d_model)"),
                              doc="std of W_Q/W_K for every QK method (a fair comparison); 0: the method's own rule")
    attn_impl: Literal["auto", "sdpa", "eager"] = _key(
        "auto", doc="attention kernel: auto, fused unless the method rewrites logits; sdpa, fused only; eager")
    attention: Literal["mha", "mla"] = _key("mha", doc="mha: MHA/GQA (see n_kv_heads); mla: latent attention "
                                                       "(docs/mla.md)")
    attn_gate: Literal["none", "head", "element"] = _key(
        "none", doc="gated attention (arXiv 2505.06708): each head's output times sigmoid(W_g x), x the block's "
                    "normalised input, before W_O; head: a gate per head, element: one per output feature")
    attn_sink: bool = _key(False, doc="a learnable per-head logit in the softmax denominator (gpt-oss's sinks)")
    q_rank: int = _key(0, _MLA_WIDTH, doc="MLA query latent width; 0: no query latent (queries from x)")
    kv_rank: int = _key(0, _MLA_WIDTH, doc="MLA key/value latent width; 0: 2 * head_dim")
    nope_dim: int = _key(0, _MLA_WIDTH, doc="MLA per-head q/k width without RoPE; 0: head_dim")
    rope_dim: int = _key(0, _MLA_WIDTH, doc="MLA per-head q/k width with RoPE (= the shared rope key's); "
                                            "0: head_dim // 2")
    v_dim: int = _key(0, _MLA_WIDTH, doc="MLA per-head value width; 0: head_dim")
    rope_scaling: Literal["none", "yarn"] = _key("none", doc="yarn: YaRN context extension, as DeepSeek-V2/V3 "
                                                             "(rope.Yarn)")
    yarn_factor: float = _key(1.0, doc="YaRN: context extension factor", allowed="> 1 (with rope_scaling=yarn)")
    yarn_original_max_len: int = _key(0, doc="YaRN: the context the frequencies were made for; 0: max_seq_len / "
                                             "yarn_factor", allowed=">= 0")
    yarn_beta_fast: float = _key(32.0, doc="YaRN: pairs turning more often than this over the original context keep "
                                           "their frequency", allowed="> 0 (and > yarn_beta_slow)")
    yarn_beta_slow: float = _key(1.0, doc="YaRN: pairs turning less often than this are fully interpolated",
                                 allowed="> 0 (and < yarn_beta_fast)")
    yarn_mscale: float = _key(0.0, doc="YaRN: 0, unset; with yarn_mscale_all_dim, the tables' attention factor is "
                                       "mscale(factor, this) / mscale(factor, yarn_mscale_all_dim)")
    yarn_mscale_all_dim: float = _key(0.0, doc="YaRN: 0, unset; else MLA's softmax scale gets "
                                               "mscale(factor, this)^2")

    @property
    def mla_dims(self) -> MLADims:
        """MLA widths with the defaults filled in."""
        hd = self.head_dim
        return MLADims(self.q_rank, self.kv_rank or 2 * hd, self.nope_dim or hd, self.rope_dim or hd // 2,
                       self.v_dim or hd)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 64 * -(-(8 * self.d_model // 3) // 64)


@dataclass
class QKConfig:
    """The QK method and controller; the options of each in its own section, qk.<name>."""

    method: str = _key("none", doc="forward-side QK method (qklab.methods.METHODS)", allowed=" | ".join(METHODS))
    controller: str = _key("none", doc="optimizer-side QK controller (qklab.methods.CONTROLLERS)",
                           allowed=" | ".join(CONTROLLERS))
    options: dict[str, Any] = _key(factory=dict, doc="the options of each method and controller, keyed by its name: "
                                                     "[qk.softcap] cap = 30.0 -> {'softcap': SoftCapOptions}")

    def __post_init__(self) -> None:
        """From Python as from TOML: unknown names are one ``ConfigError`` line, and options given as a dict
        (``options={"softcap": {"cap": 30.0}}``) become the method's Options, their keys and types checked."""
        _check(self.method in METHODS,
               f"qk.method='{self.method}' is unknown; choose one of {', '.join(sorted(METHODS))}")
        _check(self.controller in CONTROLLERS,
               f"qk.controller='{self.controller}' is unknown; choose one of {', '.join(sorted(CONTROLLERS))}")
        _check(isinstance(self.options, dict), f"qk options must be a dict keyed by method name, got "
                                               f"{type(self.options).__name__}")
        known = {**METHODS, **CONTROLLERS}
        for name, opts in list(self.options.items()):
            _check(name in known, f"qk options for '{name}', which is no method or controller; known: "
                                  f"{', '.join(sorted(known))}")
            if isinstance(opts, dict):
                self.options[name] = from_dict(known[name].Options, opts, f"qk.{name}.")
            else:
                want = known[name].Options
                _check(isinstance(opts, want), f"qk options for '{name}' must be a dict or {want.__name__}, got "
                                               f"{type(opts).__name__}")

    def opts(self, name: str) -> Any:
        cls = {**METHODS, **CONTROLLERS}[name].Options
        return self.options.get(name) or cls()


Tracker = Literal["tensorboard", "wandb"]  # train.trackers: also log to these (wandb offline)


@dataclass
class TrainConfig:
    """How a run trains: its length, batches, optimizer and schedule, and where and how often it evaluates,
    saves, logs and measures."""

    # resumable: may differ between a run and its resumption: its length, how often it logs, evaluates and
    # saves, where and on what it runs, and the remedies a non-finite stop suggests (lr, clipping, skipping)
    name: str = _key("", doc='run folder name under out_dir (a plain folder name); "": from preset, method, seed',
                     neutral=True, resumable=True)
    out_dir: str = _key("runs", doc="folder that holds the run folders", neutral=True, resumable=True)
    seed: int = _key(0, _between(0, 2**32 - 1), doc="seed of the initial weights (and of the batches, see data_seed)")
    data_seed: int = _key(-1, doc="order of the training batches; -1: train.seed (a study fixes it across cells)",
                          allowed=">= -1 (-1: train.seed)")
    trackers: list[Tracker] = _key(factory=list, doc="also log to these (wandb offline)", resumable=True)
    steps: int = _key(200, _above(0), doc="optimizer steps of the run", resumable=True)
    batch_size: int = _key(16, _above(0), doc="sequences per micro-batch on each process")
    seq_len: int = _key(256, _above(1), doc="tokens per training sequence (at most model.max_seq_len)")
    grad_accum: int = _key(1, _above(0), doc="micro-batches whose gradients make one step")
    optimizer: Literal["adamw", "muon"] = _key("adamw", doc="muon: Muon on the hidden matrices, AdamW on the rest")
    lr: float = _key(3e-3, _above(0, ", e.g. 3e-3"), doc="peak learning rate (Muon: of the hidden matrices)",
                     resumable=True)
    adam_lr: float = _key(0.0, _at_least(0, " (0: train.lr)"),
                          doc="Muon only: learning rate of the AdamW groups (embeddings, head)")
    weight_decay: float = _key(0.1, _at_least(0), doc="decoupled weight decay")
    beta1: float = _key(0.9, _between(0, 1, hi_open=True, note=", e.g. 0.9"), doc="AdamW's first-moment decay")
    beta2: float = _key(0.95, _between(0, 1, hi_open=True, note=", e.g. 0.95"), doc="AdamW's second-moment decay")
    muon_momentum: float = _key(0.95, _between(0, 1, hi_open=True, note=", e.g. 0.95"), doc="Muon's momentum")
    muon_per_head: Literal["none", "qk", "qkv"] = _key(
        "none", doc="Muon only: Newton-Schulz per attention head on W_Q, W_K (qkv: and W_V; MLA: the per-head "
                    "up-projections)")
    muon_head_groups: int = _key(
        0, _at_least(0, " (0: one group per head)"),
        doc="Muon only, with muon_per_head: Newton-Schulz over g groups of adjacent heads of each matrix (Group "
            "Muon; 1: the whole matrix, n_heads: per head); a KV matrix takes min(g, its heads) groups")
    schedule: Literal["cosine", "constant"] = _key("cosine", doc="learning rate after a linear warmup")
    warmup_steps: int = _key(20, _at_least(0), doc="steps of the linear warmup")
    min_lr_ratio: float = _key(0.1, _between(0, 1), doc="cosine: the last step's lr as a share of the peak")
    grad_clip: float = _key(1.0, _at_least(0, " (0: off)"), doc="largest global gradient norm", resumable=True)
    eval_every: int = _key(50, _above(0), doc="steps between evaluations",
                           resumable=True)
    eval_batches: int = _key(8, _above(0), doc="held-out batches per evaluation", resumable=True)
    ckpt_every: int = _key(100, _at_least(0, " (0: only at the end)"), doc="steps between checkpoints",
                           resumable=True)
    keep_ckpts: int = _key(2, _above(0), doc="newest checkpoints kept", resumable=True)
    log_every: int = _key(10, _above(0), doc="steps between metric records",
                          resumable=True)
    dtype: Literal["fp32", "bf16"] = _key("fp32", doc="bf16: autocast, for GPUs")
    compile: bool = _key(False, doc="torch.compile the model", resumable=True)
    device: Literal["auto", "cpu", "cuda"] = _key("auto", doc="auto: cuda where there is one, else cpu",
                                                  resumable=True)
    threads: int = _key(0, _at_least(0, " (0: torch's default)"), doc="torch intra-op CPU threads", neutral=True,
                        resumable=True)
    progress: bool = _key(True, doc="show a progress bar (a line a minute without a terminal)", neutral=True,
                          resumable=True)
    diag_every: int = _key(50, _at_least(0, " (0: off)"), doc="steps between attention diagnostics (fixed batch)",
                           resumable=True)
    diag_batch: int = _key(4, _above(0), doc="sequences (of seq_len tokens) in the diagnostics batch",
                           resumable=True)
    nonfinite: Literal["stop", "skip"] = _key(
        "stop", doc="on a non-finite loss or gradient: end the run, or do not apply the step", resumable=True)
    skip_limit: float = _key(0.1, _between(0, 1, note=", e.g. 0.1"),
                             doc="with nonfinite=skip, a run that skips more than this share of its steps fails",
                             resumable=True)
    parallel: Literal["none", "ddp", "fsdp"] = _key(
        "none", doc="data parallel over the processes torchrun starts (qklab.parallel); the same global batch on "
                    "another number of processes continues the same run", resumable=True)
    ckpt_format: Literal["auto", "full", "sharded"] = _key(
        "auto", doc="full: safetensors gathered on rank 0; sharded: DCP, each rank its shards; auto: sharded under "
                    "FSDP2 on 2+ processes, else full; either resumes on any number of processes", neutral=True,
        resumable=True)


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
        _check_fields("train", t)
        check_run_name(t.name, "train.name", allow_empty=True)
        check_model(m, q)
        _check(t.seq_len <= m.max_seq_len,
               f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len")
        trackers = typing.get_args(Tracker)
        _check(all(x in trackers for x in t.trackers) and len(set(t.trackers)) == len(t.trackers),
               f"train.trackers={t.trackers}: use a list of distinct names from {', '.join(trackers)}")
        _check(t.muon_head_groups == 0 or t.muon_per_head != "none",
               f"train.muon_head_groups={t.muon_head_groups} groups the heads of train.muon_per_head's matrices; "
               "set train.muon_per_head=qk or qkv")
        check_head_groups(t.muon_head_groups, m.n_heads, m.kv_heads if m.attention == "mha" else m.n_heads)
        _check(t.data_seed >= -1, f"train.data_seed={t.data_seed}: use -1 (follow train.seed) or a seed >= 0")
        try:
            self.data.validate()
        except DataError as e:
            raise ConfigError(str(e)) from None
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_model(m: ModelConfig, q: QKConfig) -> None:
    """The rules a model's shape and its QK method must meet together, one ``ConfigError`` line for the first
    broken: checked when a run's config is validated and again when a ``GPT`` is built from Python, so no rule
    is left for the model to discover."""
    _check_fields("model", m)
    _check(m.d_model % m.n_heads == 0,
           f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; pick heads that divide the width")
    _check(m.head_dim % 2 == 0, f"head dim {m.head_dim} must be even for RoPE; change model.n_heads or d_model")
    _check(m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0,
           f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (GQA groups)")
    if m.attention == "mla":
        _check(m.mla_dims.rope > 0 and m.mla_dims.rope % 2 == 0,
               f"MLA rope width {m.mla_dims.rope} must be even and > 0; set model.rope_dim")
        _check(m.n_kv_heads == 0, "model.n_kv_heads is for attention=mha (GQA); leave it 0 with attention=mla")
    if m.rope_scaling == "yarn":
        _check(m.yarn_factor > 1 and m.yarn_original_max_len >= 0 and m.yarn_beta_fast > m.yarn_beta_slow > 0,
               "YaRN needs model.yarn_factor > 1, yarn_original_max_len >= 0, yarn_beta_fast > yarn_beta_slow > 0")
    _check(q.method in METHODS, f"qk.method='{q.method}' is unknown; choose one of {', '.join(sorted(METHODS))}")
    _check(q.controller in CONTROLLERS,
           f"qk.controller='{q.controller}' is unknown; choose one of {', '.join(sorted(CONTROLLERS))}")
    _check(not (m.attn_impl == "sdpa" and METHODS[q.method].modifies_logits),
           f"qk.method='{q.method}' rewrites logits, which the fused sdpa path cannot do; "
           "set model.attn_impl=auto or eager")
    for opts in q.options.values():
        if hasattr(opts, "validate"):
            try:
                opts.validate()
            except ValueError as e:
                raise ConfigError(str(e)) from None
    try:  # the method checks its options against the attention shape (e.g. compute-matched widths)
        shape = AttnShape.of(m)
        method = METHODS[q.method](shape, q.opts(q.method))
        CONTROLLERS[q.controller].check_method(method, q.opts(q.controller))  # e.g. QK-clip on QK-Norm
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check(m.attention != "mla" or (method.proj_dim() == shape.head_dim and method.qk_in_dim() == m.d_model),
           f"qk.method='{q.method}' with these options changes the q/k projection widths (per head "
           f"{shape.head_dim} -> {method.proj_dim()}), which model.attention=mla does not support; use "
           f"model.attention=mha or options that keep the per-head q/k width {shape.head_dim}")

def check_head_groups(groups: int, n_heads: int, n_kv_heads: int) -> None:
    """Group Muon's g (``train.muon_head_groups``) must split the query heads, and the KV heads into
    min(g, n_kv_heads) groups, evenly."""
    if groups == 0:
        return
    _check(n_heads % groups == 0,
           f"train.muon_head_groups={groups} does not divide model.n_heads={n_heads}; pick a divisor")
    _check(n_kv_heads % min(groups, n_kv_heads) == 0,
           f"train.muon_head_groups={groups} does not split the {n_kv_heads} KV heads evenly; pick a divisor of both")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_fields(section: str, obj: Any) -> None:
    """Each field's range (its metadata) and choices (its Literal type): ``model.d_model=0 is out of range:
    it must be > 0``, ``train.optimizer='sgd': use adamw or muon``."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{section}.{f.name}"
        if "range" in f.metadata:
            ok, want = f.metadata["range"]
            _check(ok(value), f"{key}={value!r} is out of range: it must be {want}")
        if typing.get_origin(hints[f.name]) is Literal:
            *rest, last = choices = typing.get_args(hints[f.name])
            _check(value in choices, f"{key}={value!r}: use {', '.join(rest)} or {last}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def check_run_name(name: str, key: str = "train.name", allow_empty: bool = False) -> str:
    """A run name is a plain folder name: letters, digits and ``. _ + = -``, not starting with a dot, so
    that it can never name a parent folder, an absolute path or a sub-folder."""
    if not (allow_empty and name == "") and not RUN_NAME.fullmatch(name):
        raise ConfigError(f"{key}={name!r} is not a plain run name; use letters, digits and . _ + = - "
                          "(no slashes, not starting with a dot, at most 128 characters)")
    return name


def _keys_with(flag: str) -> frozenset[str]:
    """The dotted keys (``train.steps``, ``preset``) whose field metadata sets ``flag``."""
    out: set[str] = set()
    for f in dataclasses.fields(RunConfig):
        sub = _hints(RunConfig)[f.name]
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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, "qk." if key == "qk.options" else key + "."))  # [qk.<method>] options
        else:
            out[key] = v
    return out


def resume_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key old -> new`` for each key that differs and may not change on resume. Keys only one side has
    (added or removed by another version of qklab) are not compared."""
    a, b = _flat(saved), _flat(now)
    return [f"{k} {a[k]!r} -> {b[k]!r}" for k in sorted(a.keys() & b.keys()) if k not in RESUMABLE and a[k] != b[k]]


# ---------------------------------------------------------------------------------------------------
# the keys as ``qklab config`` and docs/config.md show them, read off the fields

@dataclass(frozen=True)
class KeyInfo:
    """One config key: its type, value, valid values and meaning, from its field's type and metadata."""

    key: str  # dotted, as --set takes it: model.d_model, qk.softcap.cap, preset
    section: str  # model, qk, qk.softcap, data, train; "" at the top level
    type: str  # int, float, bool, str, list[str]
    value: Any  # the default, or a preset's value
    default: Any
    allowed: str  # the valid values: "> 0", "auto | sdpa | eager"; "": any value of its type
    doc: str  # the meaning, one line
    neutral: bool = False
    resumable: bool = False


def config_keys(preset: str | None = None) -> list[KeyInfo]:
    """Every key of a run config, section by section (the options of each method and controller after
    ``qk``), with its default or, given a preset (name or TOML path), the preset's value."""
    keys = _keys_of("", RunConfig())
    if preset:
        keys = [dataclasses.replace(k, value=v.value) for k, v in zip(keys, _keys_of("", load_config(preset)),
                                                                      strict=True)]
    return keys


def _keys_of(section: str, obj: Any) -> list[KeyInfo]:
    out: list[KeyInfo] = []
    for f in dataclasses.fields(obj):
        key, tp, value = f"{section}.{f.name}".lstrip("."), _hints(type(obj))[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            out += _keys_of(key, value)
        elif isinstance(obj, QKConfig) and f.name == "options":  # the keys qk.<name>.<option>
            out += [k for name in {**METHODS, **CONTROLLERS} for k in _keys_of(f"qk.{name}", obj.opts(name))]
        else:
            m = f.metadata
            out.append(KeyInfo(key, section, _type_text(tp), value, value, _allowed_text(tp, m), m.get("doc", ""),
                               bool(m.get("neutral")), bool(m.get("resumable"))))
    return out


def _type_text(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return type(args[0]).__name__
    if typing.get_origin(tp) is list:
        return f"list[{_type_text(args[0])}]"
    return tp.__name__


def _allowed_text(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    if "range" in meta:
        return meta["range"][1]
    if "allowed" in meta:
        return meta["allowed"]
    if typing.get_origin(tp) is Literal:
        return " | ".join(typing.get_args(tp))
    if typing.get_origin(tp) is list and typing.get_origin(typing.get_args(tp)[0]) is Literal:
        return "distinct, from " + " | ".join(typing.get_args(typing.get_args(tp)[0]))
    return ""


def toml_value(v: Any) -> str:
    """A value as TOML writes it and ``--set`` reads it back: "runs", 0.003, true, ["wandb"]."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return f"[{', '.join(map(toml_value, v))}]"
    return repr(v)


def select_keys(keys: list[KeyInfo], prefixes: list[str]) -> list[KeyInfo]:
    """The keys that start with one of ``prefixes`` (all keys without any); a prefix that starts none is a
    ``ConfigError`` listing the sections."""
    for p in prefixes:
        if not any(k.key.startswith(p) for k in keys):
            sections = ", ".join(dict.fromkeys(k.section or k.key for k in keys))
            raise ConfigError(f"no config key starts with '{p}'; give a section ({sections}) or the start of a key, "
                              "e.g. qklab config train.lr")
    return [k for k in keys if not prefixes or any(k.key.startswith(p) for p in prefixes)]


def section_doc(section: str) -> str:
    """One line on a section: its dataclass's first sentence, or which method or controller it sets."""
    if not section:
        return "Keys outside any section."
    if section.startswith("qk."):
        name = section[3:]
        return f"Options of qk.{'method' if name in METHODS else 'controller'}={name}."
    doc = " ".join((_hints(RunConfig)[section].__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "."


def _flags(k: KeyInfo) -> str:
    return ", ".join(f for f, on in (("neutral", k.neutral), ("resumable", k.resumable)) if on)


def keys_text(keys: list[KeyInfo]) -> str:
    """What ``qklab config`` prints: a line per section, then a line per key: ``key = value``, its type,
    valid values and flags, its meaning (and its default, where a preset's value differs)."""
    lines: list[str] = []
    for section, group in itertools.groupby(keys, lambda k: k.section):
        rows = [(f"{k.key} = {toml_value(k.value)}",
                 ", ".join(filter(None, (k.type, k.allowed))) + (f"; {_flags(k)}" if _flags(k) else ""),
                 k.doc + (f" (default {toml_value(k.default)})" if k.value != k.default else ""))
                for k in group]
        w1, w2 = (min(max(len(r[i]) for r in rows), cap) for i, cap in ((0, 36), (1, 40)))
        lines += [*([""] if lines else []), f"[{section or 'top level'}] {section_doc(section)}"]
        lines += [f"  {a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in rows]
    return "\n".join(lines) + "\n"


REFERENCE = "docs/config.md"  # the page keys_markdown writes, kept in step by a test


def keys_markdown(keys: list[KeyInfo], preset: str | None = None) -> str:
    """docs/config.md: a table per section (key, type, default and a preset's value, valid values,
    meaning), then the neutral and the resumable keys."""
    made_by = "qklab config --markdown" + (f" --preset {preset}" if preset else "")
    prose = [f"Generated by `{made_by}` from the config dataclasses (`qklab/config.py`, `DataConfig` in "
           "`qklab/data/config.py`, the `Options` of each method in `qklab/methods/`): their types and the "
           "metadata of their fields. Do not edit it by hand: change the fields, then run "
           f"`qklab config --markdown > {REFERENCE}`; `tests/test_config_keys.py` fails while this page is out "
           "of step with the code. In a terminal, `qklab config [PREFIX ...] [--preset NAME]` prints the same "
           "keys, e.g. `qklab config train` or `qklab config qk.softcap --preset tiny`.",
             "A key is set in a preset's TOML file under its section (`[train]` then `lr = 1e-3`; a method's "
           "options under `[qk.<method>]`) or with `--set`: `qklab train --set train.lr=1e-3`. Types and valid "
           "values are checked when a config loads; a wrong value is one line naming the key (exit code 2)."]
    prose += [f"The column `{preset}` holds the values of that preset."] if preset else []
    out = ["# Config keys", ""] + [line for text in prose for line in (_fill(text), "")]
    for section, group in itertools.groupby(keys, lambda k: k.section):
        out += [f"## {section or 'top level'}", "", _cell(section_doc(section)), "",
                f"| key | type | default |{f' {preset} |' if preset else ''} allowed | meaning |",
                f"| --- | --- | --- |{' --- |' if preset else ''} --- | --- |"]
        out += [f"| `{k.key}` | {_cell(k.type)} | {_code(toml_value(k.default))} |"
                + (f" {_code(toml_value(k.value))} |" if preset else "")
                + f" {_cell(k.allowed)} | {_cell(k.doc)} |" for k in group]
        out.append("")
    out += ["## Neutral and resumable keys", "",
            _fill("Neutral keys do not change what a run computes (where it writes, how it shows progress, "
                          "its threads): a study cell's hash leaves them out. Resumable keys may differ between a "
                          "run and its resumption (`qklab train --resume`); a change to any other key is refused on "
                          "resume."), ""]
    for flag in ("neutral", "resumable"):
        names = ", ".join(f"`{k.key}`" for k in keys if getattr(k, flag)) or "none"
        out += [_fill(f"{flag.capitalize()}: {names}."), ""]
    return "\n".join(out[:-1]) + "\n"


def _fill(text: str) -> str:
    """A paragraph wrapped at 110 columns, never inside a `code span`."""
    spans = re.sub(r"`[^`]*`", lambda m: m.group().replace(" ", "\0"), text)
    return textwrap.fill(spans, 110, break_on_hyphens=False).replace("\0", " ")


def _cell(text: str) -> str:
    """Text as Markdown shows it in a table cell: | and < escaped (not a column, not a tag)."""
    return text.replace("|", "\\|").replace("<", "\\<")


def _code(text: str) -> str:
    """Text as a code span in a table cell: only | escaped (a code span shows any other backslash)."""
    return "`" + text.replace("|", "\\|") + "`"


# ---------------------------------------------------------------------------------------------------
# loading

def packaged(name: str) -> Path:
    """A folder of TOML files shipped inside the package (``presets``, ``studies``), as a path: a wheel
    installs qklab as plain files, so ``importlib.resources`` gives a real folder."""
    return Path(str(resources.files("qklab") / name))


PRESET_DIR = packaged("presets")


def resolve_named_file(spec: str, folder: Path, what: str, kind: str) -> Path:
    """'tiny', 'configs/tiny.toml' or any path -> an existing TOML file: the path as given first, then the
    name in ``folder`` (one of the package's own)."""
    p = Path(spec)
    for cand in (p, folder / p.name, folder / f"{spec}.toml"):
        if cand.is_file():
            return cand
    names = sorted(x.stem for x in folder.glob("*.toml"))
    raise ConfigError(f"{what} '{spec}' not found; give a TOML path or a {kind} name: {', '.join(names)}")


def resolve_preset(spec: str) -> Path:
    return resolve_named_file(spec, PRESET_DIR, "config", "preset")


def preset_names() -> list[str]:
    return sorted(x.stem for x in PRESET_DIR.glob("*.toml"))


def load_config(spec: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    raw = read_preset(spec) if spec else {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set '{item}' must look like key=value, e.g. --set train.lr=1e-3")
        set_key(raw, key.strip(), _parse_value(value.strip()))
    return from_dict(RunConfig, raw).validate()


def read_preset(spec: str) -> dict[str, Any]:
    """A preset (name or TOML path) as the raw nested dict ``from_dict`` reads, ``preset`` set to its stem."""
    path = resolve_preset(spec)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    raw.setdefault("preset", path.stem)
    return raw


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: --set qk.method=qknorm


def set_key(d: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` (``train.lr``, ``qk.softcap.cap``) in a raw nested config dict."""
    keys = key.split(".")
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: '{k}' is a value, not a section")
        d = nxt
    d[keys[-1]] = value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (table), got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if cls is QKConfig and key in {**METHODS, **CONTROLLERS} and isinstance(value, dict):
            opts_cls = {**METHODS, **CONTROLLERS}[key].Options
            kwargs.setdefault("options", {})[key] = from_dict(opts_cls, value, f"{prefix}{key}.")
            continue
        if cls is QKConfig and key in {**METHODS, **CONTROLLERS}:
            raise ConfigError(f"'{prefix}{key}' is the section of {key}'s options, not a value; set one of them, "
                              f"e.g. {prefix}{key}.<option>=..., or choose it with qk.method / qk.controller")
        if key not in names or key == "options":
            known = sorted(names - {"options"})
            more = f"; method options: {prefix}<method>.<option>" if cls is QKConfig else ""
            raise ConfigError(f"unknown key '{prefix}{key}'; known keys here: {', '.join(known)}{more}")
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin is Literal:  # a choice: here its type (str), its value in validate (``_check_fields``)
        tp, origin = type(typing.get_args(tp)[0]), None
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"'{key}' must be a finite number, got {value!r}")
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and type(value) is tp:
        return value
    if origin in (list, tuple) and isinstance(value, list):
        (inner, *_) = typing.get_args(tp) or (Any,)
        out = [v if inner is Any else _coerce(v, inner, key) for v in value]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    want = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"'{key}' must be {want}, got {type(value).__name__} {value!r}")
