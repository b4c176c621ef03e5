"""Command line: ``qklab train``, ``qklab demo``.

User mistakes print one line (``qklab: error: ...``) and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from qklab.config import ConfigError, load_config
from qklab.data import DataError


def _train(args: argparse.Namespace) -> int:
    from qklab.train.trainer import Trainer

    cfg = load_config(args.config, args.set)
    res = Trainer(cfg, resume=args.resume, overwrite=args.overwrite).run()
    print(f"done: {res.run_dir}  val_loss {res.final_val_loss:.4f}  max_logit {res.max_logit:.2f}  "
          f"{res.tokens_per_s:,.0f} tok/s")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from qklab.demo import run_demo

    run_demo(args.config, args.methods.split(","), args.set)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qklab.sweep import parse_variant, run_sweep

    seeds = [int(s) for s in args.seeds.split(",")]
    run_sweep(args.config, [parse_variant(v) for v in args.variant], seeds, Path(args.out), args.set)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qklab", description="Train and compare QK methods for attention.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a GPT with a QK method")
    t.add_argument("--config", "-c", default="tiny", help="preset name (tiny, small) or TOML path")
    t.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set qk.method=qknorm (repeatable)")
    t.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="delete an existing run folder of the same name")
    t.set_defaults(fn=_train)

    d = sub.add_parser("demo", help="train the small preset with several methods and print a comparison")
    d.add_argument("--config", "-c", default="small")
    d.add_argument("--methods", default="none,qknorm,softcap", help="comma-separated qk.method values")
    d.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE")
    d.set_defaults(fn=_demo)

    w = sub.add_parser("sweep", help="train variants x seeds at equal tokens; write a mean +- std table")
    w.add_argument("--config", "-c", default="small")
    w.add_argument("--variant", "-v", action="append", required=True, metavar="LABEL:K=V,K=V")
    w.add_argument("--seeds", default="0,1,2")
    w.add_argument("--out", required=True, help="folder for the runs and summary.{json,md}")
    w.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE", help="applied to every run")
    w.set_defaults(fn=_sweep)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, DataError) as e:
        print(f"qklab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qklab: interrupted; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
