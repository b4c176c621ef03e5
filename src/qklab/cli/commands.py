"""Command line: ``qklab train``, ``qklab demo``, ``qklab study``, ``qklab report``, ``qklab sweep``, ``qklab probe``,
``qklab tokens``.

User mistakes print one line (``qklab: error: ...``) and exit with code 2, without a traceback: bad
options and config values, missing or unwritable files (any OSError), damaged input. A run stopped by
SIGTERM/SIGINT exits with 128 + the signal number after its checkpoint, a non-finite stop (or too many
skipped steps) with 1; under torchrun every rank stops so, and rank 0 alone prints the line. An error line
under torchrun: every rank exits 2 and rank 0 prints its line; another rank prints its own, marked
``qklab: error (rank N): ...``, unless its error is known to be rank 0's too (``qklab.errors.alike``: compared
as the ranks agree to stop, or decided by the command line alone). Output into a pipe its reader closed
(``qklab ... | head``) stops quietly with 141 (128 + SIGPIPE), as other commands do. Anything else is a bug:
its traceback is printed with the run's log path, exit 1.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from qklab.config import load_config, preset_names
from qklab.diagnostics.stability import NonFiniteError
from qklab.errors import LOCAL_RANK_0_SAYS, RANK_0_SAYS, UserError, alike, alike_how
from qklab.train.signals import RunInterrupted, TermRaises
from qklab.version import version_line


def _train(args: argparse.Namespace) -> int:
    from qklab.train.startup import run_name
    from qklab.train.trainer import Trainer

    args.started = time.time()  # a checkpoint older than this is an earlier run's (_go_on, with --overwrite)
    try:
        cfg = load_config(args.config, args.set)
    except (UserError, OSError) as e:  # the command line's and its files': alike on every rank torchrun started
        raise alike(e, LOCAL_RANK_0_SAYS) from None
    args.ckpt_dir = Path(cfg.train.out_dir) / run_name(cfg) / "ckpt"  # what a stop's hint looks at (_go_on)
    res = Trainer(cfg, resume=args.resume, overwrite=args.overwrite).run()
    if not res.main:  # under torchrun, rank 0 reports for the run
        return 0
    print(f"done: {res.run_dir}  val_loss {res.final_val_loss:.4f}  max_logit {res.max_logit:.2f}  "
          f"{res.tokens_per_s:,.0f} tok/s  skipped {res.skipped} of {res.steps} steps")
    if res.skipped > cfg.train.skip_limit * res.steps:
        print(f"qklab: failed: {res.skipped} of {res.steps} steps were skipped as non-finite, more than "
              f"train.skip_limit={cfg.train.skip_limit:g} allows; lower train.lr", file=sys.stderr)
        return 1
    return 0


def _tokens(args: argparse.Namespace) -> int:
    from qklab.data.pack import pack_bytes, read_meta, write_pack

    cfg = load_config(args.config, args.set)
    out = write_pack(cfg.data, Path(args.out))
    splits = read_meta(out)["splits"]
    print(f"pack: {out} ({pack_bytes(out):,} bytes; {splits['train']['tokens']:,} train and "
          f"{splits['val']['tokens']:,} val tokens); on a machine without the source: --set data.token_pack={out}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from qklab.config import config_keys, keys_markdown, keys_text, select_keys

    keys = select_keys(config_keys(args.preset), args.prefix)
    sys.stdout.write(keys_markdown(keys, args.preset) if args.markdown else keys_text(keys))
    return 0


def _stopped_study(e: RunInterrupted) -> int:
    """A study command stopped by a signal outside its pool (reading, preparing data): nothing was running."""
    name = signal.Signals(e.exit_code - 128).name
    print(f"qklab: study stopped by {name} before any cell started; run the same command to continue", file=sys.stderr)
    return e.exit_code


def _demo(args: argparse.Namespace) -> int:
    from qklab.cli.demo import run_demo

    try:
        return run_demo(args.study, methods=args.methods, overrides=args.set, workers=args.workers, out=args.out,
                        threads=args.threads)
    except RunInterrupted as e:
        return _stopped_study(e)


def _study(args: argparse.Namespace) -> int:
    from qklab.cli.study import study_command

    try:
        return study_command(args)
    except RunInterrupted as e:
        return _stopped_study(e)


def _report(args: argparse.Namespace) -> int:
    from qklab.report import write_report

    out = write_report(args.dirs, out=args.out, title=args.title, warn=_warn, beside=args.beside)
    print(f"report: {out / 'report.html'} (and report.md, report.json, figures)")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from qklab.cli.study import exit_code, run_and_report, workers_for
    from qklab.cli.sweep import sweep_study

    study = sweep_study(args.config, args.variant, args.seeds, args.out, args.set, args.lr_mults, args.reference)
    try:
        outcome, _ = run_and_report(study, out=args.out, results=None, workers=workers_for(study, args.workers),
                                    threads=args.threads)
    except RunInterrupted as e:
        return _stopped_study(e)
    return exit_code(study, outcome)


def _export(args: argparse.Namespace) -> int:
    from qklab.train.export import export_run

    src = Path(args.path)
    default = src / "export" if not src.name.startswith("step_") else src.parent.parent / "export"
    if args.hf:
        from qklab.hf.export import export_run_pretrained

        out, step, loader = export_run_pretrained(src, args.out or default, args.allow_unverified, warn=_warn)
        how = ("AutoModelForCausalLM.from_pretrained" if loader == "transformers" else
               "qklab.hf.from_pretrained (or AutoModelForCausalLM once qklab.hf is imported)")
        print(f"exported step {step} of {src} as a transformers folder: {out} (load it with {how})")
        return 0
    out, step = export_run(src, args.out or default, unverified=args.allow_unverified, warn=_warn)
    print(f"exported step {step} of {src}: {out / 'model.safetensors'}")
    return 0


def _probe(args: argparse.Namespace) -> int:
    from qklab.diagnostics.probe import ProbeError, ProbeOptions, run_probe

    opts = ProbeOptions(batch=args.batch, samples=args.samples, seg_len=args.seg_len, max_mult=args.max_mult,
                        evidence=not args.no_evidence, device=args.device, unverified=args.allow_unverified)
    if args.compare:
        from qklab.diagnostics.compare import compare_runs

        compare_runs(([args.path] if args.path else []) + args.compare, args.out or "probe_compare", opts, warn=_warn)
    elif args.path is None:
        raise ProbeError("give a run folder or checkpoint to probe, e.g. qklab probe runs/small-none-s0")
    else:
        run_probe(args.path, out=args.out, opts=opts, warn=_warn)
    return 0


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _count(lo: int, what: str):
    """An argparse type: an integer >= ``lo`` (one line otherwise)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v}: {what}")
        return v
    return parse


WORKERS = _count(0, "use 0 (cells in this process), 1 or more")
THREADS = _count(1, "use 1 or more CPU threads per cell")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``qklab: error: ...`` and exit code 2, no usage block."""

    def error(self, message: str):
        line = _error_line(f"{message} (see {self.prog} --help)", alike(UserError(message), LOCAL_RANK_0_SAYS))
        self.exit(2, None if line is None else line + "\n")


def _config_options(p: argparse.ArgumentParser, example: str) -> None:
    """--config and --set, as train and tokens read them (``load_config``)."""
    p.add_argument("--config", "-c", default="tiny", help=f"preset name ({', '.join(preset_names())}) or TOML path")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config value, e.g. --set {example} (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qklab", description="Train and compare QK methods for attention.")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a GPT with a QK method",
                       epilog="every config key, its type, default, valid values and meaning: qklab config [SECTION] "
                       "(or docs/config.md)")
    _config_options(t, "qk.method=qknorm")
    t.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="delete an existing run folder of the same name")
    t.set_defaults(fn=_train)

    c = sub.add_parser("config", help="every config key: its type, default, valid values and meaning",
                       description="List the config keys (what --set and a preset's TOML take) with their type, "
                       "default or a preset's value, valid values and meaning, read off the config dataclasses.")
    c.add_argument("prefix", nargs="*", metavar="SECTION|KEY",
                   help="only the keys that start with one of these, e.g. train, qk.softcap, model.d_model")
    c.add_argument("--preset", default=None, metavar="NAME",
                   help=f"show this preset's values ({', '.join(preset_names())} or a TOML path), not the defaults")
    c.add_argument("--markdown", action="store_true",
                   help="print the reference page instead: qklab config --markdown > docs/config.md")
    c.set_defaults(fn=_config)

    k = sub.add_parser("tokens", help="write the token pack of a config's data (its tokenizer and token files, "
                       "xz-compressed) for a machine without the source",
                       description="Prepare a config's data (reading its source, or reusing the token cache) and write "
                       "its token pack: a folder that data.token_pack reads instead of the source (docs/corpus.md).")
    _config_options(k, "data.source=english")
    k.add_argument("--out", required=True, metavar="DIR",
                   help="the pack's folder (replaced if it is a pack), e.g. .cache/packs/english-small")
    k.set_defaults(fn=_tokens)

    d = sub.add_parser("demo", help="the main job: a small study of every QK method, a table and a report")
    d.add_argument("--study", default="demo", help="study file or name in studies/ (default: demo)")
    d.add_argument("--methods", help="comma-separated variant labels of the study to run (default: all)")
    d.add_argument("--workers", type=WORKERS, default=None, help="parallel cells (default: the study's)")
    d.add_argument("--threads", type=THREADS, default=None, help="CPU threads per cell (default: cores / workers)")
    d.add_argument("--out", default=None, help="folder for runs, results and report (default: runs/demo)")
    d.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value in every cell, e.g. --set train.steps=50")
    d.set_defaults(fn=_demo)

    st = sub.add_parser("study", help="run a study file (grid x variants x rates x seeds) or show its status")
    st.add_argument("action", choices=["run", "status", "verify", "amend", "cancel"],
                    help="run: train the cells not done; status: list them; cancel: cancel the study's Slurm jobs "
                    "(checkpoints and results stay); verify: retrain committed cells of a "
                    "results folder from their recorded config and compare bit for bit; amend: replace the "
                    "registered [claims] and design (seeds, grid, variants) of a study that has results by the file's, "
                    "in the open (--why)")
    st.add_argument("file", help="study file, e.g. studies/demo.toml (verify: a results folder, e.g. docs/results/x)")
    st.add_argument("--workers", type=WORKERS, default=None,
                    help="cells in parallel (default: the study's, else 1; status: for its time estimate)")
    st.add_argument("--threads", type=THREADS, default=None,
                    help="CPU threads per cell (default: the cores / --workers; set it when studies share a machine)")
    st.add_argument("--out", default=None, help="folder for run folders and logs (default: runs/studies/<name>)")
    st.add_argument("--results", default=None, help="folder for result files, e.g. docs/results/<name> "
                    "(default: <out>/results); a cell with a result here is done")
    st.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    st.add_argument("--executor", choices=["local", "slurm"], default="local",
                    help="local: worker processes here (default); slurm: one Slurm array task per cell "
                    "(docs/cluster.md)")
    st.add_argument("--cluster", default=None, metavar="FILE",
                    help="slurm: a cluster profile (TOML: partition, account, qos, cpus, gpus, mem, time, max_running, "
                    "sbatch, setup, ...); never part of the study or its hashes")
    st.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                    help="slurm: a profile key on the command line, over the profile's, e.g. --slurm partition=gpu "
                    "--slurm time=4:00:00 (repeatable)")
    st.add_argument("--wait", action="store_true",
                    help="slurm: follow the submitted cells until none is queued or running (default: return at once)")
    st.add_argument("--cells", type=_count(1, "verify 1 or more cells"), default=1,
                    help="verify: how many finished cells to retrain, drawn at random (default 1)")
    st.add_argument("--seed", type=int, default=None, help="verify: the seed of the random draw")
    st.add_argument("--variant", default=None, metavar="NAME[,NAME...]",
                    help="verify: draw --cells among each named variant's cells (one sample per method)")
    st.add_argument("--same-machine", action="store_true",
                    help="verify: draw only among cells trained on this kind of machine (CPU model, kernels, GPU), "
                    "where bit for bit is expected")
    st.add_argument("--summary", action="store_true",
                    help="status: one line per variant and grid point (its cells by status), not one per cell")
    st.add_argument("--why", default=None,
                    help="amend: why the registered claims or design change (kept in study.json)")
    st.add_argument("--allow-dirty", action="store_true",
                    help="run from a checkout with uncommitted changes; their diff is stored with the results "
                    "(<results>/provenance/) and named in each result.json (also: QKLAB_ALLOW_DIRTY=1)")
    st.set_defaults(fn=_study)

    rp = sub.add_parser("report", help="report.md/.html/.json from result folders (never trains)")
    rp.add_argument("dirs", nargs="+", help="folders holding result.json files (searched recursively)")
    rp.add_argument("--out", default=None, help="output folder (default: <first folder>/report)")
    rp.add_argument("--title", default="qklab report")
    rp.add_argument("--beside", nargs="+", default=None, metavar="DIR",
                    help="result folders whose claims (another corpus, say) are set beside these, each read on "
                         "its own")
    rp.set_defaults(fn=_report)

    w = sub.add_parser("sweep", help="shorthand for a study: variants x seeds (x rate multiples) at equal tokens")
    w.add_argument("--config", "-c", default="small")
    w.add_argument("--variant", "-v", action="append", required=True, metavar="LABEL:K=V,K=V")
    w.add_argument("--seeds", default="0,1,2")
    w.add_argument("--out", required=True, help="folder for the runs, results/ and report/")
    w.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE", help="applied to every run")
    w.add_argument("--lr-mults", default="1", help="each variant's rate grid, multiples of its rate: 0.5,1,2")
    w.add_argument("--reference", default=None, help="variant the others are paired with (default: the first)")
    w.add_argument("--workers", type=WORKERS, default=1, help="cells in parallel")
    w.add_argument("--threads", type=THREADS, default=None, help="CPU threads per cell (default: cores / workers)")
    w.set_defaults(fn=_sweep)

    r = sub.add_parser("probe", help="attention diagnostics of a trained run: probes.json and PNG plots")
    r.add_argument("path", nargs="?", help="run folder (runs/<name>, uses its latest checkpoint) or a checkpoint "
                   "ckpt/step_*")
    r.add_argument("--out", help="folder for probes.json and the plots (default: <run>/probes/<checkpoint>)")
    r.add_argument("--batch", type=int, default=None,
                   help="sequences in the probe batch (held-out, fixed; default: the run's train.diag_batch)")
    r.add_argument("--samples", type=int, default=8, help="contexts per (length, depth) of the evidence tests")
    r.add_argument("--seg-len", type=int, default=16, help="induction test: length of the repeated segment")
    r.add_argument("--max-mult", type=int, default=8, help="longest evidence context, in training lengths")
    r.add_argument("--no-evidence", action="store_true", help="skip the retrieval and induction tests")
    r.add_argument("--compare", nargs="+", metavar="RUN",
                   help="put several runs on one colour scale (their latest probe results; measured when missing)")
    r.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    r.add_argument("--allow-unverified", action="store_true",
                   help="accept a checkpoint without manifest.json (written before manifests; not checked)")
    r.set_defaults(fn=_probe)
    x = sub.add_parser("export", help="a run's weights as one model.safetensors (whatever wrote the checkpoint), or a "
                       "transformers folder (--hf)")
    x.add_argument("path", help="run folder (its newest good checkpoint) or a checkpoint ckpt/step_*")
    x.add_argument("--out", help="folder for model.safetensors and config.json (default: <run>/export)")
    x.add_argument("--hf", action="store_true",
                   help="write a transformers folder (config, weights, tokenizer) that from_pretrained loads")
    x.add_argument("--allow-unverified", action="store_true",
                   help="accept a checkpoint without manifest.json (written before manifests; not checked)")
    x.set_defaults(fn=_export)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _go_on(args: argparse.Namespace) -> str:
    """How to go on after a command stopped early. A run is offered --resume only where a checkpoint is there
    to resume from, as far as its files' sizes tell (``Checkpointer.resumable``, no hashes): one stopped before its
    first checkpoint starts again without it, and one whose checkpoints lost files with --overwrite (without
    it, a run folder with checkpoints is refused). A run given --overwrite and stopped before it cleared the
    earlier run (its newest checkpoint older than the command) is told to run the same command again, not to
    resume the run it was asked to replace."""
    if args.cmd != "train":
        return "nothing half-written is left; run the same command again"
    ckpt = getattr(args, "ckpt_dir", None)
    if ckpt is None:  # stopped before its config was read
        return "run the same command again"
    from qklab.train.checkpointer import Checkpointer

    newest = Checkpointer.resumable(ckpt)
    if newest is not None and getattr(args, "overwrite", False) and newest.stat().st_mtime < args.started:
        return (f"{ckpt.parent} still holds the earlier run (--overwrite had not cleared it yet): run the same "
                "command again")
    if newest is not None:
        return "the last checkpoint is intact (continue with --resume)"
    if Checkpointer.has_checkpoints(ckpt):
        return (f"no checkpoint in {ckpt} is intact (files missing or cut short), so there is nothing to resume: "
                "run the command again with --overwrite, without --resume")
    return "no checkpoint was written yet, so there is nothing to resume: run the command again without --resume"


def _os_error(e: OSError, args: argparse.Namespace) -> str:
    where = f" ({e.filename})" if e.filename else ""
    full = f"free some space; {_go_on(args)}" if args.cmd == "train" else \
        "free some space, then run the same command again"
    hint = {errno.ENOSPC: full, errno.EDQUOT: full,
            errno.EACCES: "check the permissions, or choose another folder",
            errno.EROFS: "the file system is read-only; choose another folder",
            errno.ENOENT: "check the path"}.get(e.errno, "check the path and the disk")
    return f"{e.strerror or _one_line(e)}{where}; {hint}"


def _speaks() -> bool:
    """False on the processes a launcher (torchrun) started besides rank 0 (``qklab.parallel.context.launched``,
    read here without torch): a stop reaches every rank at the same step, and rank 0 says so once."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0"


def _error_line(msg: str, e: BaseException) -> str | None:
    """The line of an error that exits 2: ``qklab: error: msg`` (one process, or rank 0 under torchrun);
    None where another process prints the same (``e`` marked ``alike``: rank 0 has it too; or the command
    line's, said by the launcher's first process on this machine); else ``qklab: error (rank N): msg``, a
    line that rank alone may see (its own disk, its own file). A line of unknown kind is rather printed twice
    than lost: with 8 ranks, the worst case is rank 0's line and seven marked ones."""
    if _speaks():
        return f"qklab: error: {msg}"
    how = alike_how(e)
    if how == RANK_0_SAYS:
        return None
    # torchrun (TORCHELASTIC_RUN_ID) gives every process it starts here the same command line and files
    if how == LOCAL_RANK_0_SAYS and "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return f"qklab: error (rank {os.environ.get('RANK', '?')}): {msg}"


QUIET_GRACE_S = 1.0  # how long a rank that leaves its line to another waits before it exits (_error)
TORCHRUN_WAIT_S = 60.0  # under torchrun: at most this long, until torchrun stops it after the other's exit


def _error(msg: str, e: BaseException) -> None:
    """Print the error's line (``_error_line``); a process that leaves it to another waits before it exits:
    torchrun stops every process once one has exited, so the quiet one must not exit before the one printing
    has printed, which on a loaded machine may reach the same error seconds later. Under torchrun it waits
    until torchrun stops it (at most ``TORCHRUN_WAIT_S``: the printing rank's exit ends the wait at once);
    under another launcher, which stops no one, a moment."""
    line = _error_line(msg, e)
    if line is not None:
        print(line, file=sys.stderr)
        return
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        time.sleep(QUIET_GRACE_S)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop, once the printing rank has exited: no line
    time.sleep(TORCHRUN_WAIT_S)


def _stop_line(line: str) -> None:
    if _speaks():
        print(line, file=sys.stderr)


def _peer_lost_line(args: argparse.Namespace) -> None:
    """The line of a process whose partner in a collective is gone: said once, by the first process of the
    run to get here (``first_to_say``; rank 0 itself may be the lost one), marked with its rank unless it is
    rank 0. The launcher stops the survivors (SIGTERM) once it sees a process gone, which may be now: a SIGTERM
    that comes while the line is decided and said is held, then let through (the process ends by it)."""
    from qklab.parallel.context import first_to_say

    held: list[int] = []
    main_thread = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    old = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum)) if main_thread else None
    try:
        if first_to_say("peer_lost"):
            rank = os.environ.get("RANK", "0")
            who = "" if rank == "0" else f" (rank {rank})"
            print(f"qklab: stopped{who}: another process of this run stopped or was lost during a collective step "
                  f"(its own line, or the launcher's log of that rank, says why); {_go_on(args)}", file=sys.stderr)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)  # None: a handler set outside Python
            if held:
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGTERM)


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower() or "can't allocate memory" in str(e)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `qklab`: what it can do, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        with TermRaises():  # SIGTERM outside the training loop: one line too
            code = args.fn(args)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return code
    except BrokenPipeError:  # the reader left (`qklab ... | head`)
        from qklab.cli.pipe import closed_pipe

        return closed_pipe()
    except UserError as e:
        _error(_one_line(e), e)
        return 2
    except OSError as e:  # a missing, unreadable or unwritable path, a full disk: the user's to fix
        _error(_os_error(e, args), e)
        return 2
    except NonFiniteError as e:
        _stop_line(f"qklab: stopped: {_one_line(e)}")
        return 1
    except RunInterrupted as e:  # after its checkpoint (the training loop), or before anything was written
        _stop_line(f"qklab: {e}" + ("" if e.checkpoint is not None else f"; {_go_on(args)}"))
        return e.exit_code
    except KeyboardInterrupt:
        _stop_line(f"qklab: interrupted; {_go_on(args)}")
        return 130
    except Exception as e:
        from qklab.parallel.context import peer_lost

        if peer_lost(e):  # under torchrun: another rank stopped first, and printed why (or its log says)
            _peer_lost_line(args)
            return 1
        if _out_of_memory(e):
            _error("out of memory; lower model sizes, train.batch_size or train.seq_len", e)
            return 2
        traceback.print_exc()
        log = next((n[len("run log: "):] for n in getattr(e, "__notes__", []) if n.startswith("run log: ")), None)
        print(f"qklab: internal error (a bug in qklab, not in your input): {type(e).__name__}"
              + (f"; the run's log is {log}" if log else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
