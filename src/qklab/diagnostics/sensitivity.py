"""Magnitude sensitivity (analyses.md item 5).

For each layer, the input of the attention block (the normalised residual stream that enters
``block.attn``) is recorded on the probe batch, scaled by a, and fed to that layer alone; nothing
upstream changes. Per layer and head it reports

* ``js``: mean Jensen-Shannon divergence (nats) between the attention rows at a and at a = 1;
* ``cos_q``, ``cos_k``: mean cosine between the q (k) vectors at a and at 1, i.e. cos(phi(z), phi(a z))
  for the method's whole q/k transform (a linear projection does not change a vector's direction, so
  this is exactly the map's own effect);
* ``norm_ratio_q``, ``norm_ratio_k``: mean ||q_a|| / ||q_1|| (a for standard attention, 1 for QK-Norm).

Standard attention sharpens with a, QK-Norm is invariant, a bounded map changes by a bounded amount.
"""

from __future__ import annotations

import torch
from torch import nn

from qklab.diagnostics import measures as M
from qklab.diagnostics.capture import attention_layers, model_device, per_query_head, probe_mode

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
KEYS = ("js", "cos_q", "cos_k", "norm_ratio_q", "norm_ratio_k")


def _norm_ratio(a: torch.Tensor, ref: torch.Tensor, n_heads: int) -> torch.Tensor:
    r = a.float().norm(dim=-1).mean(dim=(0, 2)) / ref.float().norm(dim=-1).mean(dim=(0, 2)).clamp_min(1e-30)
    return per_query_head(r, n_heads)  # (H,)


def magnitude_sensitivity(model: nn.Module, x: torch.Tensor, scales=SCALES) -> dict[str, object]:
    """x (B, T) tokens -> {"scales": [...], key: per scale, per layer, per head (S x L x H lists),
    key + "_mean": per scale, mean over layers and heads}."""
    scales = [float(a) for a in scales]
    if 1.0 not in scales:
        scales.append(1.0)
    attns = attention_layers(model)
    inputs: dict[int, tuple[tuple, dict]] = {}

    def grab(i):
        def hook(_module, args, kwargs):
            inputs[i] = (args, kwargs)
        return hook

    out: dict[str, list] = {k: [] for k in KEYS}  # key -> per layer (S, H)
    with probe_mode(model):
        handles = [a.register_forward_pre_hook(grab(i), with_kwargs=True) for i, a in enumerate(attns)]
        try:
            model(x.to(model_device(model)))
        finally:
            for h in handles:
                h.remove()
        for i, attn in enumerate(attns):
            (h_in, *rest), kwargs = inputs.pop(i)  # h_in: (B, T, C), the block's attention input
            caps = {}
            try:
                for a in scales:
                    attn.capture = {}
                    attn(h_in * a, *rest, **kwargs)
                    caps[a] = attn.capture
            finally:
                attn.capture = None
            ref = caps[1.0]
            H = ref["probs"].shape[1]
            per_scale = {k: [] for k in KEYS}
            for a in scales:
                c = caps[a]
                per_scale["js"].append(M.js_divergence(c["probs"], ref["probs"], ref["mask"]))
                per_scale["cos_q"].append(M.mean_cosine(c["q"], ref["q"], H))
                per_scale["cos_k"].append(M.mean_cosine(c["k"], ref["k"], H))
                per_scale["norm_ratio_q"].append(_norm_ratio(c["q"], ref["q"], H))
                per_scale["norm_ratio_k"].append(_norm_ratio(c["k"], ref["k"], H))
            for k in KEYS:
                out[k].append(torch.stack(per_scale[k]).cpu())  # (S, H)
    res: dict[str, object] = {"scales": scales}
    for k in KEYS:
        t = torch.stack(out[k], dim=1)  # (S, L, H)
        res[k] = t.tolist()
        res[k + "_mean"] = t.mean(dim=(1, 2)).tolist()  # (S,)
    return res
