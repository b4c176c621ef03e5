"""The sections of a run config (model, qk, train) as dataclasses, and ``from_dict``, which builds any
config dataclass from a nested dict (a preset's TOML, ``--set`` items), checking its keys and types.

What is known about a key sits on its field: a ``typing.Literal`` type lists its choices, and the
field's metadata (see ``_key``) its meaning, its valid range, whether it is neutral (does not change what
a run computes: a study's cell hash leaves it out) and whether it is resumable (may change on resume).
``qklab config`` and docs/config.md (``qklab.config.keys``) list every key from there.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from qklab.errors import ConfigError
from qklab.fields import Range, above, at_least, between, check_fields, earlier_names, field_types
from qklab.methods import CONTROLLERS, METHODS


class MLADims(typing.NamedTuple):
    q_rank: int  # 0: no query latent
    kv_rank: int
    nope: int
    rope: int
    v: int


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


_MLA_WIDTH = at_least(0, " (0: the default)")


@dataclass
class ModelConfig:
    """The GPT: its shape, its attention and its positions."""

    vocab_size: int = _key(0, at_least(0, " (0: the tokenizer's vocabulary)"),
                           doc="tokens the embedding and the head cover; 0: taken from the tokenizer")
    d_model: int = _key(256, above(0), doc="width of the residual stream")
    n_layers: int = _key(4, above(0), doc="transformer blocks")
    n_heads: int = _key(4, above(0), doc="query heads per layer (they divide d_model; head_dim = d_model / n_heads)")
    n_kv_heads: int = _key(0, at_least(0, " (0: same as n_heads)"),
                           doc="key/value heads: 0, the same as n_heads (MHA); fewer, dividing n_heads: GQA")
    d_ff: int = _key(0, at_least(0, " (0: 8/3 * d_model)"),
                     doc="SwiGLU width; 0: 8/3 * d_model rounded up to 64s")
    max_seq_len: int = _key(1024, above(1), doc="longest context: RoPE tables and the KV cache are sized from this")
    rope_theta: float = _key(10000.0, above(0, ", e.g. 10000"), doc="RoPE base: pair i turns by "
                                                                     "theta^(-2i/head_dim) radians a position")
    tie_embeddings: bool = _key(True, doc="the output head shares the token embedding's weights")
    norm_eps: float = _key(1e-6, above(0, ", e.g. 1e-6"), doc="epsilon of the RMSNorms")
    init_std: float = _key(0.02, above(0, ", e.g. 0.02"), doc="std of the normal init of the weight matrices")
    qk_init_std: float = _key(0.0, at_least(0, " (0: the QK method's own init rule), e.g. 1/sqrt(d_model)"),
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
        ensure(self.method in METHODS,
               f"qk.method='{self.method}' is unknown; choose one of {', '.join(sorted(METHODS))}")
        ensure(self.controller in CONTROLLERS,
               f"qk.controller='{self.controller}' is unknown; choose one of {', '.join(sorted(CONTROLLERS))}")
        ensure(isinstance(self.options, dict), f"qk options must be a dict keyed by method name, got "
                                               f"{type(self.options).__name__}")
        known = {**METHODS, **CONTROLLERS}
        for name, opts in list(self.options.items()):
            ensure(name in known, f"qk options for '{name}', which is no method or controller; known: "
                                  f"{', '.join(sorted(known))}")
            if isinstance(opts, dict):
                self.options[name] = from_dict(known[name].Options, opts, f"qk.{name}.")
            else:
                want = known[name].Options
                ensure(isinstance(opts, want), f"qk options for '{name}' must be a dict or {want.__name__}, got "
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
    seed: int = _key(0, between(0, 2**32 - 1), doc="seed of the initial weights (and of the batches, see data_seed)")
    data_seed: int = _key(-1, doc="order of the training batches; -1: train.seed (a study fixes it across cells)",
                          allowed=">= -1 (-1: train.seed)")
    trackers: list[Tracker] = _key(factory=list, doc="also log to these (wandb offline)", resumable=True)
    steps: int = _key(200, above(0), doc="optimizer steps of the run", resumable=True)
    batch_size: int = _key(16, above(0), doc="sequences per micro-batch on each process")
    seq_len: int = _key(256, above(1), doc="tokens per training sequence (at most model.max_seq_len)")
    grad_accum: int = _key(1, above(0), doc="micro-batches whose gradients make one step")
    optimizer: Literal["adamw", "muon"] = _key("adamw", doc="muon: Muon on the hidden matrices, AdamW on the rest")
    lr: float = _key(3e-3, above(0, ", e.g. 3e-3"), doc="peak learning rate (Muon: of the hidden matrices)",
                     resumable=True)
    adam_lr: float = _key(0.0, at_least(0, " (0: train.lr)"),
                          doc="Muon only: learning rate of the AdamW groups (embeddings, head)")
    weight_decay: float = _key(0.1, at_least(0), doc="decoupled weight decay")
    beta1: float = _key(0.9, between(0, 1, hi_open=True, note=", e.g. 0.9"), doc="AdamW's first-moment decay")
    beta2: float = _key(0.95, between(0, 1, hi_open=True, note=", e.g. 0.95"), doc="AdamW's second-moment decay")
    muon_momentum: float = _key(0.95, between(0, 1, hi_open=True, note=", e.g. 0.95"), doc="Muon's momentum")
    muon_per_head: Literal["none", "qk", "qkv"] = _key(
        "none", doc="Muon only: Newton-Schulz per attention head on W_Q, W_K (qkv: and W_V; MLA: the per-head "
                    "up-projections)")
    muon_head_groups: int = _key(
        0, at_least(0, " (0: one group per head)"),
        doc="Muon only, with muon_per_head: Newton-Schulz over g groups of adjacent heads of each matrix (Group "
            "Muon; 1: the whole matrix, n_heads: per head); a KV matrix takes min(g, its heads) groups")
    schedule: Literal["cosine", "constant"] = _key("cosine", doc="learning rate after a linear warmup")
    warmup_steps: int = _key(20, at_least(0), doc="steps of the linear warmup")
    min_lr_ratio: float = _key(0.1, between(0, 1), doc="cosine: the last step's lr as a share of the peak")
    grad_clip: float = _key(1.0, at_least(0, " (0: off)"), doc="largest global gradient norm", resumable=True)
    eval_every: int = _key(50, above(0), doc="steps between evaluations",
                           resumable=True)
    eval_batches: int = _key(8, above(0), doc="held-out batches per evaluation", resumable=True)
    ckpt_every: int = _key(100, at_least(0, " (0: only at the end)"), doc="steps between checkpoints",
                           resumable=True)
    keep_ckpts: int = _key(2, above(0), doc="newest checkpoints kept", resumable=True)
    log_every: int = _key(10, above(0), doc="steps between metric records",
                          resumable=True)
    dtype: Literal["fp32", "bf16"] = _key("fp32", doc="bf16: autocast, for GPUs")
    compile: bool = _key(False, doc="torch.compile the model (its on-disk cache kept per CPU capability)",
                         resumable=True)
    device: Literal["auto", "cpu", "cuda"] = _key("auto", doc="auto: cuda where there is one, else cpu",
                                                  resumable=True)
    threads: int = _key(0, at_least(0, " (0: torch's default)"), doc="torch intra-op CPU threads", neutral=True,
                        resumable=True)
    progress: bool = _key(True, doc="show a progress bar (a line a minute without a terminal)", neutral=True,
                          resumable=True)
    diag_every: int = _key(50, at_least(0, " (0: off)"), doc="steps between attention diagnostics (fixed batch)",
                           resumable=True)
    diag_batch: int = _key(4, above(0), doc="sequences (of seq_len tokens) in the diagnostics batch",
                           resumable=True)
    nonfinite: Literal["stop", "skip"] = _key(
        "stop", doc="on a non-finite loss or gradient: end the run, or do not apply the step", resumable=True)
    skip_limit: float = _key(0.1, between(0, 1, note=", e.g. 0.1"),
                             doc="with nonfinite=skip, a run that skips more than this share of its steps fails",
                             resumable=True)
    parallel: Literal["none", "ddp", "fsdp"] = _key(
        "none", doc="data parallel over the processes torchrun starts (qklab.parallel); the same global batch on "
                    "another number of processes continues the same run", resumable=True)
    ckpt_format: Literal["auto", "full", "sharded"] = _key(
        "auto", doc="full: safetensors gathered on rank 0; sharded: DCP, each rank its shards; auto: sharded under "
                    "FSDP2 on 2+ processes, else full; either resumes on any number of processes", neutral=True,
        resumable=True)


def ensure(ok: bool, msg: str) -> None:
    """``ConfigError(msg)`` unless ``ok``: a rule of the config, its message one line naming the key."""
    if not ok:
        raise ConfigError(msg)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (table), got {data!r}")
    hints = field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    renamed = earlier_names(cls)
    for key, value in data.items():
        key = renamed.get(key, key)  # an option's earlier name, as committed results and records have it
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


def from_table(cls: type, data: dict[str, Any], where: str) -> Any:
    """A study file's table (``[protocol]``, ``[claims."<id>"]``) as dataclass ``cls``: keys and types by
    ``from_dict``, then each field's range and choices by ``check_fields``; its keys read ``[protocol] probe``."""
    out = from_dict(cls, data, f"{where} ")
    check_fields(where, out, sep=" ")
    return out


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin is Literal:  # a choice: here its type (str), its value in validate (``check_fields``)
        tp, origin = type(typing.get_args(tp)[0]), None
    if origin in (typing.Union, types.UnionType):  # the first of its types the value is
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(value, args[0], key)
        for a in args:
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        want = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        raise ConfigError(f"'{key}' must be {want}, got {type(value).__name__} {value!r}")
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
    if origin is dict and isinstance(value, dict):
        inner = (typing.get_args(tp) or (str, Any))[1]
        return {k: v if inner is Any else _coerce(v, inner, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    want = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"'{key}' must be {want}, got {type(value).__name__} {value!r}")
