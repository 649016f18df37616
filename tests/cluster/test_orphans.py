"""Issue #16: a node start that fails leaves nothing running, and
``cluster stop`` kills every daemon it started (by the recorded process
group, never by name).

``MIRRORQ_TEST_START_HOLD`` makes the daemon wait mid-start (its admin and
actors running, its group recorded as ``starting``), so a test interrupts a
start at a known point instead of racing it."""

from __future__ import annotations

import os
import signal
import threading

import conftest
import pytest

from mirrorq.admin.cluster import ClusterError, poll
from mirrorq.node import daemon

pytestmark = pytest.mark.cluster


def node_processes(c, node):
    return conftest.processes_under(c.data_dir / node)


def one_node(data_root):
    c = conftest.LocalCluster(data_root, 1, interval=0.2, timeout=1.5)
    c.cluster.create(1, c.base_port, c.amqp_base_port, 0.2, 1.5, management_base_port=c.management_base_port)
    return c


def start_in_thread(c, errors):
    def start():
        try:
            c.cluster.start_node("node1")
        except ClusterError as e:
            errors.append(str(e))

    t = threading.Thread(target=start)
    t.start()
    return t


def mid_start(c):
    """(the daemon's pid, the recorded starting group) once the daemon holds mid-start."""

    def probe():
        info = c.cluster.pid_info("node1") or {}
        starter = [
            p for p in node_processes(c, "node1") if daemon._ppid_pgid(p) and daemon._ppid_pgid(p)[0] == os.getpid()
        ]
        return (starter[0], info["pgid"]) if info.get("starting") and starter else None

    found = poll(probe, 30, step=0.02)
    assert found, "the daemon never recorded its starting group"
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_start_leaves_nothing_and_the_port_free(data_root, monkeypatch, sig):
    """SIGTERM is what start_node sends a daemon past its deadline (the daemon
    kills what it started); after SIGKILL the daemon can do nothing, and the
    launcher kills the group it recorded."""
    c = one_node(data_root)
    errors: list = []
    monkeypatch.setenv("MIRRORQ_TEST_START_HOLD", "60")
    t = start_in_thread(c, errors)
    try:
        starter, pgid = mid_start(c)
        assert daemon.process_group_alive(pgid)
        os.kill(starter, sig)
        t.join(60)
        assert errors, "the interrupted start did not fail"
        if sig == signal.SIGTERM:
            assert "interrupted" in errors[0] and "nothing left running" in errors[0], errors
        assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")
        assert not daemon.process_group_alive(pgid)
        assert c.cluster.pid_info("node1") is None
        # nothing holds the admin port: the node starts normally
        monkeypatch.delenv("MIRRORQ_TEST_START_HOLD")
        c.cluster.start_node("node1")
        assert c.cluster.is_running("node1")
    finally:
        t.join(60)
        c.stop()
    assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")


def test_start_node_past_its_deadline_leaves_nothing(data_root, monkeypatch):
    c = one_node(data_root)
    monkeypatch.setenv("MIRRORQ_TEST_START_HOLD", "60")
    try:
        with pytest.raises(ClusterError, match="did not finish starting"):
            c.cluster.start_node("node1", timeout=8)
        assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")
        assert c.cluster.pid_info("node1") is None
    finally:
        c.stop()


def test_cluster_stop_kills_a_daemon_stuck_mid_start_by_its_recorded_group(data_root, monkeypatch):
    c = one_node(data_root)
    errors: list = []
    monkeypatch.setenv("MIRRORQ_TEST_START_HOLD", "60")
    t = start_in_thread(c, errors)
    try:
        _, pgid = mid_start(c)
        c.stop()  # cluster stop, while the start is still in progress
        assert not daemon.process_group_alive(pgid)
    finally:
        t.join(90)
        c.stop()
    assert poll(lambda: not node_processes(c, "node1"), 10), node_processes(c, "node1")


def test_start_failing_on_a_taken_port_starts_nothing(data_root):
    import socket

    c = one_node(data_root)
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
