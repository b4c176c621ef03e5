"""``qklab export``: the weights of any run's checkpoint as one consolidated ``model.safetensors``.

Whatever wrote the checkpoint (one process, DDP, FSDP2 consolidated on rank 0, or DCP shards from any
number of ranks), the export is the file one process writes: the qklab GPT's state dict, whole, on CPU,
with the run's ``config.json`` beside it. ``qklab.hf`` turns such a model into a transformers one.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_model

from qklab.atomic import atomic_write_text, follow_umask


def export_run(path: str | Path, out: str | Path, unverified: bool = False, warn=None) -> tuple[Path, int]:
    """Write ``out``/model.safetensors and ``out``/config.json from the run folder or checkpoint ``path``
    (its newest good checkpoint; each damaged newer one named through ``warn``; one without a manifest
    only with ``unverified``); returns the folder and the checkpoint's step."""
    import torch

    from qklab.rundir.load import load_model, load_run_config, resolve_target

    target = resolve_target(path, warn=warn, unverified=unverified)
    cfg = load_run_config(target, unverified)
    model, step = load_model(cfg, target.ckpt, torch.device("cpu"), unverified)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.safetensors.tmp"
    save_model(model, str(tmp))
    follow_umask(tmp)
    tmp.replace(out / "model.safetensors")
    cfg_file = target.run_dir / "config.json" if target.run_dir is not None else None
    text = cfg_file.read_text() if cfg_file is not None and cfg_file.is_file() else \
        json.dumps(cfg.to_dict(), indent=2) + "\n"
    atomic_write_text(out / "config.json", text)
    return out, step
