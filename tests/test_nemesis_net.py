"""Partitions by real packet filtering (ctl.nemesis.net) between plain
processes in the nemesis' cgroups: no cluster, but root and iptables."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ctl.nemesis import net

ok, why = net.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

SERVER = r"""
import socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
def serve(c):
    while True:
        d = c.recv(100)
        if not d:
            return
        print("GOT", d.decode(), flush=True)
        c.sendall(b"ok:" + d)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

CLIENT = r"""
import socket, sys, time
port, msgs = int(sys.argv[1]), sys.argv[2:]
c = socket.create_connection(("127.0.0.1", port), timeout=2)
for m in msgs:
    if m == "WAIT":
        input()  # the test says when to go on
        continue
    t = time.monotonic()
    try:
        c.sendall(m.encode()); r = c.recv(100)
        print("REPLY", r.decode() if r else "EOF", flush=True)
    except Exception as e:
        print("ERR", type(e).__name__, round(time.monotonic() - t, 2), flush=True)
        c = None
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=2)
        except Exception as e:
            print("CONNERR", type(e).__name__, flush=True)
            break
"""


def spawn(nem, node, code, *args, stdin=False):
    return subprocess.Popen(
        ["sh", "-c", 'echo $$ > "$0" && exec "$@"', nem.procs_file(node), sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        text=True,
    )


def run_client(nem, node, port, *msgs, timeout=20):
    p = spawn(nem, node, CLIENT, port, *msgs)
    out, _ = p.communicate(timeout=timeout)
    return out.split("\n")


@pytest.fixture
def nem():
    n = net.NetNemesis(["a", "b", "c"])
    n.open()
    procs = []
    n.procs = procs
    try:
        yield n
    finally:
        for p in procs:
            p.kill()
            p.wait()
        n.close()
        assert n.leftovers() == []


def server(nem, node):
    p = spawn(nem, node, SERVER)
    nem.procs.append(p)
    port = int(p.stdout.readline())
    os.set_blocking(p.stdout.fileno(), False)
    return p, port


def drained(p) -> str:
    """What the server printed so far (its stdout is non-blocking)."""
    out = b""
    while True:
        try:
            chunk = os.read(p.stdout.fileno(), 65536)
        except BlockingIOError:
            return out.decode()
        if not chunk:
            return out.decode()
        out += chunk


@pytest.mark.parametrize("mode", ["drop", "reset"])
def test_partition_cuts_new_and_established_connections(nem, mode):
    srv_b, port_b = server(nem, "b")
    srv_c, port_c = server(nem, "c")
    assert run_client(nem, "a", port_b, "hello")[0] == "REPLY ok:hello"
    assert nem.listen_ports("b") == {port_b}
    # an established connection, then the cut
    cli = spawn(nem, "a", CLIENT, port_b, "first", "WAIT", "second", stdin=True)
    nem.procs.append(cli)
    assert cli.stdout.readline().strip() == "REPLY ok:first"
    nem.partition([["a"], ["b", "c"]], mode)
    t0 = time.monotonic()
    cli.stdin.write("\n")
    cli.stdin.flush()
    line = cli.stdout.readline().strip()
    took = time.monotonic() - t0
    assert line.startswith("ERR"), line
    if mode == "reset":
        assert took < 1.5, f"a reset partition should fail at once, took {took:.2f}s ({line})"
    # a new connection across the cut
    out = run_client(nem, "a", port_b, "new")
    assert not any(ln.startswith("REPLY") for ln in out), out
    # nothing sent during the partition reached b, unread
    seen = drained(srv_b)
    assert "GOT second" not in seen and "GOT new" not in seen, seen
    # the majority side still talks
    assert run_client(nem, "b", port_c, "bc")[0] == "REPLY ok:bc"
    nem.heal()
    assert run_client(nem, "a", port_b, "healed")[0] == "REPLY ok:healed"


def test_new_listener_during_partition_is_cut_after_refresh(nem):
    nem.partition([["a"], ["b"]], "drop")
    _, port = server(nem, "b")
    from mirrorq.admin.cluster import poll

    assert poll(lambda: ("a", port) in nem.current.installed, 5), nem.rules()
    out = run_client(nem, "a", port, "x")
    assert not any(ln.startswith("REPLY") for ln in out), out


def test_cleanup_removes_only_dead_owners_leftovers():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    chain = f"{net.CHAIN_PREFIX}{dead.pid}"
    cg = os.path.join(net.cgroup2_root(), f"{net.PREFIX}{dead.pid}")
    mine = net.NetNemesis(["x"]).open()
    try:
        subprocess.run(["iptables", "-w", "-N", chain], check=True)
        subprocess.run(["iptables", "-w", "-N", chain + "-P"], check=True)
        subprocess.run(["iptables", "-w", "-A", "OUTPUT", "-j", chain], check=True)
        os.makedirs(os.path.join(cg, "n1"))
        removed = net.cleanup_leftovers()
        assert chain in removed and cg in removed
        assert not os.path.exists(cg)
        assert subprocess.run(["iptables", "-w", "-S", chain], capture_output=True).returncode != 0
        assert mine.leftovers() != []  # a live owner's run is left alone
    finally:
        mine.close()
        net._remove_chain(chain)
        net._remove_cgroup_tree(cg, net.cgroup2_root())
    assert mine.leftovers() == []


def test_one_way_partition_cuts_only_what_the_first_group_sends(nem):
    srv_a, port_a = server(nem, "a")
    srv_b, port_b = server(nem, "b")
    # established both ways before the cut
    from_b = spawn(nem, "b", CLIENT, port_a, "first", "WAIT", "second", stdin=True)
    from_a = spawn(nem, "a", CLIENT, port_b, "first", "WAIT", "second", stdin=True)
    nem.procs += [from_b, from_a]
    assert from_b.stdout.readline().strip() == "REPLY ok:first"
    assert from_a.stdout.readline().strip() == "REPLY ok:first"
    nem.partition([["a"], ["b", "c"]], "drop", one_way=True)
    for cli in (from_b, from_a):
        cli.stdin.write("\n")
        cli.stdin.flush()
    # b's bytes still reach a (a prints them) but a's answer never comes back
    assert from_b.stdout.readline().startswith("ERR")
    from mirrorq.admin.cluster import poll

    assert poll(lambda: "GOT second" in drained(srv_a), 5), "b's packets to a were cut too"
    # a's bytes do not reach b
    assert from_a.stdout.readline().startswith("ERR")
    assert "GOT second" not in drained(srv_b)
    nem.heal()
    assert run_client(nem, "a", port_b, "healed")[0] == "REPLY ok:healed"
    assert run_client(nem, "b", port_a, "healed")[0] == "REPLY ok:healed"


LINK_CLIENT = r"""
import socket, sys, time
sys.path.insert(0, sys.argv[1])
from mirrorq.node.posting import link_socket_options
port, tuned = int(sys.argv[2]), sys.argv[3] == "tuned"
c = socket.create_connection(("127.0.0.1", port), timeout=2)
if tuned:
    link_socket_options(c)
c.setblocking(True)
c.sendall(b"first"); print("REPLY", c.recv(100).decode(), flush=True)
input()  # the test cut the network
t = time.monotonic()
try:
    c.sendall(b"second"); r = c.recv(100)
    print("REPLY" if r else "EOF", round(time.monotonic() - t, 2), flush=True)
except OSError as e:
    print("ERR", type(e).__name__, round(time.monotonic() - t, 2), flush=True)
"""


def test_a_link_socket_whose_bytes_go_unacknowledged_fails_after_the_user_timeout(nem):
    """Link sockets carry TCP_USER_TIMEOUT: under a one-way cut (the peer
    gets the bytes, its acknowledgements are dropped) a link socket fails
    with ETIMEDOUT after LINK_USER_TIMEOUT, so the link closes and replays
    instead of living through the cut in TCP's retransmission backoff.  A
    plain socket beside it is still waiting then."""
    import mirrorq
    from mirrorq.node.posting import LINK_USER_TIMEOUT

    root = os.path.dirname(os.path.dirname(os.path.abspath(mirrorq.__file__)))
    _srv, port = server(nem, "b")
    tuned = spawn(nem, "a", LINK_CLIENT, root, port, "tuned", stdin=True)
    plain = spawn(nem, "a", LINK_CLIENT, root, port, "plain", stdin=True)
    nem.procs += [tuned, plain]
    for cli in (tuned, plain):
        assert cli.stdout.readline().strip() == "REPLY ok:first"
    nem.partition([["b"], ["a", "c"]], "drop", one_way=True)
    for cli in (tuned, plain):
        cli.stdin.write("\n")
        cli.stdin.flush()
    line = tuned.stdout.readline().split()  # blocks until the tuned client gives up
    assert line[:2] == ["ERR", "TimeoutError"], line
    assert LINK_USER_TIMEOUT - 0.5 <= float(line[2]) <= LINK_USER_TIMEOUT + 2, line
    os.set_blocking(plain.stdout.fileno(), False)
    assert drained(plain) == ""  # the plain socket still waits on TCP's retransmissions
