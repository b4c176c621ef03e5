"""Typed run configuration: dataclasses loaded from TOML, overridden by ``--set key=value``.

Every mistake a user can make in a config (unknown key, wrong type, impossible shape, unknown method,
missing data) raises ``ConfigError`` with one line that names the key and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from qklab.data import DataConfig, DataError
from qklab.methods import CONTROLLERS, METHODS, AttnShape


class ConfigError(ValueError):
    """A user mistake in a config; the message is one line, printed without a traceback."""


class MLADims(typing.NamedTuple):
    q_rank: int  # 0: no query latent
    kv_rank: int
    nope: int
    rope: int
    v: int


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: taken from the tokenizer
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (MHA); fewer: GQA
    d_ff: int = 0  # SwiGLU hidden width; 0: 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 1024  # RoPE tables and the KV cache are sized from this
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    qk_init_std: float = 0.0  # std of W_Q/W_K for every QK method (a fair comparison); 0: the method's own rule
    attn_impl: str = "auto"  # auto | sdpa | eager
    attention: str = "mha"  # mha (MHA/GQA, see n_kv_heads) | mla (multi-head latent attention, docs/mla.md)
    q_rank: int = 0  # MLA query latent width; 0: no query latent (queries straight from x)
    kv_rank: int = 0  # MLA key/value latent width; 0: 2 * head_dim
    nope_dim: int = 0  # MLA per-head q/k width without RoPE; 0: head_dim
    rope_dim: int = 0  # MLA per-head q/k width with RoPE (also the shared rope key's width); 0: head_dim // 2
    v_dim: int = 0  # MLA per-head value width; 0: head_dim
    rope_scaling: str = "none"  # none | yarn (YaRN context extension, as DeepSeek-V2/V3; qklab.model.rope.Yarn)
    yarn_factor: float = 1.0  # YaRN: context extension factor (> 1)
    yarn_original_max_len: int = 0  # YaRN: the context the frequencies were made for; 0: max_seq_len / yarn_factor
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0  # 0: unset (see Yarn)
    yarn_mscale_all_dim: float = 0.0  # 0: unset; else MLA's softmax scale gets mscale(factor, this)^2

    @property
    def yarn(self):
        """The YaRN settings (``qklab.model.rope.Yarn``), or None without rope scaling."""
        if self.rope_scaling != "yarn":
            return None
        from qklab.model.rope import Yarn

        orig = self.yarn_original_max_len or int(self.max_seq_len / self.yarn_factor)
        return Yarn(self.yarn_factor, orig, self.yarn_beta_fast, self.yarn_beta_slow, self.yarn_mscale,
                    self.yarn_mscale_all_dim)

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

    def opts(self, name: str) -> Any:
        cls = {**METHODS, **CONTROLLERS}[name].Options
        return self.options.get(name) or cls()


@dataclass
class TrainConfig:
    name: str = ""  # run directory name under out_dir; "" -> derived from preset, method and seed
    out_dir: str = "runs"
    seed: int = 0
    data_seed: int = -1  # order of the training batches; -1: train.seed (a study fixes it across cells)
    trackers: list[str] = field(default_factory=list)  # also log to: "tensorboard", "wandb" (offline)
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    optimizer: str = "adamw"  # adamw | muon
    lr: float = 3e-3  # peak lr (Muon: for the hidden matrices)
    adam_lr: float = 0.0  # Muon only: lr of the AdamW groups (embeddings, head, gains); 0 -> lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    muon_momentum: float = 0.95
    schedule: str = "cosine"  # cosine | constant (both after a linear warmup)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0: off
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100  # 0: only at the end
    keep_ckpts: int = 2
    log_every: int = 10
    dtype: str = "fp32"  # fp32 | bf16 (autocast; for GPUs)
    compile: bool = False
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads; 0: leave torch's default
    progress: bool = True
    diag_every: int = 50  # attention diagnostics on a fixed held-out batch every N steps; 0: off (no cost)
    diag_batch: int = 4  # sequences (of seq_len tokens) in the diagnostics probe batch
    nonfinite: str = "stop"  # non-finite loss or gradient: stop (end the run) | skip (do not apply the step)
    skip_limit: float = 0.1  # nonfinite=skip: a run that skips more than this share of its steps fails (exit 1)
    parallel: str = "none"  # none | ddp | fsdp: data parallel over the processes torchrun starts (qklab.parallel)
    ckpt_format: str = "auto"  # full (safetensors, gathered on rank 0) | sharded (DCP, each rank its shards) | auto:
    # sharded under FSDP2 on 2+ processes, else full; either kind resumes on any number of processes


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    qk: QKConfig = field(default_factory=QKConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str = ""

    def validate(self) -> RunConfig:
        m, t, q = self.model, self.train, self.qk
        for key, ok, want in _RANGES:
            value = getattr(getattr(self, key.split(".")[0]), key.split(".")[1])
            _check(ok(value), f"{key}={value!r} is out of range: it must be {want}")
        check_run_name(t.name, "train.name", allow_empty=True)
        _check(m.d_model % m.n_heads == 0,
               f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; pick heads that divide the width")
        _check(m.head_dim % 2 == 0, f"head dim {m.head_dim} must be even for RoPE; change model.n_heads or d_model")
        _check(m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0,
               f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (GQA groups)")
        _check(m.attn_impl in ("auto", "sdpa", "eager"), f"model.attn_impl='{m.attn_impl}': use auto, sdpa or eager")
        _check(m.attention in ("mha", "mla"), f"model.attention='{m.attention}': use mha or mla")
        if m.attention == "mla":
            _check(m.mla_dims.rope > 0 and m.mla_dims.rope % 2 == 0,
                   f"MLA rope width {m.mla_dims.rope} must be even and > 0; set model.rope_dim")
            _check(m.n_kv_heads == 0, "model.n_kv_heads is for attention=mha (GQA); leave it 0 with attention=mla")
        _check(m.rope_scaling in ("none", "yarn"), f"model.rope_scaling='{m.rope_scaling}': use none or yarn")
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
            method = METHODS[q.method](AttnShape.of(m), q.opts(q.method))
            CONTROLLERS[q.controller].check_method(method, q.opts(q.controller))  # e.g. QK-clip on QK-Norm
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check(t.optimizer in ("adamw", "muon"), f"train.optimizer='{t.optimizer}': use adamw or muon")
        _check(t.schedule in ("cosine", "constant"), f"train.schedule='{t.schedule}': use cosine or constant")
        _check(t.dtype in ("fp32", "bf16"), f"train.dtype='{t.dtype}': use fp32 or bf16")
        _check(t.device in ("auto", "cpu", "cuda"), f"train.device='{t.device}': use auto, cpu or cuda")
        _check(t.seq_len <= m.max_seq_len,
               f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len")
        _check(all(x in ("tensorboard", "wandb") for x in t.trackers) and len(set(t.trackers)) == len(t.trackers),
               f"train.trackers={t.trackers}: use a list of distinct names from tensorboard, wandb")
        _check(t.data_seed >= -1, f"train.data_seed={t.data_seed}: use -1 (follow train.seed) or a seed >= 0")
        _check(t.nonfinite in ("stop", "skip"), f"train.nonfinite='{t.nonfinite}': use stop or skip")
        _check(t.parallel in ("none", "ddp", "fsdp"), f"train.parallel='{t.parallel}': use none, ddp or fsdp")
        _check(t.ckpt_format in ("auto", "full", "sharded"),
               f"train.ckpt_format='{t.ckpt_format}': use auto, full or sharded")
        try:
            self.data.validate()
        except DataError as e:
            raise ConfigError(str(e)) from None
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _between(lo: float, hi: float, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: lo <= v < hi if hi_open else lo <= v <= hi


def _at_least(lo: float) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def _above(lo: float) -> Callable[[Any], bool]:
    return lambda v: v > lo


# every numeric key and what a valid value is (types are checked on loading, non-finite floats refused)
_RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("model.vocab_size", _at_least(0), ">= 0 (0: the tokenizer's vocabulary)"),
    ("model.d_model", _above(0), "> 0"),
    ("model.n_layers", _above(0), "> 0"),
    ("model.n_heads", _above(0), "> 0"),
    ("model.n_kv_heads", _at_least(0), ">= 0 (0: same as n_heads)"),
    ("model.d_ff", _at_least(0), ">= 0 (0: 8/3 * d_model)"),
    ("model.max_seq_len", _above(1), "> 1"),
    ("model.rope_theta", _above(0), "> 0, e.g. 10000"),
    ("model.norm_eps", _above(0), "> 0, e.g. 1e-6"),
    ("model.init_std", _above(0), "> 0, e.g. 0.02"),
    ("model.qk_init_std", _at_least(0), ">= 0 (0: the QK method's own init rule), e.g. 1/sqrt(d_model)"),
    *((f"model.{k}", _at_least(0), ">= 0 (0: the default)")
      for k in ("q_rank", "kv_rank", "nope_dim", "rope_dim", "v_dim")),
    ("train.seed", _between(0, 2**32 - 1), "from 0 to 2**32 - 1"),
    ("train.steps", _above(0), "> 0"),
    ("train.batch_size", _above(0), "> 0"),
    ("train.seq_len", _above(1), "> 1"),
    ("train.grad_accum", _above(0), "> 0"),
    ("train.lr", _above(0), "> 0, e.g. 3e-3"),
    ("train.adam_lr", _at_least(0), ">= 0 (0: train.lr)"),
    ("train.weight_decay", _at_least(0), ">= 0"),
    ("train.beta1", _between(0, 1, hi_open=True), "in [0, 1), e.g. 0.9"),
    ("train.beta2", _between(0, 1, hi_open=True), "in [0, 1), e.g. 0.95"),
    ("train.muon_momentum", _between(0, 1, hi_open=True), "in [0, 1), e.g. 0.95"),
    ("train.warmup_steps", _at_least(0), ">= 0"),
    ("train.min_lr_ratio", _between(0, 1), "in [0, 1]"),
    ("train.grad_clip", _at_least(0), ">= 0 (0: off)"),
    ("train.eval_every", _above(0), "> 0 (steps between evaluations)"),
    ("train.eval_batches", _above(0), "> 0"),
    ("train.ckpt_every", _at_least(0), ">= 0 (0: only at the end)"),
    ("train.keep_ckpts", _above(0), "> 0"),
    ("train.log_every", _above(0), "> 0 (steps between metric records)"),
    ("train.threads", _at_least(0), ">= 0 (0: torch's default)"),
    ("train.diag_every", _at_least(0), ">= 0 (0: off)"),
    ("train.diag_batch", _above(0), "> 0"),
    ("train.skip_limit", _between(0, 1), "in [0, 1], e.g. 0.1"),
]

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def check_run_name(name: str, key: str = "train.name", allow_empty: bool = False) -> str:
    """A run name is a plain folder name: letters, digits and ``. _ + = -``, not starting with a dot, so
    that it can never name a parent folder, an absolute path or a sub-folder."""
    if not (allow_empty and name == "") and not RUN_NAME.fullmatch(name):
        raise ConfigError(f"{key}={name!r} is not a plain run name; use letters, digits and . _ + = - "
                          "(no slashes, not starting with a dot, at most 128 characters)")
    return name


# keys that may differ between a run and its resumption: its length, how often it logs, evaluates and
# saves, where and on what it runs, and the remedies a non-finite stop suggests (lr, clipping, skipping)
RESUMABLE = frozenset({
    "preset", "train.name", "train.out_dir", "train.steps", "train.log_every", "train.eval_every",
    "train.eval_batches", "train.ckpt_every", "train.keep_ckpts", "train.progress", "train.threads",
    "train.device", "train.compile", "train.diag_every", "train.diag_batch", "train.nonfinite",
    "train.skip_limit", "train.lr", "train.grad_clip", "data.cache_dir", "train.trackers",
    "train.parallel",  # the same global batch on another number of processes continues the same run
    "train.ckpt_format",  # either kind of checkpoint resumes as the other
})


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
    raw: dict[str, Any] = {}
    if spec:
        path = resolve_preset(spec)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
        raw.setdefault("preset", path.stem)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set '{item}' must look like key=value, e.g. --set train.lr=1e-3")
        _set_path(raw, key.strip().split("."), _parse_value(value.strip()))
    return from_dict(RunConfig, raw).validate()


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: --set qk.method=qknorm


def _set_path(d: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: '{k}' is a value, not a section")
        d = nxt
    d[keys[-1]] = value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (table), got {data!r}")
    hints = typing.get_type_hints(cls)
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
