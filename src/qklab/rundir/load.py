"""Reading a run folder back: which checkpoint a path means, the run's config, the model with its weights.

The readers (``qklab probe``, ``qklab export``, the study runner's probes) all go through here, so each
answers a path the same way: a run folder means its newest checkpoint that verifies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qklab.config import RunConfig, from_dict
from qklab.errors import RunFolderError
from qklab.rundir.checkpoint import is_sharded, latest_checkpoint, load_checkpoint, read_state

CONFIG_KEYS = ("model", "qk", "data", "train", "preset")


@dataclass
class Target:
    ckpt: Path  # ckpt/step_XXXXXXX
    run_dir: Path | None  # the run folder holding config.json, when known


def resolve_target(path: str | Path, warn=None, unverified: bool = False) -> Target:
    """A run folder, its ckpt/ folder or one checkpoint folder -> the checkpoint to probe. A run folder
    means its newest checkpoint that verifies; each newer one skipped is named through ``warn``. Without a
    manifest a checkpoint cannot be verified: skipped too, unless ``unverified``."""
    p = Path(path)
    if not p.exists():
        raise RunFolderError(f"{p}: no such run or checkpoint folder")
    if not p.is_dir():
        raise RunFolderError(f"{p}: not a folder; give a run folder (runs/<name>) or a checkpoint (ckpt/step_*)")
    if (p / "model.safetensors").is_file() or is_sharded(p):
        if not (p / "state.pt").is_file():
            raise RunFolderError(f"{p}: incomplete checkpoint (no state.pt)")
        run_dir = p.parent.parent if p.parent.name == "ckpt" else None
        return Target(p, run_dir)
    ckpt_dir, run_dir = (p, p.parent) if p.name == "ckpt" else (p / "ckpt", p)
    skipped: list[str] = []
    ck = latest_checkpoint(ckpt_dir, warn=warn, unverified=unverified, skipped=skipped) if ckpt_dir.is_dir() else None
    if ck is None and skipped:
        hint = "; pass --allow-unverified to use one without a manifest" if any(
            "unverified" in s for s in skipped) else ""
        raise RunFolderError(f"{p}: no usable checkpoint ({'; '.join(skipped[:2])}"
                             f"{'; ...' if len(skipped) > 2 else ''}){hint}")
    if ck is None:
        raise RunFolderError(f"{p}: no checkpoint found (expected {ckpt_dir}/step_*/model.safetensors); "
                         "train the run first")
    return Target(ck, run_dir)


def load_run_config(target: Target, unverified: bool = False) -> RunConfig:
    """The run's RunConfig from config.json, else from the config saved in the checkpoint's (verified) state."""
    cfg_file = target.run_dir / "config.json" if target.run_dir is not None else None
    if cfg_file is not None and cfg_file.is_file():
        try:
            raw = json.loads(cfg_file.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunFolderError(f"{cfg_file}: not valid JSON ({' '.join(str(e).split())[:120]})") from None
        if not isinstance(raw, dict):
            raise RunFolderError(f"{cfg_file}: not a run config (a JSON {type(raw).__name__})")
    else:
        raw = read_state(target.ckpt, unverified).get("config")
        if not isinstance(raw, dict):
            raise RunFolderError(f"{target.ckpt}: no config.json next to it and none saved in state.pt")
    raw = {k: raw[k] for k in CONFIG_KEYS if k in raw}
    if not isinstance(raw.get("qk", {}), dict):
        raise RunFolderError(f"{cfg_file or target.ckpt}: its qk config is not a table")
    qk = dict(raw.get("qk", {}))
    qk.update(qk.pop("options", None) or {})  # saved as {"options": {name: {...}}}, read as [qk.<name>]
    raw["qk"] = qk
    return from_dict(RunConfig, raw).validate()


def load_model(cfg: RunConfig, ckpt: Path, device: torch.device,
               unverified: bool = False) -> tuple[torch.nn.Module, int]:
    from qklab.model import GPT

    model = GPT(cfg.model, cfg.qk)
    try:
        state = load_checkpoint(ckpt, model, unverified)
    except (RuntimeError, KeyError, OSError) as e:
        raise RunFolderError(f"{ckpt}: weights do not match the run's config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), int(state.get("step", 0))


@dataclass
class LoadedRun:
    """A trained run read back: its model (eval mode) with the weights of ``step``, its config, and its
    tokenizer (None for a BPE run written before run folders kept ``tokenizer.json``)."""

    model: torch.nn.Module
    config: RunConfig
    step: int
    tokenizer: object | None
    checkpoint: Path


def load_run(path: str | Path, device: str | torch.device = "cpu", unverified: bool = False,
             warn=None) -> LoadedRun:
    """``qklab.load_run("runs/x")``: the newest checkpoint that verifies of a run folder (or the checkpoint
    named) as a qklab ``GPT``, with its config and tokenizer; weights and config are checked as ``qklab
    probe`` checks them (one-line ``UserError`` for a folder that is no run, a damaged or unsafe checkpoint)."""
    from qklab.data.tokenizer import BPETokenizer, ByteTokenizer
    from qklab.rundir.folder import TOKENIZER

    target = resolve_target(path, warn=warn, unverified=unverified)
    cfg = load_run_config(target, unverified)
    model, step = load_model(cfg, target.ckpt, torch.device(device), unverified)
    tokenizer = None
    if cfg.data.tokenizer == "bytes":
        tokenizer = ByteTokenizer()
    elif target.run_dir is not None and (target.run_dir / TOKENIZER).is_file():
        tokenizer = BPETokenizer.load(target.run_dir / TOKENIZER)
    return LoadedRun(model, cfg, step, tokenizer, target.ckpt)
