#!/usr/bin/env bash
# Installs iptables (Debian's package) for the nemesis' partitions
# (mirrorq/nemesis/net.py).  Idempotent: does nothing when iptables is there,
# or when this is not root on a Debian-like machine (the partition tests then
# skip, saying why).  Called by ./dev.sh setup.
set -euo pipefail
if command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_iptables.sh: not root or no apt-get: skipping (nemesis partitions will be unavailable)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q iptables >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q iptables >/dev/null
fi
