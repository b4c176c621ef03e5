"""``torchrun -m qklab train`` with train.parallel=ddp: rank 0 alone reports and writes; launcher and
config that do not fit stop with one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.parallel.common import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _args(tmp: Path, *extra: str) -> list[str]:
    sets = ["train.steps=3", "train.batch_size=4", "train.progress=false", "train.diag_every=0", "train.name=cli",
            f"train.out_dir='{tmp / 'runs'}'", f"data.cache_dir='{tmp / 'cache'}'", *extra]
    return ["-m", "qklab", "train", "--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def test_torchrun_ddp_cli(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *_args(tmp_path, "train.parallel=ddp")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("done: ") == 1  # rank 0 reports, once
    run = tmp_path / "runs" / "cli"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # one writer: no step logged twice
    assert (run / "ckpt" / "step_0000003" / "manifest.json").is_file()
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["parallel"] == "ddp"


# qklab train with rank 1 sending itself SIGTERM during step 3: both ranks stop after step 3's checkpoint
SIGTERM_RANK1 = """
import os, signal, sys
import qklab.train.trainer as tr
_step = tr.Trainer.train_step
def train_step(self):
    if self.dist.rank == 1 and self.step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return _step(self)
tr.Trainer.train_step = train_step
from qklab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_stop_line_is_rank_0s_alone(tmp_path):
    """SIGTERM to one process of a torchrun run: the ranks stop together after step 3's checkpoint
    (test_signal_dist.py), and the stop line is printed once, rank 0's, not once per rank."""
    script = tmp_path / "stop.py"
    script.write_text(SIGTERM_RANK1)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(script), *_args(tmp_path, "train.parallel=ddp", "train.steps=6")[2:]]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode != 0
    stops = [ln for ln in (p.stdout + p.stderr).splitlines() if "stopped by SIGTERM" in ln]
    ckpt = tmp_path / "runs" / "cli" / "ckpt" / "step_0000003"
    assert stops == [f"qklab: stopped by SIGTERM at step 3; checkpoint {ckpt} written; continue with --resume"], \
        p.stderr[-3000:]
    assert (ckpt / "manifest.json").is_file()


def _torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


def _errors(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("qklab: error")]


def test_torchrun_error_every_rank_hits_is_printed_once(tmp_path):
    """A mistake every rank makes alike is rank 0's line alone: a bad config value (the command line's, read
    before the ranks meet) and --resume with nothing to resume (compared as the ranks agree to stop)."""
    p = _torchrun(tmp_path, *_args(tmp_path, "train.parallel=ddp", "train.steps=-1"))
    assert p.returncode != 0
    assert _errors(p) == ["qklab: error: train.steps=-1 is out of range: it must be > 0"], p.stderr[-3000:]
    p = _torchrun(tmp_path, *_args(tmp_path, "train.parallel=ddp"), "--resume")
    assert p.returncode != 0
    ckpt = tmp_path / "runs" / "cli" / "ckpt"
    assert _errors(p) == [f"qklab: error: --resume: no usable checkpoint in {ckpt}; start the run without --resume"], \
        p.stderr[-3000:]


# qklab train where rank 0 reaches its (shared) config error 3 s after rank 1, as a loaded machine may start it
SLOW_RANK0 = """
import os, sys, time
import qklab.cli.commands as commands
_load = commands.load_config
def load_config(*a, **k):
    if os.environ["RANK"] == "0":
        time.sleep(3.0)
    return _load(*a, **k)
commands.load_config = load_config
from qklab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_error_line_survives_a_slow_rank_0(tmp_path):
    """The rank that leaves a shared error's line to rank 0 stays until rank 0 has printed it (torchrun stops
    every process once one exits): a rank 0 that reaches the error seconds later still prints its line."""
    script = tmp_path / "slow0.py"
    script.write_text(SLOW_RANK0)
    p = _torchrun(tmp_path, str(script), *_args(tmp_path, "train.parallel=ddp", "train.steps=-1")[2:])
    assert p.returncode != 0
    assert _errors(p) == ["qklab: error: train.steps=-1 is out of range: it must be > 0"], p.stderr[-3000:]


# qklab train where rank 1 alone cannot read its data (its own disk, its own file)
RANK1_ERROR = """
import errno, os, sys
import qklab.train.trainer as tr
_prepare = tr.prepare_data
def prepare_data(*a, **k):
    if os.environ["RANK"] == "1":
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), "/rank1/own/file")
    return _prepare(*a, **k)
tr.prepare_data = prepare_data
from qklab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_error_of_rank_1_alone_is_printed_by_rank_1(tmp_path):
    """An error rank 1 alone meets is printed by rank 1, marked as its own; rank 0 stops too and, where the
    launcher lets it, names rank 1, and nothing is printed twice."""
    script = tmp_path / "rank1.py"
    script.write_text(RANK1_ERROR)
    p = _torchrun(tmp_path, str(script), *_args(tmp_path, "train.parallel=ddp")[2:])
    assert p.returncode != 0
    lines = _errors(p)
    own = "qklab: error (rank 1): No such file or directory (/rank1/own/file); check the path"
    named = ("qklab: error: another process of this run failed to start (rank 1); its line says why, marked (rank 1), "
             "or the launcher's log of that rank")
    assert own in lines, p.stderr[-3000:]
    assert set(lines) <= {own, named} and len(lines) == len(set(lines)), lines


# qklab train where rank 1 alone meets its own error mid-training (its own disk full at step 3)
RANK1_MID_RUN = """
import errno, os, sys
import qklab.train.trainer as tr
_step = tr.Trainer.train_step
def train_step(self):
    if self.dist.rank == 1 and self.step == 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/rank1/own/disk")
    return _step(self)
tr.Trainer.train_step = train_step
from qklab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_rank_lost_mid_run_is_no_internal_error(tmp_path):
    """Rank 1 stops on its own error during step 3; rank 0, waiting for it in the gradients' all-reduce, gets
    gloo's "Connection closed by peer". That is rank 1's failure, said by rank 1: rank 0 says in one line that
    another process stopped, with how to go on, and neither a traceback nor "internal error" is printed."""
    script = tmp_path / "rank1_mid.py"
    script.write_text(RANK1_MID_RUN)
    p = _torchrun(tmp_path, str(script), *_args(tmp_path, "train.parallel=ddp", "train.steps=6")[2:])
    assert p.returncode != 0
    out = p.stdout + p.stderr
    own = ("qklab: error (rank 1): No space left on device (/rank1/own/disk); free some space; no checkpoint was "
           "written yet, so there is nothing to resume: run the command again without --resume")
    assert _errors(p) == [own], out[-3000:]
    assert "internal error" not in out and "Connection closed by peer" not in out, out[-3000:]
    stops = [ln for ln in out.splitlines() if ln.startswith("qklab: stopped")]
    # rank 0 says it once, unless torchrun stopped it first (after rank 1's exit): then nothing more
    assert stops in ([], ["qklab: stopped: another process of this run stopped or was lost during a collective "
                          "step (its own line, or the launcher's log of that rank, says why); no checkpoint was "
                          "written yet, so there is nothing to resume: run the command again without --resume"]), stops


# qklab train where one rank (RANK_TO_KILL) is killed outright (SIGKILL: no line, no cleanup) during step 5
KILLED = """
import os, signal, sys
import qklab.train.trainer as tr
_step = tr.Trainer.train_step
def train_step(self):
    if self.dist.rank == int(os.environ["RANK_TO_KILL"]) and self.step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self)
tr.Trainer.train_step = train_step
from qklab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _killed(tmp: Path, rank: int, nproc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    script = tmp / "killed.py"
    script.write_text(KILLED)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script), *_args(tmp, "train.parallel=ddp", "train.steps=8", "train.ckpt_every=2")[2:]]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "RANK_TO_KILL": str(rank)}, timeout=300)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "internal error" not in out and "Connection closed by peer" not in out, out[-3000:]
    return p, [ln for ln in out.splitlines() if ln.startswith("qklab:")]


LOST = ("another process of this run stopped or was lost during a collective step (its own line, or the "
        "launcher's log of that rank, says why); the last checkpoint is intact (continue with --resume)")


def test_torchrun_rank_0_killed_is_said_by_the_survivor(tmp_path):
    """Rank 0 killed mid-run (the OOM killer, a lost node) leaves no line of its own; rank 1, whose all-reduce
    lost its partner, says once that the run stopped and how to go on (the step-4 checkpoint is there), though
    torchrun stops it at once (SIGTERM) on seeing rank 0 gone."""
    p, lines = _killed(tmp_path, rank=0, nproc=2)
    assert lines == [f"qklab: stopped (rank 1): {LOST}"], p.stderr[-3000:]
    assert (tmp_path / "runs" / "cli" / "ckpt" / "step_0000004" / "manifest.json").is_file()


def test_torchrun_rank_killed_among_three_is_said_once(tmp_path):
    """Rank 2 of three killed: ranks 0 and 1 both lose a partner, and the line is said once, by whichever
    reaches it first (asked of torchrun's store, which outlives every rank)."""
    p, lines = _killed(tmp_path, rank=2, nproc=3)
    assert lines in ([f"qklab: stopped: {LOST}"], [f"qklab: stopped (rank 1): {LOST}"]), p.stderr[-3000:]


def test_launcher_without_parallel_is_one_line(tmp_path):
    env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    p = subprocess.run([sys.executable, *_args(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "qklab: error: started by a launcher with WORLD_SIZE=2 but train.parallel=none; set train.parallel=ddp or fsdp"]


def test_bad_parallel_value_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, *_args(tmp_path, "train.parallel=zero")], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "qklab: error: train.parallel='zero': use none, ddp or fsdp"
