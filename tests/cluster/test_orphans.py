"""Issue #16: a node start that fails leaves nothing running, and
``cluster stop`` kills every daemon it started (by the recorded process
group, never by name)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import conftest
from ctl.cluster import ClusterError, poll
from mirrorq.node import daemon

pytestmark = pytest.mark.cluster


def node_processes(c, node):
    return conftest.processes_under(c.data_dir / node)


def test_a_start_interrupted_mid_way_leaves_nothing_and_the_port_free(data_root):
    c = conftest.LocalCluster(data_root, 1, interval=0.2, timeout=1.5)
    c.cluster.create(1, c.base_port, c.amqp_base_port, 0.2, 1.5)
    errors = []

    def start():
        try:
            c.cluster.start_node("node1")
        except ClusterError as e:
            errors.append(str(e))

    t = threading.Thread(target=start)
    t.start()
    try:
        # the moment the admin exists (a node process leading its own group), the
        # daemon gets what the launcher sends past its deadline: SIGTERM
        def admin_and_daemon():
            live = [p for p in node_processes(c, "node1") if daemon._state(p) not in (None, "Z")]
            starter = [p for p in live if daemon._ppid_pgid(p) and daemon._ppid_pgid(p)[0] == os.getpid()]
            admins = [p for p in live if p not in starter and os.getpgid(p) == p]
            return (admins, starter) if admins and starter else None

        found = poll(admin_and_daemon, 30, step=0.01)
        assert found, "the admin never appeared"
        admins, starter = found
        os.kill(starter[0], signal.SIGTERM)
    finally:
        t.join(60)
    assert errors and "interrupted" in errors[0], errors
    assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")
    assert c.cluster.pid_info("node1") is None
    # nothing holds the admin port: the node starts normally, and cluster stop leaves nothing
    try:
        c.cluster.start_node("node1")
        assert c.cluster.is_running("node1")
    finally:
        c.stop()
    assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")


def test_a_daemon_killed_mid_start_is_found_by_its_recorded_group(data_root):
    c = conftest.LocalCluster(data_root, 1, interval=0.2, timeout=1.5)
    c.cluster.create(1, c.base_port, c.amqp_base_port, 0.2, 1.5)
    # a daemon that is SIGKILLed can clean nothing up itself: what it recorded must suffice
    t = threading.Thread(target=lambda: pytest.raises(ClusterError, c.cluster.start_node, "node1"))
    t.start()
    try:
        info = poll(lambda: (c.cluster.pid_info("node1") or {}).get("starting") and c.cluster.pid_info("node1"),
                    30, step=0.01)
        assert info, "the daemon recorded no starting group"
        starter = [p for p in node_processes(c, "node1")
                   if daemon._ppid_pgid(p) and daemon._ppid_pgid(p)[0] == os.getpid()]
        assert starter
        for p in starter:
            os.kill(p, signal.SIGKILL)
    finally:
        t.join(90)
    c.stop()  # cluster stop: by the recorded group
    assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")


def test_start_failing_on_a_taken_port_starts_nothing(data_root):
    import socket

    c = conftest.LocalCluster(data_root, 1, interval=0.2, timeout=1.5)
    c.cluster.create(1, c.base_port, c.amqp_base_port, 0.2, 1.5)
    s = socket.socket()
    s.bind(("127.0.0.1", c.base_port))
    s.listen()
    try:
        with pytest.raises(ClusterError, match="already in use"):
            c.cluster.start_node("node1")
        assert not node_processes(c, "node1")
    finally:
        s.close()
        c.stop()
