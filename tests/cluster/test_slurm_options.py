"""The Slurm executor's options and files, without a cluster: a profile and ``--slurm`` keys, their mistakes
as one line and exit 2, the batch script they give, and a manifest that rebuilds every cell of the packaged
studies to the hash the study gives it."""

from __future__ import annotations

import pytest

from qklab.cli import main
from qklab.config import ConfigError
from qklab.study.cluster import SlurmOptions, batch_script, header, load_options
from qklab.study.spec import load_study
from qklab.study.task import Manifest, read_manifest, write_manifest
from tests.cluster.common import study_file

PACKAGED = ["demo", "logit_control_cpu", "ladder_english", "gpu_124m"]


def test_profile_then_command_line(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('partition = "gpu"\ncpus = 8\ngpus = 2\ntime = "4:00:00"\nsbatch = ["--exclusive"]\n')
    o = load_options(f, ["cpus=4", "sbatch=--constraint=a100", "sbatch=--nice=5", "qos=high"])
    assert (o.partition, o.cpus, o.gpus, o.time, o.qos) == ("gpu", 4, 2, "4:00:00", "high")
    assert o.sbatch == ["--constraint=a100", "--nice=5"]  # the command line's list replaces the profile's
    assert o.processes() == 2 and SlurmOptions(nproc_per_node=3).processes() == 3 and SlurmOptions().processes() == 1


@pytest.mark.parametrize(("sets", "msg"), [
    (["cpus=0"], "slurm option cpus=0: use 1 or more"),
    (["time=4h"], "slurm option time='4h': use Slurm's form"),
    (["mem=lots"], "slurm option mem='lots': use e.g."),
    (["partition=a b"], "slurm option partition='a b': not a Slurm name"),
    (["sbatch=exclusive"], "slurm option sbatch line 'exclusive': give an option"),
    (["gpu=1"], "--slurm gpu=1: unknown key 'gpu'; use one of partition, account"),
    (["cpus=eight"], "--slurm cpus=eight: cpus = 'eight' must be an integer"),
    (["cpus"], "--slurm: 'cpus' must look like key=value, e.g. partition=gpu"),
])
def test_mistakes_are_one_line(sets, msg):
    with pytest.raises(ConfigError) as e:
        load_options(None, sets)
    assert str(e.value).startswith(msg), str(e.value)


def test_cli_mistakes_exit_2(tmp_path, capsys):
    path = study_file(tmp_path, "s", 10, {"a": {"qk.method": "none"}})
    bad = tmp_path / "c.toml"
    bad.write_text("cpus = [\n")
    for args, want in ((["--cluster", str(tmp_path / "none.toml")], "no such file; give a cluster profile"),
                       (["--cluster", str(bad)], "not a TOML file"),
                       (["--slurm", "nodes=0"], "slurm option nodes=0: use 1 or more")):
        code = main(["study", "run", str(path), "--out", str(tmp_path / "o"), "--executor", "slurm", *args])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and want in err, err
    assert not (tmp_path / "o" / "slurm").exists()  # refused before anything is written


def test_batch_script_of_plain_and_parallel_cells(tmp_path):
    o = SlurmOptions(cpus=4, gpus=2, mem="8G", time="30", max_running=3, account="lab", sbatch=["--exclusive"],
                     setup="module load cuda && source /v/bin/activate", python="/v/bin/python")
    lines = header(o, "qklab.s.0123abcd", 5, tmp_path / "%A_%a.log", "m.json", tmp_path, 1)
    assert lines[:2] == ["--job-name=qklab.s.0123abcd", "--array=0-4%3"]
    for want in ("--gres=gpu:2", "--mem=8G", "--time=30", "--account=lab", "--signal=B:USR1@120", "--exclusive",
                 "--comment=m.json", "--requeue", "--cpus-per-task=4"):
        assert want in lines
    plain = batch_script(o, lines, tmp_path / "m.json", parallel=False, nodes=1)
    assert "#SBATCH --array=0-4%3\n" in plain and "module load cuda && source /v/bin/activate\n" in plain
    assert f"/v/bin/python -m qklab.study.task {tmp_path / 'm.json'} \"$SLURM_ARRAY_TASK_ID\" &\n" in plain
    multi = batch_script(o, lines, tmp_path / "m.json", parallel=True, nodes=2)
    assert "srun --kill-on-bad-exit=1 /v/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=2" in multi


@pytest.mark.parametrize("name", PACKAGED)
def test_a_manifest_rebuilds_each_cell_to_its_hash(tmp_path, name):
    from qklab.cli.study import resolve_study

    study = load_study(resolve_study(name))
    cells = study.cells[:24]
    write_manifest(tmp_path / "m.json", Manifest(study.name, tmp_path / "o", tmp_path / "r", 2, 0, None, cells))
    back = read_manifest(tmp_path / "m.json")
    assert [c.id for c in back.cells] == [c.id for c in cells]
    for a, b in zip(back.cells, cells, strict=True):
        assert (a.hash, a.variant, a.point, a.lr_mult, a.seed) == (b.hash, b.variant, b.point, b.lr_mult, b.seed)
        assert a.cfg == b.cfg
    one = read_manifest(tmp_path / "m.json", index=len(cells) - 1)
    assert [c.id for c in one.cells] == [cells[-1].id]


def test_a_manifest_whose_config_no_longer_hashes_is_refused(tmp_path):
    import json

    study = load_study(study_file(tmp_path, "s", 10, {"a": {"qk.method": "none"}}))
    write_manifest(tmp_path / "m.json", Manifest("s", tmp_path, tmp_path, 1, 0, None, study.cells))
    data = json.loads((tmp_path / "m.json").read_text())
    data["cells"][0]["config"]["train"]["lr"] = 0.5
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="hashes to .* where it was submitted"):
        read_manifest(tmp_path / "m.json")
