#!/bin/sh
# Install Debian's rabbitmq-server (and the Erlang it needs) for the benchmarks'
# yardstick (bench/rabbitmq.py, bench/amqp.py --rabbitmq, bench/sync_rabbitmq.py).
#
#   bench/install_rabbitmq.sh [--dry-run]
#
# * Does nothing when /usr/lib/rabbitmq/bin/rabbitmq-server, erl and epmd are there.
# * apt-get, noninteractive, --no-install-recommends; as root or through sudo.
# * Never starts the system service: a policy-rc.d that denies every start is in
#   place during the install (only if none exists; removed afterwards), and on a
#   systemd host the unit is disabled so no boot starts it either.  The benches
#   run their own nodes on loopback (bench/rabbitmq.py); CI does not need this.
set -eu

DRY=
case "${1:-}" in
  "") ;;
  --dry-run) DRY=-s ;;
  *) echo "install_rabbitmq.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac

if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && command -v erl >/dev/null 2>&1 \
   && command -v epmd >/dev/null 2>&1; then
  echo "rabbitmq-server is installed: $(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo '?')"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_rabbitmq.sh: needs apt-get (Debian/Ubuntu); install rabbitmq-server 3.x by hand" >&2
  exit 1
fi

SUDO=
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install_rabbitmq.sh: run as root (no sudo here)" >&2; exit 1; }
  SUDO=sudo
fi

POLICY=/usr/sbin/policy-rc.d
OURS=
cleanup() { if [ -n "$OURS" ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT INT TERM
if [ -z "$DRY" ] && [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\n# bench/install_rabbitmq.sh: no service starts while it installs\nexit 101\n' \
    | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"
  OURS=1
fi

$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install $DRY -y -q --no-install-recommends rabbitmq-server

if [ -z "$DRY" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  $SUDO systemctl disable rabbitmq-server >/dev/null 2>&1 || true
fi
echo "installed rabbitmq-server $(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo '?'); service not started"
