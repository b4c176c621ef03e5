#!/usr/bin/env bash
# Install a one-node Slurm for the cluster tests (tests/cluster/): Debian's slurmctld, slurmd, slurm-client and
# munge, and munge's key. Idempotent and quiet: does nothing when the daemons and the key are there; prints
# apt's log only on failure. The tests start their own daemons in a temporary folder (their own slurm.conf,
# ports, state and logs) and stop them by their pids; nothing here starts or enables a service.
set -euo pipefail
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
KEY=/etc/munge/munge.key
if ! { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1; then
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  # policy-rc.d (unless there is one): the packages' postinst would start the system's own services; the
  # tests start their own
  POLICY=/usr/sbin/policy-rc.d
  own=""
  if [ ! -e "$POLICY" ]; then
    $SUDO sh -c "printf '#!/bin/sh\nexit 101\n' > $POLICY && chmod +x $POLICY" && own=1
  fi
  if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
         && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
              slurmctld slurmd slurm-client munge; } >"$log" 2>&1; then
    [ -n "$own" ] && $SUDO rm -f "$POLICY"
    cat "$log" >&2
    echo "install_slurm.sh: could not install Slurm" >&2
    exit 1
  fi
  [ -n "$own" ] && $SUDO rm -f "$POLICY"
fi
if ! $SUDO test -s "$KEY"; then  # munge's shared secret: the tests' daemons and commands authenticate with it
  $SUDO mkdir -p /etc/munge
  $SUDO sh -c "dd if=/dev/urandom bs=1 count=1024 of=$KEY 2>/dev/null"
  $SUDO chown munge:munge "$KEY" 2>/dev/null || true
  $SUDO chmod 0400 "$KEY"
fi
echo "slurm: $(slurmd -V 2>&1 | head -1), munge: $(munged --version 2>&1 | head -1)"
