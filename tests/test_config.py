"""Config loading: presets, overrides, and one clear line (exit code 2) for every user mistake."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qklab.cli import main
from qklab.config import ConfigError, load_config
from qklab.methods.softcap import SoftCapOptions


def test_preset_and_overrides():
    cfg = load_config("tiny", ["train.lr=1e-4", "qk.method=softcap", "qk.softcap.cap=30", "model.tie_embeddings=false"])
    assert cfg.preset == "tiny" and cfg.model.d_model == 64
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.qk.method == "softcap" and cfg.qk.opts("softcap") == SoftCapOptions(cap=30.0)
    assert cfg.model.tie_embeddings is False


def test_int_accepted_for_float():
    assert load_config("tiny", ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lrr=1", "unknown key 'train.lrr'"),
        ("train.steps=ten", "'train.steps' must be int"),
        ("train.steps=1.5", "'train.steps' must be int"),
        ("model.tie_embeddings=1", "'model.tie_embeddings' must be bool"),
        ("model.n_heads=5", "does not divide model.d_model=64"),
        ("model.n_kv_heads=3", "must divide model.n_heads=4"),
        ("qk.method=qkfoo", "qk.method='qkfoo' is unknown"),
        ("qk.controller=bar", "qk.controller='bar' is unknown"),
        ("qk.softcap.cap=-1", "cap must be > 0"),
        ("qk.softcap.kap=1", "unknown key 'qk.softcap.kap'"),
        ("data.source=/no/such/dir/*.txt", "data.source"),
        ("train.optimizer=sgd", "train.optimizer='sgd'"),
        ("train.seq_len=4096", "exceeds model.max_seq_len"),
        ("nokeyvalue", "must look like key=value"),
    ],
)
def test_bad_config_is_one_clear_error(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("tiny", [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_softcap_refuses_sdpa_path():
    with pytest.raises(ConfigError, match="rewrites logits"):
        load_config("tiny", ["qk.method=softcap", "model.attn_impl=sdpa"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset name"):
        load_config("nonexistent")


def test_cli_exit_code_2_one_line(capsys):
    assert main(["train", "--config", "tiny", "--set", "model.n_heads=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qklab: error:") and "n_heads=3" in err[0]


def test_cli_subprocess_no_traceback():
    r = subprocess.run([sys.executable, "-m", "qklab.cli", "train", "--set", "qk.method=nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "qk.method='nope' is unknown" in r.stderr
