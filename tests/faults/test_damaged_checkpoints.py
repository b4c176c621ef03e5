"""Truncated, byte-flipped and missing checkpoint files: resume and probe fall back to the newest good
checkpoint and say which; the resumed run still ends bitwise equal to the uninterrupted one."""

from __future__ import annotations

import json
import signal

import pytest

from qklab.rundir.checkpoint import latest_checkpoint, read_state, verify_checkpoint
from qklab.rundir.metrics import MetricsLog
from tests.faults.common import LEDGER, STEPS, child, cli, copy_run, same_as_reference, sets, wait_for_step


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # one bit, deep in the tensors / the pickled state
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated-weights": lambda ck: _truncate(ck / "model.safetensors"),
    "truncated-state": lambda ck: _truncate(ck / "state.pt"),
    "flipped-weights": lambda ck: _flip(ck / "model.safetensors"),
    "flipped-state": lambda ck: _flip(ck / "state.pt"),
    "missing-weights": lambda ck: (ck / "model.safetensors").unlink(),
    "missing-state": lambda ck: (ck / "state.pt").unlink(),
    "garbled-manifest": lambda ck: (ck / "manifest.json").write_text("{not json"),
}


def _damaged_run(reference, root, how):
    """The reference run with its last two checkpoints damaged as ``how`` says (step_10 stays good),
    its training cut back to step 10 as if it had crashed there."""
    run = copy_run(reference, root, "dmg")
    for step in (20, 30):
        DAMAGE[how](run / "ckpt" / f"step_{step:07d}")
    return run


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_resume_falls_back_to_the_newest_good_checkpoint(reference, root, how):
    run = _damaged_run(reference, root, how)
    LEDGER.injected += 1
    assert verify_checkpoint(run / "ckpt" / "step_0000030") is not None
    r = cli("train", "--config", "tiny", *sets(root, "dmg"), "--resume")
    assert r.code == 0, r.err
    warn = [ln for ln in r.out.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "step_0000030 is damaged" in warn[0] and "using step_0000010" in warn[0], r.out
    assert f"resumed {run} at step 10" in r.out
    assert same_as_reference(run, reference)


def test_a_single_flipped_bit_is_caught_by_the_checksum(reference, root):
    run = copy_run(reference, root, "bit")
    ck = run / "ckpt" / f"step_{STEPS:07d}"
    _flip(ck / "model.safetensors")
    LEDGER.injected += 1
    assert "sha256" in verify_checkpoint(ck)
    with pytest.raises(ValueError, match="damaged"):
        read_state(ck)
    assert latest_checkpoint(run / "ckpt").name == "step_0000020"
    LEDGER.recovered += 1


def test_probe_uses_the_newest_good_checkpoint_and_refuses_a_damaged_one(reference, root):
    run = _damaged_run(reference, root, "truncated-weights")
    LEDGER.injected += 1
    r = cli("probe", str(run / "ckpt" / "step_0000030"), "--no-evidence", "--batch", "2", "--out", str(root / "p1"))
    assert r.code == 2 and len(r.err_lines) == 1 and "damaged" in r.err_lines[0], r.err
    r = cli("probe", str(run), "--no-evidence", "--batch", "2", "--out", str(root / "p2"))
    assert r.code == 0, r.err
    assert json.loads((root / "p2" / "probes.json").read_text())["step"] == 10
    LEDGER.recovered += 1


def test_no_good_checkpoint_left_is_one_line(reference, root):
    run = copy_run(reference, root, "none")
    for ck in (run / "ckpt").glob("step_*"):
        _truncate(ck / "state.pt")
    LEDGER.injected += 1
    r = cli("train", "--config", "tiny", *sets(root, "none"), "--resume")
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert r.err_lines[0].startswith("qklab: error: --resume: no usable checkpoint")


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_export_names_the_damaged_checkpoint_it_skips(reference, root):
    """Truncated weights in the newest checkpoints: export says which it skipped and exports step 10,
    whose weights it writes (it used to say 'exported step 30' of an older one, silently)."""
    import torch

    run = _damaged_run(reference, root, "truncated-weights")
    LEDGER.injected += 1
    r = cli("export", str(run), "--out", str(root / "x"))
    assert r.code == 0, r.err
    warn = [ln for ln in r.err_lines if ln.startswith("warning:")]
    assert len(warn) == 1 and "step_0000030 is damaged" in warn[0] and "using step_0000010" in warn[0], r.err
    assert "exported step 10" in r.out
    got = _weights(root / "x" / "model.safetensors")
    want = _weights(run / "ckpt" / "step_0000010" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    r = cli("export", str(run / "ckpt" / "step_0000030"), "--out", str(root / "y"))
    assert r.code == 2 and len(r.err_lines) == 1 and "damaged" in r.err_lines[0], r.err
    assert not (root / "y" / "model.safetensors").exists()
    LEDGER.recovered += 1


def test_a_checkpoint_without_a_manifest_is_refused_unless_allowed(reference, root):
    """No manifest: nothing can tell a flipped byte from good weights, so probe and export refuse it (one
    line naming the option), fall back past it to one that verifies, and use it with --allow-unverified."""
    run = copy_run(reference, root, "nomf")
    for ck in (run / "ckpt").glob("step_*"):
        (ck / "manifest.json").unlink()
    _flip(run / "ckpt" / "step_0000030" / "model.safetensors")
    LEDGER.injected += 1
    for argv in (["export", str(run), "--out", str(root / "x")],
                 ["probe", str(run), "--no-evidence", "--batch", "2", "--out", str(root / "p")],
                 ["export", str(run / "ckpt" / "step_0000030"), "--out", str(root / "x")]):
        r = cli(*argv)
        assert r.code == 2 and len(r.err_lines) == 1, r.err
        assert "unverified" in r.err_lines[0] and "--allow-unverified" in r.err_lines[0], r.err
    assert not (root / "x" / "model.safetensors").exists() and not (root / "p" / "probes.json").exists()
    # one good checkpoint with a manifest: used, the unverified newer ones named
    good = copy_run(reference, root, "onegood")
    for step in (20, 30):
        (good / "ckpt" / f"step_{step:07d}" / "manifest.json").unlink()
    r = cli("export", str(good), "--out", str(root / "g"))
    assert r.code == 0 and "exported step 10" in r.out and "step_0000030 is unverified" in r.err, r.err
    r = cli("export", str(run / "ckpt" / "step_0000020"), "--out", str(root / "u"), "--allow-unverified")
    assert r.code == 0 and "exported step 20" in r.out, r.err
    LEDGER.recovered += 1


def test_probe_compare_names_a_damaged_checkpoint_and_remeasures_a_damaged_cache(reference, root):
    """`probe --compare`: a run whose newest checkpoint is damaged is probed at its newest good one (named);
    a cached probes.json of {} or one measured with other options is measured again (named), not used."""
    a = _damaged_run(reference, root, "truncated-weights")
    b = copy_run(reference, root, "b")
    cache = b / "probes" / "step_0000030" / "probes.json"
    cache.parent.mkdir(parents=True)
    cache.write_text("{}")
    LEDGER.injected += 2
    args = ["--no-evidence", "--batch", "2", "--out", str(root / "cmp")]
    r = cli("probe", "--compare", str(a), str(b), *args)
    assert r.code == 0, r.err
    assert any("step_0000030 is damaged" in ln and "using step_0000010" in ln for ln in r.err_lines), r.err
    assert any(f"{cache}: not a qklab.probes/2 result; measuring it again" in ln for ln in r.err_lines), r.err
    runs = json.loads((root / "cmp" / "compare.json").read_text())["runs"]
    assert runs["dmg"]["step"] == 10 and runs["b"]["step"] == 30
    assert json.loads(cache.read_text())["options"]["batch"] == 2  # measured again, with these options
    r = cli("probe", "--compare", str(a), str(b), "--no-evidence", "--batch", "3", "--out", str(root / "cmp"))
    assert r.code == 0 and any("measured with other options" in ln for ln in r.err_lines), r.err
    assert json.loads(cache.read_text())["options"]["batch"] == 3
    LEDGER.recovered += 2



def test_a_resume_past_damaged_checkpoints_keeps_what_it_writes(reference, root):
    """Resumed at step 10 past damaged checkpoints of steps 20 and 30, on another cadence (15) and keeping 2,
    and killed at step 17: the checkpoint of step 15 is there (pruning used to keep the two damaged ones by
    name and delete it, leaving no usable checkpoint), the damaged ones are gone, and the run resumes from
    it to end as the uninterrupted one."""
    run = _damaged_run(reference, root, "truncated-state")
    proc = child(["train", "--config", "tiny", *sets(root, "dmg", "train.ckpt_every=15", "train.keep_ckpts=2"),
                  "--resume"])
    MetricsLog(run / "metrics.jsonl", truncate_after=10).close()  # as the resume will: wait_for_step then waits
    wait_for_step(run, 17, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    LEDGER.injected += 2
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
    assert sorted(p.name for p in (run / "ckpt").glob("step_*")) == ["step_0000010", "step_0000015"]
    assert verify_checkpoint(run / "ckpt" / "step_0000015") is None
    r = cli("train", "--config", "tiny", *sets(root, "dmg"), "--resume")
    assert r.code == 0, r.err
    assert f"resumed {run} at step 15" in r.out and "warning" not in r.out, r.out
    assert same_as_reference(run, reference)
