#!/usr/bin/env bash
# Run several long studies one after another, each from one commit to its end (scripts/run_study.sh: a
# study with results continues from the commit it was last started from; one without starts from HEAD, in a
# clean clone, its study file committed), so that the machine never waits between them:
#   QKLAB_RUNS=/work/runs scripts/run_studies.sh qkmap_english logit_control_english ladder_english
# A study whose cells failed (exit 1: each is in its report's failures table) does not hold up the next
# (the chain then ends with 1); one that was stopped (exit 128 + N) or refused (exit 2) ends the chain.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/run_studies.sh STUDY [STUDY ...]" >&2; exit 2; }
here=$(dirname "$0")
failed=0
for study in "$@"; do
  status=0
  "$here/run_study.sh" "$study" || status=$?
  if [ "$status" = 1 ]; then
    echo "run_studies: $study ended with failed cells (listed in its report); going on" >&2
    failed=1
  elif [ "$status" != 0 ]; then
    echo "run_studies: $study ended with $status; the studies after it did not start" >&2
    exit "$status"
  fi
done
exit $failed
