"""Resume is bitwise exact on CPU; checkpoints survive SIGKILL mid-write; metrics match golden losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

from qklab.config import load_config
from qklab.rundir.checkpoint import latest_checkpoint, load_checkpoint, read_state, save_checkpoint, write_manifest
from qklab.rundir.metrics import read_metrics
from qklab.train.signals import RunInterrupted
from qklab.train.trainer import Trainer
from tests.conftest import another_cpu_capability

GOLDEN = Path(__file__).parents[1] / "golden" / "tiny_none_losses.json"


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", f"train.name={name}", "train.steps=20",
                                "train.log_every=1", "train.ckpt_every=10", "train.eval_every=10",
                                "train.progress=false", f"data.cache_dir='{tmp_path / 'cache'}'", *extra])


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _assert_resumes_bitwise(tmp_path: Path, opt: list[str], between=None) -> None:
    """A run stopped after its step-10 checkpoint (``between`` may rewrite that checkpoint) and resumed
    ends as the uninterrupted run: every loss and weight equal, bit for bit."""
    full = Trainer(_cfg(tmp_path, "full", *opt), log=lambda s: None)
    full.run()

    part = Trainer(_cfg(tmp_path, "part", *opt), log=lambda s: None)
    for _ in range(10):
        part.train_step()
    ck = part.save()
    part.close()
    del part  # "crash" after the step-10 checkpoint (a dead process holds no lock)
    if between is not None:
        between(ck)
    resumed = Trainer(_cfg(tmp_path, "part", *opt), resume=True, log=lambda s: None)
    assert resumed.step == 10
    resumed.run()

    a, b = _losses(full.run_dir), _losses(resumed.run_dir)
    assert [a[s] for s in range(11, 21)] == [b[s] for s in range(11, 21)]  # bitwise: == on floats
    for (n, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("optimizer, controller", [("adamw", "none"), ("muon", "none"), ("muon", "quack"),
                                                   ("adamw", "qkclip")])
def test_resume_is_bitwise_exact(tmp_path, optimizer, controller):
    _assert_resumes_bitwise(tmp_path, [f"train.optimizer={optimizer}", f"qk.controller={controller}",
                                       "qk.qkclip.tau_clip=2.0"])


def _numpy_rng_as_array(ck: Path) -> None:
    """Rewrite ``ck``'s state.pt as qklab wrote it before numpy's RNG state was plain ints: the tuple of
    ``np.random.get_state()``, an array for its key (its manifest rewritten to match)."""
    state = read_state(ck)
    rng = state["rng"]["numpy"]
    key = np.asarray(rng["state"]["key"], dtype=np.uint32)
    state["rng"]["numpy"] = (rng["bit_generator"], key, rng["state"]["pos"], rng["has_gauss"], rng["gauss"])
    torch.save(state, ck / "state.pt")
    write_manifest(ck, state["step"])
    assert sorted(get_unsafe_globals_in_checkpoint(ck / "state.pt")) == [  # what weights-only loading refuses
        "numpy._core.multiarray._reconstruct", "numpy.dtype", "numpy.ndarray"]  # but STATE_GLOBALS allows
    again = read_state(ck)["rng"]["numpy"]
    assert again[0] == "MT19937" and again[1].dtype == np.uint32 and np.array_equal(again[1], key)


@pytest.mark.parametrize("opt", [["train.optimizer=adamw"], ["train.optimizer=muon"],
                                 ["train.optimizer=muon", "train.muon_per_head=qk"],
                                 ["train.optimizer=adamw", "qk.controller=quack"],
                                 ["train.optimizer=muon", "qk.controller=qkclip", "qk.qkclip.tau_clip=2.0"],
                                 ["train.optimizer=muon", "train.ckpt_format=sharded"]],
                         ids=["adamw", "muon", "muon-per-head", "adamw-quack", "muon-qkclip", "muon-sharded"])
def test_a_checkpoint_with_numpy_rng_as_an_array_resumes_bitwise_exact(tmp_path, opt):
    """Checkpoints written before numpy's RNG state was stored as plain ints still load (through
    ``STATE_GLOBALS``) and resume bit for bit, whatever optimizer, controller and format wrote them."""
    _assert_resumes_bitwise(tmp_path, opt, between=_numpy_rng_as_array)


def test_losses_match_golden(tmp_path):
    """Golden file: regenerate with QKLAB_REGEN_GOLDEN=1 after an intended change of numerics."""
    t = Trainer(_cfg(tmp_path, "golden"), log=lambda s: None)
    t.run()
    got = [_losses(t.run_dir)[s] for s in range(1, 21)]
    if os.environ.get("QKLAB_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert got[-1] < got[0] - 1.0  # and it learns


def test_run_folder_has_config_metrics_checkpoints(tmp_path):
    t = Trainer(_cfg(tmp_path, "files"), log=lambda s: None)
    t.run()
    info = json.loads((t.run_dir / "config.json").read_text())
    assert info["git_sha"] and info["versions"]["torch"] == torch.__version__
    assert info["corpus"]["files"] > 0 and len(info["corpus"]["sha256"]) == 64
    assert info["train"]["steps"] == 20
    assert latest_checkpoint(t.run_dir / "ckpt").name == "step_0000020"
    evals = [r for r in read_metrics(t.run_dir / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]


def test_config_records_the_machines_a_run_trained_on(tmp_path):
    """config.json names the machine (CPU, the kernels torch dispatches to, threads); a resume on another
    machine adds it from the step it resumed at, one on the same kind keeps the list as it was."""
    t = Trainer(_cfg(tmp_path, "m"), log=lambda s: None)
    for _ in range(10):
        t.train_step()
    t.save()
    t.close()
    info = json.loads((t.run_dir / "config.json").read_text())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    here = {"cpu": cpu or info["machines"][0]["cpu"], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}
    assert info["machines"] == [{"from_step": 0, **here}]
    del t
    other = {"from_step": 0, **here, "cpu_capability": another_cpu_capability()}
    info["machines"] = [other]  # as if the first 10 steps ran elsewhere
    (tmp_path / "runs" / "m" / "config.json").write_text(json.dumps(info))
    resumed = Trainer(_cfg(tmp_path, "m"), resume=True, log=lambda s: None)
    resumed.close()
    got = json.loads((resumed.run_dir / "config.json").read_text())["machines"]
    assert got == [other, {"from_step": 10, **here}]
    del resumed
    again = Trainer(_cfg(tmp_path, "m"), resume=True, log=lambda s: None)  # the same machine again
    again.close()
    assert json.loads((again.run_dir / "config.json").read_text())["machines"] == got


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    from qklab.config import ConfigError

    Trainer(_cfg(tmp_path, "dup"), log=lambda s: None).run()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(_cfg(tmp_path, "dup"), log=lambda s: None)



def test_resume_takes_the_newest_checkpoint_past_a_stale_latest_pointer(tmp_path):
    """A run killed between the rename of its step-20 checkpoint and the pointer's (``latest`` still names
    step 10) resumes at step 20, not at 10."""
    Trainer(_cfg(tmp_path, "stale"), log=lambda s: None).run()
    ckpt = tmp_path / "runs" / "stale" / "ckpt"
    (ckpt / "latest").write_text("step_0000010\n")
    lines: list[str] = []
    resumed = Trainer(_cfg(tmp_path, "stale", "train.steps=30"), resume=True, log=lines.append)
    resumed.close()
    assert resumed.step == 20
    assert lines[-1] == f"resumed {resumed.run_dir} at step 20 from step_0000020"

KILLER = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    import qklab.rundir.checkpoint as ck
    from tests.conftest import tiny_gpt
    torch.manual_seed(0)
    model = tiny_gpt()
    d = Path(sys.argv[1])
    ck.save_checkpoint(d, 1, model, {"marker": "good"})
    def slow_save(obj, path):            # write part of the file, then hang
        with open(path, "wb") as f:
            f.write(b"partial")
            f.flush()
        print("WRITING", flush=True)
        time.sleep(60)
    ck.save_state = slow_save
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)
    ck.save_checkpoint(d, 2, model, {"marker": "bad"})
    """
)


def test_sigkill_during_checkpoint_write_keeps_previous(tmp_path):
    root = Path(__file__).parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(tmp_path / "ckpt")], cwd=root,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest.name == "step_0000001"
    from tests.conftest import tiny_gpt

    model = tiny_gpt()
    with torch.no_grad():
        model.tok_emb.weight.zero_()
    state = load_checkpoint(latest, model)
    assert state["marker"] == "good" and state["step"] == 1
    torch.manual_seed(0)
    assert torch.equal(model.tok_emb.weight, tiny_gpt().tok_emb.weight)  # the step-1 weights, not +1
    # the next save cleans the half-written folder up
    save_checkpoint(tmp_path / "ckpt", 3, model, {})
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))


def test_cpu_trainer_flushes_subnormals(tmp_path):
    """On CPU the trainer reads subnormal floats as zero: after a logit blow-up, softmax gradients fall
    into that range and sgemm on them runs many times slower (benchmarks/denormal.py)."""
    tiny = torch.finfo(torch.float32).tiny
    a, b = torch.tensor([tiny]), torch.tensor([0.25])
    assert (a * b).item() == tiny / 4  # subnormal results exist before
    t = Trainer(_cfg(tmp_path, "ftz"), log=lambda s: None)
    assert t.device.type == "cpu"
    assert (a * b).item() == 0.0  # ... and are flushed once a CPU trainer is built
    assert (a * 4).item() == tiny * 4  # normal values are untouched


def _diags(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r["diag"] for r in read_metrics(run_dir / "metrics.jsonl") if "diag" in r}


@pytest.mark.parametrize("stop_at", [13, 10])
def test_a_run_stopped_between_diagnostics_resumes_their_logit_change(tmp_path, stop_at):
    """SIGTERM at step 13, between the diagnostics of steps 10 and 20: the resumed run's step-20 diagnostics
    (the logit change per step since step 10 included) equal the uninterrupted run's, bit for bit. A resume
    used to measure its reference at step 13, giving |s20 - s13| / 7 instead of |s20 - s10| / 10. Stopped
    at step 10, a diagnostics step, the checkpoint carries no reference (the resume measures the same one)."""
    opt = ["train.diag_every=10", "train.ckpt_every=100"]
    full = Trainer(_cfg(tmp_path, "full", *opt), log=lambda s: None)
    full.run()

    part = Trainer(_cfg(tmp_path, "part", *opt), log=lambda s: None)
    step = part.train_step

    def train_step():
        out = step()
        if part.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would: stop after a checkpoint
        return out

    part.train_step = train_step
    with pytest.raises(RunInterrupted):
        part.run()
    ck = latest_checkpoint(part.ckpt_dir)
    assert ck.name == f"step_{stop_at:07d}"
    resumed = Trainer(_cfg(tmp_path, "part", *opt), resume=True, log=lambda s: None)
    resumed.run()
    a, b = _diags(full.run_dir), _diags(resumed.run_dir)
    assert sorted(a) == sorted(b) == [0, 10, 20]
    assert b[20]["logit_change"] == a[20]["logit_change"] and b == a  # every number, bit for bit
    assert bool(read_state(ck).get("monitor")) == (stop_at % 10 != 0)
