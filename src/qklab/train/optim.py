"""Optimizers and learning-rate schedules.

Every parameter group carries ``base_lr`` (its peak rate) and ``name``; the schedule sets
``lr = base_lr * schedule_factor(step)`` before each step, and an optimizer-side QK controller may then adjust
individual groups.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qklab.config import TrainConfig
from qklab.methods.base import QKMethod
from qklab.methods.headwise import is_mla
from qklab.parallel.muon import HeadMuon


def hidden_matrix_names(model: nn.Module) -> set[str]:
    """Names of the 2-D weight matrices inside the blocks (Muon's domain): attention and MLP weights.
    Embeddings, the output head, norms and method parameters are left to AdamW."""
    return {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}


def per_head_matrices(model: nn.Module, which: str, groups: int = 0) -> dict[int, int]:
    """id(weight) -> rows per block of the attention matrices that Muon orthogonalises per head under
    ``train.muon_per_head`` (``qk`` or ``qkv``; ``none``: none). MHA/GQA: W_Q (per query head), W_K (per
    KV head) and with ``qkv`` W_V (per KV head). MLA: the per-head up-projections W_uq, W_uk, W_qr and with
    ``qkv`` W_uv; the down-projections W_dq, W_dkv and the shared rope key W_kr serve every head, have no
    per-head blocks, and stay whole.

    ``groups`` g > 0 (Group Muon, ``train.muon_head_groups``): a matrix of n heads is orthogonalised in
    min(g, n) blocks of adjacent heads (g = 1: whole; g = n: per head). A KV head serves adjacent query
    heads, so a KV block holds the KV heads of its query block (or, past n_kv groups, one KV head)."""
    if which == "none":
        return {}
    out: dict[int, int] = {}
    for a in model.attention_layers():
        if is_mla(a):
            mats = [(a.wuq, a.n_heads), (a.wuk, a.n_heads), (a.wqr, a.n_heads)]
            mats += [(a.wuv, a.n_heads)] if which == "qkv" else []
        else:
            mats = [(a.wq, a.n_heads), (a.wk, a.n_kv_heads)] + ([(a.wv, a.n_kv_heads)] if which == "qkv" else [])
        out.update({id(m.weight): m.weight.shape[0] // (min(groups, n) if groups else n) for m, n in mats})
    return out


def method_groups(model: nn.Module) -> dict[str, tuple[float, list[tuple[str, nn.Parameter]]]]:
    """Parameters of QK methods that ask for their own group (``QKMethod.param_group``):
    group name -> (rate multiplier, [(name, parameter)])."""
    out: dict[str, tuple[float, list[tuple[str, nn.Parameter]]]] = {}
    for mod_name, mod in model.named_modules():
        spec = mod.param_group() if isinstance(mod, QKMethod) else None
        if spec is None:
            continue
        name, mult = spec
        named = [(f"{mod_name}.{n}", p) for n, p in mod.named_parameters(recurse=False)]
        prev = out.setdefault(name, (mult, []))
        if prev[0] != mult:
            raise ValueError(f"optimizer group '{name}' asked for two rate multipliers ({prev[0]}, {mult})")
        prev[1].extend(named)
    return out


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    muon_cls: type[torch.optim.Muon] = torch.optim.Muon) -> list[torch.optim.Optimizer]:
    """One optimizer (AdamW) or two (Muon for hidden matrices + AdamW for the rest). QK-method
    parameters that ask for it (QK-MAP's frequencies and temperature) get an AdamW group of their own:
    no weight decay, their method's rate multiplier. ``muon_cls``: torch's Muon, or a subclass (FSDP2
    shards: ``qklab.parallel.muon.ShardedMuon``). ``cfg.muon_per_head``: the attention matrices it names
    (``per_head_matrices``) are orthogonalised head by head, or by groups of heads with
    ``cfg.muon_head_groups`` (``qklab.parallel.muon.HeadMuon``); AdamW is elementwise, so the options
    change nothing there."""
    hidden = hidden_matrix_names(model)
    own = method_groups(model)
    taken = {n for _, named in own.values() for n, _ in named}
    params = {n: p for n, p in model.named_parameters() if n not in taken}  # shared (tied) weights appear once
    matrices = [(n, p) for n, p in params.items() if p.ndim >= 2]
    others = [(n, p) for n, p in params.items() if p.ndim < 2]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        groups = [
            _group("decay", matrices, cfg.lr, cfg.weight_decay),
            _group("no_decay", others, cfg.lr, 0.0),
            *(_group(name, named, cfg.lr * mult, 0.0) for name, (mult, named) in own.items()),
        ]
        return [_adamw([g for g in groups if g["params"]], cfg.lr, betas)]
    adam_lr = cfg.adam_lr or cfg.lr
    muon_params = [(n, p) for n, p in matrices if n in hidden]
    adam_matrices = [(n, p) for n, p in matrices if n not in hidden]
    group = _group("muon", muon_params, cfg.lr, cfg.weight_decay)
    heads = per_head_matrices(model, cfg.muon_per_head, cfg.muon_head_groups)
    if heads:  # rows per head of each Muon matrix, 0: whole
        group["head_rows"] = [heads.get(id(p), 0) for _, p in muon_params]
        muon_cls = HeadMuon if muon_cls is torch.optim.Muon else muon_cls
        if not issubclass(muon_cls, HeadMuon):
            raise ValueError(f"train.muon_per_head={cfg.muon_per_head} needs a HeadMuon, got {muon_cls.__name__}")
    muon = muon_cls(
        [group],
        lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw",
    )
    adam_groups = [_group("adam_decay", adam_matrices, adam_lr, cfg.weight_decay),
                   _group("no_decay", others, adam_lr, 0.0),
                   *(_group(name, named, adam_lr * mult, 0.0) for name, (mult, named) in own.items())]
    return [muon, _adamw([g for g in adam_groups if g["params"]], adam_lr, betas)]


def _adamw(groups: list[dict], lr: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    # the fused kernel (CPU and CUDA) computes the same update as the default foreach one
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def _group(name: str, named: list[tuple[str, nn.Parameter]], lr: float, wd: float) -> dict:
    return {"name": name, "param_names": [n for n, _ in named], "params": [p for _, p in named],
            "lr": lr, "base_lr": lr, "weight_decay": wd}


def schedule_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup, then cosine decay
    to ``min_lr_ratio`` at the last step, or constant."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], mult: float) -> None:
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * mult
