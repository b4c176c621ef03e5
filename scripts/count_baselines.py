"""The count models a language model trained on a corpus should beat, read as a study reads a model: the
unigram and bigram cross-entropy of the held-out splits under the training split's counts (the bigram's
smoothing chosen on the selection split, both read on the report split). Prints JSON.
  .venv/bin/python scripts/count_baselines.py --set data.source=english > docs/results/count_baselines_english.json
Takes the same preset and --set overrides as `qklab train`; tokens come from the data cache (built if missing)."""

from __future__ import annotations

import argparse
import json
import sys

from qklab.config import load_config
from qklab.data import prepare_data
from qklab.data.stats import count_baselines
from qklab.errors import UserError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", help="preset (default: small, the studies' base config)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        data = prepare_data(cfg.data, log=lambda s: print(s, file=sys.stderr))
        splits = {"train": data.train_tokens(), "select": data.select_tokens(), "report": data.report_tokens()}
        out = count_baselines(*splits.values(), data.vocab_size)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = {k: int(x.size) for k, x in splits.items()}
    print(json.dumps({"config": args.config, "set": args.set, "vocab_size": data.vocab_size, "tokens": tokens,
                      "corpus": data.fingerprint, "nats": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
