"""Model FLOP utilisation of the train step against this machine's measured matmul peak, eager and
compiled (``train.compile=true``), in one run.

    python benchmarks/mfu.py --config small                                   # CPU, fp32
    python benchmarks/mfu.py --config gpt124m --device cuda --dtype bf16      # GPU

The peak is the best of several square matmuls (``--peak-n``) in the run's dtype, on the same threads. Model FLOPs per
step follow the usual count: 6 x (parameters in matrix multiplies, the output head included) x tokens
for forward and backward, plus 12 x layers x T x (attention width) x tokens for the q.k and
attention-times-value products (full T x T, as usually counted). Step times interleave the variants
(``_timing.py``). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from _timing import interleaved, paired_ratio, sync
from torch import nn

from qklab.config import load_config
from qklab.data import prepare_data
from qklab.methods.base import AttnShape
from qklab.train.trainer import Trainer


def matmul_peak(n: int, device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """Best FLOP/s of an (n, n) @ (n, n) matmul on ``device`` in ``dtype``."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def step_flops(model: nn.Module, cfg, tokens: int) -> float:
    mm = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    shape = AttnShape.of(cfg.model)  # per-head q.k width (MLA: nope + rope)
    attn = cfg.model.n_layers * shape.n_heads * shape.head_dim
    return tokens * (6 * mm + 12 * cfg.train.seq_len * attn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="train.dtype, and the peak's dtype")
    args = ap.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        common = [*args.set, f"train.out_dir='{tmp}'", "train.progress=false", "train.steps=100000",
                  "train.diag_every=0", f"train.device={args.device}", f"train.dtype={args.dtype}"]
        cfgs = {k: load_config(args.config, [*common, f"train.name={k}", f"train.compile={c}"])
                for k, c in (("eager", "false"), ("compiled", "true"))}
        data = prepare_data(cfgs["eager"].data, log=lambda s: None)
        trainers = {k: Trainer(c, data=data, log=lambda s: None) for k, c in cfgs.items()}
        for t in trainers.values():
            for _ in range(args.warmup):
                t.train_step()
        times = interleaved({k: t.train_step for k, t in trainers.items()}, args.rounds, 1, device)
        for t in trainers.values():
            t.close()
    peak = matmul_peak(args.peak_n, device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    t = cfgs["eager"].train
    flops = step_flops(trainers["eager"].model, cfgs["eager"], t.batch_size * t.seq_len * t.grad_accum)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "config": args.config, "overrides": args.set, "threads": torch.get_num_threads(),
        "device": args.device, "dtype": args.dtype, "matmul_peak_gflops": round(peak / 1e9, 2),
        "step_gflop": round(flops / 1e9, 3),
        "step_s": {k: round(v, 5) for k, v in med.items()},
        "achieved_gflops": {k: round(flops / v / 1e9, 2) for k, v in med.items()},
        "mfu": {k: round(flops / v / peak, 4) for k, v in med.items()},
        "compiled_over_eager_time": paired_ratio(times["compiled"], times["eager"]),
        "rounds": args.rounds,
    }, indent=2))


if __name__ == "__main__":
    main()
