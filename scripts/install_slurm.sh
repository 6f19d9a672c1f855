#!/usr/bin/env bash
# Debian's slurm-wlm + munge for the Slurm executor tests (a single-node cluster on loopback,
# started and stopped by tests/slurm_cluster.py). Idempotent; needs root (CI runs as root).
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  echo "slurm: already installed ($(slurmctld -V))"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
# The packages' own services are not used: the tests run private daemons from a temp folder.
systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true
echo "slurm: installed ($(slurmctld -V))"
