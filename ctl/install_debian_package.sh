#!/usr/bin/env bash
# install_debian_package.sh PACKAGE BINARY WHAT_WITHOUT_IT
# Installs Debian's PACKAGE unless BINARY is on the PATH or at /usr/sbin or
# /usr/bin already.  Idempotent; when this is not root on a Debian-like
# machine it does nothing but say WHAT_WITHOUT_IT (the tests needing the
# package then skip, saying why).  apt-get update only if the first install
# fails.  Called through ctl/install_iptables.sh and ctl/install_chromium.sh.
set -euo pipefail
pkg=$1 bin=$2 without=$3
if command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || [ -x "/usr/bin/$bin" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install $pkg: not root or no apt-get: skipping ($without)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q "$pkg" >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q "$pkg" >/dev/null
fi
