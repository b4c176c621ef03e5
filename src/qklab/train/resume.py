"""Continuing a run: the checkpoint it resumes from, and what a checkpoint holds besides the weights and the
optimizer states (those are the ``Checkpointer``'s): the QK controller's, the data loader's and the spike
detector's states, every random generator, the steps skipped, and the config and world size it was written
under. Seeding the generators at a fresh start is here too, beside putting them back on a resume."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from qklab.config import RunConfig, comparable
from qklab.errors import ConfigError
from qklab.train.checkpointer import Checkpointer
from qklab.train.startup import check_resume_config


class Stateful(Protocol):
    """What keeps a state across a resume: the controller, the loader, the spike detector."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def resume_point(ckpt_dir: Path, cfg: RunConfig, resume: bool, overwrite: bool, world: int,
                 warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint (path, state) a run continues from; None for a fresh start. ConfigError when --resume
    finds none or its config cannot continue here, or when a fresh start would write beside the checkpoints
    already in the run folder."""
    found = Checkpointer.find(ckpt_dir, warn=warn) if resume else None
    if resume and found is None:
        again = ("start the run again with --overwrite (its checkpoints are all unusable)"
                 if Checkpointer.has_checkpoints(ckpt_dir) else "start the run without --resume")
        raise ConfigError(f"--resume: no usable checkpoint in {ckpt_dir}; {again}")
    if found is not None:
        check_resume_config(cfg, found[1].get("config") or {}, found[1].get("world", 1), world)
    if not resume and not overwrite and Checkpointer.has_checkpoints(ckpt_dir):
        raise ConfigError(f"run folder {ckpt_dir.parent} already has checkpoints; pass --resume to continue "
                          "it, --overwrite to start again, or set train.name")
    return found


def run_state(controller: Stateful, loader: Stateful, spikes: Stateful, skipped: int, cfg: RunConfig,
              world: int, monitor: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a checkpoint holds besides the weights and the optimizer states, taken on every rank: a
    controller may reduce. ``monitor``: the diagnostics' reference for the next logit change, when it was
    measured before this step (``AttentionMonitor.state_dict``)."""
    return {"controller": controller.state_dict(), "monitor": monitor or {},
            "loader": loader.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "spikes": spikes.state_dict(), "skipped": skipped, "config": comparable(cfg),
            "world": world}


def restore_run_state(state: dict[str, Any], controller: Stateful, loader: Stateful,
                      spikes: Stateful) -> tuple[int, int]:
    """Put back what ``run_state`` took (the checkpointer puts back the rest); returns the (step, skipped
    steps) to continue from."""
    controller.load_state_dict(state["controller"])
    loader.load_state_dict(state["loader"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    _set_numpy_rng_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    spikes.load_state_dict(state.get("spikes", {}))
    return state["step"], state.get("skipped", 0)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (a fresh start; a resume restores them)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state in plain Python values (its key a list of ints, not an array), so that
    state.pt loads without unpickling numpy (``qklab.rundir.checkpoint.STATE_GLOBALS``)."""
    state = np.random.get_state(legacy=False)
    return {**state, "state": {**state["state"], "key": state["state"]["key"].tolist()}}


def _set_numpy_rng_state(saved: dict[str, Any] | tuple) -> None:
    """Restore numpy's global RNG from ``_numpy_rng_state``, or from the ``np.random.get_state()`` tuple
    that checkpoints written before it hold."""
    if isinstance(saved, dict):
        saved = {**saved, "state": {**saved["state"], "key": np.asarray(saved["state"]["key"], dtype=np.uint32)}}
    np.random.set_state(saved)
