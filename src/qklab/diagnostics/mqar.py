"""Evidence contrast where the model retrieves: the MQAR task (``qklab.data.mqar``) at the training length
T and at 2T, 4T, 8T (more filler between the pair block and the queries: the same K pairs, each query
(m - 1) T tokens further from its evidence; RoPE tables extended as the other probes do, ``rope_length``).

The evidence of a query (the position holding key k_j) is the position of v_j in the pair block, the
token after the key's earlier occurrence. The key's own position cannot be it: under the causal mask the
key's position has not seen its value, so the value is read from where it stands (what an induction head
attends to, as in the induction test of ``evidence.py``). Per query and head, with s the pre-softmax
logits over the allowed keys 0 .. q:

* ``log_contrast``: s[e] - logsumexp_{k != e} s[k] + log(#others) = log(A[e] / mean_{k != e} A[k]),
  ``evidence.contrast_from_logits`` (0 for uniform attention, exact when A[e] rounds to 1);
* ``mass``: A[e] (uniform attention: 1 / (q + 1), ``uniform_mass``);
* ``rank``: 1 + the number of keys with a larger logit than the evidence (``top1``: the share at rank 1);
* ``accuracy``: the model's argmax at the query is v_j.

Per sequence the mean over its K queries, then mean and std over sequences. The head is chosen before
scoring: the layer and head with the highest mean contrast on *selection*-split sequences at T; every
length is scored on *report*-split sequences (other pair blocks, ``mqar.split_of``), at that head and
per head. Only the query region's logit rows are formed, layer by layer (``qk_hooks``).
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.data.mqar import MQARSpec, Sequence, as_batch, heldout
from qklab.diagnostics.capture import logit_rows, model_device, probe_mode, qk_hooks, rope_length
from qklab.diagnostics.evidence import contrast_from_logits

MULTS = (1, 2, 4, 8)
METRICS = ("log_contrast", "mass", "rank")


def query_stats(s: torch.Tensor, qpos: torch.Tensor, ev: torch.Tensor) -> dict[str, torch.Tensor]:
    """s (1, H, K, N) logits of the queries at positions qpos (K,), evidence positions ev (K,) -> each
    metric per head and query (H, K)."""
    N = s.shape[-1]
    allowed = torch.arange(N, device=s.device).view(1, N) <= qpos.view(-1, 1)  # (K, N)
    s = s.float()[0]  # (H, K, N)
    s_ev = s.gather(-1, ev.view(1, -1, 1).expand(s.shape[0], -1, 1))  # (H, K, 1)
    lse = s.masked_fill(~allowed, float("-inf")).logsumexp(dim=-1)  # (H, K)
    return {"log_contrast": contrast_from_logits(s[None], qpos, ev)[0],
            "mass": (s_ev.squeeze(-1) - lse).exp(),
            "rank": 1.0 + ((s > s_ev) & allowed).sum(dim=-1).float()}


def measure(model: nn.Module, seqs: list[Sequence], region: int, batch: int):
    """Per sequence, each metric (S, L, H) (mean over its queries), the uniform mass (S,) and the share of
    its queries answered right (S,). ``region``: the query region's length (the last ``region`` rows)."""
    dev = model_device(model)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in METRICS}
    uniform, acc = [], []
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        x, y = as_batch(part)  # (b, N) each
        qs = [torch.from_numpy(s.queries).to(dev) for s in part]
        evs = [torch.from_numpy(s.evidence).to(dev) for s in part]
        layers: dict[int, dict[str, torch.Tensor]] = {}

        def on_layer(li: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, layers=layers, qs=qs, evs=evs):
            n = q.shape[2]
            s = logit_rows(attn, q, k, n - region, n)  # (b, H, region, N)
            per = [query_stats(s[b : b + 1, :, qs[b] - (n - region)], qs[b], evs[b]) for b in range(len(qs))]
            layers[li] = {key: torch.stack([p[key].mean(dim=-1) for p in per]) for key in METRICS}  # (b, H)

        with qk_hooks(model, on_layer):
            logits, _ = model(x.to(dev))  # (b, N, V)
        for key in METRICS:
            out[key].append(torch.stack([layers[li][key] for li in sorted(layers)], dim=1).cpu())  # (b, L, H)
        pred = logits.argmax(dim=-1).cpu()  # (b, N)
        for b, s in enumerate(part):
            q = torch.from_numpy(s.queries)
            acc.append((pred[b, q] == y[b, q]).double().mean())
            uniform.append((1.0 / (q.double() + 1)).mean())
    return {k: torch.cat(v) for k, v in out.items()}, torch.stack(uniform), torch.stack(acc)


def _row(vals: dict[str, torch.Tensor], uniform: torch.Tensor, acc: torch.Tensor, layer: int, head: int):
    rec: dict[str, object] = {"n": int(acc.numel())}
    for key in METRICS:
        v = vals[key][:, layer, head].double()
        rec[key], rec[key + "_std"] = v.mean().item(), v.std(unbiased=False).item()
    rec["top1"] = (vals["rank"][:, layer, head] == 1).double().mean().item()  # sequences whose mean rank is 1
    rec["uniform_mass"] = uniform.mean().item()
    rec["accuracy"], rec["accuracy_std"] = acc.mean().item(), acc.std(unbiased=False).item()
    rec["log_contrast_per_head"] = vals["log_contrast"].mean(dim=0).tolist()  # (L, H)
    rec["mass_per_head"] = vals["mass"].mean(dim=0).tolist()
    return rec


def mqar_evidence(model: nn.Module, spec: MQARSpec, train_len: int, mults=MULTS, n_samples: int = 64,
                  n_select: int = 32, batch: int = 8) -> dict[str, object]:
    """The test at ``train_len`` x each of ``mults``; deterministic (the held-out splits' fixed seed), so
    every model of the same spec sees the same sequences."""
    T, K = train_len, spec.n_pairs
    spec.check(T)
    region = spec.region(T)
    res: dict[str, object] = {"test": "mqar", "n_pairs": K, "n_queries": spec.queries, "n_keys": spec.n_keys,
                              "n_samples": n_samples,
                              "train_seq_len": T, "evidence": "the queried key's value in the pair block",
                              "longer": "filler between the pair block and the queries", "chance_accuracy":
                              1.0 / spec.n_keys, "head": None, "lengths": [], "skipped": []}
    mults = sorted({int(m) for m in mults if int(m) >= 1})
    with probe_mode(model), rope_length(model, T * max(mults)):
        sel, _, _ = measure(model, heldout("selection", spec, T, n_select, part=1), region, batch)
        mean = sel["log_contrast"].mean(dim=0)  # (L, H)
        layer, head = divmod(int(mean.argmax()), mean.shape[1])
        res["head"] = {"layer": layer, "head": head, "selected_at_length": T, "split": "selection",
                       "selection_contrast": mean[layer, head].item(), "selection_contrast_per_head": mean.tolist()}
        for m in mults:
            seqs = heldout("report", spec, T, n_samples, extra=(m - 1) * T)
            vals, uniform, acc = measure(model, seqs, region, batch)
            n = m * T
            res["lengths"].append({"length": n, "mult": m, "extrapolation": m > 1, "filler_added": (m - 1) * T,
                                   "chance_rank": (n + 1) / 3.0, **_row(vals, uniform, acc, layer, head)})
    return res
