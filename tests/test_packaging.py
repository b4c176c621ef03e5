"""The package as a user installs it: a wheel with its presets and studies, ranges (no pins) that admit
torch 2.11, a lock inside those ranges, qklab working without its optional packages, lint over every file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import qklab
from qklab.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> list[Requirement]:
    proj = PYPROJECT["project"]
    reqs = [Requirement(r) for r in proj["dependencies"]]
    for extra in proj["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra if not r.startswith("qklab[")]
    return reqs


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = Version(version.strip())
    return pins


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout, as `pip wheel .` builds it for a user."""
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("src")  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "src", build / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, build / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(build)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("qklab-*.whl")
    return whl


def test_wheel_holds_every_preset_and_study(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("presets", "studies"):
        shipped = sorted(p.name for p in (ROOT / "src" / "qklab" / folder).glob("*.toml"))
        assert shipped, folder
        missing = [n for n in shipped if f"qklab/{folder}/{n}" not in names]
        assert not missing, f"not in the wheel: {missing}"
    assert "qklab/parallel/fsdp.py" in names and not any(n.startswith("qklab/dist/") for n in names)


def test_wheel_metadata_has_ranges_not_pins(wheel):
    whl = zipfile.ZipFile(wheel)
    meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
            if line.startswith("Requires-Dist:")]
    assert f"Version: {qklab.__version__}" in meta
    pinned = [str(r) for r in reqs if any(s.operator == "==" for s in r.specifier)]
    assert not pinned, f"exact pins in the wheel: {pinned}"
    torch = next(r for r in reqs if r.name == "torch")
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.13.0")
    core = {r.name for r in reqs if r.marker is None}
    assert "datasets" not in core and "transformers" not in core  # extras, not what `pip install qklab` pulls


def test_lock_pins_every_declared_package_inside_its_range():
    pins = _lock()
    for req in _requirements():
        name = req.name.lower()
        assert name in pins, f"{name} is declared in pyproject.toml but not locked in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt {name}=={pins[name]} is outside {req}"


def test_installed_wheel_runs_from_an_empty_folder(wheel, tmp_path):
    """Installed (not the checkout): the presets and studies are found inside the package, and a name on
    the command line is a path first (a file of that name in the working folder wins)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    work = tmp_path / "empty"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def qklab_(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qklab", *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)

    where = subprocess.run([sys.executable, "-c", "import qklab; print(qklab.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    v = qklab_("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"qklab {qklab.__version__}", v  # no git SHA: not a checkout
    t = qklab_("train", "--config", "tiny", "--set", "train.steps=4", "--set", "train.eval_every=4",
               "--set", "train.progress=false")
    assert t.returncode == 0, t.stderr
    assert (work / "runs" / "tiny-none-s0" / "metrics.jsonl").is_file()
    s = qklab_("study", "status", "demo")
    n_demo = len(load_study(site / "qklab" / "studies" / "demo.toml").cells)
    assert s.returncode == 0 and "none_lr1_s0" in s.stdout and f"demo: 0/{n_demo} cells done" in s.stdout, s
    # a path given on the command line comes first: a local tiny.toml with 3 steps
    tiny = (site / "qklab" / "presets" / "tiny.toml").read_text()
    (work / "mine.toml").write_text(tiny.replace("steps = 30", "steps = 3"))
    t = qklab_("train", "--config", "mine.toml", "--set", "train.progress=false",
               "--set", "train.eval_every=3", "--set", "train.ckpt_every=3")
    assert t.returncode == 0 and "mine-none-s0" in t.stdout and "of 3 steps" in t.stdout, t.stdout + t.stderr
    bad = qklab_("train", "--config", "nosuch")
    assert bad.returncode == 2 and "tiny" in bad.stderr and "Traceback" not in bad.stderr


BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {%s}:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def test_import_and_train_without_the_optional_packages(tmp_path):
    """`pip install qklab` without extras: no datasets, transformers, tensorboard or wandb."""
    blocked = "'datasets', 'transformers', 'accelerate', 'tensorboard', 'wandb'"
    code = BLOCK % blocked + f"""
import qklab, qklab.model, qklab.methods, qklab.study, qklab.report, qklab.parallel
from qklab.cli import main
rc = main(["train", "--config", "tiny", "--set", "train.steps=3", "--set", "train.eval_every=3",
           "--set", "train.progress=false", "--set", "train.out_dir={tmp_path}/runs"])
assert rc == 0, rc
rc = main(["train", "--config", "tiny", "--set", "data.source='hf:some/corpus'",
           "--set", "train.out_dir={tmp_path}/r2"])
assert rc == 2, rc
bad = [m for m in sys.modules if m.split(".")[0] in {{{blocked}}}]
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pip install 'qklab[datasets]'" in r.stderr


def test_lint_covers_every_file_and_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the dev extra has it)")
    listed = subprocess.run([ruff, "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True).stdout
    for rel in ("src/qklab/parallel/fsdp.py", "tests/parallel/common.py", "benchmarks/step_time.py"):
        assert str(ROOT / rel) in listed, f"ruff does not look at {rel}"
    r = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
