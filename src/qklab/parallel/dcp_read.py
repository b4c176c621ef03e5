"""Reading DCP shards without running a stranger's code (``qklab.parallel.dcp`` loads through here).

DCP keeps two kinds of pickle in ``dcp/``: the index ``.metadata`` (what each file holds, where), which its
own reader unpickles with ``pickle.load``, and the non-tensor values of a state (an optimizer's settings:
lr, betas), which its load planner unpickles with torch's unrestricted ``torch.load``. Here the index is
unpickled by ``IndexUnpickler``, which builds only what ``INDEX_GLOBALS`` names (and torch's dtypes), and the
values by torch's weights-only unpickler (plain values: no global at all). Either refusal is an
``UnsafeCheckpoint`` naming the global, raised by ``load`` once DCP is done (DCP would wrap an error raised
inside it).

Importing this module imports ``torch.distributed.checkpoint`` (most of a second): ``dcp`` imports it when
it reads shards.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import get_unsafe_globals_in_checkpoint

from qklab.errors import CheckpointError, UnsafeCheckpoint

INDEX = ".metadata"

# What a DCP index may name (``module.name``) besides torch's dtypes: the classes of DCP's metadata and of
# its file reader's entries, the sizes, layouts and memory formats of the tensors it lists, and the folder
# its writer saw (a path). All of them only hold values; none runs anything when built.
INDEX_GLOBALS = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
)


class Refused(pickle.UnpicklingError):
    """A global an index names that ``INDEX_GLOBALS`` does not (``name``: ``module.name``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, building only what ``INDEX_GLOBALS`` names and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if f"{module}.{name}" not in INDEX_GLOBALS and not is_dtype:
            raise Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_index(folder: Path) -> Metadata:
    """The index of the DCP folder ``folder`` (a checkpoint's ``dcp/``); one that names anything outside
    ``INDEX_GLOBALS`` raises ``UnsafeCheckpoint`` before that is built."""
    try:
        with open(folder / INDEX, "rb") as f:
            return IndexUnpickler(f).load()
    except Refused as e:
        raise UnsafeCheckpoint.needing(folder.parent, f"{folder.name}/{INDEX}", [e.name]) from None


class Reader(FileSystemReader):
    """DCP's file reader, its index read by ``read_index`` beforehand (so that a refusal is not wrapped)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.index = read_index(folder)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self.index, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            self.index.storage_meta = StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index


def _named_globals(value: io.BytesIO) -> list[str]:
    """The globals a pickled value names beyond torch's own, found without building it ([] when torch's
    scan does not parse it)."""
    try:
        value.seek(0)
        return sorted(get_unsafe_globals_in_checkpoint(value))
    except Exception:  # not a torch.save file: damaged, then
        return []


def read_value(value: io.BytesIO, ckpt: Path, name: str) -> Any:
    """A non-tensor value of the checkpoint ``ckpt`` (``name`` in messages) through torch's weights-only
    unpickler; one that needs a global raises ``UnsafeCheckpoint`` naming it, one that does not load
    otherwise ``CheckpointError`` (damaged)."""
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:  # unpickling a damaged value can raise nearly anything
        names = _named_globals(value) if isinstance(e, pickle.UnpicklingError) else []
        if names:
            raise UnsafeCheckpoint.needing(ckpt, name, names) from None
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} does not load ({type(e).__name__})") from None


class Planner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor values read by ``read_value``; the first refusal is kept in
    ``refusal`` (the value left out) for ``load`` to raise once DCP is done."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.refusal: CheckpointError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = read_value(value, self.folder.parent, f"{self.folder.name}/ item {fqn}")
        except CheckpointError as e:
            self.refusal = self.refusal or e
            return
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes stores it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state: dict[str, Any], folder: Path, single: bool) -> None:
    """``dcp.load`` of ``state`` from ``folder`` (``single``: as the only process), nothing in it unpickled
    but through ``read_index`` and ``read_value``; raises ``UnsafeCheckpoint`` for what either refuses."""
    planner = Planner(folder)
    dcp.load(state, storage_reader=Reader(folder), planner=planner, no_dist=single)
    if planner.refusal is not None:
        raise planner.refusal
