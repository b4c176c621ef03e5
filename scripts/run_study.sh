#!/usr/bin/env bash
# Run a long study from one commit to its end: in a separate clone at that commit (a clean tree), its
# results written into this checkout's docs/results/STUDY and committed cell by cell
# (scripts/commit_results.sh). Run it again, in a later session too, to continue where it stopped:
#   scripts/run_study.sh qkmap_english            # the commit it was last started from, else HEAD
#   scripts/run_study.sh qkmap_english 9c4d00a    # a given commit
# Once its study file has changed since the commit it last ran from (a design amended with `qklab study
# amend`), it runs nothing and names the commit to continue from, given once as above.
# Needs this checkout's .venv (make setup); the clone imports its own src/ through PYTHONPATH.
# QKLAB_WORKERS: cells at a time (default 2; a study continued with another count trains the same cells).
# QKLAB_THREADS: CPU threads per cell (default: the cores / workers; set it when studies share the machine).
set -euo pipefail
study=${1:?usage: scripts/run_study.sh STUDY [COMMIT]}
root=$(git rev-parse --show-toplevel)
cd "$root"
results=$root/docs/results/$study
py=$root/.venv/bin/python
[ -x "$py" ] || { echo "error: no $py; run make setup first" >&2; exit 2; }
# the study file as git tracks it (studies/ may be a link to the package's src/qklab/studies)
file=$(realpath --relative-to="$root" "studies/$study.toml")
commit=${2:-}
if [ -z "$commit" ] && [ -f "$results/study.json" ]; then  # the code it was last started from
  commit=$("$py" -c "import json,sys; c=json.load(open(sys.argv[1])).get('code') or [{}]; print(c[-1].get('commit') or '')" \
           "$results/study.json")
  if [ -n "$commit" ] && ! git diff --quiet "$commit" HEAD -- "$file"; then  # amended since, or edited
    echo "error: studies/$study.toml changed since commit ${commit:0:12}, the one the study last ran from; once" \
         "the change is recorded with qklab study amend, continue from the commit that holds it:" \
         "scripts/run_study.sh $study $(git log -1 --format=%h -- "$file")" >&2
    exit 2
  fi
fi
if [ -z "$commit" ]; then  # HEAD, in a clean clone; edits in this checkout are not part of the study
  [ -z "$(git status --porcelain -- "$file")" ] || {
    echo "error: studies/$study.toml has uncommitted changes; commit them first (the study runs from HEAD)" >&2
    exit 2; }
  dirty=$(git status --porcelain --untracked-files=no | cut -c4- | paste -sd ' ' -)
  [ -z "$dirty" ] || echo "note: uncommitted changes ($dirty) are not part of this study; it runs from HEAD" >&2
  commit=$(git rev-parse HEAD)
fi
commit=$(git rev-parse --verify "$commit^{commit}")
runs=${QKLAB_RUNS:-$root/../qklab-runs}
clone=$runs/clones/$study-${commit:0:12}
if [ ! -d "$clone" ]; then
  mkdir -p "$runs/clones"
  git clone -q "$root" "$clone"
  git -C "$clone" checkout -q "$commit"
fi
[ "$(git -C "$clone" rev-parse HEAD)" = "$commit" ] || { echo "error: $clone is not at $commit" >&2; exit 2; }
echo "study $study from commit ${commit:0:12} in $clone; results in $results"
# --no-report: the committer builds every report, the last one too, with this checkout's code (report/ reads
# result files only); the clone's commit, older, may not build one (e435ac4's claims.py imports a module
# committed after it), and a failed report there would make a finished study exit non-zero
(cd "$clone" && env -u QKLAB_ALLOW_DIRTY PYTHONPATH="$clone/src" "$py" -m qklab study run "studies/$study.toml" \
   --workers "${QKLAB_WORKERS:-2}" ${QKLAB_THREADS:+--threads "$QKLAB_THREADS"} --results "$results" \
   --out "$runs/$study" --no-report) &
run=$!
mkdir -p "$results"
interval=${QKLAB_COMMIT_INTERVAL:-120}
QKLAB=$root/.venv/bin/qklab scripts/commit_results.sh "$study" "$interval" &
committer=$!
trap 'kill -TERM $run 2>/dev/null; wait $run; kill $committer 2>/dev/null' INT TERM
status=0
wait $run || status=$?
# the committer's last pass: wait while a finished cell is not yet committed (at most two intervals; none
# when the run trained nothing or was refused), then stop it between commits, under its lock
deadline=$((SECONDS + interval * 2 + 10))
uncommitted() { git ls-files --others --exclude-standard -- "$results" | grep '/result\.json$' || true; }
while [ -n "$(uncommitted)" ] && [ $SECONDS -lt $deadline ]; do
  sleep 2
done
(flock 9; kill $committer 2>/dev/null || true) 9>"${TMPDIR:-/tmp}/qklab-commit.lock"
exit $status
