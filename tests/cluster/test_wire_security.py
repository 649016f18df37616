"""Issue #16 item 3: the inter-node ports are closed to strangers.

* every admin and actor port of every node listens on the cluster address
  (127.0.0.1 here) only: a connection to it through this machine's
  non-loopback address is refused;
* a message without the cluster secret's MAC -- a crafted pickle that would
  create a file if it were unpickled -- is dropped unread: the file never
  appears, on any port; the same pickle signed with the secret does create
  it (the test can tell the difference), one signed with another key does not.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess

import conftest
import pytest

from ctl.nemesis.net import _listening_ports_by_inode, _socket_inodes
from mirrorq.admin.cluster import poll
from mirrorq.node import daemon, wire

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        yield c


def non_loopback_address() -> str | None:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        addr = parts[3].split("/")[0]
        if not addr.startswith("127."):
            return addr
    return None


def listening(c, node: str) -> dict[int, str]:
    """port -> local address of every TCP socket the node's processes listen on."""
    pgid = int(c.cluster.pid_info(node)["pgid"])
    by_inode = _listening_ports_by_inode()
    local = {}
    for table in ("/proc/net/tcp",):
        with open(table) as f:
            next(f)
            for line in f:
                p = line.split()
                if p[3] == "0A":
                    h, port = p[1].split(":")
                    local[int(p[9])] = socket.inet_ntoa(bytes.fromhex(h)[::-1])
    out = {}
    for pid in daemon._group_members(pgid):
        for ino in _socket_inodes(pid):
            if ino in by_inode:
                out[by_inode[ino]] = local.get(ino, "::")
    return out


def send_frame(port: int, payload: bytes) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(b"%d>" % len(payload) + payload)
        got = b""
        while True:
            try:
                chunk = s.recv(4096)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        s.close()


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_every_node_port_listens_on_loopback_only_and_refuses_other_addresses(cluster):
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for node in ("node1", "node2", "node3"):
        ports = listening(cluster, node)
        admin = cluster.admin_port(node)
        assert admin in ports and len(ports) >= 4, (node, ports)  # admin, agent, manager, listener, ...
        assert set(ports.values()) == {"127.0.0.1"}, (node, ports)
        for port in ports:
            s = socket.socket()
            s.settimeout(3)
            try:
                with pytest.raises(ConnectionRefusedError):
                    s.connect((addr, port))
            finally:
                s.close()


def test_a_message_without_the_secret_is_dropped_unread(cluster, tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Evil(str(marker)))
    for node in ("node1", "node2", "node3"):
        for port in listening(cluster, node):
            if port == int(cluster.cluster.pid_info(node)["amqp_port"]):
                continue
            send_frame(port, evil)  # a bare pickle, as Thespian's own wire carries
            wrong = wire.AuthSerializer()
            wrong.add_key(b"0" * 64)
            send_frame(port, wrong.dumps(Evil(str(marker))))  # signed, with another cluster's key
            send_frame(port, wire.MAGIC + b"\x01" + os.urandom(32) + evil)  # a forged MAC
    # the nodes read all of it (and still answer), and nothing ran
    for node in ("node1", "node2", "node3"):
        assert cluster.cluster.status(node) is not None
    assert not marker.exists()
    # control: the same pickle signed with the cluster secret is unpickled, so the check above could fail
    right = wire.AuthSerializer()
    right.add_key(wire.read_secret(cluster.cluster.secret_path))
    send_frame(cluster.admin_port("node1"), right.dumps(Evil(str(marker))))
    assert poll(marker.exists, 10), "a message signed with the secret was not unpickled: the test proves nothing"


def test_the_secret_file_is_private_and_required(cluster, tmp_path):
    st = os.stat(cluster.cluster.secret_path)
    assert st.st_mode & 0o077 == 0
    cfg = cluster.cluster.config("node1")
    assert cfg.secret_file == str(cluster.cluster.secret_path)
    bad = tmp_path / "open.secret"
    bad.write_text("x" * 64)
    os.chmod(bad, 0o644)
    from mirrorq.node.config import NodeConfig

    with pytest.raises(daemon.StartError, match="readable by group or others"):
        daemon.load_secret(NodeConfig(name="n", secret_file=str(bad)))
    with pytest.raises(daemon.StartError, match="no secret_file"):
        daemon.load_secret(NodeConfig(name="n"))
