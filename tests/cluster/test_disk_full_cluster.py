"""A node whose data dir's disk fills up (a 64 MiB tmpfs as node1's data dir).

With the default ``disk_free_limit`` (50 MB) the disk alarm blocks the
publisher before the disk is full.  With the limit at 1 byte the disk
really fills: the queue's replica stops with a DiskFull error naming its
directory, and the publisher is blocked ("low on disk") once nothing is
left.  When space returns (the tmpfs grows) the publisher is unblocked and
finishes; every message is in the queue once, and still is after the node
restarts (nothing on disk was corrupted).

Needs root and mount(2); skipped with the reason where a tmpfs cannot be
mounted.  The tmpfs is unmounted in every case.
"""

from __future__ import annotations

import os
import subprocess
import threading

import conftest
import pytest
from conftest import wait_for

from mirrorq.node.log import read as read_log

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

BODY = 64 * 1024
PUBLISHES = 1200  # 75 MiB: more than the tmpfs holds


def _mount(path, size: str) -> str:
    """'' once a tmpfs of ``size`` is mounted at ``path``, else why not."""
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount could not run: {e}"
    return "" if r.returncode == 0 else f"mount -t tmpfs failed: {(r.stderr or r.stdout).strip()}"


@pytest.fixture
def small_disk(data_root):
    """A started 1-node cluster whose node1 data dir is a 64 MiB tmpfs."""
    node_dir = data_root / "node1"
    node_dir.mkdir()
    why = _mount(node_dir, "64m")
    if why:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root and mount permission): {why}")
    c = conftest.LocalCluster(data_root, 1, interval=0.2, timeout=1.5)
    try:
        c.start()
        yield c, node_dir
    finally:
        c.stop()
        conftest.kill_pids(conftest.processes_under(data_root))
        if subprocess.run(["umount", str(node_dir)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(node_dir)], capture_output=True)  # lazily, if still busy


class Publisher(threading.Thread):
    """PUBLISHES persistent messages with confirms, one at a time; counts
    the confirmed ones and records connection.blocked / unblocked."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.confirmed = 0
        self.blocked: list[str] = []
        self.unblocked = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port, connection_attempts=3))
            # on the connection under BlockingConnection: its own callbacks wait for basic_publish to return
            conn._impl.add_on_connection_blocked_callback(lambda _c, f: self.blocked.append(f.method.reason))
            conn._impl.add_on_connection_unblocked_callback(
                lambda _c, _f: setattr(self, "unblocked", self.unblocked + 1)
            )
            ch = conn.channel()
            ch.confirm_delivery()
            for i in range(PUBLISHES):
                ch.basic_publish(
                    "", "disk.q", i.to_bytes(4, "big") * (BODY // 4), pika.BasicProperties(delivery_mode=2)
                )
                self.confirmed += 1
            conn.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_disk_that_fills_blocks_publishers_corrupts_nothing_and_recovers_when_space_returns(small_disk):
    c, node_dir = small_disk
    with c.channel(0) as ch:
        ch.queue_declare("disk.q", durable=True)
    pub = Publisher(c.amqp_base_port)
    pub.start()
    try:
        # the default limit (50 MB of 64 MiB): blocked before the disk is full
        wait_for(lambda: (bool(pub.blocked) or pub.error is not None, pub.confirmed), 60, "the disk alarm")
        assert pub.error is None and pub.blocked == ["low on disk"] and pub.confirmed < PUBLISHES
        st = c.json("status", "-n", "node1")
        assert st["disk_free_alarm"] is True and 0 < st["disk_free"] < 50_000_000
        assert free_bytes(node_dir) > 4 << 20  # the alarm came first: room is left

        # a limit of 1 byte: publishing goes on until the disk is really full
        assert c.ctl("set_disk_free_limit", "-n", "node1", "1") == 0
        wait_for(lambda: (pub.unblocked == 1, pub.unblocked), 15, "connection.unblocked under the new limit")
        wait_for(
            lambda: (len(pub.blocked) == 2 or pub.error is not None, (pub.confirmed, free_bytes(node_dir))),
            60,
            "the publisher blocked again on a full disk",
        )
        assert pub.error is None and pub.blocked[1] == "low on disk" and pub.confirmed < PUBLISHES
        assert c.json("status", "-n", "node1")["disk_free"] == 0

        # space returns
        r = subprocess.run(["mount", "-o", "remount,size=256m", str(node_dir)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: (pub.unblocked == 2, pub.unblocked), 15, "connection.unblocked once space returned")
        pub.join(120)
        assert not pub.is_alive() and pub.error is None and pub.confirmed == PUBLISHES
    finally:
        pub.join(5)
    assert c.queue_row("disk.q").get("messages") == PUBLISHES
    # what the node logged while its disk was full was kept and written since: the replica's clear error
    crashed = [r for r in read_log(str(node_dir)) if r["event"] == "replica_crashed"]
    assert crashed and "DiskFull" in crashed[0]["error"] and "no space left on its device" in crashed[0]["error"]
    assert "disk.q" in crashed[0]["error"]  # its directory

    # nothing on disk was corrupted: after a restart the queue holds every message once
    assert c.ctl("stop_node", "node1") == 0
    assert c.ctl("start_node", "node1") == 0
    wait_for(
        lambda: (c.queue_row("disk.q").get("messages") == PUBLISHES, c.queue_row("disk.q")),
        60,
        "the queue recovered after a restart",
    )
    seen = set()
    with c.channel(0, confirm=False) as ch:
        for method, _props, body in ch.consume("disk.q", auto_ack=True, inactivity_timeout=15):
            assert method is not None, f"the queue ran dry after {len(seen)} messages"
            i = int.from_bytes(body[:4], "big")
            assert body == i.to_bytes(4, "big") * (BODY // 4) and i not in seen
            seen.add(i)
            if len(seen) == PUBLISHES:
                break
    assert seen == set(range(PUBLISHES))
    corrupt = [r for r in read_log(str(node_dir)) if "corrupt" in r["event"]]
    assert corrupt == []
