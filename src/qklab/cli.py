"""Command line: ``qklab train``, ``qklab demo``, ``qklab sweep``, ``qklab probe``.

User mistakes print one line (``qklab: error: ...``) and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from qklab.config import ConfigError, load_config
from qklab.data import DataError
from qklab.diagnostics.stability import NonFiniteError


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

    from qklab.sweep import lr_grid_table, parse_variant, run_sweep

    seeds = [int(s) for s in args.seeds.split(",")]
    summary = run_sweep(args.config, [parse_variant(v) for v in args.variant], seeds, Path(args.out), args.set)
    if args.lr_grid:  # labels <method>-x<multiplier>: a method x learning-rate table
        table = lr_grid_table(summary)
        (Path(args.out) / "lr_grid.md").write_text(table)
        print(table)
    return 0


def _probe(args: argparse.Namespace) -> int:
    from qklab.diagnostics.probe import run_probe

    run_probe(args.path, out=args.out, batch=args.batch, samples=args.samples, seg_len=args.seg_len,
              max_mult=args.max_mult, evidence=not args.no_evidence, device=args.device)
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
    w.add_argument("--lr-grid", action="store_true", help="labels are <method>-x<lr multiplier>: also write lr_grid.md")
    w.set_defaults(fn=_sweep)

    r = sub.add_parser("probe", help="attention diagnostics of a trained run: probes.json and PNG plots")
    r.add_argument("path", help="run folder (runs/<name>, uses its latest checkpoint) or a checkpoint ckpt/step_*")
    r.add_argument("--out", help="folder for probes.json and the plots (default: the run folder)")
    r.add_argument("--batch", type=int, default=8, help="sequences in the probe batch (held-out, fixed)")
    r.add_argument("--samples", type=int, default=8, help="contexts per (length, depth) of the evidence test")
    r.add_argument("--seg-len", type=int, default=16, help="length of the repeated random segment")
    r.add_argument("--max-mult", type=int, default=8, help="longest evidence context, in training lengths")
    r.add_argument("--no-evidence", action="store_true", help="skip the evidence-contrast grid")
    r.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    r.set_defaults(fn=_probe)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, DataError) as e:
        print(f"qklab: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"qklab: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("qklab: interrupted; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
