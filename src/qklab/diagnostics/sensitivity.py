"""Magnitude sensitivity (docs/diagnostics.md).

For each layer, the input of the attention block (the normalised residual stream that enters
``block.attn``) is recorded on the probe batch, scaled by a, and fed to that layer alone; nothing
upstream changes. Per layer and head it reports

* ``js``: mean Jensen-Shannon divergence (nats) between the attention rows at a and at a = 1;
* ``cos_q``, ``cos_k``: mean cosine between the q (k) vectors at a and at 1, i.e. cos(phi(z), phi(a z))
  for the method's whole q/k transform (a linear projection does not change a vector's direction, so
  this is exactly the map's own effect);
* ``norm_ratio_q``, ``norm_ratio_k``: mean ||q_a|| / ||q_1|| (a for standard attention, 1 for QK-Norm).

Standard attention sharpens with a, QK-Norm is invariant, a bounded map changes by a bounded amount.

Each layer is measured inside the probe batch's forward pass (a pre-hook on its attention block) and
reduced to per-head numbers at once: one layer's q and k at a = 1 and at one other scale exist at a
time, and the attention rows are compared in chunks of query rows (never a (B, H, T, T) tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.diagnostics import measures as M
from qklab.diagnostics import streamed
from qklab.diagnostics.capture import (
    logit_rows,
    model_device,
    per_query_head,
    probe_mode,
    qk_hooks,
    row_chunk,
)

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
KEYS = ("js", "cos_q", "cos_k", "norm_ratio_q", "norm_ratio_k")


def _norm_ratio(a: torch.Tensor, ref: torch.Tensor, n_heads: int) -> torch.Tensor:
    r = a.float().norm(dim=-1).mean(dim=(0, 2)) / ref.float().norm(dim=-1).mean(dim=(0, 2)).clamp_min(1e-30)
    return per_query_head(r, n_heads)  # (H,)


def chunked_js(attn: nn.Module, qa: torch.Tensor, ka: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """Mean JS divergence between the causal attention rows made of (qa, ka) and of (q1, k1), over batch
    and queries at positions >= 1, per head (H,); computed in chunks of query rows."""
    B, H, T, _ = qa.shape
    total = torch.zeros(H, device=qa.device)
    step = row_chunk(B, H, T, streamed.CHUNK_ELEMENTS)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        mask = torch.arange(T, device=qa.device).view(1, T) <= torch.arange(r0, r1, device=qa.device).view(-1, 1)
        pa = torch.softmax(logit_rows(attn, qa, ka, r0, r1).masked_fill(~mask, float("-inf")), dim=-1)
        p1 = torch.softmax(logit_rows(attn, q1, k1, r0, r1).masked_fill(~mask, float("-inf")), dim=-1)
        lo = 1 if r0 == 0 else 0
        total += js_rows(pa, p1)[:, :, lo:].sum(dim=(0, 2))
        del pa, p1
    return total / (B * max(T - 1, 1))


def js_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """JS divergence (nats) of each row of p and q (B, H, R, Tk) -> (B, H, R)."""
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(dim=-1)
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(dim=-1)
    return (0.5 * (kl_pm + kl_qm)).clamp_min(0.0)


def magnitude_sensitivity(model: nn.Module, x: torch.Tensor, scales=SCALES) -> dict[str, object]:
    """x (B, T) tokens -> {"scales": [...], key: per scale, per layer, per head (S x L x H lists),
    key + "_mean": per scale, mean over layers and heads}."""
    scales = [float(a) for a in scales]
    if 1.0 not in scales:
        scales.append(1.0)
    attns = model.attention_layers()
    out: list = [None] * len(attns)  # per layer {key: (S, H)}
    grabbed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    state = {"busy": False}

    def on_qk(_i: int, _attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        if state["busy"]:  # only the scaled re-runs below are recorded
            grabbed["qk"] = (q, k)

    def run(attn: nn.Module, h: torch.Tensor, rest, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        attn(h, *rest, **kwargs)
        return grabbed.pop("qk")

    def measure_layer(i: int):
        def hook(attn, args, kwargs):
            if state["busy"]:
                return
            state["busy"] = True
            try:
                (h_in, *rest) = args  # h_in: (B, T, C), the block's attention input
                q1, k1 = run(attn, h_in, rest, kwargs)
                H = q1.shape[1]
                per_scale = {key: [] for key in KEYS}
                for a in scales:
                    qa, ka = (q1, k1) if a == 1.0 else run(attn, h_in * a, rest, kwargs)
                    per_scale["js"].append(chunked_js(attn, qa, ka, q1, k1))
                    per_scale["cos_q"].append(M.mean_cosine(qa, q1, H))
                    per_scale["cos_k"].append(M.mean_cosine(ka, k1, H))
                    per_scale["norm_ratio_q"].append(_norm_ratio(qa, q1, H))
                    per_scale["norm_ratio_k"].append(_norm_ratio(ka, k1, H))
                out[i] = {key: torch.stack(v).cpu() for key, v in per_scale.items()}  # each (S, H)
            finally:
                state["busy"] = False
        return hook

    with probe_mode(model), qk_hooks(model, on_qk):
        handles = [a.register_forward_pre_hook(measure_layer(i), with_kwargs=True) for i, a in enumerate(attns)]
        try:
            model(x.to(model_device(model)))
        finally:
            for h in handles:
                h.remove()
    res: dict[str, object] = {"scales": scales}
    for key in KEYS:
        t = torch.stack([o[key] for o in out], dim=1)  # (S, L, H)
        res[key] = t.tolist()
        res[key + "_mean"] = t.mean(dim=(1, 2)).tolist()  # (S,)
    return res
