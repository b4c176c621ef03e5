"""Config loading: presets, overrides, and one clear line (exit code 2) for every user mistake."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qklab.cli import build_parser, main
from qklab.config import ConfigError, comparable, flatten, load_config, resume_changes
from qklab.methods import METHODS
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
        ("qk.softcap.cap=-1", "qk.softcap.cap=-1.0 is out of range: it must be > 0"),
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
    r = subprocess.run([sys.executable, "-m", "qklab", "train", "--set", "qk.method=nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "qk.method='nope' is unknown" in r.stderr


@pytest.mark.parametrize(
    "override, needle",
    [  # values that used to pass validation and then crash or misbehave
        ("train.eval_every=0", "train.eval_every=0 is out of range"),
        ("train.log_every=0", "train.log_every=0 is out of range"),
        ("train.threads=-1", "train.threads=-1 is out of range"),
        ("model.d_ff=-64", "model.d_ff=-64 is out of range"),
        ("model.init_std=-0.02", "model.init_std=-0.02 is out of range"),
        ("model.init_std=0", "model.init_std=0.0 is out of range"),
        ("train.lr=inf", "'train.lr' must be a finite number, got inf"),
        ("train.lr=nan", "'train.lr' must be a finite number, got nan"),
        ("qk.softcap.cap=inf", "'qk.softcap.cap' must be a finite number"),
        ("train.warmup_steps=-1", "train.warmup_steps=-1 is out of range"),
        ("train.ckpt_every=-5", "train.ckpt_every=-5 is out of range"),
        ("train.keep_ckpts=0", "train.keep_ckpts=0 is out of range"),
        ("train.seed=-1", "train.seed=-1 is out of range"),
        ("train.beta2=1.0", "train.beta2=1.0 is out of range"),
        ("train.skip_limit=2", "train.skip_limit=2.0 is out of range"),
        ("model.d_model=0", "model.d_model=0 is out of range: it must be > 0"),  # names the key
        ("model.n_layers=-2", "model.n_layers=-2 is out of range"),
        ("train.name=..", "train.name='..' is not a plain run name"),
        ("train.name='a/b'", "train.name='a/b' is not a plain run name"),
    ],
)
def test_validation_gaps_are_closed(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_messages_name_the_key_and_list_choices_plainly():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["qk.softcap=1"])
    assert "'qk.softcap' is the section of softcap's options" in str(e.value) and "qk.softcap.<option>" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["qk.method=bogus"])
    assert "[" not in str(e.value) and f"choose one of {', '.join(sorted(METHODS))}" in str(e.value)


def test_train_help_lists_every_preset():
    helptext = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name in ("tiny", "small", "small_mla"):
        assert name in helptext


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("qklab: error: unrecognized arguments: --bogus")


def test_resume_changes_name_only_keys_that_may_not_change():
    a = comparable(load_config("tiny"))
    b = comparable(load_config("tiny", ["train.steps=99", "train.lr=1e-4", "qk.method=softcap", "qk.softcap.cap=20"]))
    assert resume_changes(a, b) == ["qk.method 'none' -> 'softcap'"]
    c = comparable(load_config("tiny", ["qk.method=softcap"]))
    assert resume_changes(c, b) == ["qk.softcap.cap 50.0 -> 20.0"]  # a method option counts too
    assert resume_changes({"train": {"steps": 1}}, b) == []  # keys a run did not save are not compared


def test_flatten_gives_dotted_keys_and_lifts_only_what_it_is_told():
    nested = {"qk": {"method": "softcap", "options": {"softcap": {"cap": 30.0}}}, "train.lr": 1e-3}
    assert flatten(nested) == {"qk.method": "softcap", "qk.options.softcap.cap": 30.0, "train.lr": 1e-3}
    assert flatten(nested, lift={"qk.options"}) == {"qk.method": "softcap", "qk.softcap.cap": 30.0, "train.lr": 1e-3}
    assert flatten({"softcap": {"cap": 1}}, "qk.") == {"qk.softcap.cap": 1}


def test_choices_come_from_the_field_types():
    """A choice field is a Literal: a value outside it is one line listing the choices, also when the
    config is built in code; a value of another type is a type error."""
    import typing

    from qklab.config import ModelConfig, RunConfig, TrainConfig

    hints = {sec: typing.get_type_hints(cls) for sec, cls in (("model", ModelConfig), ("train", TrainConfig))}
    choices = {f"{sec}.{k}": typing.get_args(tp) for sec, h in hints.items() for k, tp in h.items()
               if typing.get_origin(tp) is typing.Literal}
    assert {"model.attn_impl", "model.attention", "model.rope_scaling", "train.optimizer", "train.schedule",
            "train.dtype", "train.device", "train.nonfinite", "train.parallel", "train.ckpt_format"} <= set(choices)
    needs = {"yarn": ["model.yarn_factor=2"]}  # choices that need another key set
    for key, allowed in choices.items():
        for ok in allowed:
            load_config("tiny", [f"{key}={ok}", *needs.get(ok, [])])
        with pytest.raises(ConfigError) as e:
            load_config("tiny", [f"{key}=bogus"])
        assert str(e.value) == f"{key}='bogus': use {', '.join(allowed[:-1])} or {allowed[-1]}"
    assert "train.optimizer='sgd': use adamw or muon" in _error(["train.optimizer=sgd"])
    assert "train.device='tpu': use auto, cpu or cuda" in _error(["train.device=tpu"])
    assert _error(["train.optimizer=1"]) == "'train.optimizer' must be str, got int 1"
    assert _error(["train.trackers=['x']"]) == ("train.trackers=['x']: use a list of distinct names from "
                                               "tensorboard, wandb")
    with pytest.raises(ConfigError, match="train.dtype='fp16': use fp32 or bf16"):
        RunConfig(train=TrainConfig(dtype="fp16")).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model.d_model=0 is out of range: it must be > 0"):
        RunConfig(model=ModelConfig(d_model=0)).validate()


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_neutral_and_resumable_keys_come_from_the_fields():
    """The keys a study cell's hash leaves out and the keys a resume may change, as the fields' metadata
    says: pinned, since a change to either moves every committed cell hash or what --resume accepts."""
    from qklab.config import NEUTRAL, RESUMABLE

    assert NEUTRAL == {"train.out_dir", "train.name", "train.progress", "train.threads", "train.ckpt_format",
                       "data.cache_dir", "data.token_pack"}
    assert RESUMABLE == {
        "preset", "train.name", "train.out_dir", "train.steps", "train.log_every", "train.eval_every",
        "train.eval_batches", "train.ckpt_every", "train.keep_ckpts", "train.progress", "train.threads",
        "train.device", "train.compile", "train.diag_every", "train.diag_batch", "train.nonfinite",
        "train.skip_limit", "train.lr", "train.grad_clip", "data.cache_dir", "data.token_pack", "train.trackers",
        "train.parallel", "train.ckpt_format"}


MLA_NARROW = ["model.attention=mla", "qk.method=qkmap", "qk.qkmap.proj_dim=4"]
MLA_WIDTH_ERROR = ("qk.method='qkmap' with these options changes the q/k projection widths (per head 24 -> 4), which "
                   "model.attention=mla does not support; use model.attention=mha or options that keep the per-head "
                   "q/k width 24")


def test_every_width_rule_is_checked_in_validation(tmp_path, capsys):
    """MLA with a method that changes the q/k widths is refused by the config and by a study file, before any
    cell exists (it used to pass both and fail inside the worker, recorded as a failed cell)."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", MLA_NARROW)
    assert str(e.value) == MLA_WIDTH_ERROR
    assert load_config("tiny", [*MLA_NARROW[:2], "qk.qkmap.proj_dim=24"]).qk.method == "qkmap"  # MLA's own width
    study = tmp_path / "s.toml"
    study.write_text('[study]\nconfig = "tiny"\nseeds = [0]\n[variants.a]\n"model.attention" = "mla"\n'
                     '"qk.method" = "qkmap"\n"qk.qkmap.proj_dim" = 4\n')
    assert main(["study", "run", str(study), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"qklab: error: variant 'a', lr x1: {MLA_WIDTH_ERROR}"
    assert not (tmp_path / "o").exists()


def test_python_constructors_raise_the_cli_errors():
    """GPT and QKConfig built from Python give the same one-line ConfigError as a config file: an unknown
    method, options as a dict (converted and checked as TOML's are), an impossible shape."""
    from qklab.config import ModelConfig, QKConfig
    from qklab.errors import UserError
    from qklab.model import GPT

    small = {"vocab_size": 50, "d_model": 64, "n_heads": 4, "n_layers": 1}
    cases = [
        (lambda: QKConfig(method="qk_norm"),
         f"qk.method='qk_norm' is unknown; choose one of {', '.join(sorted(METHODS))}"),
        (lambda: QKConfig(controller="quack2"), "qk.controller='quack2' is unknown; choose one of"),
        (lambda: QKConfig(method="softcap", options={"softcap": {"cop": 20.0}}),
         "unknown key 'qk.softcap.cop'; known keys here: cap"),
        (lambda: QKConfig(method="softcap", options={"softcap": {"cap": "x"}}), "'qk.softcap.cap' must be float"),
        (lambda: QKConfig(options={"bogus": {}}), "qk options for 'bogus', which is no method or controller"),
        (lambda: GPT(ModelConfig(**{**small, "n_heads": 3})),
         "model.n_heads=3 does not divide model.d_model=64; pick heads that divide the width"),
        (lambda: GPT(ModelConfig(**{**small, "attention": "mla"}),
                     QKConfig(method="qkmap", options={"qkmap": {"proj_dim": 4}})),
         "changes the q/k projection widths (per head 24 -> 4)"),
        (lambda: GPT(ModelConfig(**{**small, "attn_impl": "sdpa"}), QKConfig(method="softcap")),
         "qk.method='softcap' rewrites logits, which the fused sdpa path cannot do"),
        (lambda: GPT(ModelConfig(**{**small, "vocab_size": 0})), "model.vocab_size must be set"),
    ]
    for build, needle in cases:
        with pytest.raises(ConfigError) as e:
            build()
        assert isinstance(e.value, UserError | ValueError) and needle in str(e.value) and "\n" not in str(e.value)
    qk = QKConfig(method="softcap", options={"softcap": {"cap": 20}})  # a dict, as TOML gives it
    assert qk.opts("softcap") == SoftCapOptions(cap=20.0)
    model = GPT(ModelConfig(**small), qk)
    assert model.blocks[0].attn.qk.opts.cap == 20.0
