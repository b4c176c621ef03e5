from __future__ import annotations

import os

import pytest
import torch

from qklab.config import ModelConfig, QKConfig
from qklab.model import GPT
from qklab.train.startup import inductor_cache_per_cpu_capability

# the suite runs `qklab study run` from this checkout, often with uncommitted changes: as --allow-dirty
# (tests/study/test_provenance.py unsets it to test the refusal)
os.environ.setdefault("QKLAB_ALLOW_DIRTY", "1")


# compiled graphs (e.g. torchtitan's compiled FlexAttention) cached per CPU capability, as a compiled
# training run keeps them: runs of the suite under two capabilities on one machine keep apart
inductor_cache_per_cpu_capability()


@pytest.fixture(autouse=True)
def _fp32_deterministic():
    torch.manual_seed(0)
    yield
    torch.set_flush_denormal(False)  # a Trainer on CPU sets it for the process; each test starts without


def another_cpu_capability() -> str:
    """A CPU capability that is not this machine's, for tests that need "a run trained on another kind of
    machine": never a fixed name, which is some machine's own (AVX2 on an AVX2 machine)."""
    here = torch.backends.cpu.get_cpu_capability()
    return next(c for c in ("AVX2", "AVX512", "DEFAULT") if c != here)


def tiny_gpt(method: str = "none", n_kv_heads: int = 0, impl: str = "auto", **kw) -> GPT:
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                      max_seq_len=64, attn_impl=impl, **kw)
    return GPT(cfg, QKConfig(method=method)).eval()
