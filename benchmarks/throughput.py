"""Train-step throughput and peak memory of a qklab GPT against a plain-PyTorch reference loop.

The reference is a self-contained GPT of identical shape (pre-norm RMSNorm, RoPE, SDPA attention,
SwiGLU, tied head) trained with the same optimizer; it shares no code with qklab's model. Both are
timed in the same process, interleaved step by step; the ratio is the median of per-round ratios
(``_timing.py``), so machine drift cancels. The reference uses ``torch.optim.AdamW`` with its defaults,
as a plain loop would; qklab uses the fused kernel, which computes the same update. Peak memory
is the CUDA allocator's peak on GPU, and on CPU the peak RSS of a fresh subprocess per model.

    python benchmarks/throughput.py --config small [--set qk.method=qknorm] [--steps 10 --rounds 5]
    python benchmarks/throughput.py --config small --compile   # + qklab under torch.compile, same run

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from _timing import interleaved, paired_ratio, sync
from torch import nn

from qklab.config import load_config
from qklab.model import GPT
from qklab.train.optim import build_optimizer


class RefBlock(nn.Module):
    def __init__(self, d: int, h: int, ff: int, eps: float) -> None:
        super().__init__()
        self.h = h
        self.n1, self.n2 = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        a = self.n1(x)
        q, k, v = (p(a).view(B, T, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))

        def rot(t):
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        b = self.n2(x)
        return x + self.down(F.silu(self.gate(b)) * self.up(b))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, h: int, ff: int, T: int, theta: float, eps: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(RefBlock(d, h, ff, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=eps)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, 0, 0.02)
        hd = d // h
        f = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(T).float(), f)
        self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        T = idx.shape[1]
        for b in self.blocks:
            x = b(x, self.cos[:T], self.sin[:T])
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(kind: str, cfg, device):
    m = cfg.model
    if kind == "qklab":
        model = GPT(m, cfg.qk).to(device)
    else:
        model = RefGPT(
            m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.ff_dim, cfg.train.seq_len, m.rope_theta, m.norm_eps
        ).to(device)
    # same optimizer recipe for both: qklab's param grouping logic applied by name pattern
    if kind == "ref" and cfg.train.optimizer == "muon":
        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
        rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
        opts = [
            torch.optim.Muon(hidden, lr=cfg.train.lr, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=cfg.train.lr, betas=(0.9, 0.95)),
        ]
    elif kind == "ref":
        opts = [torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1)]
    else:
        opts = build_optimizer(model, cfg.train)
    return model, opts


def step(model, opts, x, y, clip):
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    return loss


def peak_memory_mb(kind: str, args) -> float:
    """Peak memory of ``steps`` train steps of one model, measured in isolation."""
    if torch.cuda.is_available():
        cfg, device = _cfg(args), torch.device("cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model, opts = build(kind, cfg, device)
        x, y = _batch(cfg, device)
        for _ in range(3):
            step(model, opts, x, y, 1.0)
        sync(device)
        peak = torch.cuda.max_memory_allocated() / 2**20
        del model, opts
        return peak
    sets = [a for s in args.set for a in ("--set", s)]
    cmd = [sys.executable, __file__, "--config", args.config, "--memory-of", kind, *sets]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _cfg(args):
    cfg = load_config(args.config, args.set)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = args.vocab
    return cfg


def _batch(cfg, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len), generator=g)
    return x.to(device), y.to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--vocab", type=int, default=4096, help="vocab size when the config takes it from the data")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per model per round")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time qklab's model under torch.compile (as "
                    "train.compile=true does), against the same eager reference")
    ap.add_argument("--memory-of", choices=["qklab", "ref"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg = _cfg(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.memory_of:  # subprocess mode: peak RSS (MiB) after a few steps of one model
        model, opts = build(args.memory_of, cfg, device)
        x, y = _batch(cfg, device)
        for _ in range(3):
            step(model, opts, x, y, 1.0)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return

    torch.manual_seed(0)
    models = {k: build(k, cfg, device) for k in ("qklab", "ref")}
    if args.compile:  # a second qklab model with the same weights, its forward and backward compiled
        model, _ = build("qklab", cfg, device)
        model.load_state_dict(models["qklab"][0].state_dict())
        models["qklab_compiled"] = (torch.compile(model), build_optimizer(model, cfg.train))
    x, y = _batch(cfg, device)
    for model, opts in models.values():
        for _ in range(args.warmup):
            step(model, opts, x, y, 1.0)
    fns = {k: (lambda m=m, o=o: step(m, o, x, y, 1.0)) for k, (m, o) in models.items()}
    times = interleaved(fns, args.rounds, args.steps, device)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    mem = {k: peak_memory_mb(k, args) for k in ("qklab", "ref")}
    out = {
        "config": args.config,
        "overrides": args.set,
        "method": cfg.qk.method,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "batch": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len,
        "optimizer": cfg.train.optimizer,
        "params": sum(p.numel() for p in models["qklab"][0].parameters()),
        "step_s": {k: round(v, 5) for k, v in med.items()},
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in med.items()},
        # paired: the median over rounds of t_ref / t_qklab within the round (see _timing.py)
        "throughput_ratio_qklab_over_ref": paired_ratio(times["ref"], times["qklab"]),
        "ratio_of_medians": round(med["ref"] / med["qklab"], 4),
        "peak_memory_mb": {k: round(v, 1) for k, v in mem.items()},
        "memory_ratio_qklab_over_ref": round(mem["qklab"] / mem["ref"], 4),
        **({"throughput_ratio_compiled_qklab_over_ref": paired_ratio(times["ref"], times["qklab_compiled"]),
            "throughput_ratio_compiled_over_eager_qklab": paired_ratio(times["qklab"], times["qklab_compiled"])}
           if args.compile else {}),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
    }
    assert math.isfinite(out["throughput_ratio_qklab_over_ref"]["median"])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
