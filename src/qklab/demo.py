"""The main job: train one preset with several QK methods on the built-in corpus, print a table."""

from __future__ import annotations

import json
import time
from pathlib import Path

from qklab.config import load_config
from qklab.data import prepare_data, unigram_entropy
from qklab.train.trainer import Trainer


def run_demo(preset: str, methods: list[str], overrides: list[str]) -> list[dict]:
    base = load_config(preset, overrides)
    data = prepare_data(base.data)
    val = data.val_tokens()
    h1 = unigram_entropy(val, data.vocab_size)
    rows = []
    for m in methods:
        cfg = load_config(preset, [*overrides, f"qk.method={m}"])
        t0 = time.time()
        res = Trainer(cfg, overwrite=True, data=data).run()
        rows.append({"method": m, "val_loss": res.final_val_loss, "max_logit": res.max_logit,
                     "tokens_per_s": res.tokens_per_s, "minutes": (time.time() - t0) / 60, "run": str(res.run_dir)})
    print()
    print(f"corpus: {data.fingerprint.get('source')}  {data.fingerprint.get('files')} files  "
          f"tokenizer {data.fingerprint.get('tokenizer')}  unigram entropy of val tokens: {h1:.3f} nats")
    print(f"{'method':<10} {'val loss':>9} {'max logit':>10} {'tokens/s':>10} {'minutes':>8}")
    for r in rows:
        print(f"{r['method']:<10} {r['val_loss']:>9.4f} {r['max_logit']:>10.2f} {r['tokens_per_s']:>10,.0f} "
              f"{r['minutes']:>8.1f}")
    out = Path(base.train.out_dir) / f"demo-{base.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"unigram_entropy": h1, "rows": rows}, indent=2) + "\n")
    print(f"table written to {out}")
    return rows
