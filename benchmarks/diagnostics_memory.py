"""Peak memory of the attention diagnostics against a plain forward pass, as the context length grows.

Each measurement runs in a fresh process on a model of the preset's shape (random weights, random
tokens; memory does not depend on the values), in fp32 and eval mode without gradients:

* ``forward``: one plain forward pass on (B, T) tokens (the baseline);
* ``monitor``: two evaluations of the training diagnostics (``AttentionMonitor.measure``; the second one
  also computes the logit change against the q and k the first one kept), peak over both, held
  reference included;
* ``magnitude``: magnitude sensitivity at the five scales;
* ``retrieval``: the retrieval test at N = T (B contexts per forward);
* ``eager_capture`` (up to ``--eager-max``): every layer's full (B, H, T, T) logits and probabilities
  kept, as the capture dicts hold them; the cost the chunked measurements avoid.

Peak = the process's peak memory during the step minus its memory just before (CPU: the resident-set
high-water mark, reset through /proc/self/clear_refs, with glibc set to return freed memory at once;
CUDA: ``torch.cuda.max_memory_allocated``).

    python benchmarks/diagnostics_memory.py --config small --lengths 256,512,1024,2048 [--device cuda]

Prints JSON: per T, each variant's peak in MB and its ratio to the forward pass of the same T.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = ("forward", "monitor", "magnitude", "retrieval", "eager_capture")
# glibc: a fixed mmap threshold and immediate trimming, so that freed tensors leave the resident set and
# the high-water mark follows the live memory rather than the allocator's caching
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(config: str, variant: str, T: int, batch: int, device: str) -> float:
    """Peak extra memory (MB) of one variant; runs in its own process."""
    import numpy as np
    import torch

    from qklab.config import load_config
    from qklab.diagnostics import AttentionMonitor, capturing, magnitude_sensitivity, retrieval_test
    from qklab.model import GPT

    torch.manual_seed(0)
    cfg = load_config(config, [f"model.max_seq_len={max(T, 64)}"])
    cfg.model.vocab_size = cfg.model.vocab_size or cfg.data.vocab_size
    dev = torch.device(device)
    model = GPT(cfg.model, cfg.qk).to(dev).eval()
    x = torch.randint(0, cfg.model.vocab_size, (batch, T), device=dev)
    text = np.random.default_rng(0).integers(0, cfg.model.vocab_size // 2, 4 * T)
    pool = np.arange(cfg.model.vocab_size // 2, cfg.model.vocab_size)
    with torch.no_grad():
        model(x[:, :64])  # load kernels and allocate what every call needs, outside the measurement
    ops = {
        "forward": lambda: torch.no_grad()(model)(x),
        "monitor": lambda: [m.measure(model, s) for m in [AttentionMonitor(x.cpu())] for s in (0, 1)],
        "magnitude": lambda: magnitude_sensitivity(model, x),
        "retrieval": lambda: retrieval_test(model, text, pool, [T], T, depths=(0.5,), n_samples=batch, batch=batch),
        "eager_capture": lambda: _eager(model, x, capturing),
    }
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        keep = ops[variant]()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _rss_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        keep = ops[variant]()
        peak = _rss_kb("VmHWM") * 1024 - before
    del keep
    return peak / 2**20


def _eager(model, x, capturing):
    import torch

    with torch.no_grad(), capturing(model) as caps:
        model(x)
    return caps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--batch", type=int, default=4, help="sequences per forward (train.diag_batch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eager-max", type=int, default=1024, help="longest T for the full-capture reference")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(worker(args.config, args.worker[0], int(args.worker[1]), args.batch, args.device))
        return
    rows = []
    for T in (int(t) for t in args.lengths.split(",")):
        row: dict[str, object] = {"T": T}
        for v in VARIANTS:
            if v == "eager_capture" and T > args.eager_max:
                continue
            cmd = [sys.executable, __file__, "--config", args.config, "--batch", str(args.batch), "--device",
                   args.device, "--worker", v, str(T)]
            env = {**os.environ, **MALLOC_ENV}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            row[v + "_mb"] = round(float(out.strip().splitlines()[-1]), 1)
        for v in VARIANTS[1:]:
            if v + "_mb" in row:
                row[v + "_ratio"] = round(row[v + "_mb"] / row["forward_mb"], 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"config": args.config, "batch": args.batch, "device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
