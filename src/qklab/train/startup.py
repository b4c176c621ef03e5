"""What a run decides before it starts: its name, its device, whether a resume may continue, and the
package versions it records."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import torch

from qklab.config import ConfigError, RunConfig, check_run_name, comparable, resume_changes


def versions() -> dict[str, str]:
    import safetensors
    import tokenizers

    import qklab
    return {"qklab": qklab.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
            "python": platform.python_version()}


def pick_device(spec: str) -> torch.device:
    if spec == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def run_name(cfg: RunConfig) -> str:
    if cfg.train.name:
        return check_run_name(cfg.train.name)
    qk = cfg.qk.method + ("" if cfg.qk.controller == "none" else f"+{cfg.qk.controller}")
    return check_run_name(f"{cfg.preset or 'run'}-{qk}-s{cfg.train.seed}", "the run name derived from the preset "
                          "(set train.name)")


def check_resume_config(cfg: RunConfig, saved: dict[str, Any], saved_world: int, world: int) -> None:
    """Refuse, in one line, a resume whose config changed in a way that cannot continue the run (the
    same global batch on another number of processes can)."""
    now = comparable(cfg)
    b_saved, b_now = saved.get("train", {}).get("batch_size"), now["train"]["batch_size"]
    if b_saved is None or saved_world == world:
        pass  # the usual comparison names a changed batch_size
    elif b_saved * saved_world != b_now * world:
        raise ConfigError(f"--resume with a changed global batch: {saved_world} process(es) x train.batch_size="
                          f"{b_saved} -> {world} x {b_now}; keep processes x train.batch_size at "
                          f"{b_saved * saved_world}")
    else:
        now["train"]["batch_size"] = b_saved  # the same global batch on another number of processes
    if now["model"]["vocab_size"] == 0:  # not filled in from the tokenizer yet; checked against it later
        now["model"]["vocab_size"] = saved.get("model", {}).get("vocab_size", 0)
    changes = resume_changes(saved, now)
    if changes:
        raise ConfigError(f"--resume with a changed config: {'; '.join(changes)}. These cannot change within a "
                          "run; undo the change, or start a new run with another train.name")
