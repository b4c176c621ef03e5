"""The transformers round trip: apply -> train -> save_pretrained -> from_pretrained in a fresh process gives
back the same model (every parameter, logits to 1e-6) for every family and every method and option that
``qklab.hf.apply`` supports; transformers without qklab refuses such a folder instead of loading a different
model; a model left unchanged saves a plain folder; a second method is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qklab.errors import ConfigError  # noqa: E402
from qklab.hf import apply  # noqa: E402
from qklab.hf import from_pretrained as qk_from_pretrained  # noqa: E402
from tests.hf.common import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
CASES = {  # name: (method, options, attn_gate, attn_sink)
    "qknorm": ("qknorm", {}, "none", False),
    "qknorm-noqgain": ("qknorm", {"q_gain": False}, "none", False),
    "qknorm-flat-head": ("qknorm", {"stats": "flat", "gains": "head"}, "none", False),
    "qknorm-p3": ("qknorm", {"p": 3.0}, "none", False),
    "qkmap": ("qkmap", {}, "none", False),
    "qkmap-coord": ("qkmap", {"n_freqs": 2, "sharing": "coord"}, "none", False),
    "quest": ("quest", {}, "none", False),
    "quest-headscale": ("quest", {"head_scale": True}, "none", False),
    "softcap": ("softcap", {"cap": 2.0}, "none", False),
    "ssmax": ("ssmax", {"ref_len": 16}, "none", False),
    "alibi": ("alibi", {"slope_scale": 4.0}, "none", False),
    "gate-head": ("none", {}, "head", False),
    "gate-element": ("none", {}, "element", False),
    "sink": ("none", {}, "none", True),
    "qknorm-gate-sink": ("qknorm", {}, "head", True),
}
X = torch.arange(3, 3 + 2 * 11).reshape(2, 11) % 97 + 3  # (B, T) token ids


def _trained(family: str, case: str) -> torch.nn.Module:
    """A tiny model with the case applied and a few SGD steps taken, so that every parameter (the method's
    too) differs from its initial value."""
    method, opts, gate, sink = CASES[case]
    model = apply(tiny_model(family), method, attn_gate=gate, attn_sink=sink, **opts).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        model(X, labels=X).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Every family x case saved with save_pretrained, beside its logits and state dict."""
    root = tmp_path_factory.mktemp("pretrained")
    for family in FAMILIES:
        for case in CASES:
            model, out = _trained(family, case), root / f"{family}-{case}"
            model.save_pretrained(out)
            with torch.no_grad():
                torch.save({"logits": model(X).logits, "state": model.state_dict()}, out / "reference.pt")
    return root


LOAD = r"""
import sys, torch
from pathlib import Path
{imports}
from transformers import AutoModelForCausalLM
x = torch.load(sys.argv[2])
for folder in sorted(Path(sys.argv[1]).iterdir()):
    ref = torch.load(folder / "reference.pt")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    state = model.state_dict()
    assert state.keys() == ref["state"].keys(), (folder.name, state.keys() ^ ref["state"].keys())
    same = all(torch.equal(state[k], v) for k, v in ref["state"].items())
    with torch.no_grad():
        gap = (model(x).logits - ref["logits"]).abs().max().item()
    print(folder.name, type(model).__name__, same, gap)
"""


def _load_all(folder: Path, tmp_path: Path, imports: str) -> list[list[str]]:
    torch.save(X, tmp_path / "x.pt")
    p = subprocess.run([sys.executable, "-c", LOAD.format(imports=imports), str(folder), str(tmp_path / "x.pt")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return [line.split() for line in p.stdout.splitlines()]


@pytest.mark.parametrize("imports", ["import qklab.hf", "import transformers\nimport qklab.hf"],
                         ids=["qklab-first", "transformers-first"])
def test_every_method_comes_back_from_a_fresh_process(saved, tmp_path, imports):
    rows = _load_all(saved, tmp_path, imports)
    assert [r[0] for r in rows] == sorted(f"{f}-{c}" for f in FAMILIES for c in CASES)
    for name, cls, same, gap in rows:
        family = name.split("-")[0]
        assert cls == f"QK{dict(llama='Llama', mistral='Mistral', qwen2='Qwen2', qwen3='Qwen3')[family]}ForCausalLM"
        assert same == "True" and float(gap) <= 1e-6, (name, same, gap)


def test_without_qklab_such_a_folder_is_refused_never_loaded_different(saved):
    code = ("import sys\nfrom pathlib import Path\nfrom transformers import AutoModelForCausalLM\n"
            "for f in sorted(Path(sys.argv[1]).iterdir()):\n"
            "    try:\n        AutoModelForCausalLM.from_pretrained(f)\n        print(f.name, 'LOADED')\n"
            "    except ValueError as e:\n        print(f.name, str(e).split('`')[1])\n")
    p = subprocess.run([sys.executable, "-c", code, str(saved)], capture_output=True, text=True, cwd=ROOT)
    rows = [line.split() for line in p.stdout.splitlines()]
    assert len(rows) == len(FAMILIES) * len(CASES)
    assert all(kind == f"qklab_{name.split('-')[0]}" for name, kind in rows), rows


def test_the_folder_says_what_it_holds(saved):
    cfg = json.loads((saved / "qwen3-qkmap-coord" / "config.json").read_text())
    assert cfg["model_type"] == "qklab_qwen3" and cfg["architectures"] == ["QKQwen3ForCausalLM"]
    rec = cfg["qklab"]
    assert (rec["method"], rec["options"]["n_freqs"], rec["options"]["sharing"], rec["attn_gate"],
            rec["attn_sink"]) == ("qkmap", 2, "coord", "none", False)


def test_sharded_folders_dtype_and_device_map(tmp_path):
    """A folder in several shards; dtype and device_map as transformers takes them."""
    model = _trained("llama", "qknorm-gate-sink")
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1
    back = qk_from_pretrained(tmp_path / "m", device_map="cpu").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(X).logits, model(X).logits, rtol=0, atol=1e-6)
    half = qk_from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    for (n, p), (m, q) in zip(half.named_parameters(), model.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q.to(torch.bfloat16)), n
    assert half.model.layers[0].self_attn.qk_method.q_norm.weight.dtype == torch.bfloat16


def test_an_unchanged_model_saves_a_plain_folder(tmp_path):
    model = apply(tiny_model("llama"), "none")
    model.save_pretrained(tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "qklab" not in cfg and type(model) is transformers.LlamaForCausalLM
    assert type(qk_from_pretrained(tmp_path / "plain")) is transformers.LlamaForCausalLM


def test_a_second_method_is_refused_and_a_later_gate_recorded(tmp_path):
    model = apply(tiny_model("llama"), "qknorm")
    with pytest.raises(ConfigError) as e:
        apply(model, "softcap", cap=2.0)
    assert str(e.value) == ("this model already has qklab's qknorm (model.config.qklab); qklab.hf.apply converts a "
                            "model once: start from a model without a method to try another")
    apply(model, "none", attn_sink=True)  # a sink added later is recorded beside the method
    assert (model.config.qklab["method"], model.config.qklab["attn_sink"]) == ("qknorm", True)
    model.save_pretrained(tmp_path / "m")
    back = qk_from_pretrained(tmp_path / "m")
    assert back.model.layers[1].self_attn.attn_sink is not None
    assert type(back.model.layers[1].self_attn.qk_method).__name__ == "QKNorm"


def test_apply_leaves_a_config_shared_with_other_models_as_it_was(tmp_path):
    """transformers' from_config keeps the config object it is given: apply must convert only its own model,
    not a sibling built from the same config, nor a later model built from it."""
    from tests.hf.common import tiny_config

    cfg = tiny_config("llama")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    treated = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        ref = base(X).logits  # (B, T, V) before anything is applied
    apply(treated, "qknorm")
    assert type(cfg) is transformers.LlamaConfig and not hasattr(cfg, "qklab")
    assert cfg._attn_implementation == "eager" and base.config is cfg
    base.save_pretrained(tmp_path / "base")
    assert "qklab" not in json.loads((tmp_path / "base" / "config.json").read_text())
    back = qk_from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    later = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(back) is type(later) is transformers.LlamaForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(base(X).logits, ref, atol=0, rtol=0)
        torch.testing.assert_close(back(X).logits, ref, atol=0, rtol=0)
