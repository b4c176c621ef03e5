"""Fuzzed configs and command lines: each is a valid config (or run) or one line with exit 2, never a
traceback. Most examples only load and validate; a few train for a step or two."""

from __future__ import annotations

import dataclasses
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qklab.config import ConfigError, DataConfig, ModelConfig, TrainConfig, load_config
from qklab.methods import CONTROLLERS, METHODS
from tests.faults.common import LEDGER, cli

KEYS = ([f"model.{f.name}" for f in dataclasses.fields(ModelConfig)]
        + [f"train.{f.name}" for f in dataclasses.fields(TrainConfig)]
        + [f"data.{f.name}" for f in dataclasses.fields(DataConfig)]
        + ["qk.method", "qk.controller", "qk.softcap", "qk.softcap.cap", "qk.qknorm.eps", "qk.quack.bogus",
           "train", "model.d_model.x", "nosuch.key", "qk.options", ""])
WORDS = [*METHODS, *CONTROLLERS, "auto", "mha", "mla", "eager", "sdpa", "adamw", "muon", "cosine", "skip", "stop",
         "bf16", "cpu", "cuda", "..", ".", "/", "a/b", "runs", "pystdlib", "bytes", "bpe", "[1, 2]", "{a = 1}", "'x'",
         '"unterminated', "nan", "inf", "-inf", "true", "false", "1e400", "0x10", "", "=", "é"]
VALUES = st.one_of(
    st.integers(-3, 300).map(str), st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(WORDS),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6),
)
OVERRIDES = st.lists(st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=4)
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(FUZZ, max_examples=300)
@given(OVERRIDES)
def test_fuzzed_overrides_validate_or_fail_with_one_line(overrides):
    LEDGER.fuzzed += 1
    try:
        load_config("tiny", overrides)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).strip()


TOKENS = ["--config", "-c", "tiny", "small_mla", "nope", "configs/tiny.toml", "--set", "-s", "--resume",
          "--overwrite", "--bogus", "train.lr=1e-3", "train.lr", "=", "x=1", "", "--", "-"]


@settings(FUZZ, max_examples=60)
@given(st.lists(st.sampled_from(TOKENS), max_size=6))
def test_fuzzed_train_arguments_fail_with_one_line_or_parse(faults_root, argv):
    LEDGER.fuzzed += 1
    with tempfile.TemporaryDirectory() as d:  # a valid combination would train: make it short and local
        short = ["--set", f"train.out_dir='{d}'", "--set", "train.steps=1", "--set", "train.diag_every=0",
                 "--set", "train.progress=false", "--set", "train.threads=1",
                 "--set", f"data.cache_dir='{faults_root / 'cache'}'"]
        r = cli("train", *argv, *short) if "--" not in argv else cli("train", *argv)
    assert r.code in (0, 2), r.err
    assert "Traceback" not in r.err
    if r.code == 2:
        assert len(r.err_lines) == 1 and r.err_lines[0].startswith("qklab: error:"), r.err


SMALL_KEYS = ["model.d_model", "model.n_heads", "model.n_kv_heads", "model.n_layers", "model.d_ff", "train.batch_size",
              "train.seq_len", "train.grad_accum", "train.warmup_steps", "train.eval_every", "train.log_every",
              "train.ckpt_every", "train.keep_ckpts", "qk.method", "qk.controller", "model.attention",
              "train.optimizer", "train.lr", "train.schedule"]
SMALL_VALUES = st.one_of(st.integers(-1, 96).map(str),
                         st.sampled_from([*METHODS, *CONTROLLERS, "mla", "muon", "constant", "0.01", "-1e-3", "nan"]))
SMALL = st.lists(st.tuples(st.sampled_from(SMALL_KEYS), SMALL_VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=3)


@settings(FUZZ, max_examples=8)
@given(SMALL)
def test_fuzzed_small_configs_train_or_fail_with_one_line(faults_root, overrides):
    LEDGER.fuzzed += 1
    with tempfile.TemporaryDirectory() as d:
        sets = [*overrides, f"train.out_dir='{d}'", f"data.cache_dir='{faults_root / 'cache'}'", "train.steps=2",
                "train.diag_every=0", "train.progress=false", "train.threads=1", "train.name=fz"]
        r = cli("train", "--config", "tiny", *[a for s in sets for a in ("--set", s)])
    assert "Traceback" not in r.err, r.err
    assert r.code in (0, 1, 2), r.err
    if r.code == 0:
        assert r.out.splitlines()[-1].startswith("done:")
    else:
        assert len(r.err_lines) == 1 and r.err_lines[0].startswith(("qklab: error:", "qklab: stopped:")), r.err
