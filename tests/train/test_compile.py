"""The train step's model work (forward, loss, backward) compiles as one graph for every forward-side
method on MHA, GQA and MLA, with QK-clip's max-logit tracking on, and computes what eager mode computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.model import GPT

CASES = [("mha", 0, m) for m in ("none", "qknorm", "softcap", "qkmap")] + [("mha", 2, "qknorm")] + \
    [("mla", 0, m) for m in ("none", "qknorm", "softcap")]


@pytest.mark.parametrize("attention, n_kv, method", CASES)
def test_train_step_compiles_fullgraph_and_matches_eager(attention, n_kv, method):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=1, n_heads=4, n_kv_heads=n_kv, max_seq_len=64,
                      attention=attention)
    eager = GPT(cfg, QKConfig(method=method)).train()
    compiled = GPT(cfg, QKConfig(method=method)).train()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        for b in m.blocks:
            b.attn.track_max_logit = True  # QK-clip's per-head max logit, updated inside the graph
    x = torch.randint(0, 97, (2, 32))
    y = torch.randint(0, 97, (2, 32))
    torch._dynamo.reset()
    # fullgraph: a graph break raises; aot_eager traces the backward too, without a C++ compiler
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    _, want = eager(x, y)
    _, got = fn(x, y)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    for a, b in zip(eager.blocks, compiled.blocks, strict=True):
        torch.testing.assert_close(b.attn.pop_max_logit(), a.attn.pop_max_logit())


_COMPILED = """
import sys, torch
from qklab.train.startup import inductor_cache_per_cpu_capability
inductor_cache_per_cpu_capability()
torch.manual_seed(0)
x = torch.randn(4, 37, 64)  # (B, T, D)
f = lambda x: (x @ x.transpose(1, 2) * 0.125).softmax(-1) @ x
print((torch.compile(f)(x) - f(x)).abs().max().item())
"""


def test_a_compiled_graph_is_not_served_to_another_cpu_capability(tmp_path):
    """Inductor's cache keys leave out the vector ISA: without a folder per capability, a graph compiled by
    an AVX-512 process and loaded under AVX2 was 4.3 off (and the other way round corrupted the heap).
    Two processes share one TORCHINDUCTOR_CACHE_DIR, first this machine's capability, then another."""
    from tests.conftest import another_cpu_capability

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    for capability in (None, another_cpu_capability()):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability.lower()}
        r = subprocess.run([sys.executable, "-c", _COMPILED], env=run_env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert float(r.stdout.split()[-1]) < 1e-5, (capability, r.stdout)


def test_a_compiled_run_keeps_its_cache_per_cpu_capability(tmp_path, monkeypatch):
    from qklab.config import load_config
    from qklab.train.trainer import Trainer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config("tiny", [f"train.out_dir='{tmp_path / 'runs'}'", "train.name=c", "train.compile=true",
                                "train.progress=false", f"data.cache_dir='{tmp_path / 'data'}'"])
    Trainer(cfg, log=lambda s: None).close()
    here = torch.backends.cpu.get_cpu_capability().lower()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / here)


def test_a_compiled_cpu_run_without_a_cpp_compiler_is_one_line_before_it_starts(tmp_path):
    """torch.compile on the CPU builds C++: with no compiler the run stopped at its first step as 'internal
    error (a bug in qklab)'. Now one line, exit 2, and no run folder left behind."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")}
    argv = ["train", "--config", "tiny", "--set", "train.compile=true", "--set", f"train.out_dir='{tmp_path / 'runs'}'",
            "--set", f"data.cache_dir='{tmp_path / 'data'}'", "--set", "train.device=cpu"]
    r = subprocess.run([sys.executable, "-m", "qklab", *argv], env=env, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("qklab: error: train.compile=true on the CPU needs a C++ compiler"), lines[0]
    assert "no-such-g++" in lines[0] and not (tmp_path / "runs" / "tiny-none-s0").exists()
