"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

A sharded checkpoint keeps the model and optimizer states in ``dcp/`` inside the checkpoint folder
(``.metadata`` plus one ``__<rank>_0.distcp`` file per writing rank), beside the ``state.pt`` and
``manifest.json`` of every checkpoint (``qklab.rundir.checkpoint``). Nothing is gathered: an FSDP2 rank
writes the rows it holds, and a replicated tensor (DDP, or FSDP's whole vectors) is written once.

DCP reshards on load. Each process asks for the tensors it holds (its shards under FSDP2, whole tensors
otherwise) and reads them from whichever files hold the pieces, so a checkpoint written by N processes
resumes on M, in one process without a process group, and loads into a plain model for ``qklab probe``
and ``qklab export``. Optimizer states are stored flat, keyed by parameter name
(``optim<i>.state.<name>.<key>``), so they do not depend on how parameters were numbered.

Loading runs nothing the files name: DCP's pickles (its index, an optimizer's settings) are read through
``qklab.parallel.dcp_read``, which refuses any that needs more than plain values (``UnsafeCheckpoint``).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch import nn

DCP_DIR = "dcp"


@contextlib.contextmanager
def _io():
    """Yields True without a process group (DCP then reads and writes as the only process, and warns each
    time that it assumes so: we mean it, so that warning is silenced)."""
    import torch.distributed as tdist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield not (tdist.is_available() and tdist.is_initialized())


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """The model's and optimizers' state as this process holds it (DTensor shards under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd = {"model": get_model_state_dict(model, options=_options())}
    for i, opt in enumerate(optimizers):  # an empty optimizer state is allocated first (one step at lr 0)
        sd[f"optim{i}"] = get_optimizer_state_dict(model, opt, options=_options())
    return sd


def save_sharded(folder: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Write this process's shards of the model and optimizer states into ``folder`` (a collective: every
    rank calls it with the same folder, on a file system they share)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = _state(model, optimizers)
    try:
        with _io() as single:
            dcp.save(state, checkpoint_id=str(folder), no_dist=single)
    except CheckpointException as e:  # the failures of every rank, wrapped: a full disk is its OSError again
        err = next((x for x, _ in e.failures.values() if isinstance(x, OSError)), None)
        if err is None:
            raise
        raise OSError(err.errno, err.strerror, err.filename or str(folder)) from None


def load_sharded(folder: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Load a sharded checkpoint into ``model`` and ``optimizers``, whatever the number of processes that
    wrote it (a collective when a process group is running)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from qklab.parallel.dcp_read import load

    sd = _state(model, optimizers)
    with _io() as single:
        load(sd, folder, single)
    set_model_state_dict(model, sd["model"], options=_options())
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, sd[f"optim{i}"], options=_options())


def load_sharded_weights(folder: Path, model: nn.Module) -> None:
    """The model's weights alone, read whole from a sharded checkpoint (``qklab probe``, ``qklab export``);
    strict: every tensor of the model must be in the checkpoint, with its shape."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from qklab.parallel.dcp_read import load

    sd = {"model": get_model_state_dict(model)}
    with _io() as single:
        load(sd, folder, single)
    set_model_state_dict(model, sd["model"])
