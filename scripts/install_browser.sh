#!/usr/bin/env bash
# Install Debian's chromium for the headless-browser check of report.html (tests/report/test_html_browser.py).
# Idempotent and quiet: does nothing when /usr/bin/chromium is there; prints apt's log only on failure.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
       >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_browser.sh: could not install chromium" >&2
  exit 1
fi
echo "installed $(/usr/bin/chromium --version 2>/dev/null)"
