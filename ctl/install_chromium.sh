#!/usr/bin/env bash
# Installs Debian's chromium for the ring page's headless-browser test
# (tests/cluster/test_mgmt_browser.py, driven by playwright with this
# binary: playwright never downloads a browser here).  Called by ./dev.sh setup.
exec "$(dirname "$0")/install_debian_package.sh" chromium chromium "the ring page's browser test will be skipped"
