"""Sharded (DCP) checkpoints in one process resume bitwise; ``qklab export`` writes the weights of any
checkpoint as one model.safetensors equal to the trained model's state."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model

from qklab.cli import main
from qklab.config import load_config
from qklab.model import GPT
from qklab.rundir.checkpoint import is_sharded, latest_checkpoint, verify_checkpoint
from qklab.rundir.load import resolve_target
from qklab.rundir.metrics import read_metrics
from qklab.train.trainer import Trainer


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", f"train.name={name}", "train.steps=10",
                                "train.log_every=1", "train.ckpt_every=5", "train.eval_every=10", "train.diag_every=0",
                                "train.optimizer=muon", "qk.controller=quack", "train.progress=false",
                                f"data.cache_dir='{tmp_path / 'cache'}'", *extra])


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_sharded_checkpoint_resumes_bitwise_in_one_process(tmp_path):
    full = Trainer(_cfg(tmp_path, "full", "train.ckpt_format=sharded"), log=lambda s: None)
    full.run()
    part = Trainer(_cfg(tmp_path, "part", "train.ckpt_format=sharded"), log=lambda s: None)
    for _ in range(5):
        part.train_step()
    ck = part.save()
    part.close()
    assert is_sharded(ck) and not (ck / "model.safetensors").exists() and verify_checkpoint(ck) is None
    resumed = Trainer(_cfg(tmp_path, "part", "train.ckpt_format=full"), resume=True, log=lambda s: None)
    assert resumed.step == 5
    resumed.run()  # continues from the shards; its own checkpoints are consolidated now
    assert _losses(full.run_dir)[5:] == _losses(resumed.run_dir)  # bitwise
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert not is_sharded(latest_checkpoint(resumed.ckpt_dir))


def test_export_writes_the_trained_weights_from_either_kind(tmp_path, capsys):
    for fmt in ("sharded", "full"):
        t = Trainer(_cfg(tmp_path, fmt, f"train.ckpt_format={fmt}", "train.steps=5"), log=lambda s: None)
        t.run()
        assert main(["export", str(t.run_dir)]) == 0
        assert f"exported step 5 of {t.run_dir}" in capsys.readouterr().out
        stored = load_file(str(t.run_dir / "export" / "model.safetensors"))
        assert set(stored) == set(t.model.state_dict()) - {"tok_emb.weight"}  # tied to lm_head: stored once
        fresh = GPT(t.cfg.model, t.cfg.qk)
        load_model(fresh, str(t.run_dir / "export" / "model.safetensors"))
        for (k, a), b in zip(fresh.state_dict().items(), t.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), (fmt, k)
        saved = json.loads((t.run_dir / "export" / "config.json").read_text())
        assert saved["train"]["ckpt_format"] == fmt and saved["model"] == t.cfg.to_dict()["model"]
        assert resolve_target(latest_checkpoint(t.ckpt_dir)).ckpt == latest_checkpoint(t.ckpt_dir)  # probe-able


def test_export_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such run or checkpoint folder" in err[0]


def test_written_files_follow_the_umask(tmp_path):
    """Every file of a run folder, its checkpoints and an export gets 0666 less the umask, as any program's
    files do: safetensors writes its files 0600, which a shared run folder's readers could not open."""
    import os

    old = os.umask(0o002)  # a group-shared folder's umask: 0664 for every file
    try:
        t = Trainer(_cfg(tmp_path, "modes", "train.steps=5"), log=lambda s: None)
        t.run()
        assert main(["export", str(t.run_dir), "--out", str(tmp_path / "exp")]) == 0
    finally:
        os.umask(old)
    files = [f for d in (t.run_dir, tmp_path / "exp") for f in d.rglob("*") if f.is_file()]
    assert any(f.name == "model.safetensors" for f in files) and len(files) > 5
    assert {f.relative_to(tmp_path).as_posix(): oct(f.stat().st_mode & 0o777) for f in files} == \
        {f.relative_to(tmp_path).as_posix(): "0o664" for f in files}


def test_a_bpe_run_keeps_its_tokenizer_and_load_run_reads_it_back(tmp_path):
    """The run folder holds the tokenizer its tokens came from; ``qklab.load_run`` gives the model of the
    newest checkpoint (equal to the trainer's), the config and that tokenizer (same ids)."""
    import qklab

    t = Trainer(_cfg(tmp_path, "bpe", "train.steps=5", "train.ckpt_every=5", "data.tokenizer=bpe",
                     "data.vocab_size=320"), log=lambda s: None)
    t.run()
    run = qklab.load_run(t.run_dir)
    assert run.step == 5 and run.config.data.tokenizer == "bpe" and run.checkpoint.name == "step_0000005"
    text = "def f(x):\n    return x + 1\n"
    assert run.tokenizer.to_json() == t.data.tokenizer.to_json() and run.tokenizer.encode(text) == \
        t.data.tokenizer.encode(text)
    ours = dict(t.model.state_dict())
    assert all(torch.equal(v, ours[k]) for k, v in run.model.state_dict().items()) and not run.model.training
