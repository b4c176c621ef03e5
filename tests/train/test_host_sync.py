"""No host synchronisation inside a training step: qklab's code never reads a tensor's value between two
flushes (the logging cadence), for every QK method and controller, with AdamW and Muon, on MHA and MLA.

On CPU a read costs nothing, so the test watches the Python-level reads (``item``, ``tolist``, ``bool``,
``float``, ``int``, ``numpy``, ``cpu``) made from qklab's own source files. torch's optimizers read their CPU
step counters, which is no device synchronisation, and are not counted. On CUDA the device itself is
asked (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import qklab
from qklab.config import load_config
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer

SRC = str(Path(qklab.__file__).parent)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")


class Reads(list):
    """The reads seen; ``on[0]`` switches the watch on and off."""

    def __init__(self) -> None:
        super().__init__()
        self.on = [False]


@pytest.fixture
def reads(monkeypatch):
    """A list that gets the file:line of every tensor read made from qklab's source while it is on."""
    seen = Reads()
    on = seen.on

    def watch(name):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, **k):
            caller = sys._getframe(1).f_code
            if on[0] and caller.co_filename.startswith(SRC):
                seen.append(f"{Path(caller.co_filename).name}:{sys._getframe(1).f_lineno} {name}")
            return orig(self, *a, **k)
        return wrapped

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, watch(name))
    return seen


def _trainer(tmp_path: Path, name: str, *extra: str) -> Trainer:
    cfg = load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", f"train.name={name}", "train.steps=8",
                               "train.log_every=4", "train.eval_every=8", "train.ckpt_every=0", "train.diag_every=0",
                               "train.progress=false", f"data.cache_dir='{tmp_path / 'cache'}'", *extra])
    return Trainer(cfg, log=lambda s: None)


CASES = [("mha", "none", "none", "adamw"), ("mha", "qknorm", "none", "muon"), ("mha", "qkmap", "none", "adamw"),
         ("mha", "softcap", "qkclip", "adamw"), ("mha", "none", "quack", "muon"), ("mha", "none", "qkclip", "muon"),
         ("mha", "none", "qk_lr_multiplier", "adamw"), ("mla", "none", "quack", "muon"),
         ("mla", "qknorm", "none", "adamw"), ("mla", "none", "qkclip", "adamw")]


@pytest.mark.parametrize("attention, method, controller, optimizer", CASES)
def test_steps_read_nothing_between_flushes(tmp_path, reads, attention, method, controller, optimizer):
    t = _trainer(tmp_path, "s", f"model.attention={attention}", f"qk.method={method}",
                 f"qk.controller={controller}", f"train.optimizer={optimizer}", "qk.qkclip.tau_clip=2.0")
    reads.on[0] = True
    for _ in range(3):
        t.train_step()
    reads.on[0] = False
    assert reads == [], f"host reads inside train_step: {reads}"
    got = t.flush()
    assert [s for s, _, _ in got] == [1, 2, 3] and all(math.isfinite(v) for _, v, _ in got)


def test_the_watch_sees_a_read_skip_mode_makes(tmp_path, reads):
    """train.nonfinite=skip must decide before applying a step: one read per step, and the watch sees it."""
    t = _trainer(tmp_path, "skip", "train.nonfinite=skip")
    reads.on[0] = True
    t.train_step()
    t.train_step()
    reads.on[0] = False
    assert len(reads) == 2 and all("trainer.py" in r and "tolist" in r for r in reads), reads


def test_flushed_values_equal_what_the_step_returned(tmp_path):
    """The log records the same losses and gradient norms the steps computed, step by step."""
    t = _trainer(tmp_path, "log", "train.log_every=1")
    stepped = [tuple(float(v) for v in t.train_step()) for _ in range(3)]
    flushed = t.flush()
    assert [(loss, gn) for _, loss, gn in flushed] == stepped
    t.run()  # steps 4..8 with records at every step
    logged = {r["step"]: r["loss"] for r in read_metrics(t.run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(logged) == [4, 5, 6, 7, 8]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device's own sync check)")
def test_no_device_sync_inside_a_cuda_step(tmp_path):
    for controller in ("none", "quack", "qkclip"):
        t = _trainer(tmp_path, f"cuda-{controller}", "train.device=cuda", f"qk.controller={controller}")
        t.train_step()  # the first step allocates the optimizer state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            t.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        t.close()
