"""What a run decides before it starts: its name, its device, whether a resume may continue, and the
package versions it records."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import torch

from qklab.config import ConfigError, RunConfig, check_run_name, comparable, resume_changes
from qklab.errors import UserError


def inductor_cache_per_cpu_capability() -> None:
    """Keep torch.compile's on-disk cache (TORCHINDUCTOR_CACHE_DIR, or torch's default) in a folder of this
    process's CPU capability. Inductor's cache keys leave out the vector instruction set, which
    ATEN_CPU_CAPABILITY picks, while the C++ it stores is written for one vector width: a graph compiled
    under AVX-512 and loaded under AVX2 gives wrong values (or NaN), and the other way round can corrupt
    the heap. A folder that already names the capability is kept as it is."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = torch.backends.cpu.get_cpu_capability().lower()
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(os.path.normpath(base)) != capability:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, capability)


def check_cpu_compiler() -> None:
    """torch.compile on the CPU writes C++ and builds it: without a C++ compiler the first step fails deep
    inside torch. Say so in one line before the run starts (data prepared, folder made)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # another torch's layout: the compile itself will tell
        return
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        raise UserError(f"train.compile=true on the CPU needs a C++ compiler and torch finds none ({e}): install "
                        "one (g++ or clang++; CXX names it) or leave train.compile false") from None


def versions() -> dict[str, str]:
    import safetensors
    import tokenizers

    import qklab
    return {"qklab": qklab.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
            "python": platform.python_version()}


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """What a run's float results depend on beyond code and config: the CPU kernels (the instruction set
    PyTorch dispatches to), the thread count and the GPU. Two machines that differ here may part from
    step 0 at float rounding, so a bit-for-bit check is a same-kind-of-machine check."""
    out: dict[str, Any] = {"cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "threads": torch.get_num_threads()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def machines(before: list[dict[str, Any]] | None, step: int, device: torch.device) -> list[dict[str, Any]]:
    """The machines a run has trained on, each from the step it (re)started at: ``before`` (the run's record
    so far, on a resume) and this one, when it differs from the last."""
    here = machine(device)
    kept = [m for m in before or [] if isinstance(m, dict) and m.get("from_step", 0) < step]
    if kept and {k: v for k, v in kept[-1].items() if k != "from_step"} == here:
        return kept
    return [*kept, {"from_step": step, **here}]


def pick_device(spec: str) -> torch.device:
    if spec == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def run_name(cfg: RunConfig) -> str:
    if cfg.train.name:
        return check_run_name(cfg.train.name)
    qk = cfg.qk.method + ("" if cfg.qk.controller == "none" else f"+{cfg.qk.controller}")
    return check_run_name(f"{cfg.preset or 'run'}-{qk}-s{cfg.train.seed}", "the run name derived from the preset "
                          "(set train.name)")


def check_resume_config(cfg: RunConfig, saved: dict[str, Any], saved_world: int, world: int) -> None:
    """Refuse, in one line, a resume whose config changed in a way that cannot continue the run (the
    same global batch on another number of processes can)."""
    now = comparable(cfg)
    b_saved, b_now = saved.get("train", {}).get("batch_size"), now["train"]["batch_size"]
    if b_saved is None or saved_world == world:
        pass  # the usual comparison names a changed batch_size
    elif b_saved * saved_world != b_now * world:
        raise ConfigError(f"--resume with a changed global batch: {saved_world} process(es) x train.batch_size="
                          f"{b_saved} -> {world} x {b_now}; keep processes x train.batch_size at "
                          f"{b_saved * saved_world}")
    else:
        now["train"]["batch_size"] = b_saved  # the same global batch on another number of processes
    if now["model"]["vocab_size"] == 0:  # not filled in from the tokenizer yet; checked against it later
        now["model"]["vocab_size"] = saved.get("model", {}).get("vocab_size", 0)
    changes = resume_changes(saved, now)
    if changes:
        raise ConfigError(f"--resume with a changed config: {'; '.join(changes)}. These cannot change within a "
                          "run; undo the change, or start a new run with another train.name")
