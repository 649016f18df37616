#!/usr/bin/env bash
# Installs iptables (Debian's package) for the nemesis' partitions
# (ctl/nemesis/net.py).  Called by ./dev.sh setup.
exec "$(dirname "$0")/install_debian_package.sh" iptables iptables "nemesis partitions will be unavailable"
