"""Evidence contrast on a synthetic long context (analyses.md item 6).

A context of N tokens is held-out corpus text with a segment S of m random tokens inserted at relative
depth p (S starts at d = round(p * (N - 2m)), so that it lies at depth p of the text before the repeat)
and repeated at the end:

    text[:d] | S | text[d:N-2m] | S            (length N)

For the query at repeat position N - m + j (token S[j], j = 0 .. m - 2), the evidence position is
e = d + j + 1, the token after the earlier occurrence of S[j] (it holds S[j + 1], the next token). Per
head the contrast of that query is

    log( A[e] / mean_{k allowed, k != e} A[k] ) = s[e] - logsumexp_{k != e} s[k] + log(#others)

computed from the pre-softmax logits s (exact even when A[e] rounds to 1). It is 0 for uniform
attention. Per layer: the mean over queries and samples of each head, then the best head. Also the
next-token accuracy on the repeat: argmax of the model's output at N - m + j equals S[j + 1].

N runs from the training length to 8x; RoPE tables are sized by ``model.cfg.max_seq_len``, so lengths
beyond it are measured on a copy of the model built with a larger max_seq_len and the same weights
(the copy changes nothing else); a length that cannot be measured is listed in ``skipped`` with why.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from qklab.diagnostics.capture import capturing, model_device, probe_mode

DEPTHS = (0.1, 0.5, 0.9)
SEG_LEN = 16


def with_max_len(model: nn.Module, n: int) -> nn.Module:
    """The model itself if its RoPE tables cover n positions, else a copy with max_seq_len = n."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "max_seq_len"):
        raise ValueError(f"{type(model).__name__} has no cfg.max_seq_len to size RoPE tables from")
    if cfg.max_seq_len >= n:
        return model
    with torch.random.fork_rng(devices=[]):  # building the copy draws an init we overwrite at once
        big = type(model)(dataclasses.replace(cfg, max_seq_len=n), model.qk_cfg)
    big.load_state_dict(model.state_dict(), strict=True)
    return big.to(model_device(model)).eval()


def build_contexts(text: np.ndarray, n: int, depth: float, seg_len: int, n_samples: int,
                   seg_vocab: tuple[int, int], rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> tokens (S, N) int64, segments (S, m) int64, and d, where S starts."""
    m, fill = seg_len, n - 2 * seg_len
    d = int(round(depth * fill))
    lo, hi = seg_vocab
    starts = rng.integers(0, len(text) - fill + 1, size=n_samples)
    seqs, segs = [], []
    for s in starts:
        filler = np.asarray(text[s : s + fill], dtype=np.int64)
        seg = rng.choice(np.arange(lo, hi, dtype=np.int64), size=m, replace=False)  # distinct tokens
        seqs.append(np.concatenate([filler[:d], seg, filler[d:], seg]))
        segs.append(seg)
    return torch.from_numpy(np.stack(seqs)), torch.from_numpy(np.stack(segs)), d


def contrast_from_logits(s: torch.Tensor, qpos: torch.Tensor, ev: torch.Tensor) -> torch.Tensor:
    """s (B, H, Q, N) logits of queries at absolute positions qpos (Q,), evidence positions ev (Q,)
    -> the log contrast (B, H, Q)."""
    B, H, Q, N = s.shape
    keys = torch.arange(N, device=s.device)
    allowed = keys.view(1, N) <= qpos.view(Q, 1)  # (Q, N)
    is_ev = keys.view(1, N) == ev.view(Q, 1)  # (Q, N)
    s = s.float()
    s_ev = s.gather(-1, ev.view(1, 1, Q, 1).expand(B, H, Q, 1)).squeeze(-1)  # (B, H, Q)
    rest = s.masked_fill(~allowed | is_ev, float("-inf")).logsumexp(dim=-1)  # (B, H, Q)
    n_others = qpos.to(s.dtype)  # qpos + 1 allowed keys, minus the evidence
    return s_ev - rest + n_others.log()


def _cell(model: nn.Module, tokens: torch.Tensor, segs: torch.Tensor, d: int, batch: int):
    """Contrast per layer and head (L, H) and accuracy for one (N, p) cell, in chunks of ``batch``."""
    n, m = tokens.shape[1], segs.shape[1]
    q0, q1 = n - m, n - 1  # queries S[0 .. m-2] of the repeat
    dev = model_device(model)
    qpos = torch.arange(q0, q1, device=dev)  # (Q,)
    ev = d + 1 + torch.arange(q1 - q0, device=dev)  # (Q,)

    def keep_query_rows(cap: dict) -> None:  # after each layer: drop all but the repeat's logit rows
        rows = cap["logits"][:, :, q0:q1].clone()  # (B, H, Q, N)
        cap.clear()  # in place: the layer holds this dict
        cap["rows"] = rows

    total, correct, count = None, 0, 0
    for i in range(0, tokens.shape[0], batch):
        x, seg = tokens[i : i + batch].to(dev), segs[i : i + batch].to(dev)
        with capturing(model, reduce=keep_query_rows) as caps:
            out, _ = model(x)  # (b, N, V)
            c = torch.stack([contrast_from_logits(cap["rows"], qpos, ev).sum(dim=(0, 2)) for cap in caps])  # (L, H)
        total = c if total is None else total + c
        pred = out[:, q0:q1].argmax(dim=-1)  # (b, Q)
        correct += (pred == seg[:, 1:]).sum().item()
        count += pred.numel()
    return (total / count).cpu(), correct / count


def evidence_contrast(model: nn.Module, text: np.ndarray, lengths, depths=DEPTHS, seg_len: int = SEG_LEN,
                      n_samples: int = 8, batch: int = 4, seed: int = 0,
                      seg_vocab: tuple[int, int] | None = None) -> dict[str, object]:
    """Run the grid lengths x depths on held-out tokens ``text`` (1-D). Segment tokens are drawn without
    replacement from seg_vocab = [lo, hi) (default: the whole vocabulary). Deterministic in ``seed``:
    every model sees the same contexts."""
    vocab = model.cfg.vocab_size
    lo, hi = seg_vocab or (0, vocab)
    if not (0 <= lo < hi <= vocab and hi - lo >= seg_len):
        raise ValueError(f"segment vocabulary [{lo}, {hi}) must lie in [0, {vocab}) and hold {seg_len} tokens")
    cells, skipped = [], []
    lengths = sorted(int(n) for n in lengths)
    ok = [n for n in lengths if n >= 4 * seg_len and n - 2 * seg_len <= len(text)]
    for n in lengths:
        if n not in ok:
            skipped.append({"length": n, "reason": f"needs N >= {4 * seg_len} and {n - 2 * seg_len} held-out "
                                                   f"tokens (have {len(text)})"})
    runner = None
    if ok:
        try:
            runner = with_max_len(model, max(ok))
        except (ValueError, RuntimeError, TypeError) as e:
            limit = getattr(getattr(model, "cfg", None), "max_seq_len", 0)
            skipped += [{"length": n, "reason": f"longer than max_seq_len={limit} and no copy: {e}"}
                        for n in ok if n > limit]
            ok = [n for n in ok if n <= limit]
            runner = model
    with probe_mode(runner):
        for n in ok:
            for j, p in enumerate(depths):
                rng = np.random.Generator(np.random.PCG64([seed, n, j]))
                tokens, segs, d = build_contexts(text, n, p, seg_len, n_samples, (lo, hi), rng)
                per_head, acc = _cell(runner, tokens, segs, d, batch)
                best = per_head.max(dim=1)
                cells.append({"length": n, "depth": p, "segment_start": d, "accuracy": acc,
                              "contrast": best.values.tolist(), "best_head": best.indices.tolist(),
                              "contrast_per_head": per_head.tolist(),
                              "contrast_best_layer": best.values.max().item()})
    return {"seg_len": seg_len, "n_samples": n_samples, "seed": seed, "seg_vocab": [lo, hi],
            "lengths": ok, "depths": list(depths), "cells": cells, "skipped": skipped,
            "chance_accuracy": 1.0 / (hi - lo)}
