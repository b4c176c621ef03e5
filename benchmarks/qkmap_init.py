"""Starting attention-logit statistics of each QK-MAP variant against standard attention and QK-Norm.

At initialisation, on one batch of held-out text of the chosen preset: for every layer, the std of the
pre-softmax logits over all causal (query, key) pairs and heads, the mean over query rows of the
std across keys (how far from uniform attention starts), and the mean attention distance in tokens (how
local it starts; uniform causal attention: T / 4). Prints JSON; docs/qk-map.md quotes it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/qkmap_init.py --config small
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/qkmap_init.py --config small --set data.source=english \
        --set model.d_model=512 --set model.n_heads=8 --set model.qk_init_std=0.04419417382415922
"""

from __future__ import annotations

import argparse
import json

import torch

from qklab.config import load_config
from qklab.data import TokenLoader, prepare_data
from qklab.diagnostics.measures import distance
from qklab.diagnostics.streamed import uniform_distance
from qklab.model import GPT

VARIANTS = {
    "none": ["qk.method=none"],
    "qknorm": ["qk.method=qknorm"],
    "qkmap-post": ["qk.method=qkmap"],
    "qkmap-post-T1": ["qk.method=qkmap", "qk.qkmap.temperature=SQRT_D"],
    "qkmap-post-rope-before": ["qk.method=qkmap", "qk.qkmap.rope=before"],
    "qkmap-polar": ["qk.method=qkmap", "qk.qkmap.variant=polar"],
    "qkmap-input": ["qk.method=qkmap", "qk.qkmap.variant=input"],
}


@torch.no_grad()
def logit_stats(model: GPT, idx: torch.Tensor) -> list[dict[str, float]]:
    """Per layer: std of the causal logits (all heads pooled), mean per-row std across keys, and the mean
    attention distance (mean over heads)."""
    for b in model.blocks:
        b.attn.capture = {}
    model(idx)
    out = []
    for b in model.blocks:
        s, mask = b.attn.capture["logits"].float(), b.attn.capture["mask"]  # (B, H, T, T), (T, T)
        probs = b.attn.capture["probs"]  # (B, H, T, T)
        b.attn.capture = None
        vals = s[..., mask]  # (B, H, pairs)
        m = mask.float()
        n = m.sum(-1).clamp_min(1)  # keys per row
        mean = (s * m).sum(-1, keepdim=True) / n.unsqueeze(-1)
        row_var = (((s - mean) * m) ** 2).sum(-1) / n  # (B, H, T)
        out.append({"logit_std": vals.std().item(), "row_std": row_var[..., 1:].sqrt().mean().item(),
                    "distance": distance(probs, mask).mean().item()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = load_config(args.config, [f"train.seed={args.seed}", *args.set])
    data = prepare_data(base.data, log=lambda _m: None)
    idx = TokenLoader.eval_batches(data.val_tokens(), args.batch, base.train.seq_len, 1)[0][0]  # (B, T) held-out
    result = {"config": args.config, "set": args.set, "seed": args.seed, "batch": list(idx.shape),
              "uniform_distance": uniform_distance(idx.shape[1]), "variants": {}}
    sqrt_d = base.model.head_dim ** 0.5
    for name, sets in VARIANTS.items():
        sets = [s.replace("SQRT_D", f"{sqrt_d:.6g}") for s in sets]
        cfg = load_config(args.config, [f"train.seed={args.seed}", *args.set, *sets])
        cfg.model.vocab_size = data.vocab_size
        torch.manual_seed(args.seed)
        model = GPT(cfg.model, cfg.qk).eval()
        result["variants"][name] = logit_stats(model, idx)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
