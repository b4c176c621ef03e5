"""Two-process gloo runs on CPU for the data-parallel tests: spawn, run a list of training cases on
every rank, and compare with one process at the same global batch."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from qklab.config import load_config
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer

STEPS = 6
# per-rank batch 4 on 2 ranks = one process at batch 8 (the tiny preset's)
BASE = ["train.steps=6", "train.log_every=1", "train.eval_every=100", "train.diag_every=0", "train.ckpt_every=0",
        "train.progress=false", "train.warmup_steps=2", "train.threads=1", "model.n_layers=2",
        "qk.qkclip.tau_clip=2.0"]


def cfg(tmp: Path, name: str, extra: list[str], batch: int = 8):
    return load_config("tiny", [*BASE, f"train.out_dir='{tmp / 'runs'}'", f"data.cache_dir='{tmp / 'cache'}'",
                                f"train.name={name}", f"train.batch_size={batch}", *extra])


def losses(tmp: Path, name: str) -> list[float]:
    recs = read_metrics(tmp / "runs" / name / "metrics.jsonl")
    return [r["loss"] for r in recs if "loss" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tmp: str, jobs: list) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    try:
        for job in jobs:
            job(Path(tmp), rank)
    finally:
        tdist.destroy_process_group()
    # Leave without finalizing the interpreter. A device mesh (FSDP2, sharded Muon) keeps the gloo group
    # alive past destroy_process_group, and its worker thread can still be dropping the last collective's
    # work (which holds tensors) when the process exits at once: that thread then takes the GIL during
    # finalization and the process aborts (SIGABRT, "terminate called without an active exception", about
    # 1 run in 20 of the sharded Muon job). Everything a job writes is saved and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(tmp: Path, jobs: list, world: int = 2) -> None:
    """Run each ``job(tmp, rank)`` (picklable callables) in order on ``world`` gloo processes."""
    mp.spawn(_worker, args=(world, free_port(), str(tmp), jobs), nprocs=world, join=True)


class TrainJob:
    """Train one case on every rank; each rank saves its final weights to <tmp>/<name>-rank<r>.pt."""

    def __init__(self, name: str, extra: list[str], batch: int = 4, resume: bool = False) -> None:
        self.name, self.extra, self.batch, self.resume = name, extra, batch, resume

    def __call__(self, tmp: Path, rank: int) -> None:
        t = Trainer(cfg(tmp, self.name, self.extra, self.batch), resume=self.resume, log=lambda s: None)
        t.run()
        if t.parallel.sharded:  # the full weights, gathered (rank 0 gets them)
            from qklab.parallel import full_state

            weights = full_state(t.model, [])[0]
            if rank == 0:
                torch.save(weights, tmp / f"{self.name}-rank0.pt")
            whole = {n: p.detach() for n, p in t.model.named_parameters() if not hasattr(p, "to_local")}
            torch.save(whole, tmp / f"{self.name}-whole-rank{rank}.pt")  # kept whole on every rank
            return
        torch.save(t.model.state_dict(), tmp / f"{self.name}-rank{rank}.pt")


def single(tmp: Path, name: str, extra: list[str], batch: int = 8, resume: bool = False) -> dict:
    """One process (train.parallel=none) at the given batch; returns its final weights."""
    t = Trainer(cfg(tmp, name, extra, batch), resume=resume, log=lambda s: None)
    t.run()
    return t.model.state_dict()


# N ranks reduce the loss and the gradients in another order than one process: fp32 rounding noise of
# ~1e-7 at step 1 that training amplifies (up to 1.2e-5 relative by step 5 on torch 2.11, less on 2.13).
# A missed gradient sync, a wrong scale or another data order moves a curve by more than 1e-3.
CURVE_RTOL = 5e-5


def assert_close_curves(a: list[float], b: list[float], rtol: float = CURVE_RTOL) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rtol * abs(x), f"step {i + 1}: {x} vs {y}"


class CopyRun:
    """Rank 0 copies run folder ``src`` to ``dst`` (a second run to resume elsewhere); all ranks wait."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst

    def __call__(self, tmp: Path, rank: int) -> None:
        import shutil

        if rank == 0:
            shutil.copytree(tmp / "runs" / self.src, tmp / "runs" / self.dst, ignore=shutil.ignore_patterns(".lock"))
        tdist.barrier()


def run_cases(tmp: Path, cases: dict[str, list[str]], parallel: str) -> dict[str, dict]:
    """Each case in one process at batch 8 (its final weights returned) and on 2 ranks at batch 4."""
    refs = {name: single(tmp, f"{name}-one", extra) for name, extra in cases.items()}
    spawn(tmp, [TrainJob(f"{name}-{parallel}", [*extra, f"train.parallel={parallel}"])
                for name, extra in cases.items()])
    return refs


def check_against_one(tmp: Path, refs: dict[str, dict], name: str, parallel: str) -> None:
    """The 2-rank run's loss curve equals one process's to CURVE_RTOL, and so do its final weights
    (rank 0's, gathered under FSDP). torch's Muon orthogonalises in bf16 (torch/optim/_muon.py), which
    turns fp32 rounding differences of the reduced gradient into bf16 ones in its weights: looser there."""
    assert_close_curves(losses(tmp, f"{name}-one"), losses(tmp, f"{name}-{parallel}"))
    saved = torch.load(tmp / f"{name}-{parallel}-rank0.pt")
    assert saved.keys() == refs[name].keys()
    atol = 2e-3 if "muon" in name else 1e-4  # 1e-4: one element in 4096 off by 6e-5, compiled, torch 2.11
    for k, w in saved.items():
        torch.testing.assert_close(w, refs[name][k], rtol=1e-4, atol=atol,
                                   msg=lambda m, k=k: f"{k} vs one process: {m}")


def assert_ranks_equal(tmp: Path, run: str, mode: str) -> None:
    """What both ranks hold whole is equal on both: every tensor under DDP; under FSDP2 the vectors and the
    QK methods' parameters (QK-MAP's temperature, which QK-clip scales)."""
    suffix = "" if mode == "ddp" else "-whole"
    w0 = torch.load(tmp / f"{run}{suffix}-rank0.pt")
    w1 = torch.load(tmp / f"{run}{suffix}-rank1.pt")
    assert w0 and w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), f"{k} differs between ranks"


def muon_grads(rows: int, step: int) -> torch.Tensor:
    """The planted gradient of an (rows, 8) matrix at ``step``."""
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(100 * rows + step))


def head_muon(params: list, rows: int, cls: type | None = None) -> torch.optim.Optimizer:
    """HeadMuon (or ``cls``) with head blocks of ``rows`` rows (0: the whole matrix one block)."""
    from qklab.parallel.muon import HeadMuon

    return (cls or HeadMuon)([{"params": params, "head_rows": [rows]}], lr=0.02, weight_decay=0.1, momentum=0.95,
                             adjust_lr_fn="match_rms_adamw")


def muon_steps(shapes, hook=None, mesh=None) -> dict[tuple[int, int], torch.Tensor]:
    """Two Muon steps on each (rows, rows per head) matrix of ``shapes`` (seeded by its rows), with
    ``hook(rows, rows_per_head)`` as its preconditioner when given: in one process (``mesh`` None, HeadMuon),
    or sharded by rows over ``mesh`` (ShardedMuon on FSDP2-style DTensors). The full results by shape."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from qklab.parallel.muon import ShardedMuon

    out = {}
    for n, rows in shapes:
        full = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        shard = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if mesh is not None else (lambda t: t)
        p = torch.nn.Parameter(shard(full.clone()))
        opt = head_muon([p], rows, ShardedMuon if mesh is not None else None)
        if hook is not None:
            opt.set_preconditioner(p, hook(n, rows))
        for step in range(2):
            p.grad = shard(muon_grads(n, step))
            opt.step()
        out[(n, rows)] = p.full_tensor() if mesh is not None else p.detach()
    return out


class ShardedMuonJob:
    """On 2 gloo ranks: ``muon_steps`` sharded by rows; rank 0 saves the results to ``tmp / name``."""

    def __init__(self, shapes, name: str, hook=None) -> None:
        self.shapes, self.name, self.hook = shapes, name, hook

    def __call__(self, tmp: Path, rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        out = muon_steps(self.shapes, self.hook, init_device_mesh("cpu", (2,)))
        if rank == 0:
            torch.save(out, tmp / self.name)
