"""The retrieval test of evidence contrast (docs/diagnostics.md, the main test).

Contexts (``qklab.data.retrieval.query_context``): K = 4 key-value pairs at relative depth p of a
stretch of held-out text, the context ending with one of the keys, k_j; the model should predict v_j.
For the query (the last position) and each head, with A its attention row and s its logits:

* ``mass``: A[k_j] + A[v_j], the attention on the evidence (uniform attention gives 2 / N);
* ``rank``: 1 + the number of keys with more attention than the better of the two evidence tokens
  (1: the head's top key is evidence; keys in random order give (N + 1) / 3 on average);
* ``log_contrast``: log (A[k_j] + A[v_j]) - log (A[k_i] + A[v_i]) for a control pair i != j at the same
  depth (logsumexp of logits, exact where A rounds to 0 or 1); 0 when the head does not prefer the
  evidence over a matched distractor;
* ``contrast``: log(A[v_j] / mean of A over every other allowed key) = s[v_j] - logsumexp_{k != v_j} s[k]
  + log(N - 1) (``evidence.contrast_from_logits``): the value's position against the whole context, not
  a matched pair (0 for uniform attention). The value, not the key: under the causal mask the key's
  position has not seen its value, so what the model copies stands where the value is (the token after
  the key's earlier occurrence, what an induction head attends to);
* ``accuracy``: the model's argmax next token is v_j.

The head is chosen once, before scoring: the layer and head with the highest mean evidence mass on
*selection* contexts (their own seed) at the longest measured N <= the training length T. The scored
contexts are other draws. Lengths above T are marked ``extrapolation``. Each layer's q and k are reduced
to the query row as the forward runs, so no T x T tensor exists; longer contexts enlarge the RoPE tables
in place (``rope_length``) for the duration of the test.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from qklab.data.retrieval import N_PAIRS, query_context
from qklab.diagnostics.capture import logit_rows, model_device, probe_mode, qk_hooks, rope_length
from qklab.diagnostics.evidence import contrast_from_logits

DEPTHS = (0.1, 0.5, 0.9)
METRICS = ("mass", "rank", "log_contrast", "contrast")


def _contexts(text: np.ndarray, n: int, depth: float, pool: np.ndarray, n_pairs: int, n_samples: int,
              rng: np.random.Generator):
    fill = n - 2 * n_pairs - 1
    starts = rng.integers(0, len(text) - fill + 1, size=n_samples)
    return [query_context(np.asarray(text[s : s + fill], dtype=np.int64), depth, pool, n_pairs, rng) for s in starts]


def _measure(model: nn.Module, ctxs, batch: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per context: each metric (S, L, H) and whether the prediction was right (S,)."""
    dev = model_device(model)
    out: dict[str, list] = {k: [] for k in METRICS}
    hits = []
    for i in range(0, len(ctxs), batch):
        part = ctxs[i : i + batch]
        x = torch.from_numpy(np.stack([c.tokens for c in part])).to(dev)  # (b, N)
        ev = torch.tensor([c.positions(c.query) for c in part], device=dev)  # (b, 2): key, value
        q_at = torch.tensor([x.shape[1] - 1], device=dev)  # the query: the last position
        ctrl = torch.tensor([c.positions(c.control) for c in part], device=dev)  # (b, 2)
        per_layer: dict[int, dict[str, torch.Tensor]] = {}

        def on_layer(li: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, ev=ev, ctrl=ctrl,
                     per_layer=per_layer, q_at=q_at) -> None:
            n = q.shape[2]
            s = logit_rows(attn, q, k, n - 1, n)[:, :, 0]  # (b, H, N): the query sees every key
            H = s.shape[1]
            lse_ev = s.gather(-1, ev.unsqueeze(1).expand(-1, H, -1)).logsumexp(dim=-1)  # (b, H)
            lse_ctrl = s.gather(-1, ctrl.unsqueeze(1).expand(-1, H, -1)).logsumexp(dim=-1)
            best_ev = s.gather(-1, ev.unsqueeze(1).expand(-1, H, -1)).amax(dim=-1)  # (b, H)
            value = torch.stack([contrast_from_logits(s[b : b + 1, :, None], q_at, ev[b, 1:])[0, :, 0]
                                 for b in range(s.shape[0])])  # (b, H): the value against every other key
            per_layer[li] = {"mass": (lse_ev - s.logsumexp(dim=-1)).exp(),
                             "rank": 1.0 + (s > best_ev.unsqueeze(-1)).sum(dim=-1).float(),
                             "log_contrast": lse_ev - lse_ctrl, "contrast": value}

        with qk_hooks(model, on_layer):
            logits, _ = model(x)  # (b, N, V)
        for key in METRICS:
            out[key].append(torch.stack([per_layer[li][key] for li in sorted(per_layer)], dim=1).cpu())  # (b, L, H)
        want = torch.tensor([int(c.pairs[c.query, 1]) for c in part], device=dev)
        hits.append((logits[:, -1].argmax(dim=-1) == want).cpu())
    return {k: torch.cat(v) for k, v in out.items()}, torch.cat(hits)


def _stats(vals: dict[str, torch.Tensor], hits: torch.Tensor, layer: int, head: int) -> dict[str, float]:
    """Mean, std (over contexts) of the chosen head's metrics, its top-1 share, and the accuracy."""
    rec: dict[str, float] = {"n": int(hits.numel())}
    for key in METRICS:
        v = vals[key][:, layer, head].double()
        rec[key] = v.mean().item()
        rec[key + "_std"] = v.std(unbiased=False).item()
    rec["top1"] = (vals["rank"][:, layer, head] == 1).double().mean().item()
    rec["accuracy"] = hits.double().mean().item()
    return rec


def retrieval_test(model: nn.Module, text: np.ndarray, pool: np.ndarray, lengths, train_len: int,
                   depths=DEPTHS, n_pairs: int = N_PAIRS, n_samples: int = 8, batch: int = 4,
                   seed: int = 0) -> dict[str, object]:
    """Run the grid ``lengths`` x ``depths`` on held-out tokens ``text`` with key/value ids from ``pool``
    (ids seen in training, special ids removed). Deterministic in ``seed``: every model of the same data
    sees the same contexts."""
    lengths = sorted({int(n) for n in lengths})
    need = 2 * n_pairs + 1
    ok, skipped = [], []
    for n in lengths:
        if n < 2 * need or n - need > len(text):
            skipped.append({"length": n, "reason": f"needs N >= {2 * need} and {n - need} held-out tokens "
                                                   f"(have {len(text)})"})
        else:
            ok.append(n)
    res: dict[str, object] = {"test": "retrieval", "n_pairs": n_pairs, "n_samples": n_samples, "seed": seed,
                              "depths": list(depths), "train_seq_len": train_len, "pool_size": int(len(pool)),
                              "chance_accuracy": 1.0 / max(len(pool), 1), "skipped": skipped,
                              "head": None, "cells": [], "lengths": []}
    main = [n for n in ok if n <= train_len]
    if not main:
        res["skipped"] += [{"length": n, "reason": "no length <= the training length to choose the head on"}
                           for n in ok]
        return res
    sel_len = max(main)
    with probe_mode(model), rope_length(model, max(ok)):
        def cell(n: int, j: int, part: int):
            rng = np.random.Generator(np.random.PCG64([seed, n, j, part]))
            return _measure(model, _contexts(text, n, depths[j], pool, n_pairs, n_samples, rng), batch)

        sel = [cell(sel_len, j, 1) for j in range(len(depths))]
        sel_mass = torch.cat([v["mass"] for v, _ in sel]).mean(dim=0)  # (L, H)
        layer, head = divmod(int(sel_mass.argmax()), sel_mass.shape[1])
        res["head"] = {"layer": layer, "head": head, "selected_at_length": sel_len,
                       "selection_mass": sel_mass[layer, head].item(), "selection_mass_per_head": sel_mass.tolist()}
        for n in ok:
            per_depth = [cell(n, j, 0) for j in range(len(depths))]
            for p, (vals, hits) in zip(depths, per_depth, strict=True):
                res["cells"].append({"length": n, "depth": p, "extrapolation": n > train_len,
                                     **_stats(vals, hits, layer, head),
                                     "mass_per_head": vals["mass"].mean(dim=0).tolist(),
                                     "log_contrast_per_head": vals["log_contrast"].mean(dim=0).tolist(),
                                     "contrast_per_head": vals["contrast"].mean(dim=0).tolist()})
            vals = {k: torch.cat([v[k] for v, _ in per_depth]) for k in METRICS}
            hits = torch.cat([h for _, h in per_depth])
            res["lengths"].append({"length": n, "extrapolation": n > train_len, "uniform_mass": 2.0 / n,
                                   "chance_rank": (n + 1) / 3.0, **_stats(vals, hits, layer, head)})
    return res
