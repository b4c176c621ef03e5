"""The one checkpointer of a run: ``save(step, state)`` and ``restore()``, whatever the parallel mode.

It owns the three formats (``qklab.rundir.checkpoint`` has the verified, atomic folder they share):

    whole       one process or DDP: rank 0 writes the model's ``model.safetensors`` and the optimizer states
    gathered    FSDP2: the shards gathered into full CPU tensors on rank 0, written as one process writes
    sharded     DCP (``train.ckpt_format=sharded``, the default under FSDP2): every rank writes its shards
                into rank 0's staging folder, then rank 0 adds the state and the manifest

and the fallback: ``find`` takes the newest checkpoint that verifies, naming each damaged one it skips.
Any format restores into any mode and number of processes (DCP reshards; a whole checkpoint is split).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qklab.parallel import DistContext, load_sharded, save_sharded
from qklab.parallel.dcp import DCP_DIR
from qklab.parallel.strategy import Strategy
from qklab.rundir.checkpoint import (
    complete_checkpoints,
    is_sharded,
    latest_checkpoint,
    load_weights,
    new_staging_dir,
    newest_intact,
    newest_usable,
    remove_stale_temps,
    save_checkpoint,
)


class Checkpointer:
    def __init__(self, ckpt_dir: Path, strategy: Strategy, optimizers: list[torch.optim.Optimizer],
                 fmt: str = "auto", keep: int = 2) -> None:
        self.dir, self.strategy, self.optimizers, self.keep = ckpt_dir, strategy, optimizers, keep
        self.dist: DistContext = strategy.dist
        self.sharded = fmt == "sharded" or (fmt == "auto" and strategy.sharded)  # write DCP shards

    # finding ---------------------------------------------------------------------------------------------
    @staticmethod
    def clean(ckpt_dir: Path) -> None:
        """Remove the temporary folders of dead writers (rank 0, before anything else is read or written)."""
        remove_stale_temps(ckpt_dir)

    @staticmethod
    def find(ckpt_dir: Path, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        """The newest usable checkpoint and its state (None: there is none); each damaged checkpoint
        skipped on the way is named through ``warn``."""
        return newest_usable(ckpt_dir, warn=warn)

    @staticmethod
    def has_checkpoints(ckpt_dir: Path) -> bool:
        return bool(complete_checkpoints(ckpt_dir))

    @staticmethod
    def resumable(ckpt_dir: Path) -> Path | None:
        """The newest checkpoint with all its files at their sizes (``newest_intact``): what --resume takes,
        unless a byte of it changed (resume's hashes tell); None where there is none."""
        return newest_intact(ckpt_dir)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (for messages: "the last good one is ...")."""
        return latest_checkpoint(self.dir)

    # writing ---------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write the checkpoint of ``step`` (a collective: every rank calls it, with the same ``state`` of
        everything but the weights and optimizer states); every rank raises when the write failed."""
        if self.sharded:
            return self._save_sharded(step, {**state, "optimizers": None})  # their states are in the shards
        model, optim = self.strategy.full_state(self.optimizers)  # the model itself, or gathered on rank 0
        path, failed = self.dir / f"step_{step:07d}", None
        if self.dist.is_main:  # DDP: the weights and optimizer state are the same on every rank
            try:
                path = save_checkpoint(self.dir, step, model, {**state, "optimizers": optim}, keep=self.keep)
            except BaseException as e:
                failed = e
        self.dist.agree(failed)  # every rank stops when the write failed (e.g. a full disk)
        if failed is not None:
            raise failed
        return path

    def _save_sharded(self, step: int, state: dict[str, Any]) -> Path:
        staged = self.dist.broadcast(new_staging_dir(self.dir, step) if self.dist.is_main else None)
        path, failed = self.dir / f"step_{step:07d}", None
        try:
            save_sharded(staged / DCP_DIR, self.strategy.model, self.optimizers)  # a collective
        except BaseException as e:
            failed = e
        if self.dist.is_main:
            try:
                if failed is not None:
                    shutil.rmtree(staged, ignore_errors=True)
                else:
                    path = save_checkpoint(self.dir, step, None, state, keep=self.keep, staged=staged)
            except BaseException as e:
                failed = e
        self.dist.agree(failed, "failed to write its checkpoint")
        if failed is not None:
            raise failed
        return path

    # reading ---------------------------------------------------------------------------------------------
    def restore(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load the weights and optimizer states of the checkpoint ``path`` (found by ``find``, whose
        ``state`` it is) into this run's model and optimizers; returns ``state`` for the rest."""
        model = self.strategy.model
        if is_sharded(path):  # DCP: each rank reads the pieces it holds, whatever wrote them
            load_sharded(path / DCP_DIR, model, self.optimizers)
        elif self.strategy.sharded:  # every rank reads the consolidated checkpoint and keeps its shards
            whole = self.strategy.empty_model()
            load_weights(path, whole)
            self.strategy.load_full(self.optimizers, whole.state_dict(), state["optimizers"])
        else:
            load_weights(path, model)
            self.strategy.load_full(self.optimizers, None, state["optimizers"])
        return state
