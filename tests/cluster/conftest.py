"""The ``slurm`` fixture: one one-node Slurm cluster for the session's cluster tests (tests/cluster/slurm.py),
stopped at the end by the pids it started; where Slurm cannot run here, every test that asks for it skips and
says why."""

from __future__ import annotations

import os

import pytest

from tests.cluster.slurm import SlurmCluster, Unavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Unavailable as e:
        cluster.stop()
        pytest.skip(f"no Slurm cluster: {e}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.root / "slurm.conf")  # qklab's own squeue/sbatch calls in this process
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        cluster.stop()
