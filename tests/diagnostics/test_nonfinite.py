"""A non-finite gradient triggers train.nonfinite (stop or skip); the last good checkpoint survives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qklab.cli import main
from qklab.config import load_config
from qklab.diagnostics import NonFiniteError
from qklab.model import GPT
from qklab.rundir.checkpoint import latest_checkpoint, load_checkpoint
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", f"train.name={name}", "train.steps=20",
                                "train.log_every=1", "train.ckpt_every=10", "train.eval_every=10",
                                "train.diag_every=0", "train.progress=false",
                                f"data.cache_dir='{tmp_path / 'cache'}'", *extra])


class RecordingTrainer(Trainer):
    """Keeps a copy of the weights it saved in each checkpoint."""

    def save(self) -> Path:
        path = super().save()
        weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.saved = {**getattr(self, "saved", {}), path.name: weights}
        return path


def _poison_gradient_at(trainer: Trainer, step: int) -> None:
    """Make the gradient of one weight non-finite during optimizer step ``step`` (1-based)."""
    w = trainer.model.blocks[0].attn.wq.weight
    w.register_hook(lambda g: g * float("inf") if trainer.step == step - 1 else g)


def _events(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "event" in r]


def test_stop_ends_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    t = RecordingTrainer(_cfg(tmp_path, "stop", "train.nonfinite=stop"), log=lambda s: None)
    _poison_gradient_at(t, 15)
    with pytest.raises(NonFiniteError, match="non-finite gradient at step 15.*step_0000010"):
        t.run()
    ck = latest_checkpoint(t.ckpt_dir)
    assert ck.name == "step_0000010"
    fresh = GPT(t.cfg.model, t.cfg.qk)
    state = load_checkpoint(ck, fresh)
    assert state["step"] == 10
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, t.saved["step_0000010"][k]), k  # unchanged since it was written
    assert [(e["step"], e["event"]) for e in _events(t.run_dir)] == [(15, "nonfinite_stop")]
    assert Trainer(_cfg(tmp_path, "stop", "train.nonfinite=stop"), resume=True, log=lambda s: None).step == 10


def test_skip_does_not_apply_the_step_and_training_goes_on(tmp_path):
    t = Trainer(_cfg(tmp_path, "skip", "train.nonfinite=skip"), log=lambda s: None)
    _poison_gradient_at(t, 15)
    for _ in range(14):
        t.train_step()
    weights = {k: v.clone() for k, v in t.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in t.optimizers[0].state.values()]
    loss, gnorm = t.train_step()
    assert math.isfinite(loss) and not math.isfinite(gnorm) and t.step == 15
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for m, s in zip(moments, t.optimizers[0].state.values(), strict=True):
        assert torch.equal(m, s["exp_avg"])
    t.run()  # steps 16..20, then the checkpoint
    ck = latest_checkpoint(t.ckpt_dir)
    assert ck.name == "step_0000020"
    fresh = GPT(t.cfg.model, t.cfg.qk)
    load_checkpoint(ck, fresh)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())
    assert [(e["step"], e["event"]) for e in _events(t.run_dir)] == [(15, "nonfinite_skip")]


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    t = Trainer(_cfg(tmp_path, "w"), log=lambda s: None)
    t.train_step()
    good = t.save()
    with torch.no_grad():
        t.model.blocks[1].mlp.w1.weight[0, 0] = float("nan")
    t.step = 2
    with pytest.raises(NonFiniteError, match="no checkpoint written"):
        t.save()
    assert latest_checkpoint(t.ckpt_dir) == good


def test_cli_stops_with_one_line(tmp_path, capsys):
    cfg = _cfg(tmp_path, "cli")  # an absurd learning rate: the loss turns non-finite within a few steps
    sets = [f"train.out_dir='{cfg.train.out_dir}'", "train.name=cli", "train.lr=1e30", "train.grad_clip=0.0",
            "train.warmup_steps=0", "train.progress=false", f"data.cache_dir='{cfg.data.cache_dir}'"]
    code = main(["train", "--config", "tiny", *sum((["--set", s] for s in sets), [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("qklab: stopped: non-finite") and "Traceback" not in err[0]


def test_skip_resets_the_qkclip_tracker(tmp_path):
    """The logits of a dropped step must not decide QK-clip's next clip."""
    t = Trainer(_cfg(tmp_path, "skipclip", "train.nonfinite=skip", "qk.controller=qkclip"), log=lambda s: None)
    _poison_gradient_at(t, 3)
    for _ in range(3):
        t.train_step()
    assert t.step == 3
    for b in t.model.blocks:  # popped by the skip: nothing seen since
        assert torch.isneginf(b.attn.max_logit).all()
    t.train_step()
    for b in t.model.blocks:  # step 4 was applied and its tracker consumed by the clip
        assert torch.isneginf(b.attn.max_logit).all()
    assert t.controller.metrics()["qkclip_smax"] > 0
