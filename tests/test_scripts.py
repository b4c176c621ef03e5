"""The study scripts, with stubs for what they call. scripts/run_studies.sh: studies in turn; failed cells
(exit 1) do not hold up the next study, a stopped or refused one (any other non-zero exit) ends the chain.
scripts/run_study.sh: a new study from HEAD in a clean clone. scripts/rebuild_reports.sh: which reports it
rebuilds. scripts/install_corpus.sh: a pinned Debian version that the package lists do not know yet."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
echo "$1" >> "$LOG"
code=$(sed -n "s/^$1=//p" "$CODES")
exit "${code:-0}"
"""


def _chain(tmp_path: Path, codes: dict[str, int], studies: list[str]) -> tuple[int, list[str], str]:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(ROOT / "scripts" / "run_studies.sh", scripts)
    (scripts / "run_study.sh").write_text(STUB)
    (scripts / "run_study.sh").chmod(0o755)
    (tmp_path / "codes").write_text("".join(f"{k}={v}\n" for k, v in codes.items()))
    log = tmp_path / "log"
    p = subprocess.run(["bash", str(scripts / "run_studies.sh"), *studies], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "LOG": str(log), "CODES": str(tmp_path / "codes")})
    return p.returncode, log.read_text().split() if log.exists() else [], p.stderr


@pytest.mark.parametrize("codes, rc, ran", [
    ({}, 0, ["a", "b", "c"]),
    ({"a": 1}, 1, ["a", "b", "c"]),  # failed cells: listed in a's report, b and c still run
    ({"b": 130}, 130, ["a", "b"]),  # stopped by SIGINT: the chain ends with b's code
    ({"a": 2}, 2, ["a"]),  # refused (a changed plan, a dirty tree)
])
def test_studies_run_in_turn(tmp_path, codes, rc, ran):
    got_rc, got_ran, err = _chain(tmp_path, codes, ["a", "b", "c"])
    assert (got_rc, got_ran) == (rc, ran)
    if rc > 1:
        assert f"{ran[-1]} ended with {rc}; the studies after it did not start" in err


def test_no_study_is_a_usage_line(tmp_path):
    rc, ran, err = _chain(tmp_path, {}, [])
    assert rc == 2 and ran == [] and err.startswith("usage:")


QKLAB_STUB = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
"""


def _results_tree(root: Path) -> Path:
    """demo and qkmap_cpu complete, logit_control_cpu half done, qkmap_english with one result, a stray
    folder without study.json."""
    import json

    r = root / "results"
    for study, cells, done in (("demo", ["a", "b"], 2), ("qkmap_cpu", ["a"], 1), ("logit_control_cpu", ["a", "b"], 1),
                               ("qkmap_english", ["a", "b", "c"], 1), ("ladder_english", ["a"], 1)):
        (r / study).mkdir(parents=True)
        (r / study / "study.json").write_text(json.dumps({"cells": cells}))
        for c in cells[:done]:
            (r / study / c).mkdir()
            (r / study / c / "result.json").write_text("{}")
    (r / "benchmarks").mkdir()
    return r


def test_rebuild_reports_leaves_running_studies_to_their_committer(tmp_path):
    """scripts/rebuild_reports.sh: a report for each complete study (the demo under its own title), the
    combined code report from the complete code studies, the English one from the complete English studies
    beside it; a study that is not complete is skipped by name and left out of the combined reports."""
    results = _results_tree(tmp_path)
    stub = tmp_path / "qklab"
    stub.write_text(QKLAB_STUB)
    stub.chmod(0o755)
    log = tmp_path / "log"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "rebuild_reports.sh")], capture_output=True, text=True,
                       cwd=ROOT, env={"PATH": "/usr/bin:/bin", "LOG": str(log), "QKLAB": str(stub),
                                      "QKLAB_RESULTS": str(results)})
    assert p.returncode == 0, p.stderr
    r = str(results)
    calls = log.read_text().splitlines()
    assert calls == [
        f"report {r}/demo --out {r}/demo/report --title qklab demo",
        f"report {r}/ladder_english --out {r}/ladder_english/report --title qklab study: ladder_english",
        f"report {r}/qkmap_cpu --out {r}/qkmap_cpu/report --title qklab study: qkmap_cpu",
        f"report {r}/qkmap_cpu --out {r}/report --title qklab: both papers' claims at CPU scale",
        f"report {r}/ladder_english --beside {r}/qkmap_cpu --out {r}/report_english --title "
        "qklab: both papers' claims on natural English, beside Python source",
    ]
    assert "skipped: logit_control_cpu (not complete" in p.stdout and "skipped: qkmap_english" in p.stdout
    assert "not in the combined reports yet: logit_control_cpu" in p.stderr
    assert "not in the combined reports yet: qkmap_english" in p.stderr


PY_STUB = """#!/usr/bin/env bash
if [ "$1" = -c ]; then exec python3 "$@"; fi
echo "$(git rev-parse HEAD) $*" >> "$LOG"
if [ -n "${CELL:-}" ]; then mkdir -p "$(dirname "$CELL")"; echo {} > "$CELL"; fi  # a cell that finished last
exit "${RC:-0}"
"""
# a committer that takes a finished cell a few seconds after it lands, as scripts/commit_results.sh does
COMMITTER = """#!/usr/bin/env bash
while true; do
  sleep 3
  for f in $(git ls-files --others --exclude-standard -- "docs/results/$1" | grep '/result.json$'); do
    git add "$f" && git -c user.name=t -c user.email=t@t commit -qm "results: $f" -- "$f"
  done
done
"""
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def _repo(tmp_path: Path) -> Path:
    """A checkout with scripts/run_study.sh, a study file, an unrelated tracked file, and stubs for the
    .venv's python (logs the commit it runs at and its arguments) and the committer."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "studies").mkdir()
    shutil.copy(ROOT / "scripts" / "run_study.sh", repo / "scripts")
    (repo / "scripts" / "commit_results.sh").write_text("#!/usr/bin/env bash\nexit 0\n")
    (repo / "scripts" / "commit_results.sh").chmod(0o755)
    (repo / "studies" / "a.toml").write_text("[study]\nname = 'a'\n")
    (repo / "notes.md").write_text("one\n")
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").write_text(PY_STUB)
    (repo / ".venv" / "bin" / "python").chmod(0o755)
    subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*GIT, "add", "."], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "x"], cwd=repo, check=True)
    return repo


def _run_study(repo: Path, rc: int = 0, interval: int = 0, cell: str = "") -> tuple[int, list[str], str]:
    log = repo.parent / "log"
    p = subprocess.run(["bash", "scripts/run_study.sh", "a"], cwd=repo, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "LOG": str(log), "RC": str(rc),
                            "QKLAB_COMMIT_INTERVAL": str(interval), "CELL": cell, "TMPDIR": str(repo.parent),
                            "QKLAB_RUNS": str(repo.parent / "runs"), "HOME": str(repo.parent)})
    return p.returncode, log.read_text().splitlines() if log.exists() else [], p.stderr


def test_run_study_starts_from_head_in_a_clean_clone(tmp_path):
    """scripts/run_study.sh: a new study runs from HEAD in its own clone; edits elsewhere in the checkout
    are named and left out; its exit code is the study's."""
    repo = _repo(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "notes.md").write_text("two\n")  # an edit that is not part of the study
    rc, log, err = _run_study(repo, rc=1)
    assert rc == 1
    assert log == [f"{head} -m qklab study run studies/a.toml --workers 2 --results {repo}/docs/results/a "
                   f"--out {tmp_path}/runs/a --no-report"]
    assert "note: uncommitted changes (notes.md) are not part of this study; it runs from HEAD" in err
    assert (tmp_path / "runs" / "clones" / f"a-{head[:12]}" / "notes.md").read_text() == "one\n"


def test_run_study_ends_with_a_refused_run_without_waiting_for_the_committer(tmp_path):
    """A run that trains nothing (refused, or every cell done) leaves nothing to commit: the script ends at
    once, not one committer interval (here 10 minutes, beyond the call's timeout) later."""
    repo = _repo(tmp_path)
    (repo / "scripts" / "commit_results.sh").write_text(COMMITTER)
    rc, log, _ = _run_study(repo, rc=2, interval=600)
    assert (rc, len(log)) == (2, 1)


def test_run_study_waits_for_the_committer_to_take_the_last_cell(tmp_path):
    """The cell that finished last is committed before the script ends (the committer takes it seconds
    later: the script waits for it rather than a fixed time, and stops the committer only then)."""
    repo = _repo(tmp_path)
    (repo / "scripts" / "commit_results.sh").write_text(COMMITTER)
    cell = repo / "docs" / "results" / "a" / "none_lr1_s0" / "result.json"
    assert _run_study(repo, cell=str(cell))[0] == 0
    committed = subprocess.run(["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True).stdout
    assert committed.splitlines()[0] == "results: docs/results/a/none_lr1_s0/result.json"


def test_run_study_refuses_an_uncommitted_study_file(tmp_path):
    repo = _repo(tmp_path)
    (repo / "studies" / "a.toml").write_text("[study]\nname = 'b'\n")
    rc, log, err = _run_study(repo)
    assert (rc, log) == (2, [])
    assert err.strip() == ("error: studies/a.toml has uncommitted changes; commit them first (the study runs from "
                           "HEAD)")


def test_run_study_finds_an_uncommitted_study_file_behind_a_link(tmp_path):
    """As in this repository, studies/ a link to the package's study files: git does not follow it, so the
    check must name the file git tracks."""
    repo = _repo(tmp_path)
    (repo / "src").mkdir()
    subprocess.run([*GIT, "mv", "studies", "src/studies"], cwd=repo, check=True)
    (repo / "studies").symlink_to("src/studies")
    subprocess.run([*GIT, "add", "studies"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "link"], cwd=repo, check=True)
    (repo / "src" / "studies" / "a.toml").write_text("[study]\nname = 'b'\n")
    rc, log, err = _run_study(repo)
    assert (rc, log) == (2, [])
    assert err.strip().startswith("error: studies/a.toml has uncommitted changes")


def test_run_study_refuses_to_continue_from_a_commit_whose_study_file_was_since_changed(tmp_path):
    """A study continues from the commit it last ran from; once its file has changed in a later commit (a
    design amended with qklab study amend), it says which commit to continue from, and runs nothing."""
    repo = _repo(tmp_path)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    results = repo / "docs" / "results" / "a"
    results.mkdir(parents=True)
    (results / "study.json").write_text(json.dumps({"name": "a", "code": [{"commit": first}]}))
    assert _run_study(repo)[:2] == (0, [f"{first} -m qklab study run studies/a.toml --workers 2 --results "
                                        f"{results} --out {tmp_path}/runs/a --no-report"])  # unchanged: it continues
    (repo / "studies" / "a.toml").write_text("[study]\nname = 'a'\nseeds = [0, 1]\n")
    subprocess.run([*GIT, "commit", "-qam", "amend"], cwd=repo, check=True)
    amended = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=repo, capture_output=True, text=True).stdout
    (tmp_path / "log").unlink()
    rc, log, err = _run_study(repo)
    assert (rc, log) == (2, [])
    assert err.strip() == (f"error: studies/a.toml changed since commit {first[:12]}, the one the study last ran "
                           "from; once the change is recorded with qklab study amend, continue from the commit that "
                           f"holds it: scripts/run_study.sh a {amended.strip()}")


APT = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $*" in
  "apt-cache show"*) [ -f "$UPDATED" ] && echo "Package: $3"; exit 0;;  # 0 either way, as apt-cache does
  "apt-get update"*) touch "$UPDATED";;
  "apt-get download"*) pin=${@: -1}; [ -f "$UPDATED" ] && touch "${pin/=/_}_all.deb" || exit 100;;
esac
"""


@pytest.mark.parametrize("listed", [False, True])
def test_install_corpus_updates_the_package_lists_for_a_pin_they_do_not_know(tmp_path: Path, listed: bool):
    """apt-cache show exits 0 for an unknown version; the lists must be updated before the download all the
    same (a new security release of a pinned package), and not when they already know it."""
    script = (ROOT / "scripts" / "install_corpus.sh").read_text()
    fetch = script[script.index("deb_fetch() {"):]
    fetch = fetch[:fetch.index("\n}\n") + 3]
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("apt-cache", "apt-get"):
        (bin_ / tool).write_text(APT)
        (bin_ / tool).chmod(0o755)
    (tmp_path / "dl").mkdir()
    if listed:
        (tmp_path / "updated").touch()
    (tmp_path / "fetch.sh").write_text(fetch)
    body = (f'DL={tmp_path}/dl; apt_updated=0; quiet() {{ "$@"; }}; die() {{ echo "die: $*"; exit 1; }}; '
            f'source {tmp_path}/fetch.sh; deb_fetch python3.11-doc 3.11.2-6+deb12u9')
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"), "UPDATED": str(tmp_path / "updated")}
    p = subprocess.run(["bash", "-c", body], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f"{tmp_path}/dl/python3.11-doc_3.11.2-6+deb12u9_all.deb"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert ("apt-get update -q" in calls) is not listed
    assert calls[-1].startswith("apt-get download")


# a report that lists the cells it read, as `qklab report` does in report.json; while it builds, the next
# pending cell finishes (cells shorter than a report build: the commits must still move on)
REPORT_STUB = """#!/usr/bin/env bash
d=$2 out=$4
mkdir -p "$out"
python3 - "$d" "$out" "$PENDING" <<'PY'
import json, pathlib, shutil, sys
d, out, pending = map(pathlib.Path, sys.argv[1:])
cells = sorted(p.parent.name for p in d.glob("*/result.json"))
(out / "report.json").write_text(json.dumps({"cells": [f"a/{c}" for c in cells]}))
(out / "report.md").write_text(" ".join(cells))
for p in sorted(pending.iterdir())[:1]:
    shutil.move(str(p), str(d / p.name))
PY
"""


def test_commit_results_commits_exactly_the_cells_its_report_was_built_from(tmp_path):
    """scripts/commit_results.sh: a cell that finishes while the report builds waits for the next pass, so
    every commit's report names exactly the cells committed beside it, and cells that finish faster than a
    report builds still get committed one pass at a time (the committer once rebuilt until no cell had
    landed during a build, and with such cells never committed). It stops when the study is complete."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "commit_results.sh", repo / "scripts")
    d = repo / "docs" / "results" / "a"
    d.mkdir(parents=True)
    names = [f"none_lr{i}_s0" for i in range(4)]
    (d / "study.json").write_text(json.dumps({"cells": names}))
    pending = tmp_path / "pending"
    for i, name in enumerate(names):
        (pending if i else d).joinpath(name).mkdir(parents=True)
        (pending if i else d).joinpath(name, "result.json").write_text("{}")
    stub = tmp_path / "qklab"
    stub.write_text(REPORT_STUB)
    stub.chmod(0o755)
    subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*GIT, "add", "scripts", "docs/results/a/study.json"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "x"], cwd=repo, check=True)
    who = {f"GIT_{r}_{k}": v for r in ("AUTHOR", "COMMITTER") for k, v in (("NAME", "t"), ("EMAIL", "t@t"))}
    p = subprocess.run(["bash", "scripts/commit_results.sh", "a", "0"], cwd=repo, capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "QKLAB": str(stub), "PENDING": str(pending),
                                        "TMPDIR": str(tmp_path), "HOME": str(tmp_path), **who})
    assert p.returncode == 0, p.stderr
    log = subprocess.run(["git", "log", "--reverse", "--format=%H %s"], cwd=repo, capture_output=True,
                         text=True).stdout.splitlines()[1:]
    assert [s.split(" ", 1)[1] for s in log] == [
        f"results: a, {i + 1} of 4 cells (new: {name}); {'complete' if i == 3 else 'partial'} report"
        for i, name in enumerate(names)]
    for line in log:  # each commit: its report names exactly the cells in its tree
        sha = line.split()[0]
        tree = subprocess.run(["git", "ls-tree", "-r", "--name-only", sha, "docs/results/a"], cwd=repo,
                              capture_output=True, text=True).stdout.split()
        report = json.loads(subprocess.run(["git", "show", f"{sha}:docs/results/a/report/report.json"], cwd=repo,
                                           capture_output=True, text=True).stdout)
        assert report["cells"] == [f"a/{t.split('/')[-2]}" for t in tree if t.endswith("/result.json")]


def test_count_baselines_reads_the_splits_a_study_reads(tmp_path):
    """scripts/count_baselines.py: the count models of a corpus's training split, read on its selection and
    report splits as prepare_data cuts them; a user's mistake is one line and exit 2."""
    import sys

    import numpy as np

    from qklab.config import load_config
    from qklab.data import prepare_data, unigram_cross_entropy, unigram_entropy

    docs = tmp_path / "docs"
    docs.mkdir()
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    for i in range(60):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice(words, 80)) + ".\n")
    sets = [f"data.source={docs}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}"]
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_baselines.py"), *(f"--set={s}" for s in sets)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    data = prepare_data(load_config("small", sets).data, log=lambda s: None)
    train, select, report = data.train_tokens(), data.select_tokens(), data.report_tokens()
    assert got["tokens"] == {"train": train.size, "select": select.size, "report": report.size}
    assert got["nats"]["unigram_report"] == pytest.approx(unigram_cross_entropy(train, report, data.vocab_size))
    assert got["nats"]["unigram_entropy_select"] == pytest.approx(unigram_entropy(select, data.vocab_size))
    assert got["nats"]["bigram_report"] < got["nats"]["unigram_report"]  # ten words: one byte of context helps
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_baselines.py"), "--set", "data.bogus=1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert p.stderr.startswith("error: unknown key 'data.bogus'")


def test_make_test_installs_no_system_package():
    """`make test` sets up the venv and runs pytest; the browser (apt, system-wide) only on `make browser`,
    which CI runs. Read from make's own dry run with the venv taken as built."""
    def dry(target: str) -> str:
        return subprocess.run(["make", "-n", "-o", ".venv/.installed-core", "-o", ".venv/.installed-dev", target],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout

    assert "install_browser" not in dry("test") and "apt-get" not in dry("test") and "pytest tests" in dry("test")
    assert "scripts/install_browser.sh" in dry("browser")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make browser") < ci.index("make test")
