"""Why CPU training flushes subnormal floats to zero: backward passes after a logit blow-up.

When logits spread widely (attention logits in the thousands are what the logit-control studies see
without intervention), many softmax probabilities fall below 1.2e-38 (subnormal), and so do the
gradients built from them. CPU sgemm kernels slow down by orders of magnitude on subnormal inputs
(a study cell at eta 1 ran at 600 tokens/s against 5400 at healthy rates). The trainer sets
``torch.set_flush_denormal(True)`` on CPU, so such values read as zero. This times, with flushing off
and on, interleaved, at a healthy spread and blown-up ones, at the CPU study shape:
- attention: causal SDPA forward and backward, (B, H, T, D) = (8, 2, 256, 64), logits ~ N(0, std^2);
- lm_head: ``cross_entropy(h @ W.T)`` forward and backward, 2048 tokens, width 128, 4096 words.

    python benchmarks/denormal.py [--rounds 5] [--threads 1]

Prints JSON: per case and spread, the share of subnormal entries in the attention probabilities
(attention) or in the gradient of the logits (lm_head) with flushing off, the median seconds off and
on, and the paired ratio off / on (median and quartiles over rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from _timing import interleaved, paired_ratio

from qklab.model.loss import cross_entropy

TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, 1.18e-38


def _subnormal(x: torch.Tensor) -> float:
    return round(((x.abs() < TINY) & (x != 0)).float().mean().item(), 4)


def lm_head(spread: float, n: int = 2048, d: int = 128, vocab: int = 4096):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g)
    w = (torch.randn(vocab, d, generator=g) * spread / d**0.5).requires_grad_()  # logits ~ N(0, spread^2)
    t = torch.randint(0, vocab, (n,), generator=g)
    seen = {}

    def step() -> None:
        w.grad = None
        z = h @ w.T  # (N, V)
        z.register_hook(lambda gz: seen.__setitem__("share", _subnormal(gz)))
        cross_entropy(z, t).backward()
    return step, seen


def attention(spread: float, b: int = 8, heads: int = 2, t: int = 256, d: int = 64):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(b, heads, t, d, generator=g) * spread).requires_grad_()  # q.k / sqrt(d) ~ N(0, spread^2)
    k, v = (torch.randn(b, heads, t, d, generator=g).requires_grad_() for _ in range(2))
    with torch.no_grad():  # the attention probabilities the kernels compute with
        z = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        seen = {"share": _subnormal(z.softmax(-1))}  # (B, H, T, T)

    def step() -> None:
        for x in (q, k, v):
            x.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()  # (B, H, T, D)
    return step, seen


def case(name: str, spread: float, rounds: int) -> dict:
    step, seen = {"attention": attention, "lm_head": lm_head}[name](spread)

    def run(flush: bool):
        def f() -> None:
            torch.set_flush_denormal(flush)
            step()
        return f
    run(False)()
    share = seen["share"]
    times = interleaved({"off": run(False), "on": run(True)}, rounds, 1, torch.device("cpu"))
    torch.set_flush_denormal(False)
    return {"case": name, "logit_std": spread, "subnormal_share": share,
            "off_s": round(statistics.median(times["off"]), 5), "on_s": round(statistics.median(times["on"]), 5),
            "off_over_on": paired_ratio(times["off"], times["on"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"benchmark": "denormal", "threads": args.threads,
           "cases": [case("attention", s, args.rounds) for s in (1.0, 30.0, 100.0)]
           + [case("lm_head", s, args.rounds) for s in (3.0, 40.0)]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
