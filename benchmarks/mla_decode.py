"""MLA decoding: cache bytes per token (MHA, GQA, MLA) and decode tokens/s of the absorbed latent path
against the materialised paths, at the `small` shape.

Paths timed, all on the same `small_mla` model, greedy one-token steps after a prefill of ``context``
tokens, at batch 1 (where per-token fixed costs, the MLP, head and Python dispatch, weigh most) and at a
larger batch (where reading the cache dominates):
* absorbed: latent cache (kv_rank + rope values per token), W_uk folded into the query, W_uv into the
  output; every head attends to the one shared latent key.
* recompute (the like-for-like baseline): the same latent cache, decoded on the materialised path, so
  each step expands the whole cached latent into per-head k and v (what ``transformers``'
  DeepseekV3Attention does; eager kernel). Same cache memory as absorbed; the two differ only in how
  they compute, which is the comparison the absorbed path exists for. Its extra work per step is
  O(context * kv_rank * H * (nope + v)).
* per_head: per-head k, v cached as in MHA, H * (nope + rope + v) values per token (6x the latent
  cache here); each step only attends. A different memory budget, reported because it is the fastest
  non-absorbed decode. Timed with both attention kernels (SDPA and eager; on CPU eager is faster for
  one-query steps); the ratio is taken against the faster.

Per cached position and head, absorbed attention does kv_rank + rope + kv_rank multiply-adds on
kv_rank + rope cached values shared by all heads; per-head attention does nope + rope + v on its own
values. So absorbed trades compute (1.8x here, with 6 heads) for memory traffic (1/6): it wins where
decoding is memory-bound (large batch or context on a GPU); on a contended CPU core it ties (docs/mla.md).

The paths are interleaved round by round (order rotated), so machine noise hits them alike. Rates are
the median over rounds; the speed-ups are paired: the median over rounds of the per-round ratio, with
its quartiles (``_timing.paired_ratio``), so that drift between rounds cancels. ``--chunks`` times steps
of several tokens too (2-8: the chunks speculative decoding verifies; "auto" decodes them absorbed).
``model.max_seq_len`` is raised to fit the longest context.

    python benchmarks/mla_decode.py [--contexts 512,2048,8192 --batches 1,8 --chunks 1,4 --tokens 16 \
        --rounds 5 --device cpu|cuda --dtype fp32|bf16]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _timing import paired_ratio, sync

from qklab.config import load_config
from qklab.model import GPT, KVCache, LatentCache


def cache_bytes_per_token(caches: list, max_len: int) -> int:
    """Bytes per token over all layers of ``caches`` made for max_len tokens (after a prefill, so that
    lazily allocated parts exist)."""
    total = 0
    for c in caches:
        if isinstance(c, LatentCache):
            total += c.kv.numel() * c.kv.element_size()
            total += 0 if c.kscale is None else c.kscale.numel() * c.kscale.element_size()
        else:
            total += c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
    return total // max_len


def build(preset: str, max_len: int, extra: list[str] | None = None, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> GPT:
    cfg = load_config(preset, [f"model.max_seq_len={max_len}", "model.vocab_size=4096", *(extra or [])])
    torch.manual_seed(0)
    return GPT(cfg.model, cfg.qk).eval().to(device=device, dtype=dtype)


def cache_table(max_len: int) -> dict:
    out = {}
    specs = {"mha": ("small", [], None), "gqa_kv2": ("small", ["model.n_kv_heads=2"], None),
             "mla_latent": ("small_mla", [], True), "mla_per_head": ("small_mla", [], False)}
    for name, (preset, extra, latent) in specs.items():
        model = build(preset, max_len, extra)
        L = 64
        caches = model.make_caches(1, L) if latent is None else model.make_caches(1, L, latent=latent)
        with torch.no_grad():
            model(torch.randint(0, 4096, (1, 8)), caches=caches)
        per_model = cache_bytes_per_token(caches, L)
        out[name] = {"bytes_per_token_per_layer": per_model // len(caches), "bytes_per_token_model": per_model}
    return out


def set_length(caches: list, n: int) -> None:
    for c in caches:
        c.length = n


PATHS = {  # name: (cache kind, MLAttention.latent_path, MLAttention.impl)
    "absorbed": ("latent", "absorbed", "auto"),
    "per_head_sdpa": ("per_head", "auto", "sdpa"),
    "per_head_eager": ("per_head", "auto", "eager"),
    "recompute": ("latent", "materialised", "eager"),
}


def widen(caches: list, batch: int) -> list:
    """Batch-1 caches -> the same contents repeated for ``batch`` sequences."""
    out = []
    for c in caches:
        if isinstance(c, LatentCache):
            ks = None if c.kscale is None else c.kscale.repeat(batch, 1, 1)
            out.append(LatentCache(c.kv.repeat(batch, 1, 1), ks, c.length))
        else:
            out.append(KVCache(c.k.repeat(batch, 1, 1, 1), c.v.repeat(batch, 1, 1, 1), c.length))
    return out


@torch.no_grad()
def decode_rate(model: GPT, caches: list, ctx: int, tokens: int, path: str, chunk: int = 1) -> float:
    """Tokens/s (all sequences) of ``tokens`` decode steps of ``chunk`` new tokens each, starting at
    context length ``ctx``."""
    _, latent_path, impl = PATHS[path]
    for b in model.blocks:
        b.attn.latent_path, b.attn.impl = latent_path, impl
    set_length(caches, ctx)
    batch = caches[0].kv.shape[0] if isinstance(caches[0], LatentCache) else caches[0].k.shape[0]
    device = model.tok_emb.weight.device
    tok = torch.randint(0, 4096, (batch, chunk), device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits, _ = model(tok, caches=caches)
        tok = logits.argmax(-1)  # (batch, chunk): the next chunk, as a verify step would take it
    sync(device)
    return batch * chunk * tokens / (time.perf_counter() - t0)


@torch.no_grad()
def decode_table(contexts: list[int], batches: list[int], chunks: list[int], tokens: int, rounds: int,
                 device: str, dtype: torch.dtype) -> list[dict]:
    room = tokens * max(chunks) + 1
    model = build("small_mla", max(contexts) + room, device=device, dtype=dtype)
    rows = []
    for ctx in contexts:
        prompt = torch.randint(0, 4096, (1, ctx), device=device)
        latent1 = model.make_caches(1, ctx + room, latent=True)
        per_head1 = model.make_caches(1, ctx + room, latent=False)
        model(prompt, caches=latent1)  # prefill (materialised from the latent)
        model(prompt, caches=per_head1)
        assert isinstance(latent1[0], LatentCache) and isinstance(per_head1[0], KVCache)
        for batch in batches:
            for chunk in chunks:
                timed = time_paths(model, widen(latent1, batch), widen(per_head1, batch), ctx, tokens, rounds, chunk)
                rows.append({"context": ctx, "batch": batch, "chunk": chunk, **timed})
    return rows


@torch.no_grad()
def time_paths(model: GPT, latent: list, per_head: list, ctx: int, tokens: int, rounds: int, chunk: int = 1) -> dict:
    """Median tokens/s of every path, interleaved round by round, and the absorbed path's paired
    speed-ups (median and quartiles of the per-round ratios; per-head: the faster kernel of the round)."""
    paths = {p: latent if kind == "latent" else per_head for p, (kind, _, _) in PATHS.items()}
    rates: dict[str, list[float]] = {p: [] for p in paths}
    for p, c in paths.items():  # warm-up
        decode_rate(model, c, ctx, 2, p, chunk)
    for r in range(rounds):
        order = list(paths)[r % len(paths) :] + list(paths)[: r % len(paths)]
        for p in order:
            rates[p].append(decode_rate(model, paths[p], ctx, tokens, p, chunk))
    per_head = [max(a, b) for a, b in zip(rates["per_head_sdpa"], rates["per_head_eager"], strict=True)]
    return {**{f"{p}_tok_s": round(statistics.median(v), 1) for p, v in rates.items()},
            "absorbed_over_recompute": paired_ratio(rates["absorbed"], rates["recompute"]),
            "absorbed_over_per_head": paired_ratio(rates["absorbed"], per_head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--batches", default="1,8", help="sequences decoded together")
    ap.add_argument("--chunks", default="1", help="new tokens per decode step (2-8: speculative verify chunks)")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps per timed run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto (cuda when present)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: for GPUs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit(f"qklab: error: --device {args.device}: use cpu, or cuda/auto on a machine with CUDA")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    contexts = [int(c) for c in args.contexts.split(",")]
    model = build("small_mla", 1024)
    d = model.cfg.mla_dims
    result = {
        "shape": {"d_model": model.cfg.d_model, "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
                  "q_rank": d.q_rank, "kv_rank": d.kv_rank, "nope": d.nope, "rope": d.rope, "v": d.v},
        "dtype": args.dtype, "threads": torch.get_num_threads(), "device": device,
        "cache": cache_table(1024),
        "decode": decode_table(contexts, [int(b) for b in args.batches.split(",")],
                               [int(c) for c in args.chunks.split(",")], args.tokens, args.rounds, device, dtype),
        "baseline": "recompute: the same latent cache expanded to per-head k/v every step (like-for-like); "
                    "per_head: per-head k/v cache (6x the memory), against the faster of its sdpa and eager "
                    "kernels in each round; ratios are medians of per-round ratios with quartiles",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
