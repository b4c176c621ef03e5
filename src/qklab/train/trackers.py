"""Optional experiment trackers fed by the one metrics function (``MetricsLog.log``).

``train.trackers = ["tensorboard", "wandb"]``: every record written to metrics.jsonl is also sent, as
flat scalars, to TensorBoard (event files in ``<run>/tb``) and to Weights & Biases in offline mode (files
in ``<run>/wandb``; ``wandb sync`` uploads them later). Each package is imported only when asked for;
metrics.jsonl stays the record of the run. Per-head lists are summarised by their own scalar fields
(``diag/max_logit_max`` ...), not sent head by head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qklab.config import ConfigError


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("train.trackers has 'tensorboard' but the tensorboard package is missing; "
                              "pip install 'qklab[track]' or tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        self.writer.add_text("config", "```\n" + _pretty(config) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.trackers has 'wandb' but the wandb package is missing; "
                              "pip install 'qklab[track]' or wandb") from None
        # offline: nothing leaves the machine; the run id is the folder name so a resume continues it
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="qklab", name=run_dir.name,
                              id=run_dir.name, resume="allow", config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _pretty(config: dict[str, Any]) -> str:
    import json

    return json.dumps(config, indent=1, default=str)


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}  # names checked by RunConfig.validate


def build_trackers(names: list[str], run_dir: Path, config: dict[str, Any]) -> list:
    return [TRACKERS[n](run_dir, config) for n in names]
