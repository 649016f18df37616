#!/usr/bin/env bash
# mirrorq developer entry point.
#   ./dev.sh demo   set up .venv, start a local 3-node cluster and run the demo
#   ./dev.sh test   set up .venv, lint, and run the test suite (what CI runs)
#   ./dev.sh lint   set up .venv and lint only (ruff check, ruff format --check, mypy)
set -euo pipefail
cd "$(dirname "$0")"

export THESPIAN_BASE_IPADDR=127.0.0.1 SPARK_LOCAL_IP=127.0.0.1
# Spark's Python workers must run the venv's python by its venv path: the
# symlink resolved (/usr/bin/python3.11) would lose the venv's packages.
export PYSPARK_PYTHON="$PWD/.venv/bin/python" PYSPARK_DRIVER_PYTHON="$PWD/.venv/bin/python"

find_python() {
  for py in "${PYTHON:-}" python3.11 python3 python; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "dev.sh: need Python >= 3.11 (set PYTHON=...)" >&2; return 1
}

setup() {
  local py; py=$(find_python)
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
  fi
  # reinstall only when the project's dependencies changed
  if [ ! -f .venv/.mirrorq-installed ] || [ pyproject.toml -nt .venv/.mirrorq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test,spark]'
    touch .venv/.mirrorq-installed
  fi
  # iptables for the nemesis' partitions (idempotent; skips when present)
  ./ctl/install_iptables.sh
  # Debian's chromium for the ring page's browser test (idempotent; skips when present)
  ./ctl/install_chromium.sh
  # iproute2 (ip netns, veth, bridge) for the multi-host lab's tests (idempotent; skips when present)
  ./ctl/install_debian_package.sh iproute2 ip "the multi-host namespace tests will fail, naming what is missing"
}

# ruff's rules and formatting, mypy's types (pyproject.toml [tool.ruff], [tool.mypy]);
# the tests run only on clean, type-checked code
lint() {
  .venv/bin/ruff check --quiet .
  .venv/bin/ruff format --check --quiet .
  .venv/bin/mypy
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup
    exec .venv/bin/python -m ctl.demo "$@"
    ;;
  lint)
    setup
    lint
    ;;
  test)
    setup
    lint
    exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
    ;;
  setup)
    setup
    ;;
  *)
    echo "usage: ./dev.sh demo|test|lint|setup [args...]" >&2
    exit 2
    ;;
esac
