#!/usr/bin/env bash
# Installs Debian's chromium for the ring page's headless-browser test
# (tests/cluster/test_mgmt_browser.py, driven by playwright with this
# binary: playwright never downloads a browser here).  Idempotent: does
# nothing when chromium is there, or when this is not root on a Debian-like
# machine (the browser test then skips, saying why).  Called by ./dev.sh setup.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium.sh: not root or no apt-get: skipping (the ring page's browser test will be skipped)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q chromium >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q chromium >/dev/null
fi
