"""Typed run configuration: dataclasses loaded from TOML, overridden by ``--set key=value``.

Every mistake a user can make in a config (unknown key, wrong type, impossible shape, unknown method,
missing data) raises ``ConfigError`` with one line that names the key and says how to fix it.

What is known about a key sits on its field: a ``typing.Literal`` type lists its choices, and the
field's metadata (see ``_key``) its valid range, whether it is neutral (does not change what a run
computes: a study's cell hash leaves it out) and whether it is resumable (may change on resume).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
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


def _key(default: Any = dataclasses.MISSING, rng: Range | None = None, *, factory: Any = dataclasses.MISSING,
         neutral: bool = False, resumable: bool = False) -> Any:
    """A config field and what is known about it, in its metadata:
    range: (check, text), the valid values (types are checked on loading, non-finite floats refused);
    neutral: does not change what a run computes (where it writes, how it shows progress, its threads);
    resumable: may differ between a run and its resumption (see ``RESUMABLE``)."""
    meta = {k: v for k, v in (("range", rng), ("neutral", neutral), ("resumable", resumable)) if v}
    return field(default=default, default_factory=factory, metadata=meta)


_MLA_WIDTH = _at_least(0, " (0: the default)")


@dataclass
class ModelConfig:
    vocab_size: int = _key(0, _at_least(0, " (0: the tokenizer's vocabulary)"))  # 0: taken from the tokenizer
    d_model: int = _key(256, _above(0))
    n_layers: int = _key(4, _above(0))
    n_heads: int = _key(4, _above(0))
    n_kv_heads: int = _key(0, _at_least(0, " (0: same as n_heads)"))  # 0: same as n_heads (MHA); fewer: GQA
    d_ff: int = _key(0, _at_least(0, " (0: 8/3 * d_model)"))  # SwiGLU width; 0: 8/3 * d_model rounded up to 64s
    max_seq_len: int = _key(1024, _above(1))  # RoPE tables and the KV cache are sized from this
    rope_theta: float = _key(10000.0, _above(0, ", e.g. 10000"))
    tie_embeddings: bool = True
    norm_eps: float = _key(1e-6, _above(0, ", e.g. 1e-6"))
    init_std: float = _key(0.02, _above(0, ", e.g. 0.02"))
    # std of W_Q/W_K for every QK method (a fair comparison); 0: the method's own rule
    qk_init_std: float = _key(0.0, _at_least(0, " (0: the QK method's own init rule), e.g. 1/sqrt(d_model)"))
    attn_impl: Literal["auto", "sdpa", "eager"] = "auto"
    attention: Literal["mha", "mla"] = "mha"  # mha (MHA/GQA, see n_kv_heads) | mla (latent attention, docs/mla.md)
    # gated attention (arXiv 2505.06708): each head's output times sigmoid(W_g x), x the block's normalised
    # input, before W_O; head: one gate per head, element: one per output feature; none: no gate
    attn_gate: Literal["none", "head", "element"] = "none"
    attn_sink: bool = False  # a learnable per-head logit in the softmax denominator (gpt-oss's sinks)
    q_rank: int = _key(0, _MLA_WIDTH)  # MLA query latent width; 0: no query latent (queries from x)
    kv_rank: int = _key(0, _MLA_WIDTH)  # MLA key/value latent width; 0: 2 * head_dim
    nope_dim: int = _key(0, _MLA_WIDTH)  # MLA per-head q/k width without RoPE; 0: head_dim
    rope_dim: int = _key(0, _MLA_WIDTH)  # MLA per-head q/k width with RoPE (= the shared rope key's); 0: head_dim // 2
    v_dim: int = _key(0, _MLA_WIDTH)  # MLA per-head value width; 0: head_dim
    rope_scaling: Literal["none", "yarn"] = "none"  # yarn: YaRN context extension, as DeepSeek-V2/V3 (rope.Yarn)
    yarn_factor: float = 1.0  # YaRN: context extension factor (> 1)
    yarn_original_max_len: int = 0  # YaRN: the context the frequencies were made for; 0: max_seq_len / yarn_factor
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0  # 0: unset (see Yarn)
    yarn_mscale_all_dim: float = 0.0  # 0: unset; else MLA's softmax scale gets mscale(factor, this)^2

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
    method: str = "none"  # forward-side method, see qklab.methods.METHODS
    controller: str = "none"  # optimizer-side controller, see qklab.methods.CONTROLLERS
    # per-method options, keyed by method name: [qk.softcap] cap = 30.0 -> {"softcap": SoftCapOptions}
    options: dict[str, Any] = field(default_factory=dict)

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
    # resumable: may differ between a run and its resumption: its length, how often it logs, evaluates and
    # saves, where and on what it runs, and the remedies a non-finite stop suggests (lr, clipping, skipping)
    name: str = _key("", neutral=True, resumable=True)  # run folder name under out_dir; "": from preset, method, seed
    out_dir: str = _key("runs", neutral=True, resumable=True)
    seed: int = _key(0, (lambda v: 0 <= v <= 2**32 - 1, "from 0 to 2**32 - 1"))
    data_seed: int = -1  # order of the training batches; -1: train.seed (a study fixes it across cells)
    trackers: list[Tracker] = _key(factory=list, resumable=True)
    steps: int = _key(200, _above(0), resumable=True)
    batch_size: int = _key(16, _above(0))
    seq_len: int = _key(256, _above(1))
    grad_accum: int = _key(1, _above(0))
    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = _key(3e-3, _above(0, ", e.g. 3e-3"), resumable=True)  # peak lr (Muon: for the hidden matrices)
    adam_lr: float = _key(0.0, _at_least(0, " (0: train.lr)"))  # Muon only: of the AdamW groups (embeddings, head)
    weight_decay: float = _key(0.1, _at_least(0))
    beta1: float = _key(0.9, _between(0, 1, hi_open=True, note=", e.g. 0.9"))
    beta2: float = _key(0.95, _between(0, 1, hi_open=True, note=", e.g. 0.95"))
    muon_momentum: float = _key(0.95, _between(0, 1, hi_open=True, note=", e.g. 0.95"))
    # Muon only: Newton-Schulz per attention head on W_Q, W_K (qkv: and W_V; MLA: the per-head up-projections)
    muon_per_head: Literal["none", "qk", "qkv"] = "none"
    schedule: Literal["cosine", "constant"] = "cosine"  # both after a linear warmup
    warmup_steps: int = _key(20, _at_least(0))
    min_lr_ratio: float = _key(0.1, _between(0, 1))
    grad_clip: float = _key(1.0, _at_least(0, " (0: off)"), resumable=True)
    eval_every: int = _key(50, _above(0, " (steps between evaluations)"), resumable=True)
    eval_batches: int = _key(8, _above(0), resumable=True)
    ckpt_every: int = _key(100, _at_least(0, " (0: only at the end)"), resumable=True)
    keep_ckpts: int = _key(2, _above(0), resumable=True)
    log_every: int = _key(10, _above(0, " (steps between metric records)"), resumable=True)
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast, for GPUs
    compile: bool = _key(False, resumable=True)
    device: Literal["auto", "cpu", "cuda"] = _key("auto", resumable=True)
    threads: int = _key(0, _at_least(0, " (0: torch's default)"), neutral=True, resumable=True)  # torch intra-op
    progress: bool = _key(True, neutral=True, resumable=True)
    diag_every: int = _key(50, _at_least(0, " (0: off)"), resumable=True)  # attention diagnostics (fixed batch)
    diag_batch: int = _key(4, _above(0), resumable=True)  # sequences (of seq_len tokens) in the diagnostics batch
    nonfinite: Literal["stop", "skip"] = _key("stop", resumable=True)  # on a non-finite loss or gradient: end
    # the run, or do not apply the step; with skip, a run that skips more than skip_limit of its steps fails
    skip_limit: float = _key(0.1, _between(0, 1, note=", e.g. 0.1"), resumable=True)
    # data parallel over the processes torchrun starts (qklab.parallel); the same global batch on another
    # number of processes continues the same run
    parallel: Literal["none", "ddp", "fsdp"] = _key("none", resumable=True)
    # full (safetensors, gathered on rank 0) | sharded (DCP, each rank its shards) | auto: sharded under
    # FSDP2 on 2+ processes, else full; either kind resumes on any number of processes, as the other
    ckpt_format: Literal["auto", "full", "sharded"] = _key("auto", neutral=True, resumable=True)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    qk: QKConfig = field(default_factory=QKConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str = _key("", resumable=True)

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


# DataConfig lives in qklab.data (its own validation): what the study and resume logic know of its keys
_DATA_FLAGS = {"cache_dir": ("neutral", "resumable")}


def _keys_with(flag: str) -> frozenset[str]:
    """The dotted keys (``train.steps``, ``preset``) whose field metadata sets ``flag``."""
    out = {f"data.{k}" for k, flags in _DATA_FLAGS.items() if flag in flags}
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
