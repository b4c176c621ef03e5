"""Process groups: who am I, how many of us, and the few collectives the trainer and controllers need.

``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``) starts one process per device; ``DistContext.start`` joins them into the default process
group (gloo on CPU, NCCL on CUDA). Without those variables, or with ``train.parallel=none``, the context is
a single process and every collective is the identity, so the same code runs in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from qklab.config import ConfigError
from qklab.errors import LOCAL_RANK_0_SAYS, RANK_0_SAYS, alike

_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


def _identity(e: BaseException) -> str:
    """What two ranks compare to tell whether they failed alike: the error's type and message."""
    return f"{type(e).__module__}.{type(e).__qualname__}: {' '.join(str(e).split())}"


def launched() -> bool:
    """True when a launcher (torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# what a collective raises on a rank whose partner is gone (gloo's TCP pairs, the TCP store, NCCL), in torch's words
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "communicator was aborted")


def peer_lost(e: BaseException) -> bool:
    """True for the error a collective raises on this rank because another process of the run is gone (it
    stopped on its own error, crashed or was killed): the other's failure, not this rank's, and no bug here."""
    if not launched():
        return False
    return isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_LOST)  # torch's Dist*Error among them


SAY_TIMEOUT_S = 2.0  # how long first_to_say tries to reach the launcher's store


def first_to_say(what: str) -> bool:
    """True on the first process of a launched run to ask about ``what`` (e.g. a lost partner), False on the
    others: the one line a stop deserves, said once by whichever process survives to say it (rank 0 may be
    the one lost). Asked of the launcher's store (``MASTER_ADDR``:``MASTER_PORT``: under torchrun its agent's,
    which outlives every rank), keyed by the run and its restart count, as torch keys its own use of that
    store. Where the store cannot be reached every process says it, rather twice than never: under a launcher
    whose store lives in rank 0's process, the survivors that ask after rank 0 has gone."""
    if not launched():
        return True
    key = "qklab/said/{}/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", "-"),
                                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), what)
    try:
        store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=SAY_TIMEOUT_S), wait_for_workers=False)
        return store.add(key, 1) == 1
    except (RuntimeError, KeyError, ValueError):  # no store to ask (torch's DistError is a RuntimeError)
        return True


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    parallel: str = "none"  # none | ddp | fsdp
    owns_group: bool = False  # True: this context started the process group and ends it in close()
    mesh: Any = None  # FSDP2: the 1-D device mesh of all ranks

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes logs, metrics, progress and checkpoints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @classmethod
    def start(cls, parallel: str, device_spec: str = "auto", timeout_s: float = 1800.0) -> DistContext:
        """Join the processes torchrun started (``parallel`` ddp or fsdp), or a single-process context.

        A mismatch (parallel set without a launcher, or a launcher without parallel) is the user's to fix."""
        if parallel == "none":
            if launched():
                raise alike(ConfigError(f"started by a launcher with WORLD_SIZE={os.environ['WORLD_SIZE']} but "
                                        "train.parallel=none; set train.parallel=ddp or fsdp"), LOCAL_RANK_0_SAYS)
            return cls()
        if not launched():
            return cls(parallel=parallel)  # one process: data parallel over one rank is plain training
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = device_spec != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        owns = not tdist.is_initialized()
        if owns:
            tdist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        ctx = cls(rank, world, local, parallel, owns)
        if parallel == "fsdp":  # made now, while every rank is here (a collective)
            from torch.distributed.device_mesh import init_device_mesh

            ctx.mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
        return ctx

    def device(self, picked: torch.device) -> torch.device:
        """This rank's device: cuda:LOCAL_RANK when ``picked`` is CUDA, else ``picked``."""
        if picked.type == "cuda" and self.active:
            return torch.device("cuda", self.local_rank)
        return picked

    # collectives: identities in one process ---------------------------------------------------------
    def reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce ``t`` in place (op sum, max or min) over every rank and return it."""
        if self.active:
            tdist.all_reduce(t, op=_OPS[op])
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (e.g. a signal received by one process)."""
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device())
        return bool(self.reduce(t, "max").item() > 0)

    def agree(self, error: BaseException | None, what: str = "failed to start") -> None:
        """A step every rank takes together: when some rank failed (``error``), the others stop too, with
        one line naming the ranks that say what went wrong. The ranks compare their errors here: one that
        rank 0 raised too (the same type and message: a --resume with nothing to resume, a missing corpus, a
        full disk every rank writes to) is marked for rank 0 alone to print (``qklab.errors.alike``); a rank's
        own error (its disk, its file) is not, and that rank prints it."""
        if not self.active:
            return
        said: list[str | None] = [None] * self.world
        tdist.all_gather_object(said, None if error is None else _identity(error))
        failed = [r for r, x in enumerate(said) if x is not None]
        if not failed:
            return
        if error is None:  # this rank stops because another failed: rank 0 names it
            ranks = ", ".join(map(str, failed))
            raise alike(ConfigError(f"another process of this run {what} (rank {ranks}); its line says why, "
                                    f"marked (rank {failed[0]}), or the launcher's log of that rank"), RANK_0_SAYS)
        if self.rank != 0 and said[self.rank] == said[0]:
            alike(error, RANK_0_SAYS)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a small picklable value, e.g. a folder name)."""
        if not self.active:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def _comm_device(self) -> torch.device:
        nccl = tdist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def close(self) -> None:
        if self.owns_group and tdist.is_initialized():
            tdist.destroy_process_group()
            self.owns_group = False
