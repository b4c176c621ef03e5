"""Data-parallel scaling on CPU: training throughput of 1 process against 2 (gloo), in one run.

    python benchmarks/scaling.py --config small --parallel ddp

Weak scaling: every process trains at the config's per-rank batch with ``--threads`` threads, so 2
processes train on twice the global batch; ideal throughput is 2x. Each process count is timed over
``--steps`` steps after ``--warmup``; the two are measured back to back in the same run, twice in the
order 1, 2, 2, 1, and the throughput of each count is the better of its two. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from qklab.config import load_config
from qklab.train.trainer import Trainer


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str, tag: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    parallel = args.parallel if world > 1 else "none"
    if world == 1:
        os.environ["WORLD_SIZE"] = "1"
    cfg = load_config(args.config, [*args.set, f"train.out_dir='{out}'", f"train.name={tag}-{world}",
                                    "train.progress=false", "train.steps=100000", "train.diag_every=0",
                                    f"train.parallel={parallel}", f"train.threads={args.threads}"])
    t = Trainer(cfg, log=lambda s: None)
    for _ in range(args.warmup):
        t.train_step()
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        t.train_step()
    tdist.barrier()
    dt = time.perf_counter() - t0
    t.close()
    tdist.destroy_process_group()
    if rank == 0:
        tokens = cfg.train.batch_size * world * cfg.train.seq_len * cfg.train.grad_accum * args.steps
        result = {"tokens_per_s": tokens / dt, "step_s": dt / args.steps}
        Path(out, f"{tag}-{world}.json").write_text(json.dumps(result))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, world in enumerate((1, 2, 2, 1)):
            mp.spawn(_worker, args=(world, _port(), args, tmp, f"r{i}"), nprocs=world, join=True)
            runs[world].append(json.loads(Path(tmp, f"r{i}-{world}.json").read_text()))
    best = {w: max(r["tokens_per_s"] for r in rs) for w, rs in runs.items()}
    print(json.dumps({
        "config": args.config, "overrides": args.set, "parallel": args.parallel, "threads_per_process": args.threads,
        "cpus": os.cpu_count(), "tokens_per_s": {str(w): round(v, 1) for w, v in best.items()},
        "speedup_2_over_1": round(best[2] / best[1], 3), "efficiency": round(best[2] / best[1] / 2, 3),
        "all_runs": {str(w): [round(r["tokens_per_s"], 1) for r in rs] for w, rs in runs.items()},
        "steps": args.steps,
    }, indent=2))


if __name__ == "__main__":
    main()
