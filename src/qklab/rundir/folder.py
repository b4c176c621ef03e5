"""Run folders: one writer at a time, and ``--overwrite`` only ever deletes a run's own files.

The lock is an exclusive ``flock`` on ``<run>/.lock``, held for the life of the training process; the
kernel drops it when the process ends, however it ends, so a crashed run never leaves a stale lock.
The file records the holder's process id for the message a second writer gets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from qklab.errors import ConfigError, RunLockError

LOCK = ".lock"
TOKENIZER = "tokenizer.json"  # a BPE run's tokenizer (tokenizers' JSON); a bytes run has none (its config says so)
# what a run folder may hold; --overwrite refuses to delete a folder holding anything else
RUN_FILES = {LOCK, "config.json", TOKENIZER, "metrics.jsonl", "train.log", "ckpt", "probes.json", "probes", "tb",
             "wandb", "cell.json", "probe", "export"}  # probe: a study cell's probes of its final checkpoint


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path, self._fd = run_dir / LOCK, None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask, as open() gives
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockError(f"run folder {run_dir} is in use by another qklab process (pid {holder}); "
                               "wait for it to finish, or choose another train.name", holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def lock_holder(run_dir: Path) -> int | None:
    """The pid of the process that holds ``run_dir``'s lock, or None (free, no folder, or not Linux). Read
    from the kernel's table of locks (/proc/locks), never by taking the lock: a test lock, even for an
    instant, would make a trainer that opens the folder at that instant give up."""
    try:
        st = os.stat(run_dir / LOCK)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:5596411 0 EOF"; "->": a waiter
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == dev and f[4].isdigit():
            return int(f[4])
    return None


def _is_run_file(name: str) -> bool:
    return name in RUN_FILES or name.startswith(("probe_", ".config.json.", ".metrics.jsonl.", f".{TOKENIZER}."))


def clear_run_folder(run_dir: Path, dry_run: bool = False) -> None:
    """Delete a run's files for ``--overwrite`` (the lock stays: it is held). Refuses, naming a file, when
    the folder holds anything a run does not write; ``dry_run`` only checks."""
    foreign = sorted(p.name for p in run_dir.iterdir() if not _is_run_file(p.name))
    if foreign:
        raise ConfigError(f"--overwrite: {run_dir} holds files that are not from a qklab run ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); refusing to delete it. Move them, or choose "
                          "another train.name")
    for p in [] if dry_run else run_dir.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


class RunFolder:
    """An opened run folder: created if needed, locked, checked for ``--overwrite`` before any work, and
    removed again by ``abandon`` when the run fails to start in a folder this call created."""

    def __init__(self, run_dir: Path, overwrite: bool = False) -> None:
        self.path = run_dir
        self.created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(run_dir)
        except OSError as e:
            raise ConfigError(f"cannot write the run folder {run_dir} ({e.strerror or e}); choose a writable "
                              "train.out_dir") from None
        if overwrite and not self.created:
            try:
                clear_run_folder(run_dir, dry_run=True)  # refuse now, before any work, if it is not a run
            except ConfigError:
                self.lock.release()
                raise

    def clear(self) -> None:
        clear_run_folder(self.path)

    def release(self) -> None:
        self.lock.release()

    def abandon(self) -> None:
        self.release()
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)


class FollowerFolder:
    """The run folder as a rank other than 0 sees it: rank 0 holds the lock and writes every file."""

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def clear(self) -> None:
        pass
