"""Crash-safe, verified checkpoints.

A checkpoint is a folder ``ckpt/step_XXXXXXX/`` holding ``model.safetensors`` (weights), ``state.pt``
(optimizer, controller, data-loader and RNG state, step, config) and ``manifest.json`` (the size and
sha256 of each file). A sharded checkpoint (``train.ckpt_format=sharded``, ``qklab.parallel.dcp``) holds the
weights and optimizer states in ``dcp/``, written by every rank, instead of ``model.safetensors``.

A checkpoint is written under a temporary name, every file is fsynced, and only then
is the folder renamed into place and the ``latest`` pointer replaced (also by rename; a hint for people and
other tools: readers take the newest step that verifies, whatever it names). A process killed
at any moment leaves the previous checkpoint intact; a failed write (a full disk) removes its temporary
folder, and temporary folders of dead writers are removed before the next write.

Loading checks the manifest first: a truncated, altered or missing file makes the checkpoint unusable,
and ``latest_checkpoint`` / ``newest_usable`` fall back to the newest good one and say which was skipped.
Checkpoints written before manifests existed (no ``manifest.json``) are accepted unverified where the caller
allows it (``unverified=True``: resuming a run); the readers (probe, export) refuse them unless asked.

Nothing in a checkpoint runs code when it is loaded: ``state.pt`` is read by torch's weights-only unpickler,
which builds tensors and plain Python values and, beyond them, only what ``STATE_GLOBALS`` names. A file that
needs anything else (``os.system``, ``builtins.exec``: a checkpoint from elsewhere) is refused by name
(``UnsafeCheckpoint``), never skipped for an older one; ``qklab.parallel.dcp_read`` reads DCP shards alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy._core.multiarray import _reconstruct
from safetensors.torch import load_model, save_model
from torch import nn

from qklab.atomic import atomic_write_text, follow_umask, fsync_dir, fsync_file, pid_alive
from qklab.errors import CheckpointError, UnsafeCheckpoint

PREFIX = "step_"
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "state.pt")  # a consolidated checkpoint's data files
WEIGHTS, STATE, SHARDS = FILES[0], FILES[1], "dcp/.metadata"  # SHARDS: a sharded checkpoint's index

# What state.pt may need besides tensors and plain Python values (which torch's weights-only unpickler builds
# by itself): a numpy uint32 array, the key of numpy's RNG state as ``np.random.get_state()`` gives it, which
# checkpoints written before that state was stored as plain ints hold. No other global is ever unpickled.
STATE_GLOBALS = (np.ndarray, np.dtype, np.dtypes.UInt32DType, _reconstruct)

__all__ = ["CheckpointError", "UnsafeCheckpoint", "STATE_GLOBALS", "atomic_write_text", "save_checkpoint",
           "latest_checkpoint", "newest_usable", "load_checkpoint", "read_state", "load_weights",
           "verify_checkpoint", "complete_checkpoints", "newest_intact", "remove_stale_temps", "new_staging_dir",
           "is_sharded", "write_manifest"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def new_staging_dir(ckpt_dir: Path, step: int) -> Path:
    """An empty temporary folder for the checkpoint of ``step``, named after this process (a writer that
    dies leaves it to ``remove_stale_temps``), once the temporaries of dead writers are gone."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(ckpt_dir)
    tmp = ckpt_dir / f".tmp-{PREFIX}{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def is_sharded(path: Path) -> bool:
    """True for a checkpoint whose weights are DCP shards (``dcp/``) rather than ``model.safetensors``."""
    return (path / SHARDS).is_file()


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module | None, state: dict[str, Any], keep: int = 2,
                    staged: Path | None = None) -> Path:
    """Write ``model`` (safetensors) and ``state``, or add ``state`` to the shards every rank already wrote
    into ``staged`` (``model`` None; a folder from ``new_staging_dir``), then publish the folder by rename.
    Nothing half-written stays."""
    tmp = staged or new_staging_dir(ckpt_dir, step)
    final = ckpt_dir / f"{PREFIX}{step:07d}"
    old = ckpt_dir / f".old-{PREFIX}{step:07d}-{os.getpid()}"
    try:
        try:
            if model is not None:
                save_model(model, str(tmp / WEIGHTS))
                follow_umask(tmp / WEIGHTS)  # safetensors writes 0600
            save_state({**state, "step": step}, tmp / STATE)
        except Exception as e:  # a full disk: the OSError the library's error hides, for its one line
            err = os_error(e, tmp)
            if err is None or err is e:
                raise
            raise err from None
        files = write_manifest(tmp, step)
        for f in [*files, tmp / MANIFEST]:
            fsync_file(f)
        for d in {f.parent for f in files}:
            fsync_dir(d)
        if final.exists():  # re-saving a step: move the old copy aside first (a folder cannot be replaced)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        atomic_write_text(ckpt_dir / "latest", final.name + "\n")
    except BaseException:  # a full disk or a signal: leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _prune(ckpt_dir, final, keep)
    return final


def save_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` through a file of ours, so that a failed write (a full disk) keeps its OSError."""
    with open(path, "wb") as f:
        torch.save(state, f)


def os_error(e: BaseException, path: Path) -> OSError | None:
    """The OSError behind a library's failed write, or None: ``torch.save`` raises a RuntimeError with it as
    its context, safetensors a SafetensorError that gives its number ("No space left on device (os error 28)")."""
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError):
            return cause if cause.filename or cause.errno is None else OSError(cause.errno, cause.strerror, str(path))
    m = re.search(r"\(os error (\d+)\)", str(e))
    return OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path)) if m else None


def write_manifest(folder: Path, step: int) -> list[Path]:
    """Write the ``manifest.json`` of the checkpoint ``folder`` (the size and sha256 of each of its files);
    returns the files it lists."""
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f != folder / MANIFEST)
    manifest = {"step": step, "files": {f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size,
                                                                           "sha256": _sha256(f)} for f in files}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return files


def _prune(ckpt_dir: Path, final: Path, keep: int) -> None:
    """Keep the ``keep`` newest intact checkpoints up to ``final``, the one just written, and remove every other
    folder: the older intact ones beyond ``keep``; those before ``final`` that lost files (a deletion cut
    short, a truncated file), which no resume can use and which would otherwise stay for good; and those of
    later steps, left by the run this one resumed before (damaged ones it passed over): it writes their steps
    again. ``final`` itself always stays, so the newest usable checkpoint is never removed."""
    folders = _by_step(ckpt_dir)
    intact = [p for p in folders if step_of(p) < step_of(final) and _intact(p)]
    kept = set(intact[max(0, len(intact) - (max(1, keep) - 1)):])
    for old in folders:
        if old != final and old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _intact(path: Path) -> bool:
    """True for a checkpoint folder that holds all its files: its data files, and every file its manifest lists
    at the size it lists. Sizes only, no hashes (pruning runs at every checkpoint): what an interrupted
    deletion or a truncated write leaves is found, a flipped byte is not. A consolidated checkpoint without a
    manifest (written before manifests) counts as intact; a sharded one always had its manifest."""
    if _missing(path):
        return False
    if not (path / MANIFEST).is_file():
        return not is_sharded(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        sizes = {n: int(f["bytes"]) for n, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all((path / n).is_file() and (path / n).stat().st_size == size for n, size in sizes.items())


def remove_stale_temps(ckpt_dir: Path) -> list[Path]:
    """Remove the temporary folders of writers that no longer run (killed mid-write, or failed on a full
    disk); a live writer's folder is left alone. Returns what was removed."""
    removed = []
    if not ckpt_dir.is_dir():
        return removed
    for junk in [*ckpt_dir.glob(f".tmp-{PREFIX}*"), *ckpt_dir.glob(f".old-{PREFIX}*"), *ckpt_dir.glob(".latest.*")]:
        m = re.search(r"[-.](\d+)(\.tmp)?$", junk.name)  # the writer's process id
        if m is None or int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1))):
            if junk.is_dir():
                shutil.rmtree(junk, ignore_errors=True)
            else:
                junk.unlink(missing_ok=True)
            removed.append(junk)
    return removed


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name gives (``step_0001000`` -> 1000); None for any other name."""
    digits = path.name.removeprefix(PREFIX)
    return int(digits) if path.name.startswith(PREFIX) and digits.isascii() and digits.isdigit() else None


def _by_step(ckpt_dir: Path) -> list[Path]:
    """The checkpoint folders in ``ckpt_dir`` (``step_<digits>``), oldest step first. By the number, not the
    name: ``step_10000000`` comes after ``step_9999999``, which its name sorts before."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob(f"{PREFIX}*") if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders holding their state and weights, oldest first (not verified; see verify_checkpoint)."""
    return [p for p in _by_step(ckpt_dir) if not _missing(p)]


def newest_intact(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint folder that holds every file its manifest lists, at its size (``_intact``); None
    when there is none. What resume would take, as far as a stat per file tells: no hashes (a stop's hint
    reads it, and re-hashing gigabytes there would delay the stop), so a flipped byte is left to resume."""
    return next((p for p in _candidates(ckpt_dir) if _intact(p)), None)


def _missing(path: Path) -> list[str]:
    weights = [] if (path / WEIGHTS).is_file() or is_sharded(path) else [WEIGHTS]
    return [*weights, *([] if (path / STATE).is_file() else [STATE])]


NO_MANIFEST = f"no {MANIFEST} (written before manifests, so it cannot be verified)"


def verify_checkpoint(path: Path, unverified: bool = True) -> str | None:
    """None when every file matches the manifest; otherwise what is wrong, in a few words. A checkpoint
    without a manifest passes unchecked when ``unverified``, and is refused otherwise."""
    missing = _missing(path)
    if missing:
        return f"{', '.join(missing)} missing"
    if not (path / MANIFEST).is_file():
        return None if unverified else NO_MANIFEST
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        want = {n: (int(f["bytes"]), str(f["sha256"])) for n, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    unlisted = [n for n in (WEIGHTS, STATE, SHARDS) if (path / n).is_file() and n not in want]
    if unlisted:
        return f"{', '.join(unlisted)} not in the manifest"
    for n, (size, sha) in want.items():
        if not (path / n).is_file():
            return f"{n} missing"
        got = (path / n).stat().st_size
        if got != size:
            return f"{n} has {got} bytes, the manifest says {size} (truncated?)"
        if _sha256(path / n) != sha:
            return f"{n} does not match its sha256 in the manifest (altered on disk)"
    return None


def _candidates(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders, newest step first. The ``latest`` pointer is not consulted: it is a hint for people
    and other tools, and a stale one (a kill between a checkpoint's rename and the pointer's) would put an
    older checkpoint before a newer complete one."""
    return _by_step(ckpt_dir)[::-1]


def newest_usable(ckpt_dir: Path, warn: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose files verify and whose state loads, with that state; each damaged one
    skipped on the way is reported through ``warn``. None when there is none. A checkpoint whose state needs
    code qklab does not load is no damaged one: ``UnsafeCheckpoint`` is raised, nothing older is tried."""
    skipped: list[str] = []
    for cand in _candidates(ckpt_dir):
        try:
            state = read_state(cand)
        except UnsafeCheckpoint:  # not damaged: planted; refused outright
            raise
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if skipped and warn is not None:
            warn(f"warning: {'; '.join(skipped)}; using {cand.name}, the newest good checkpoint")
        return cand, state
    if skipped and warn is not None:
        warn(f"warning: {'; '.join(skipped)}; no good checkpoint left")
    return None


def latest_checkpoint(ckpt_dir: Path, warn: Callable[[str], None] | None = None, unverified: bool = True,
                      skipped: list[str] | None = None) -> Path | None:
    """The newest checkpoint whose files match their manifest, else None; damaged ones are skipped (and
    reported through ``warn``, and listed in ``skipped``)."""
    skipped = [] if skipped is None else skipped
    for cand in _candidates(ckpt_dir):
        problem = verify_checkpoint(cand, unverified)
        if problem is None:
            if skipped and warn is not None:
                warn(f"warning: {'; '.join(skipped)}; using {cand.name}, the newest good checkpoint")
            return cand
        skipped.append(f"checkpoint {cand} is {'unverified' if problem == NO_MANIFEST else 'damaged'}: {problem}")
    return None


def _refused_globals(file: Path) -> list[str]:
    """The globals ``file`` (a ``torch.save`` file) names beyond those torch and ``STATE_GLOBALS`` allow,
    found without unpickling it ([] when there are none, or it cannot be read that far)."""
    try:
        with torch.serialization.safe_globals(list(STATE_GLOBALS)):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # not a torch.save zip, or a pickle torch's scan does not parse: damaged, then
        return []


def _unpickle_state(path: Path) -> Any:
    """The checkpoint's ``state.pt`` through torch's weights-only unpickler: tensors, plain values and
    ``STATE_GLOBALS``. Raises ``UnsafeCheckpoint`` naming any other global it needs, ``CheckpointError``
    (damaged) when it does not load otherwise."""
    try:
        with torch.serialization.safe_globals(list(STATE_GLOBALS)):
            return torch.load(path / STATE, weights_only=True, map_location="cpu")  # a GPU run's, anywhere
    except Exception as e:  # unpickling a damaged file can raise nearly anything
        names = _refused_globals(path / STATE) if isinstance(e, pickle.UnpicklingError) else []
        if names:
            raise UnsafeCheckpoint.needing(path, STATE, names) from None
        raise CheckpointError(f"checkpoint {path} is damaged: state.pt does not load ({type(e).__name__})") from None


def read_state(path: Path, unverified: bool = True) -> dict[str, Any]:
    """Verify the checkpoint and load its state (everything but the weights); a state that needs a global
    outside ``STATE_GLOBALS`` raises ``UnsafeCheckpoint`` before anything of it is built."""
    problem = verify_checkpoint(path, unverified)
    if problem == NO_MANIFEST:
        raise CheckpointError(f"checkpoint {path} is unverified: {problem}; pass --allow-unverified to use it anyway")
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    state = _unpickle_state(path)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is damaged: state.pt holds no training state")
    return state


def load_weights(path: Path, model: nn.Module) -> None:
    """Load the checkpoint's weights into ``model``, from ``model.safetensors`` or from the DCP shards of a
    sharded checkpoint (strict: every tensor, every shape)."""
    try:
        if is_sharded(path):
            from qklab.parallel.dcp import DCP_DIR, load_sharded_weights

            load_sharded_weights(path / DCP_DIR, model)
        else:
            load_model(model, str(path / WEIGHTS), strict=True)
    except CheckpointError:  # shards whose index needs code qklab does not load (UnsafeCheckpoint)
        raise
    except Exception as e:  # shapes that do not fit (RuntimeError), a damaged unverified file (SafetensorError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model ({first[:200]})") from None


def load_checkpoint(path: Path, model: nn.Module, unverified: bool = True) -> dict[str, Any]:
    """Verify, load weights into ``model`` (strict) and return the rest of the state."""
    state = read_state(path, unverified)
    load_weights(path, model)
    return state
