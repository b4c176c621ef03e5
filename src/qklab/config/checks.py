"""The rules a run config must meet beyond each key's type and range: rules across keys (a model's shape
with its QK method, Group Muon's heads) and run names. Each broken rule is one ``ConfigError`` line that
names the key and says how to fix it; each field's own range and choices are ``check_fields``'s
(``qklab.fields``)."""

from __future__ import annotations

import re

from qklab.config.sections import ModelConfig, QKConfig, ensure
from qklab.errors import ConfigError
from qklab.fields import check_fields
from qklab.methods import CONTROLLERS, METHODS, AttnShape


def check_model(m: ModelConfig, q: QKConfig) -> None:
    """The rules a model's shape and its QK method must meet together, one ``ConfigError`` line for the first
    broken: checked when a run's config is validated and again when a ``GPT`` is built from Python, so no rule
    is left for the model to discover."""
    check_fields("model", m)
    ensure(m.d_model % m.n_heads == 0,
           f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; pick heads that divide the width")
    ensure(m.head_dim % 2 == 0, f"head dim {m.head_dim} must be even for RoPE; change model.n_heads or d_model")
    ensure(m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0,
           f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (GQA groups)")
    if m.attention == "mla":
        ensure(m.mla_dims.rope > 0 and m.mla_dims.rope % 2 == 0,
               f"MLA rope width {m.mla_dims.rope} must be even and > 0; set model.rope_dim")
        ensure(m.n_kv_heads == 0, "model.n_kv_heads is for attention=mha (GQA); leave it 0 with attention=mla")
    if m.rope_scaling == "yarn":
        ensure(m.yarn_factor > 1 and m.yarn_original_max_len >= 0 and m.yarn_beta_fast > m.yarn_beta_slow > 0,
               "YaRN needs model.yarn_factor > 1, yarn_original_max_len >= 0, yarn_beta_fast > yarn_beta_slow > 0")
    ensure(q.method in METHODS, f"qk.method='{q.method}' is unknown; choose one of {', '.join(sorted(METHODS))}")
    ensure(q.controller in CONTROLLERS,
           f"qk.controller='{q.controller}' is unknown; choose one of {', '.join(sorted(CONTROLLERS))}")
    ensure(not (m.attn_impl == "sdpa" and METHODS[q.method].modifies_logits),
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
    ensure(m.attention != "mla" or (method.proj_dim() == shape.head_dim and method.qk_in_dim() == m.d_model),
           f"qk.method='{q.method}' with these options changes the q/k projection widths (per head "
           f"{shape.head_dim} -> {method.proj_dim()}), which model.attention=mla does not support; use "
           f"model.attention=mha or options that keep the per-head q/k width {shape.head_dim}")


def check_head_groups(groups: int, n_heads: int, n_kv_heads: int) -> None:
    """Group Muon's g (``train.muon_head_groups``) must split the query heads, and the KV heads into
    min(g, n_kv_heads) groups, evenly."""
    if groups == 0:
        return
    ensure(n_heads % groups == 0,
           f"train.muon_head_groups={groups} does not divide model.n_heads={n_heads}; pick a divisor")
    ensure(n_kv_heads % min(groups, n_kv_heads) == 0,
           f"train.muon_head_groups={groups} does not split the {n_kv_heads} KV heads evenly; pick a divisor of both")


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def check_run_name(name: str, key: str = "train.name", allow_empty: bool = False) -> str:
    """A run name is a plain folder name: letters, digits and ``. _ + = -``, not starting with a dot, so
    that it can never name a parent folder, an absolute path or a sub-folder."""
    if not (allow_empty and name == "") and not RUN_NAME.fullmatch(name):
        raise ConfigError(f"{key}={name!r} is not a plain run name; use letters, digits and . _ + = - "
                          "(no slashes, not starting with a dot, at most 128 characters)")
    return name
