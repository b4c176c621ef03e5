"""The training loop: data -> model -> optimizer (+ QK controller) -> metrics and checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qklab.atomic import atomic_write_text
from qklab.config import RunConfig
from qklab.data import PreparedData, prepare_data
from qklab.data.mqar import IGNORE, MQARData
from qklab.data.retrieval import train_loader
from qklab.diagnostics.monitor import AttentionMonitor
from qklab.diagnostics.stability import NonFiniteError, SpikeDetector
from qklab.errors import ConfigError, UserError
from qklab.methods import CONTROLLERS
from qklab.methods.base import watched_metrics
from qklab.model import GPT
from qklab.model.flex import causal_block_mask
from qklab.parallel import DistContext
from qklab.parallel.strategy import strategy
from qklab.rundir.folder import TOKENIZER, FollowerFolder, RunFolder
from qklab.rundir.metrics import MetricsLog, NoMetrics
from qklab.train.checkpointer import Checkpointer
from qklab.train.evaluate import eval_loss, max_attention_logits
from qklab.train.optim import build_optimizer, schedule_factor, set_lr
from qklab.train.progress import Progress
from qklab.train.resume import restore_run_state, resume_point, run_state, seed_everything
from qklab.train.signals import RunInterrupted, StopSignals
from qklab.train.startup import (
    check_cpu_compiler,
    inductor_cache_per_cpu_capability,
    machines,
    pick_device,
    run_name,
    versions,
)
from qklab.train.trackers import build_trackers
from qklab.version import git_sha

# how a run may end without a bug: the user's to fix (one line), a non-finite stop, a signal
EXPECTED = (UserError, OSError, NonFiniteError, RunInterrupted)


@dataclass
class TrainResult:
    run_dir: Path
    final_val_loss: float
    max_logit: float
    tokens_per_s: float
    steps: int
    skipped: int = 0  # steps dropped under train.nonfinite=skip
    main: bool = True  # False on data-parallel ranks other than 0 (which write nothing)


class Trainer:
    def __init__(self, cfg: RunConfig, resume: bool = False, overwrite: bool = False,
                 data: PreparedData | None = None, log=print) -> None:
        self.cfg, self.echo = cfg, log  # echo: how a line reaches the user (print)
        self.run_dir = Path(cfg.train.out_dir) / run_name(cfg)
        self.ckpt_dir = self.run_dir / "ckpt"
        self.dist = DistContext.start(cfg.train.parallel, cfg.train.device)  # rank 0 alone writes and logs
        if not self.dist.is_main:
            self.echo = lambda msg: None
        try:  # locked: one writer at a time
            self.folder = RunFolder(self.run_dir, overwrite=overwrite and not resume) if self.dist.is_main \
                else FollowerFolder()
        except BaseException as e:
            self.dist.agree(e)
            raise
        self.dist.agree(None)
        failed: BaseException | None = None
        try:
            self._build(resume, overwrite, data)
        except BaseException as e:
            failed = e
        try:
            self.dist.agree(failed)  # the others stop too when one rank failed to build
            if failed is not None:
                raise failed
            self.wrap()
        except BaseException as e:
            if isinstance(e, Exception) and not isinstance(e, EXPECTED):  # a bug: keep its story in the log
                self._log_line(f"failed to start: {type(e).__name__}: {e}\n{traceback.format_exc()}", echo=False)
                e.add_note(f"run log: {self.run_dir / 'train.log'}")
                self.folder.release()
            else:  # nothing half-made stays behind: the lock goes, a folder made just now too
                self.folder.abandon()
            self.dist.close()
            raise

    def _build(self, resume: bool, overwrite: bool, data: PreparedData | None) -> None:
        cfg, t = self.cfg, self.cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = self.dist.device(pick_device(t.device))
        if t.compile and self.device.type == "cpu":
            check_cpu_compiler()
        if self.device.type == "cpu":
            # subnormal floats (< 1.2e-38) as zero: once the logits blow up, softmax gradients underflow into
            # that range, and a CPU sgemm on subnormal inputs runs ~100x slower (benchmarks/denormal.py)
            torch.set_flush_denormal(True)
        if self.dist.is_main:
            Checkpointer.clean(self.ckpt_dir)  # left by a killed writer or a full disk; frees the space first
        found = resume_point(self.ckpt_dir, cfg, resume, overwrite, self.dist.world, warn=self._log_line)

        self.data = data or prepare_data(cfg.data, log=self.echo)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.data.vocab_size
        elif cfg.model.vocab_size < self.data.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} < tokenizer vocab {self.data.vocab_size}; "
                              "set it to 0 to take the tokenizer's")
        seed_everything(t.seed)
        self.model = GPT(cfg.model, cfg.qk).to(self.device)
        self.parallel = strategy(self.dist, self._cpu_model)  # one process, DDP or FSDP2: asked, not tested
        self.parallel.prepare(self.model)  # before the optimizers and the controller: they hold its parameters
        self.optimizers = build_optimizer(self.model, t, self.parallel.muon)
        self.checkpointer = Checkpointer(self.ckpt_dir, self.parallel, self.optimizers, t.ckpt_format, t.keep_ckpts)
        self.controller = CONTROLLERS[cfg.qk.controller](self.model, self.optimizers, cfg.qk.opts(cfg.qk.controller))
        self.controller.reduce = self.dist.reduce if self.dist.active else None  # e.g. QK-clip's max over ranks
        self.watched = [a for a in self.model.attention_layers() if a.qk.watches_logits]  # QK-Guard's layers
        for a in self.watched:
            a.track_max_logit = True
        data_seed = t.seed if t.data_seed < 0 else t.data_seed  # a study fixes it: same tokens in every cell
        world = self.dist.world  # every rank draws the global micro-batch and keeps its own rows
        self.loader = self.parallel.loader(train_loader(self.data, t.batch_size * world, t.seq_len, data_seed,
                                                        cfg.data.retrieval))
        # val_loss: the selection part of the held-out text; report_loss (final step only): the report part;
        # batches of the global batch, as one process draws them, each rank evaluating its rows (evaluate)
        val = self.data.eval_batches("selection", t.batch_size * world, t.seq_len, t.eval_batches)
        self.logit_x = val[0][0][:4]  # the max logit's rows: those of one process, on every rank
        self.val_batches = self._rows(val)
        self.report_batches = self._rows(self.data.eval_batches("report", t.batch_size * world, t.seq_len,
                                                                t.eval_batches))
        if isinstance(self.data, MQARData):  # the loss is on the queried values only
            self.model.ignore_index = IGNORE
        if self.device.type == "cuda":  # FlexAttention's causal mask, made before anything is compiled
            causal_block_mask(t.seq_len, self.device)
        self.monitor = (AttentionMonitor.from_tokens(self.data.val_tokens(), t.diag_batch, t.seq_len)
                        if t.diag_every else None)  # attention diagnostics; None: off
        self.spikes = SpikeDetector()
        self.step, self.skipped, self._saved_at = 0, 0, -1
        self._diag_ref = False  # the monitor's reference for the next logit change came from the checkpoint
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # steps not read yet (flush)
        self._progress: Progress | None = None  # the progress bar (or line a minute) while run() runs
        if found is not None:
            self._restore(*found)
            self._log_line(f"resumed {self.run_dir} at step {self.step} from {found[0].name}")
        elif overwrite:
            self.folder.clear()  # only now: a run that fails to start leaves the old one intact
        if found is None:  # with "resumed" and "ended" lines, the log tells how long each part took
            self._log_line(f"started {self.run_dir} ({self.dist.world} process(es) on {self.device})", echo=False)
        if not self.dist.is_main:
            self.metrics = NoMetrics()
            return
        self._write_config()
        trackers = build_trackers(t.trackers, self.run_dir, cfg.to_dict()) if t.trackers else []
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", truncate_after=self.step if resume else -1,
                                  trackers=trackers)

    def wrap(self) -> None:
        """What the train step calls: the model or its DDP wrapper, compiled or not (a collective: every rank
        calls it once the build agreed)."""
        self.fwd = self.parallel.wrap()
        if self.cfg.train.compile:
            inductor_cache_per_cpu_capability()
            self.fwd = torch.compile(self.fwd)

    # ------------------------------------------------------------------------------------------------
    def autocast(self):
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _write_config(self) -> None:
        before = None
        if self.step > 0:  # a resume: the machines the run trained on so far, from its last config.json
            with contextlib.suppress(OSError, ValueError, AttributeError):
                before = json.loads((self.run_dir / "config.json").read_text()).get("machines")
        info = {**self.cfg.to_dict(), "git_sha": git_sha(), "corpus": self.data.fingerprint,
                "versions": versions(), "n_params": self.model.num_params(), "device": str(self.device),
                "machines": machines(before, self.step, self.device)}
        atomic_write_text(self.run_dir / "config.json", json.dumps(info, indent=2) + "\n")
        if hasattr(self.data.tokenizer, "to_json"):  # the run folder carries what reads its tokens back
            atomic_write_text(self.run_dir / TOKENIZER, self.data.tokenizer.to_json())

    def _log_line(self, msg: str, echo: bool = True) -> None:
        """A line kept in the run's log (train.log), and shown to the user too when ``echo``."""
        if not self.dist.is_main:
            return
        if echo:
            self.echo(msg)
        with contextlib.suppress(OSError), open(self.run_dir / "train.log", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def close(self) -> None:
        """Close the metrics file and release the run folder (run() does this when it ends)."""
        if hasattr(self, "metrics"):
            self.metrics.close()
        self.folder.release()
        self.dist.close()

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        self.checkpointer.restore(path, state)  # weights and optimizer states, whatever wrote them
        self.step, self.skipped = restore_run_state(state, self.controller, self.loader, self.spikes)
        # the logit change of the next diagnostics is measured from the last ones before this step, as in a
        # run never stopped (a checkpoint between two diagnostics carries their reference)
        self._diag_ref = self.monitor is not None and self.monitor.load_state_dict(state.get("monitor") or {})

    def _rows(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of each global held-out batch (as ``Strategy.loader`` slices the training batches)."""
        if not self.dist.active:
            return batches
        b = self.cfg.train.batch_size
        return [(x[self.dist.rank * b:(self.dist.rank + 1) * b], y[self.dist.rank * b:(self.dist.rank + 1) * b])
                for x, y in batches]

    def _eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The held-out loss over every rank's rows: each rank's mean, averaged over the ranks."""
        loss = eval_loss(self.model, batches, self.device, self.autocast)
        if not self.dist.active:
            return loss
        return self.dist.reduce(torch.tensor(loss, dtype=torch.float64, device=self.device)).item() / self.dist.world

    def _cpu_model(self) -> GPT:
        """An unsharded CPU GPT of this config, its weights left uninitialised (FSDP checkpoints)."""
        with torch.device("meta"):
            whole = GPT(self.cfg.model, self.cfg.qk)
        whole = whole.to_empty(device="cpu")
        if self.cfg.model.tie_embeddings:
            whole.lm_head.weight = whole.tok_emb.weight
        return whole

    def _diagnose(self) -> dict[str, Any]:
        """Attention diagnostics of the current weights, measured on the model as one process holds it
        (FSDP2: a whole copy gathered on rank 0), so the numbers are those of one process ({} elsewhere)."""
        whole, _ = self.parallel.full_state([])
        return {} if whole is None else self.monitor.measure(whole.to(self.device), self.step)

    def save(self) -> Path:
        self.flush()  # a non-finite step since the last flush ends the run before anything is saved
        if not self.parallel.all_finite(list(self.model.parameters())):  # keep the last good one
            self.metrics.log(self.step, event="nonfinite_weights")
            raise NonFiniteError(f"weights are non-finite at step {self.step}; no checkpoint written, the last good "
                                 f"one is {self.checkpointer.latest() or 'none'}")
        path = self.checkpointer.save(self.step, run_state(
            self.controller, self.loader, self.spikes, self.skipped, self.cfg, self.dist.world,
            self.monitor.state_dict(self.step) if self.monitor is not None else None))
        self._saved_at = self.step
        return path

    # ------------------------------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step (with accumulation); returns the mean loss and the gradient norm before
        clipping as 0-dim float64 device tensors, left unread: reading them is a host synchronisation,
        which ``flush`` does once for all the steps since the last one, at the logging cadence. Only
        train.nonfinite=skip reads them here, as it must decide before applying the step."""
        t = self.cfg.train
        set_lr(self.optimizers, schedule_factor(self.step, t))
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device: no host sync
        for i in range(t.grad_accum):
            x, y = self.loader.next_batch()
            with self.parallel.accumulating(i < t.grad_accum - 1):
                with self.autocast():
                    _, loss = self.fwd(x.to(self.device), y.to(self.device))
                (loss / t.grad_accum).backward()
            total += loss.detach().double()  # float64, as the Python floats it replaces
        params = [p for p in self.model.parameters() if p.grad is not None]
        gnorm = self.parallel.clip(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        mean = self.dist.reduce(total / t.grad_accum) / self.dist.world  # every rank decides on the same loss
        gnorm = gnorm.detach().double()
        apply = True  # stop: a non-finite step is found at the next flush, before anything is saved
        if t.nonfinite == "skip":
            loss, gn = torch.stack([mean, gnorm]).tolist()  # skip decides now: a host sync every step
            apply = math.isfinite(loss) and math.isfinite(gn)
        if apply:
            self.controller.before_step(self.step)
            for opt in self.optimizers:
                opt.step()
            self.controller.after_step(self.step)
            self._watch_step()
        else:
            self._nonfinite(loss, gn, self.step + 1)  # logs it; the step is not applied
            self.controller.skip_step(self.step)
            for a in self.watched:  # a dropped step's logits decide nothing
                a.pop_max_logit()
            self.skipped += 1
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1
        self._pending.append((self.step, mean, gnorm))
        return mean, gnorm

    def _watch_step(self) -> None:
        """Methods that watch their logits (QK-Guard) get each layer's per-head max logit of the step just
        taken, the same on every rank (MAX over the data-parallel ranks, all layers in one reduction)."""
        if not self.watched:
            return
        maxima = [a.pop_max_logit() for a in self.watched]  # per layer (H,)
        packed = torch.cat([m.to(self.device) for m in maxima])
        if self.dist.active:
            packed = self.dist.reduce(packed, "max")
        for a, m in zip(self.watched, packed.split([len(m) for m in maxima]), strict=True):
            a.qk.step_end(m, self.step)

    def flush(self) -> list[tuple[int, float, float]]:
        """Read the (step, loss, grad norm) of every step since the last flush in one host sync, end the
        run at the first non-finite one (train.nonfinite=stop) and feed the spike detector in step order."""
        if not self._pending:
            return []
        steps = [s for s, _, _ in self._pending]
        values = torch.stack([torch.stack([m, g]) for _, m, g in self._pending]).tolist()  # (n, 2)
        self._pending = []
        out = [(s, loss, gn) for s, (loss, gn) in zip(steps, values, strict=True)]
        for s, loss, gn in out:
            if self.cfg.train.nonfinite == "stop" and not (math.isfinite(loss) and math.isfinite(gn)):
                self._nonfinite(loss, gn, s)  # raises
            spike = self.spikes.update(loss)
            if spike is not None:
                self.metrics.log(s, event="loss_spike", **spike)
                self._echo(f"step {s}: loss spike {loss:.3f}, {spike['sigmas']:.1f} sigma above the window")
        return out

    def _nonfinite(self, loss: float, gnorm: float, step: int) -> None:
        what = "loss" if not math.isfinite(loss) else "gradient"
        policy = self.cfg.train.nonfinite
        self.metrics.log(step, event=f"nonfinite_{policy}", loss=loss, grad_norm=gnorm)
        if policy == "stop":
            good = self.checkpointer.latest()
            then = "continue with --resume" if good is not None else "run it again without --resume (none to resume)"
            raise NonFiniteError(f"non-finite {what} at step {step} (loss {loss}, grad norm {gnorm}); stopped, and "
                                 "no weights of that step or later were saved (train.nonfinite=stop). Last good "
                                 f"checkpoint: {good or 'none'}; lower train.lr or set train.nonfinite=skip, then "
                                 f"{then}")
        self._echo(f"step {step}: non-finite {what}; step skipped (train.nonfinite=skip)")

    def evaluate(self) -> dict[str, float]:
        val = self._eval_loss(self.val_batches)
        x = self.logit_x.to(self.device)
        with self.autocast():
            ml = max_attention_logits(self.model, x)
        return {"val_loss": val, "max_logit": ml.max().item(), "max_logit_per_layer": ml.amax(dim=1).tolist()}

    def run(self) -> TrainResult:
        t = self.cfg.train
        tokens_per_step = t.batch_size * self.dist.world * t.seq_len * t.grad_accum  # the global batch
        progress = Progress(t.steps, self.step, self.run_dir.name, show=t.progress and self.dist.is_main)
        last = {}
        stop = StopSignals()  # SIGTERM / SIGINT: checkpoint at the next step boundary, then RunInterrupted
        # a signal is checked after every step where that costs no device sync, else at each flush
        signals_every_step = not self.dist.active or self.device.type == "cpu"
        try:
            stop.install()
            self._progress = progress
            if self.monitor is not None and not self._diag_ref:  # the reference for the first logit change;
                base = self._diagnose()  # logged at step 0 only
                if self.step == 0:
                    self.metrics.log(0, diag=base)
            t0, s0 = time.perf_counter(), self.step
            while self.step < t.steps:
                self.train_step()
                progress.update()
                end = self.step == t.steps
                at_log, at_eval = self.step % t.log_every == 0 or end, self.step % t.eval_every == 0 or end
                at_diag = self.monitor is not None and (self.step % t.diag_every == 0 or end)
                at_ckpt = bool(t.ckpt_every and self.step % t.ckpt_every == 0) or end
                synced = at_log or at_eval or at_diag or at_ckpt
                rec: dict[str, Any] = {}
                if synced:
                    _, loss, gnorm = self.flush()[-1]  # the one host sync of these steps
                    tps = tokens_per_step * (self.step - s0) / (time.perf_counter() - t0)  # over train steps only
                    progress.measured(self.step, loss, tps)
                if at_log:
                    rec.update(loss=loss, grad_norm=gnorm, lr=self.optimizers[0].param_groups[0]["lr"],
                               tokens_per_s=tps, tokens=self.step * tokens_per_step, **self.controller.metrics(),
                               **watched_metrics(self.watched))
                if at_eval:
                    last = self.evaluate()
                    rec.update(last)
                    if end:  # the report split is read once, at the end
                        rec["report_loss"] = self._eval_loss(self.report_batches)
                    self._echo(f"step {self.step}: val_loss {last['val_loss']:.4f}  "
                               f"max_logit {last['max_logit']:.2f}")
                if at_diag:
                    rec["diag"] = self._diagnose()
                if rec:
                    self.metrics.log(self.step, **rec)
                if at_ckpt:
                    self.save()
                if (synced or signals_every_step) and self.dist.any(stop.received is not None):
                    self._stop_on_signal(stop.name or "SIGTERM", stop.received or 15)  # all ranks at one step
                if synced:
                    t0, s0 = time.perf_counter(), self.step
        except Exception as e:  # the whole story goes to the run's log; the CLI prints one line or the traceback
            trace = "" if isinstance(e, EXPECTED) else "\n" + traceback.format_exc()
            self._log_line(f"ended at step {self.step}: {type(e).__name__}: {e}{trace}", echo=False)
            e.add_note(f"run log: {self.run_dir / 'train.log'}")
            raise
        finally:
            stop.restore()
            self._progress = None
            progress.close()
            self.close()
        if not last:
            last = self.evaluate()
        self._log_line(f"done at step {self.step}: val_loss {last['val_loss']:.4f}, skipped {self.skipped} steps",
                  echo=False)
        return TrainResult(self.run_dir, last["val_loss"], last["max_logit"], progress.steady_tokens_per_s(),
                           self.step, self.skipped, self.dist.is_main)

    def _echo(self, msg: str) -> None:
        """A line for the user beside the progress bar while run() runs (else through echo), not kept in
        train.log; rank 0 speaks for the run."""
        if self.dist.is_main:
            (self._progress.write if self._progress is not None else self.echo)(msg)

    def _stop_on_signal(self, name: str, signum: int) -> None:
        path = self.save() if self._saved_at != self.step else self.ckpt_dir / f"step_{self.step:07d}"
        self.metrics.log(self.step, event="signal", signal=name)
        raise RunInterrupted(f"stopped by {name} at step {self.step}; checkpoint {path} written; continue with "
                             "--resume", signum, path)
