"""How a study's cells run on a Slurm cluster: the resources of each cell's task and the array's settings,
from a cluster profile (``--cluster FILE``, TOML) and ``--slurm KEY=VALUE`` options, never from the study
file (the executor is no part of the science: a study's cells, their hashes and its registered plan are the
same whichever runs them); and the batch script of one submission.

    # cluster.toml: every key is optional
    partition = "gpu"
    account = "lab"
    qos = "normal"
    cpus = 8                    # CPUs of each cell's task (its threads: cpus / processes)
    gpus = 1                    # GPUs of each cell's task (--gres=gpu:N)
    mem = "32G"                 # memory of each cell's task
    time = "4:00:00"            # time limit of each task; the task is warned signal_before seconds ahead,
    signal_before = 120         # checkpoints and requeues itself
    max_running = 16            # the array's concurrency limit (%N); 0: Slurm's own
    nodes = 1                   # nodes of a cell whose config runs several processes (train.parallel)
    nproc_per_node = 0          # its processes per node under torchrun (0: gpus, or 1 without GPUs)
    sbatch = ["--constraint=a100"]   # extra #SBATCH lines
    setup = "source /shared/qklab/.venv/bin/activate"   # a shell line run before each cell
    python = "python"           # the interpreter on the nodes (default: the submitting one)
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qklab.config import ConfigError, parse_value, split_set

TIME_RE = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")  # Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
MEM_RE = re.compile(r"^\d+[KMGT]?$")


@dataclass
class SlurmOptions:
    partition: str = ""
    account: str = ""
    qos: str = ""
    cpus: int = 1
    gpus: int = 0
    mem: str = ""
    time: str = ""
    signal_before: int = 120
    max_running: int = 0
    nodes: int = 1
    nproc_per_node: int = 0
    sbatch: list[str] = field(default_factory=list)
    setup: str = ""
    python: str = field(default_factory=lambda: sys.executable)

    def processes(self) -> int:
        """Processes per node of a cell that runs several (torchrun's --nproc-per-node)."""
        return self.nproc_per_node or max(self.gpus, 1)

    def check(self) -> SlurmOptions:
        for name in ("cpus", "nodes"):
            _need(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: use 1 or more")
        for name in ("gpus", "max_running", "nproc_per_node", "signal_before"):
            _need(getattr(self, name) >= 0, f"{name}={getattr(self, name)}: use 0 or more")
        _need(not self.time or TIME_RE.match(self.time) is not None,
              f"time={self.time!r}: use Slurm's form, e.g. \"4:00:00\", \"90\" (minutes) or \"1-00:00:00\"")
        _need(not self.mem or MEM_RE.match(self.mem) is not None, f"mem={self.mem!r}: use e.g. \"32G\" or \"4000M\"")
        for name in ("partition", "account", "qos"):
            v = getattr(self, name)
            _need(re.match(r"^[A-Za-z0-9_.,+-]*$", v) is not None, f"{name}={v!r}: not a Slurm name")
        for line in self.sbatch:
            _need(line.startswith("-") and "\n" not in line, f"sbatch line {line!r}: give an option, e.g. "
                  "\"--constraint=a100\" (one per list item)")
        _need("\n" not in self.setup, "setup: give one shell line (join commands with &&)")
        _need(bool(self.python.strip()), "python: name the interpreter the nodes run")
        return self


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(f"slurm option {msg}")


FIELDS = {f.name: f for f in dataclasses.fields(SlurmOptions)}


def _typed(key: str, value: Any, where: str) -> Any:
    if key not in FIELDS:
        raise ConfigError(f"{where}: unknown key '{key}'; use one of {', '.join(FIELDS)}")
    want = FIELDS[key].type
    if want == "int":
        ok = type(value) is int
    elif want == "str":
        ok = isinstance(value, str)
    else:  # list[str]
        value = [value] if isinstance(value, str) else value
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        raise ConfigError(f"{where}: {key} = {value!r} must be {'an integer' if want == 'int' else 'text'}"
                          + (" (or a list of lines)" if want.startswith("list") else ""))
    return value


def read_profile(path: str | Path) -> dict[str, Any]:
    """A cluster profile's keys, type-checked (``--cluster FILE``)."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--cluster {path}: no such file; give a cluster profile (TOML)") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--cluster {path}: not a TOML file ({' '.join(str(e).split())})") from None
    return {k: _typed(k, v, f"--cluster {path}") for k, v in raw.items()}


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--slurm KEY=VALUE`` items: a value is TOML (a number, a quoted string, a list) or a bare word."""
    out: dict[str, Any] = {}
    for item in items:
        key, text = split_set(item, "--slurm", "partition=gpu")
        want = FIELDS[key].type if key in FIELDS else "str"
        value = parse_value(text) if want != "str" else text  # a str field keeps its text: account=0123
        if want.startswith("list") and isinstance(value, str):
            value = [*out.get(key, []), value]  # --slurm sbatch=... is repeatable
        out[key] = _typed(key, value, f"--slurm {item}")
    return out


def load_options(profile: str | Path | None = None, sets: list[str] | None = None) -> SlurmOptions:
    """The profile's keys, then ``--slurm`` options over them, checked."""
    keys = read_profile(profile) if profile else {}
    keys.update(parse_sets(sets or []))
    return SlurmOptions(**keys).check()


def header(opts: SlurmOptions, job_name: str, n_tasks: int, log_pattern: Path, comment: str, chdir: Path,
           nodes: int) -> list[str]:
    """The #SBATCH lines of a submission of ``n_tasks`` cells (one array task each)."""
    array = f"0-{n_tasks - 1}" + (f"%{opts.max_running}" if opts.max_running else "")
    lines = [f"--job-name={job_name}", f"--array={array}", f"--output={log_pattern}", "--open-mode=append",
             f"--comment={comment}", f"--chdir={chdir}", f"--cpus-per-task={opts.cpus}", "--requeue",
             f"--nodes={nodes}", "--ntasks-per-node=1"]
    if opts.signal_before:  # to the batch shell (B:), which stops the cell and requeues the task
        lines.append(f"--signal=B:USR1@{opts.signal_before}")
    lines += [f"--{k}={getattr(opts, k)}" for k in ("partition", "account", "qos", "mem", "time") if getattr(opts, k)]
    if opts.gpus:
        lines.append(f"--gres=gpu:{opts.gpus}")
    return [*lines, *opts.sbatch]


def batch_script(opts: SlurmOptions, sbatch: list[str], manifest: Path, parallel: bool, nodes: int) -> str:
    """The batch script of a submission: each array task trains the cell its index names in ``manifest``.
    The cell runs as a child of this shell; the time limit's warning (USR1) becomes a SIGTERM to it (a
    checkpoint at its next step), and the task then requeues itself. A scancel or a preemption signals
    every process of the task: the cell checkpoints, and Slurm ends or requeues it."""
    task = f"-m qklab.study.task {shlex.quote(str(manifest))} \"$SLURM_ARRAY_TASK_ID\""
    if not parallel:
        run = f"{opts.python} {task}"
    elif nodes == 1:
        run = (f"{opts.python} -m torch.distributed.run --standalone --nnodes=1 "
               f"--nproc-per-node={opts.processes()} {task}")
    else:  # one torchrun per node, meeting at the first node
        run = (f"srun --kill-on-bad-exit=1 {opts.python} -m torch.distributed.run --nnodes={nodes} "
               f"--nproc-per-node={opts.processes()} --rdzv-backend=c10d "
               f"--rdzv-endpoint=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)\":29500 "
               f"--rdzv-id=\"$SLURM_JOB_ID\" {task}")
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {line}" for line in sbatch),
        "# written by qklab study run --executor slurm: one cell per array task",
        *([opts.setup] if opts.setup else []),
        "requeue=",
        "trap 'requeue=1; kill -TERM \"$child\" 2>/dev/null' USR1",
        "trap ':' TERM  # scancel and preemption signal the cell itself",
        f"{run} &",
        "child=$!",
        "rc=0",
        "while kill -0 \"$child\" 2>/dev/null; do wait \"$child\"; rc=$?; done",
        "if [ -n \"$requeue\" ] && [ \"$rc\" -ne 0 ]; then",
        "  echo \"qklab: time limit near: the cell stopped after a checkpoint; requeueing this task\"",
        "  scontrol requeue \"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}\"",
        "fi",
        "exit $rc",
        "",
    ])
