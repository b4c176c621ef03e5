"""Overhead of the in-training attention diagnostics at their cadence, measured in one run, interleaved.

One ``Trainer`` of the preset alternates blocks of ``diag_every`` optimizer steps: an "off" block is
plain training; an "on" block is the same training plus one diagnostics evaluation, exactly what the
trainer runs every ``train.diag_every`` steps (``trainer.monitor.measure``). Off and on blocks alternate,
so machine noise hits both alike.

    python benchmarks/diagnostics_overhead.py --config small [--rounds 2] [--set train.diag_every=50]

Prints JSON: mean seconds per step off and on (the evaluation amortised over its block), their ratio,
the median time of one evaluation, and the ratio estimated from medians (1 + eval / (N * step)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from qklab.config import load_config
from qklab.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--rounds", type=int, default=2, help="off/on block pairs")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base = load_config(args.config, args.set)
        every = base.train.diag_every or 50
        steps = args.warmup + 2 * args.rounds * every + 1
        cfg = load_config(args.config, [*args.set, f"train.out_dir='{tmp}'", "train.name=bench",
                                        f"train.steps={steps}", f"train.diag_every={every}", "train.progress=false"])
        t = Trainer(cfg, log=lambda s: None)
        for _ in range(args.warmup):
            t.spikes.update(t.train_step()[0])
        t.monitor.measure(t.model, t.step)  # first evaluation: allocations, and the reference logits

        step_s: dict[str, list[float]] = {"off": [], "on": []}
        block_s: dict[str, list[float]] = {"off": [], "on": []}
        diag_s: list[float] = []
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                b0 = time.perf_counter()
                for _ in range(every):
                    s0 = time.perf_counter()
                    t.spikes.update(t.train_step()[0])
                    step_s[mode].append(time.perf_counter() - s0)
                if mode == "on":
                    d0 = time.perf_counter()
                    t.monitor.measure(t.model, t.step)
                    diag_s.append(time.perf_counter() - d0)
                block_s[mode].append(time.perf_counter() - b0)
        t.metrics.close()

    off = sum(block_s["off"]) / (every * args.rounds)
    on = sum(block_s["on"]) / (every * args.rounds)
    med_step, med_diag = statistics.median(step_s["off"] + step_s["on"]), statistics.median(diag_s)
    m = cfg.model
    print(json.dumps({
        "config": args.config, "shape": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
                                         "batch": cfg.train.batch_size, "seq_len": cfg.train.seq_len},
        "diag_every": every, "diag_batch": cfg.train.diag_batch, "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "step_s_off": off, "step_s_on": on, "ratio": on / off,
        "diag_eval_s": med_diag, "median_step_s": med_step,
        "ratio_from_medians": 1.0 + med_diag / (every * med_step),
    }, indent=2))


if __name__ == "__main__":
    main()
