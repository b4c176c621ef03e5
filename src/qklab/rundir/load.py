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
from qklab.rundir.checkpoint import is_sharded, latest_checkpoint, load_checkpoint

CONFIG_KEYS = ("model", "qk", "data", "train", "preset")


@dataclass
class Target:
    ckpt: Path  # ckpt/step_XXXXXXX
    run_dir: Path | None  # the run folder holding config.json, when known


def resolve_target(path: str | Path) -> Target:
    """A run folder, its ckpt/ folder or one checkpoint folder -> the checkpoint to probe."""
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
    ck = latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    if ck is None:
        raise RunFolderError(f"{p}: no checkpoint found (expected {ckpt_dir}/step_*/model.safetensors); "
                         "train the run first")
    return Target(ck, run_dir)


def load_run_config(target: Target) -> RunConfig:
    """The run's RunConfig from config.json, else from the config saved in the checkpoint's state."""
    cfg_file = target.run_dir / "config.json" if target.run_dir is not None else None
    if cfg_file is not None and cfg_file.is_file():
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise RunFolderError(f"{cfg_file}: not valid JSON ({e})") from None
    else:
        raw = torch.load(target.ckpt / "state.pt", weights_only=False, map_location="cpu").get("config")
        if not isinstance(raw, dict):
            raise RunFolderError(f"{target.ckpt}: no config.json next to it and none saved in state.pt")
    raw = {k: raw[k] for k in CONFIG_KEYS if k in raw}
    qk = dict(raw.get("qk", {}))
    qk.update(qk.pop("options", None) or {})  # saved as {"options": {name: {...}}}, read as [qk.<name>]
    raw["qk"] = qk
    return from_dict(RunConfig, raw).validate()


def load_model(cfg: RunConfig, ckpt: Path, device: torch.device) -> tuple[torch.nn.Module, int]:
    from qklab.model import GPT

    model = GPT(cfg.model, cfg.qk)
    try:
        state = load_checkpoint(ckpt, model)
    except (RuntimeError, KeyError, OSError) as e:
        raise RunFolderError(f"{ckpt}: weights do not match the run's config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), int(state.get("step", 0))
