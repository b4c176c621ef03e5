"""What submitting a large study to Slurm costs: ``qklab study run --executor slurm`` of an N-cell tiny study
(variants x seeds) on a one-node test cluster (tests/cluster/slurm.py, Debian's Slurm, as root), held
(``--slurm sbatch=--hold``) so that nothing trains, then the same command again (it must find every cell
queued and submit nothing), ``study status`` and ``study cancel``.

    python benchmarks/slurm_submit.py [--cells 1000]

Prints JSON: the wall seconds of each command (a fresh process each: imports and parsing the study
included), the sbatch seconds, the manifest's bytes, and per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.slurm import SlurmCluster  # noqa: E402


def _timed(*args: str) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKLAB_ALLOW_DIRTY": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "qklab", *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"qklab {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return time.perf_counter() - t0, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=1000, help="cells in the study (4 variants x cells/4 seeds)")
    n = ap.parse_args().cells // 4
    tmp = Path(tempfile.mkdtemp(prefix="qklab-slurm-bench-"))
    cluster = SlurmCluster(tmp / "cluster").start()
    os.environ["SLURM_CONF"] = str(cluster.root / "slurm.conf")
    try:
        study = tmp / "big.toml"
        study.write_text(f'[study]\nconfig = "tiny"\nseeds = {list(range(n))}\n[study.set]\n"train.steps" = 10\n'
                         f'"data.max_files" = 20\n"data.cache_dir" = "{tmp / "cache"}"\n'
                         + "".join(f'[variants.{m}]\n"qk.method" = "{m}"\n'
                                   for m in ("none", "qknorm", "softcap", "ssmax")))
        where = [str(study), "--out", str(tmp / "o")]
        submit_s, _ = _timed("study", "run", *where, "--executor", "slurm", "--slurm", "sbatch=--hold")
        again_s, out = _timed("study", "run", *where, "--executor", "slurm")
        assert "nothing new to submit" in out, out
        status_s, _ = _timed("study", "status", *where)
        cancel_s, _ = _timed("study", "cancel", *where)
        sub = json.loads((tmp / "o" / "slurm" / "submissions.jsonl").read_text().splitlines()[0])
        manifest = (tmp / "o" / "slurm" / sub["manifest"]).stat().st_size
        cells = len(sub["cells"])
        print(json.dumps({"cells": cells, "submit_s": round(submit_s, 2), "sbatch_s": round(sub["sbatch_seconds"], 4),
                          "resubmit_none_s": round(again_s, 2), "status_s": round(status_s, 2),
                          "cancel_s": round(cancel_s, 2), "manifest_bytes": manifest,
                          "per_cell": {"submit_ms": round(1000 * submit_s / cells, 2),
                                       "manifest_bytes": manifest // cells}}, indent=1))
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
