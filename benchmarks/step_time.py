"""Train-step time of several qklab variants of one preset, measured in one run, interleaved.

Each variant is a full ``Trainer`` (data loading, forward, backward, clipping, the QK controller and
the optimizer step), so a method's whole cost is counted. The first variant is the baseline.

    python benchmarks/step_time.py --config small --variant none: --variant "qkmap:qk.method=qkmap"
    python benchmarks/step_time.py --config small --suite controllers   # the optimizer-side entries below

``--suite`` names a list of variants (and the ``--set`` they share) kept here, so that a committed table can
be rerun as it was: ``controllers`` is Muon with each optimizer-side controller against Muon alone, Compositional
Muon in both forms (the exact one orthogonalises W_Q, W_K per head, so ``muon-per-head-qk`` is its cost
without the whitening). Further ``--variant`` entries are appended.

Prints JSON: median seconds per step of each variant and its ratio to the baseline, the median of
per-round ratios (``_timing.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from _timing import interleaved, paired_ratio

from qklab.cli.sweep import parse_variant
from qklab.config import load_config
from qklab.data import prepare_data
from qklab.train.trainer import Trainer

EXACT = "qk.controller=compositional,qk.compositional.form=exact,qk.compositional.decay=base,train.muon_per_head=qk"
SUITES: dict[str, tuple[list[str], list[str]]] = {  # name -> (--set, --variant entries; the first the baseline)
    "controllers": (["train.optimizer=muon"], [
        "none:", "quack:qk.controller=quack", "compositional:qk.controller=compositional",
        f"compositional-exact:{EXACT}",
        "muon-per-head-qk:train.muon_per_head=qk", "muon-per-head-qkv:train.muon_per_head=qkv"]),
    # the 2026 optimizer-side baselines beside their parents (small: 6 heads): Group Muon at g = 2 and 3 against
    # packed and per-head Muon; the upper-layer Q/K slowdown (held on for the whole run) against the fixed
    # multiplier, which rescales every layer's Q/K change the same way
    "baselines2026": (["train.optimizer=muon"], [
        "none:", "muon-per-head-qk:train.muon_per_head=qk",
        "group-muon-g2:train.muon_per_head=qk,train.muon_head_groups=2",
        "group-muon-g3:train.muon_per_head=qk,train.muon_head_groups=3",
        "qk-lr-multiplier:qk.controller=qk_lr_multiplier",
        "upper-qk-slowdown:qk.controller=upper_qk_slowdown,qk.upper_qk_slowdown.steps=1000000",
        # QK-Guard dormant (its max-logit watch only) and switched (every head from the first step: a QK-Norm's cost)
        "qkguard-dormant:qk.method=qkguard", "qkguard-switched:qk.method=qkguard,qk.qkguard.threshold=1e-9"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V,K=V")
    ap.add_argument("--suite", choices=sorted(SUITES), help="a named list of variants (and shared --set)")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.suite:
        sets, entries = SUITES[args.suite]
        args.set, args.variant = [*sets, *args.set], [*entries, *args.variant]
    if not args.variant:
        ap.error("give --variant (one or more) or --suite")
    variants = [parse_variant(v) for v in args.variant]
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = {
            v.label: load_config(
                args.config,
                [
                    *args.set,
                    *v.overrides,
                    f"train.out_dir='{tmp}'",
                    f"train.name={v.label}",
                    "train.progress=false",
                    "train.steps=100000",
                ],
            )
            for v in variants
        }
        data = prepare_data(next(iter(cfgs.values())).data, log=lambda s: None)
        trainers = {k: Trainer(c, data=data, log=lambda s: None) for k, c in cfgs.items()}
        for t in trainers.values():
            for _ in range(args.warmup):
                t.train_step()
        device = next(iter(trainers.values())).device
        times = interleaved({k: t.train_step for k, t in trainers.items()}, args.rounds, args.steps, device)
        for t in trainers.values():
            t.metrics.close()
    base = variants[0].label
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "config": args.config,
                "overrides": args.set,
                "threads": torch.get_num_threads(),
                "variants": {v.label: v.overrides for v in variants},
                "step_s": {k: round(v, 5) for k, v in med.items()},
                # paired: the median over rounds of t_variant / t_base within the round (see _timing.py)
                "ratio_to_" + base: {k: paired_ratio(times[k], times[base]) for k in med},
                "ratio_of_medians": {k: round(v / med[base], 4) for k, v in med.items()},
                "rounds": args.rounds,
                "steps_per_round": args.steps,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
