"""The induction-copy test of evidence contrast (docs/diagnostics.md, the second test; the
main test is the retrieval test of ``retrieval.py``).

A context of N tokens is held-out corpus text with a segment S of m random tokens inserted at relative
depth p (S starts at d = round(p * (N - 2m)), so that it lies at depth p of the text before the repeat)
and repeated at the end:

    text[:d] | S | text[d:N-2m] | S            (length N)

For the query at repeat position N - m + j (token S[j], j = 0 .. m - 2), the evidence position is
e = d + j + 1, the token after the earlier occurrence of S[j] (it holds S[j + 1], the next token). Per
head the contrast of that query is

    log( A[e] / mean_{k allowed, k != e} A[k] ) = s[e] - logsumexp_{k != e} s[k] + log(#others)

computed from the pre-softmax logits s (exact even when A[e] rounds to 1). It is 0 for uniform
attention. Per head: the mean over queries, then over samples. Also the next-token accuracy on the
repeat: argmax of the model's output at N - m + j equals S[j + 1].

Segment tokens are drawn from ``pool`` (ids seen in training, special ids removed) minus every id of
the context's text, so S[j] occurs only in the two copies. The head is chosen before scoring: the layer
and head with the best mean contrast on *selection* contexts (their own seed) at the longest measured
N <= the training length; every cell reports that head (``contrast``, with its spread) beside all
heads' means. Lengths above the training length are marked ``extrapolation``. Only the repeat's logit
rows are formed, layer by layer during the forward (``qk_hooks``); longer contexts enlarge the RoPE
tables in place (``rope_length``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from qklab.diagnostics.capture import logit_rows, model_device, probe_mode, qk_hooks, rope_length

DEPTHS = (0.1, 0.5, 0.9)
SEG_LEN = 16


def build_contexts(text: np.ndarray, n: int, depth: float, seg_len: int, n_samples: int,
                   pool: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> tokens (S, N) int64, segments (S, m) int64, and d, where S starts."""
    m, fill = seg_len, n - 2 * seg_len
    d = int(round(depth * fill))
    starts = rng.integers(0, len(text) - fill + 1, size=n_samples)
    seqs, segs = [], []
    for s in starts:
        filler = np.asarray(text[s : s + fill], dtype=np.int64)
        free = np.setdiff1d(pool, filler)
        if len(free) < m:
            raise ValueError(f"only {len(free)} seen token ids are absent from the context; need {m}")
        seg = rng.choice(free, size=m, replace=False).astype(np.int64)  # distinct tokens
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
    """Contrast per sample, layer and head (S, L, H) and accuracy for one (N, p) cell, in chunks of batch."""
    n, m = tokens.shape[1], segs.shape[1]
    q0, q1 = n - m, n - 1  # queries S[0 .. m-2] of the repeat
    dev = model_device(model)
    qpos = torch.arange(q0, q1, device=dev)  # (Q,)
    ev = d + 1 + torch.arange(q1 - q0, device=dev)  # (Q,)
    per_sample, correct, count = [], 0, 0
    for i in range(0, tokens.shape[0], batch):
        x, seg = tokens[i : i + batch].to(dev), segs[i : i + batch].to(dev)
        layers: dict[int, torch.Tensor] = {}

        def on_layer(li: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, layers=layers) -> None:
            layers[li] = contrast_from_logits(logit_rows(attn, q, k, q0, q1), qpos, ev).mean(dim=2)  # (b, H)

        with qk_hooks(model, on_layer):
            out, _ = model(x)  # (b, N, V)
        per_sample.append(torch.stack([layers[li] for li in sorted(layers)], dim=1).cpu())  # (b, L, H)
        pred = out[:, q0:q1].argmax(dim=-1)  # (b, Q)
        correct += (pred == seg[:, 1:]).sum().item()
        count += pred.numel()
    return torch.cat(per_sample), correct / count


def evidence_contrast(model: nn.Module, text: np.ndarray, lengths, depths=DEPTHS, seg_len: int = SEG_LEN,
                      n_samples: int = 8, batch: int = 4, seed: int = 0, pool: np.ndarray | None = None,
                      train_len: int | None = None) -> dict[str, object]:
    """The induction-copy test on the grid lengths x depths of held-out tokens ``text`` (1-D). Segment
    tokens come from ``pool`` (default: every id of the vocabulary); ``train_len`` (default: the
    shortest length) separates the main grid from extrapolation. Deterministic in ``seed``."""
    vocab = model.cfg.vocab_size
    pool = np.arange(vocab, dtype=np.int64) if pool is None else np.asarray(pool, dtype=np.int64)
    if len(pool) < seg_len or pool.min() < 0 or pool.max() >= vocab:
        raise ValueError(f"segment pool must hold >= {seg_len} ids in [0, {vocab})")
    lengths = sorted(int(n) for n in lengths)
    train_len = int(train_len or lengths[0])
    ok = [n for n in lengths if n >= 4 * seg_len and n - 2 * seg_len <= len(text)]
    skipped = [{"length": n, "reason": f"needs N >= {4 * seg_len} and {n - 2 * seg_len} held-out tokens "
                                       f"(have {len(text)})"} for n in lengths if n not in ok]
    res: dict[str, object] = {"test": "induction", "seg_len": seg_len, "n_samples": n_samples, "seed": seed,
                              "pool_size": int(len(pool)), "train_seq_len": train_len, "depths": list(depths),
                              "lengths": ok, "cells": [], "skipped": skipped, "head": None,
                              "chance_accuracy": 1.0 / len(pool)}
    main = [n for n in ok if n <= train_len]
    if not main:
        res["skipped"] += [{"length": n, "reason": "no length <= the training length to choose the head on"}
                           for n in ok]
        res["lengths"] = []
        return res
    with probe_mode(model), rope_length(model, max(ok)):
        def cell(n: int, j: int, part: int):
            rng = np.random.Generator(np.random.PCG64([seed, n, j, part]))
            tokens, segs, d = build_contexts(text, n, depths[j], seg_len, n_samples, pool, rng)
            return (*_cell(model, tokens, segs, d, batch), d)

        sel_len = max(main)
        sel = torch.cat([cell(sel_len, j, 1)[0] for j in range(len(depths))]).mean(dim=0)  # (L, H)
        layer, head = divmod(int(sel.argmax()), sel.shape[1])
        res["head"] = {"layer": layer, "head": head, "selected_at_length": sel_len,
                       "selection_contrast": sel[layer, head].item()}
        for n in ok:
            for j, p in enumerate(depths):
                vals, acc, d = cell(n, j, 0)
                v = vals[:, layer, head].double()
                res["cells"].append({"length": n, "depth": p, "extrapolation": n > train_len, "segment_start": d,
                                     "accuracy": acc, "contrast": v.mean().item(),
                                     "contrast_std": v.std(unbiased=False).item(),
                                     "contrast_per_head": vals.mean(dim=0).tolist()})
    return res
