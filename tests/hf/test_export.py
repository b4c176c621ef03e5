"""Export of a qklab GPT to transformers Llama (none) / Qwen3 (qknorm) folders and import back: logits equal
to 1e-5 in transformers, generate() from the folder offline equals qklab's greedy decoding, the
tokenizer keeps its ids, and export -> import -> export is bit-exact. Every other method, gate and sink as
qklab's twin folder (logits to 1e-5 through qklab.hf); `qklab export RUN --hf` from a trained run."""

from __future__ import annotations

import filecmp

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qklab.hf  # noqa: E402
from qklab.config import ModelConfig, QKConfig  # noqa: E402
from qklab.data.tokenizer import BPETokenizer, ByteTokenizer  # noqa: E402
from qklab.hf.export import LAYER_KEYS, export_pretrained, import_pretrained  # noqa: E402
from qklab.methods.qknorm import QKNormOptions  # noqa: E402
from qklab.methods.softcap import SoftCapOptions  # noqa: E402
from qklab.model import GPT  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20


def _gpt(method="none", n_kv=2, tie=True, vocab=300, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                      tie_embeddings=tie, init_std=0.1)
    model = GPT(cfg, QKConfig(method=method)).eval()
    with torch.no_grad():  # non-trivial norm gains
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("method, n_kv, tie", [("none", 2, True), ("none", 0, False), ("qknorm", 2, False),
                                               ("qknorm", 4, True)])
def test_exported_model_matches_in_transformers_and_generates(method, n_kv, tie, tmp_path):
    tok = BPETokenizer.train(TEXTS, 300)
    ours = _gpt(method, n_kv, tie)
    export_pretrained(ours, tmp_path, tokenizer=tok)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(theirs).__name__ == {"none": "LlamaForCausalLM", "qknorm": "Qwen3ForCausalLM"}[method]
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)
        if method == "qknorm":  # apply on a model loaded from a local folder: Qwen3's QK-Norm taken over
            qklab.hf.apply(theirs, "qknorm")
            assert theirs.model.layers[0].self_attn.q_norm is None
            torch.testing.assert_close(theirs(x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    prompt = torch.tensor([hf_tok.encode("def add(a, b):")])
    assert prompt[0].tolist() == tok.encode("def add(a, b):")
    out = theirs.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(out, ours.generate(prompt, max_new_tokens=12, temperature=0))
    assert len(set(out[0, prompt.shape[1]:].tolist())) >= 2  # not one repeated token


@pytest.mark.parametrize("method", ["none", "qknorm"])
def test_export_import_export_is_bit_exact(method, tmp_path):
    ours = _gpt(method, tie=False)
    export_pretrained(ours, tmp_path / "a", tokenizer=ByteTokenizer())
    back, tok = import_pretrained(tmp_path / "a")
    assert back.qk_cfg.method == method
    for (k, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    x = torch.randint(0, 300, (2, 30))
    with torch.no_grad():
        assert torch.equal(back(x)[0], ours(x)[0])
    export_pretrained(back, tmp_path / "b", tokenizer=tok)
    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert filecmp.cmp(tmp_path / "a" / f, tmp_path / "b" / f, shallow=False), f


def test_byte_tokenizer_keeps_its_ids(tmp_path):
    ours = _gpt(vocab=257)
    export_pretrained(ours, tmp_path, tokenizer=ByteTokenizer())
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "naïve café ✓ \x00\x7f tab\tend"
    ids = ByteTokenizer().encode(text)
    assert hf_tok.encode(text) == ids and hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == 256


def test_layer_names_cover_every_parameter():
    names = {k.split(".", 2)[2] for k in _gpt("qknorm").state_dict() if k.startswith("blocks.")}
    assert names == set(LAYER_KEYS)


@pytest.mark.parametrize("bad, match", [("mla", "MHA/GQA"), ("yarn", "YaRN")])
def test_export_refuses_what_has_no_equivalent(bad, match, tmp_path):
    """One line each, before anything is written."""
    extra = {"attention": "mla"} if bad == "mla" else {"rope_scaling": "yarn", "yarn_factor": 2.0}
    model = GPT(ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, **extra))
    with pytest.raises(ValueError, match=match) as e:
        export_pretrained(model, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


TWINS = [("softcap", {"softcap": SoftCapOptions(cap=5.0)}, {}), ("qkmap", {}, {}), ("quest", {}, {}),
         ("ssmax", {}, {}), ("qknorm", {"qknorm": QKNormOptions(p=3.0)}, {}), ("none", {}, {"attn_gate": "head"}),
         ("none", {}, {"attn_sink": True}), ("qknorm", {}, {"attn_gate": "element", "attn_sink": True})]


@pytest.mark.parametrize("method, opts, extra", TWINS, ids=str)
def test_any_method_exports_as_a_folder_that_loads_back(method, opts, extra, tmp_path):
    """What no plain Llama/Qwen3 folder holds is exported as the Llama qklab.hf.apply converts (qklab's twin):
    AutoModelForCausalLM (qklab.hf imported) gives qklab's logits to 1e-5; transformers alone refuses it."""
    torch.manual_seed(0)
    ours = GPT(ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                           init_std=0.1, **extra), QKConfig(method=method, options=opts)).eval()
    with torch.no_grad():  # every parameter away from its initial value (gains, sinks, frequencies)
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_pretrained(ours, tmp_path, tokenizer=ByteTokenizer())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(theirs).__name__ == "QKLlamaForCausalLM" and theirs.config.qklab["method"] == method
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x)[0], atol=1e-5, rtol=1e-5)
    assert sorted(k for k in theirs.state_dict() if "qk_method" in k or "attn_gate" in k or "attn_sink" in k) == \
        sorted(f"model.layers.{k.split('.', 2)[1]}.{_twin_name(k.split('.', 2)[2])}" for k in ours.state_dict()
               if k.startswith("blocks.") and k.split(".", 2)[2].startswith(("attn.qk.", "attn.wg.", "attn.sink")))


def _twin_name(rest: str) -> str:
    return rest.replace("attn.qk.", "self_attn.qk_method.").replace("attn.wg.", "self_attn.attn_gate.") \
        .replace("attn.sink", "self_attn.attn_sink")


def test_qklab_export_hf_from_a_run(tmp_path, capsys):
    """`qklab export RUN --hf`: a trained run as a transformers folder with its tokenizer, loading in a fresh
    process with qklab's logits (qklab.load_run's model) to 1e-5."""
    import json
    import subprocess
    import sys

    import qklab
    from qklab.cli import main

    sets = ["train.steps=6", "train.eval_every=6", "train.ckpt_every=6", "train.diag_every=0", "train.progress=false",
            "qk.method=softcap", "qk.softcap.cap=8.0", f"train.out_dir='{tmp_path / 'runs'}'", "train.name=r",
            f"data.cache_dir='{tmp_path / 'cache'}'"]
    assert main(["train", "--config", "tiny", *[a for s_ in sets for a in ("--set", s_)]]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "runs" / "r"), "--hf", "--out", str(tmp_path / "hf")]) == 0
    assert "as a transformers folder" in capsys.readouterr().out
    run = qklab.load_run(tmp_path / "runs" / "r")
    assert run.step == 6 and isinstance(run.tokenizer, ByteTokenizer) and run.config.qk.method == "softcap"
    x = torch.tensor([run.tokenizer.encode("def f(x):\n    return x\n")])
    with torch.no_grad():
        torch.save({"x": x, "logits": run.model(x)[0]}, tmp_path / "ref.pt")
    code = ("import sys, torch, qklab.hf\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "ref = torch.load(sys.argv[2])\nm = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "assert tok.encode('def f(x):\\n    return x\\n') == ref['x'][0].tolist()\n"
            "with torch.no_grad():\n    print((m(ref['x']).logits - ref['logits']).abs().max().item())\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf"), str(tmp_path / "ref.pt")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout.strip()) <= 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["qklab"]["options"]["cap"] == 8.0
