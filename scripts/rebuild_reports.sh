#!/usr/bin/env bash
# Rebuild the committed reports from their result files, after a change to the analysis or when a study
# has finished: every complete study's own report (the demo's keeps its HTML copy), the combined report of
# the code-corpus studies (docs/results/report) and, once an English study is complete, the combined
# English report beside the code one (docs/results/report_english, `qklab report --beside`); the combined
# reports read complete studies only. Then review
# `git diff docs/results` and commit.
#   make reports            # or: scripts/rebuild_reports.sh
# A study still running is left to its committer (scripts/commit_results.sh rebuilds its report with each
# cell) and stays out of the combined reports until it is complete.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
qklab=${QKLAB:-.venv/bin/qklab}
results=${QKLAB_RESULTS:-docs/results}
code=(qkmap_cpu logit_control_cpu logit_control_mla_cpu logit_control_width)
english=(qkmap_english logit_control_english ladder_english)

complete() {  # every cell that study.json names has its result.json
  python3 - "$results/$1" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
try:
    cells = json.loads((d / "study.json").read_text()).get("cells") or []
except (OSError, ValueError):
    sys.exit(1)
sys.exit(0 if cells and all((d / c / "result.json").is_file() for c in cells) else 1)
EOF
}

report() {  # OUT TITLE DIR... [--beside DIR...]
  local out=$1 title=$2
  shift 2
  echo "report: $out"
  "$qklab" report "$@" --out "$out" --title "$title" > /dev/null
}

for d in "$results"/*/; do
  d=${d%/} s=$(basename "$d")
  [ -f "$d/study.json" ] || continue
  if ! complete "$s"; then
    echo "skipped: $s (not complete; its committer rebuilds its report)"
    continue
  fi
  if [ "$s" = demo ]; then
    report "$d/report" "qklab demo" "$results/demo"
  else
    report "$d/report" "qklab study: $s" "$results/$s"
    rm -f "$d/report/report.html"
  fi
done

have() {  # the named studies that are complete (a running one would give verdicts that move with each cell)
  for s in "$@"; do
    if complete "$s"; then echo "$results/$s"
    elif [ -f "$results/$s/study.json" ]; then echo "not in the combined reports yet: $s (not complete)" >&2
    fi
  done
  return 0
}
mapfile -t code_dirs < <(have "${code[@]}")
mapfile -t english_dirs < <(have "${english[@]}")
if [ ${#code_dirs[@]} -gt 0 ]; then
  report "$results/report" "qklab: both papers' claims at CPU scale" "${code_dirs[@]}"
  rm -f "$results/report/report.html"
fi
if [ ${#english_dirs[@]} -gt 0 ]; then
  report "$results/report_english" "qklab: both papers' claims on natural English, beside Python source" \
    "${english_dirs[@]}" ${code_dirs[@]:+--beside "${code_dirs[@]}"}
  rm -f "$results/report_english/report.html"
fi
