"""Overload on a real 3-node mirrored queue (issue #30): credit, not buffers.

* A consumer whose client never reads its socket (no-ack, no prefetch
  limit) on a 64 MiB backlog: its node's memory does not take the backlog
  in (link credit stops the master), the queue keeps what was not sent,
  and a client that starts reading gets every message once, in order.
* Every queue host of a mirror's node stopped (SIGSTOP) for 10 s under a
  publisher without confirms: the ring cannot complete, so confirms stop,
  the front end stops reading the publisher (it is slowed, not dropped),
  the master's node's memory stays bounded; after SIGCONT the mirror
  catches up and the queue holds every message the publisher wrote before
  its close-ok.

Memory is the resident size of each node's whole process group
(``mirrorq.node.daemon.group_rss``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import pytest

from conftest import wait_for
from mirrorq.node.daemon import group_rss

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

MiB = 1 << 20


def _mirrored_queue(c, name: str) -> None:
    """``name`` (a ``flow.`` queue) declared on node1, mirrored on all three."""
    assert c.ctl("set_policy", "--apply-to", "queues", "ha-flow", r"^flow\.",
                 '{"ha-mode":"all","ha-sync-mode":"automatic"}') == 0
    with c.channel(0) as ch:
        ch.queue_declare(name, durable=True)
    c.wait_mirrored(name)


def _pgid(c, node: str) -> int:
    return int(c.cluster.pid_info(node)["pgid"])


def _messages(c, name: str, node: str = "node1") -> int | None:
    return c.queue_row(name, node).get("messages")


def _queue_host_pids(c, node: str) -> set[int]:
    """The PIDs of ``node``'s queue host processes, from its structured log."""
    pids = set()
    with open(c.data_dir / node / "node.log") as f:
        for line in f:
            rec = json.loads(line)
            if str(rec.get("component", "")).startswith("queue_host"):
                pids.add(int(rec["pid"]))
    return pids


def test_a_consumer_that_does_not_read_stops_its_queue_instead_of_filling_its_node(cluster3):
    c = cluster3
    _mirrored_queue(c, "flow.noread")
    n, size = 64, MiB
    with c.channel(0) as ch:
        for i in range(n):
            ch.basic_publish("", "flow.noread", b"%04d" % i + bytes(size - 4), pika.BasicProperties(delivery_mode=2))
    node = "node2"  # the consumer's node: not the master's, so its front end is all it runs for this queue
    before = group_rss(_pgid(c, node))
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + 1))
    try:
        ch = conn.channel()
        got: list[bytes] = []
        ch.basic_consume("flow.noread", lambda _c, _m, _p, body: got.append(body[:4]), auto_ack=True)
        # the client reads nothing from now on: what the master sends waits in
        # sockets and in the front end, up to the link credit, and no further
        seen = wait_for(lambda: ((m := _messages(c, "flow.noread")) is not None and m < n, m), 30,
                        "deliveries to start")
        peak = before
        deadline = time.monotonic() + 5  # the master would have sent all 64 MiB in far less
        while time.monotonic() < deadline:
            peak = max(peak, group_rss(_pgid(c, node)))
            time.sleep(0.1)
        left = _messages(c, "flow.noread")
        assert left is not None and left >= n - 32, f"the queue kept {left} of {n} (saw {seen})"
        assert peak - before < 48 * MiB, f"{node} grew {(peak - before) / MiB:.0f} MiB for a client that reads nothing"
        # the client reads again: everything comes, in order, each once
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.5)
        assert got == [b"%04d" % i for i in range(n)]
    finally:
        with contextlib.suppress(Exception):
            conn.close()


class _Blaster(threading.Thread):
    """Publishes 4 KiB persistent messages without confirms until told to
    stop, then closes its connection (close-ok)."""

    def __init__(self, port: int, queue: str) -> None:
        super().__init__(daemon=True)
        self.port, self.queue = port, queue
        self.sent = 0
        self.stop = threading.Event()
        self.error: str | None = None
        self.closed = False

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port, heartbeat=0))
            ch = conn.channel()
            props = pika.BasicProperties(delivery_mode=2)
            body = bytes(4096)
            while not self.stop.is_set():
                ch.basic_publish("", self.queue, body, props)
                self.sent += 1
            conn.close()
            self.closed = True
        except Exception as e:  # noqa: BLE001 -- the test reports it
            self.error = f"{type(e).__name__}: {e}"


def test_a_stopped_mirror_slows_the_publisher_bounds_the_master_and_catches_up(cluster3):
    c = cluster3
    _mirrored_queue(c, "flow.stopped")
    hosts = _queue_host_pids(c, "node3")
    assert hosts, "node3 logged no queue host"
    before = group_rss(_pgid(c, "node1"))
    pub = _Blaster(c.amqp_base_port, "flow.stopped")
    pub.start()
    stopped = False
    try:
        wait_for(lambda: (pub.sent > 2000 or pub.error is not None, pub.sent), 30, "the publisher to get going")
        assert pub.error is None, pub.error
        for pid in hosts:
            os.kill(pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        peak = before
        progress = []
        while time.monotonic() - t0 < 10:
            peak = max(peak, group_rss(_pgid(c, "node1")))
            progress.append((time.monotonic() - t0, pub.sent))
            time.sleep(0.2)
        for pid in hosts:
            os.kill(pid, signal.SIGCONT)
        stopped = False
        # slowed: once the front end's credit ran out, the publisher barely moves
        at3 = next(s for t, s in progress if t >= 3)
        assert progress[-1][1] - at3 < 2000, f"the publisher went on while the ring was stuck: {progress[::10]}"
        assert peak - before < 160 * MiB, f"node1 grew {(peak - before) / MiB:.0f} MiB while node3's mirror was stopped"
        wait_for(lambda: (pub.sent > progress[-1][1] + 2000 or pub.error is not None, pub.sent), 60,
                 "the publisher to go on after SIGCONT")
    finally:
        if stopped:
            for pid in hosts:
                os.kill(pid, signal.SIGCONT)
        pub.stop.set()
        pub.join(60)
    assert pub.error is None and pub.closed, pub.error
    wait_for(lambda: ((m := _messages(c, "flow.stopped")) == pub.sent, m), 60,
             f"the queue to hold all {pub.sent} messages written before close-ok")
    c.wait_mirrored("flow.stopped")
    row = c.queue_row("flow.stopped", "node3")
    assert row.get("messages") == pub.sent
