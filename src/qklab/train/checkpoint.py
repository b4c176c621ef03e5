"""Crash-safe checkpoints.

A checkpoint is a folder ``ckpt/step_XXXXXXX/`` holding ``model.safetensors`` (weights) and
``state.pt`` (optimizer, controller, data-loader and RNG state, step). It is written under a temporary
name, every file is fsynced, and only then is the folder renamed into place and the ``latest`` pointer
replaced (also by rename). A process killed at any moment leaves the previous checkpoint intact and
``latest`` pointing at a complete one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

PREFIX = "step_"


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, state: dict[str, Any], keep: int = 2) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{PREFIX}{step:07d}"
    tmp = ckpt_dir / f".tmp-{PREFIX}{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save({**state, "step": step}, tmp / "state.pt")
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    old = ckpt_dir / f".old-{PREFIX}{step:07d}-{os.getpid()}"
    if final.exists():  # re-saving a step: move the old copy aside first (a folder cannot be replaced)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / "latest", final.name + "\n")
    shutil.rmtree(old, ignore_errors=True)
    _prune(ckpt_dir, keep)
    return final


def _prune(ckpt_dir: Path, keep: int) -> None:
    done = complete_checkpoints(ckpt_dir)
    for old in done[: max(0, len(done) - max(1, keep))]:
        shutil.rmtree(old, ignore_errors=True)
    for junk in [*ckpt_dir.glob(f".tmp-{PREFIX}*"), *ckpt_dir.glob(f".old-{PREFIX}*")]:  # left by a killed writer
        if not junk.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(junk, ignore_errors=True)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    found = [p for p in ckpt_dir.glob(f"{PREFIX}*")
             if (p / "state.pt").is_file() and (p / "model.safetensors").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The folder ``latest`` names, else the newest complete one, else None."""
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        cand = ckpt_dir / pointer.read_text().strip()
        if (cand / "state.pt").is_file():
            return cand
    done = complete_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    return done[-1] if done else None


def load_checkpoint(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load weights into ``model`` (strict) and return the rest of the state."""
    load_model(model, str(path / "model.safetensors"), strict=True)
    return torch.load(path / "state.pt", weights_only=False)
