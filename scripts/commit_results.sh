#!/usr/bin/env bash
# Commit a running study's results cell by cell: every INTERVAL seconds, any result.json that finished
# under docs/results/STUDY since the last commit is committed together with the study's rebuilt report
# (tests/report/test_published.py checks that a committed report matches the result files beside it).
# A commit holds exactly the cells its report was built from (the report's report.json names them): a cell
# that finished while the report was being built waits for the next pass, so short cells finishing faster
# than a report builds never hold up the commits.
# Run it beside `qklab study run ... --results docs/results/STUDY`, from the repository root:
#   scripts/commit_results.sh qkmap_cpu            # stop it with Ctrl-C or kill; nothing is half-committed
# Only docs/results/STUDY is committed; the report's HTML copy (figures inlined) is not kept.
set -euo pipefail
study=${1:?usage: scripts/commit_results.sh STUDY [INTERVAL_SECONDS]}
interval=${2:-60}
cd "$(git rev-parse --show-toplevel)"
d=docs/results/$study
qklab=${QKLAB:-.venv/bin/qklab}
lock=${TMPDIR:-/tmp}/qklab-commit.lock  # shared with any other commit made under `flock` meanwhile
[ -d "$d" ] || { echo "error: no folder $d; start the study with --results $d first" >&2; exit 2; }

new_cells() {
  git ls-files --others --exclude-standard -- "$d" | sed -n "s#^$d/\([^/]*\)/result.json\$#\1#p" | sort
}
# the cells the report was built from, and those whose files it skipped (damaged or duplicate) but which
# were there before it started: both go into the commit beside it
built_from() {
  python3 -c "import json,sys; print('\n'.join(c.rsplit('/', 1)[-1] for c in json.load(open(sys.argv[1]))['cells']))" \
    "$d/report/report.json"
  printf '%s\n' $before
}

while true; do
  if [ -n "$(new_cells)" ]; then
    before=$(new_cells)
    nice -n 10 "$qklab" report "$d" --out "$d/report" --title "qklab study: $study" > /dev/null
    rm -f "$d/report/report.html"
    cells=$(comm -12 <(new_cells) <(built_from | sort -u))
    done_n=$(( $(git ls-files -- "$d" | grep -c '/result\.json$' || true) + $(echo "$cells" | grep -c . || true) ))
    total=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1])).get('cells', [])) or '?')" "$d/study.json")
    state=$([ "$done_n" = "$total" ] && echo "complete report" || echo "partial report")
    (
      flock 9
      for c in $cells; do git add "$d/$c"; done
      git add -A "$d/report" "$d/study.json"
      git commit -q -m "results: $study, $done_n of $total cells (new: $(echo $cells)); $state" -- "$d"
      echo "$(date +%T) committed $study: $done_n of $total (new: $(echo $cells))"
    ) 9>"$lock"
    [ "$done_n" = "$total" ] && exit 0
  fi
  sleep "$interval"
done
