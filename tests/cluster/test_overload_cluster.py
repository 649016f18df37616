"""Overload on a real 3-node mirrored queue (issue #30): credit, not buffers.

* A consumer whose client never reads its socket (no-ack, no prefetch
  limit) on a 64 MiB backlog, of a mirrored classic queue and of a quorum
  queue: its node's memory does not take the backlog
  in (link credit stops the master), the queue keeps what was not sent,
  and a client that starts reading gets every message once, in order.
* A consumer with no prefetch limit that never acks: it holds every
  message unacknowledged, the broker keeps them on disk, not in memory.
* Every queue host of a mirror's node stopped (SIGSTOP) for 10 s under a
  publisher without confirms: the ring cannot complete, so confirms stop,
  the front end stops reading the publisher (it is slowed, not dropped),
  the master's node's memory stays bounded; after SIGCONT the mirror
  catches up and the queue holds every message the publisher wrote before
  its close-ok.  A publisher with confirms (a window of 1,000) runs into a
  second mirrored queue meanwhile: its confirms stop with the ring and
  resume after it, and every one of its messages is confirmed, none
  nacked, none left unanswered.

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

from bench import clients
from mirrorq.node.daemon import group_rss

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

MiB = 1 << 20
#: what a queued message may keep in a node's memory once its body is on
#: disk: a classic queue's index entry (its id, state and offset: about
#: 0.3 KiB by tracemalloc; 0.3-0.7 KiB of resident size per message over
#: 64k of them here, the dicts' doublings included), a quorum machine's
#: (id, size and counts; less)
INDEX_BUDGET = 1024


def _mirrored_queue(c, name: str, durable: bool = True) -> None:
    """``name`` (a ``flow.`` queue) declared on node1, mirrored on all three."""
    assert (
        c.ctl(
            "set_policy", "--apply-to", "queues", "ha-flow", r"^flow\.", '{"ha-mode":"all","ha-sync-mode":"automatic"}'
        )
        == 0
    )
    with c.channel(0) as ch:
        ch.queue_declare(name, durable=durable)
    c.wait_mirrored(name)


def _pgid(c, node: str) -> int:
    return int(c.cluster.pid_info(node)["pgid"])


def _messages(c, name: str, node: str = "node1") -> int | None:
    return c.queue_row(name, node).get("messages")


def _declare(c, name: str, kind: str) -> None:
    """``name`` declared on node1: a mirrored durable queue (``classic`` or
    ``durable``), a mirrored non-durable one (``transient``), or a 3-member
    quorum queue."""
    if kind == "quorum":
        with c.channel(0) as ch:
            ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    else:
        _mirrored_queue(c, name, durable=kind != "transient")


def _publish_mib(c, name: str, n: int) -> None:
    """``n`` persistent 1 MiB messages, numbered in their first 4 bytes."""
    with c.channel(0) as ch:
        for i in range(n):
            ch.basic_publish("", name, b"%04d" % i + bytes(MiB - 4), pika.BasicProperties(delivery_mode=2))


def _counts(c, name: str) -> dict:
    rows = c.json("list_queues", "-n", "node1", "name", "messages_ready", "messages_unacknowledged")
    return next((r for r in rows if r["name"] == name), {})


def _queue_host_pids(c, node: str) -> set[int]:
    """The PIDs of ``node``'s queue host processes, from its structured log."""
    pids = set()
    with open(c.data_dir / node / "node.log") as f:
        for line in f:
            rec = json.loads(line)
            if str(rec.get("component", "")).startswith("queue_host"):
                pids.add(int(rec["pid"]))
    return pids


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_a_consumer_that_does_not_read_stops_its_queue_instead_of_filling_its_node(cluster3, kind):
    c = cluster3
    name = f"flow.noread.{kind}"
    _declare(c, name, kind)  # a quorum queue's link credit is replicated: its machine decides deliveries
    n = 64
    _publish_mib(c, name, n)
    node = "node2"  # the consumer's node: not the master's, so its front end is all it runs for this queue
    before = group_rss(_pgid(c, node))
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + 1))
    try:
        ch = conn.channel()
        got: list[bytes] = []
        ch.basic_consume(name, lambda _c, _m, _p, body: got.append(body[:4]), auto_ack=True)
        # the client reads nothing from now on: what the master sends waits in
        # sockets and in the front end, up to the link credit, and no further
        seen = wait_for(lambda: ((m := _messages(c, name)) is not None and m < n, m), 30, "deliveries to start")
        peak = before
        deadline = time.monotonic() + 5  # the master would have sent all 64 MiB in far less
        while time.monotonic() < deadline:
            peak = max(peak, group_rss(_pgid(c, node)))
            time.sleep(0.1)
        left = _messages(c, name)
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


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_a_consumer_that_never_acks_with_unlimited_prefetch_holds_its_messages_not_its_nodes_memory(cluster3, kind):
    """basic.qos 0 and no acks: every message goes to the client and stays
    unacknowledged there; the broker keeps them on disk, so neither the
    queue's nodes nor the consumer's node grow with them.  When the
    consumer's connection closes, all of them are ready again."""
    c = cluster3
    name = f"flow.noack.{kind}"
    _declare(c, name, kind)
    n = 128
    _publish_mib(c, name, n)
    nodes = ("node1", "node2", "node3")
    before = {node: group_rss(_pgid(c, node)) for node in nodes}
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + 1))
    try:
        ch = conn.channel()
        got: list[bytes] = []
        ch.basic_consume(name, lambda _c, _m, _p, body: got.append(body[:4]), auto_ack=False)
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.5)
        assert sorted(got) == [b"%04d" % i for i in range(n)], f"got {len(got)} of {n}"
        after = {node: group_rss(_pgid(c, node)) for node in nodes}
        grown = {node: (after[node] - before[node]) // MiB for node in nodes}
        assert all(g < 96 for g in grown.values()), f"nodes grew by {grown} MiB for {n} MiB held unacked"
        row = wait_for(
            lambda: ((r := _counts(c, name)).get("messages_unacknowledged") == n, r),
            30,
            f"{name} to count {n} unacknowledged",
        )
        assert row.get("messages_ready") == 0, row
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    wait_for(lambda: ((r := _counts(c, name)).get("messages_ready") == n, r), 30, f"{name}'s {n} messages back")


@pytest.mark.parametrize(
    "kind,size",
    [("durable", 64 << 10), ("transient", 64 << 10), ("quorum", 64 << 10), ("durable", 1 << 10), ("quorum", 1 << 10)],
)
def test_a_backlog_larger_than_the_memory_bound_stays_on_disk(cluster3, kind, size):
    """2 x 160 MiB of 64 KiB bodies (2 x 64 MiB of 1 KiB ones) and no
    consumer: no node's process group takes the backlog into memory -- a
    classic queue's bodies are in its segment log (a non-durable queue's
    too: paged out, never fsync'd), a quorum queue's in its Raft log; what
    stays in memory is an index and bounded caches (a 64 MiB body cache per
    queue host process, a few MiB of Raft entries per quorum member).
    Neither half grows a node by half of what it adds, nor by more than
    INDEX_BUDGET per message it adds (with 1 KiB bodies the index is what
    grows)."""
    c = cluster3
    name = f"flow.backlog.{kind}.{size}"
    _declare(c, name, kind)
    nodes = ("node1", "node2", "node3")
    n = (160 * MiB if size >= 64 << 10 else 64 * MiB) // size
    rss = [{node: group_rss(_pgid(c, node)) for node in nodes}]
    peak = dict(rss[0])
    for half in range(2):
        with c.channel(0, confirm=False) as ch:
            for i in range(half * n, (half + 1) * n):
                ch.basic_publish(
                    "",
                    name,
                    b"%05d" % i + bytes(size - 5),
                    pika.BasicProperties(delivery_mode=2 if kind != "transient" else 1),
                )
                if i % (16 * MiB // size) == 0:
                    for node in nodes:
                        peak[node] = max(peak[node], group_rss(_pgid(c, node)))
        want = (half + 1) * n
        wait_for(lambda: ((m := _messages(c, name)) == want, m), 120, f"{name} to hold {want} messages")
        rss.append({node: group_rss(_pgid(c, node)) for node in nodes})
        for node in nodes:
            peak[node] = max(peak[node], rss[-1][node])
    first = {node: (rss[1][node] - rss[0][node]) // MiB for node in nodes}
    second = {node: (rss[2][node] - rss[1][node]) // MiB for node in nodes}
    grown = {node: (peak[node] - rss[0][node]) // MiB for node in nodes}
    what = f"the first {n * size // MiB} MiB grew the nodes by {first} MiB, the second by {second} MiB (peak {grown})"
    print(f"{kind} {size}: {what}")
    # The fixed caches fill over both halves in varying shares (a quorum
    # leader's node took 76-123 of its 107-139 MiB in the first half, over 9
    # runs), so the bound on the second half is half of what it adds: bodies
    # kept in memory would add all of it, and twice that over the run.  With
    # 1 KiB bodies the index is what grows: INDEX_BUDGET per message (bodies
    # kept in memory would add their 1 KiB each on top of the index's).
    bound = max(n * size // 2, n * INDEX_BUDGET) // MiB
    assert all(g < bound for g in second.values()), f"{what}: over {bound} MiB"
    assert all(g < 256 for g in grown.values()), what
    with c.channel(1) as ch:  # and it is all there, through another node
        got = [ch.basic_get(name, auto_ack=True) for _ in range(3)]
        assert [body[:5] for _m, _p, body in got] == [b"00000", b"00001", b"00002"]


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
    _mirrored_queue(c, "flow.confirmed")
    hosts = _queue_host_pids(c, "node3")
    assert hosts, "node3 logged no queue host"
    before = group_rss(_pgid(c, "node1"))
    n_confirmed = 100_000  # 1 KiB bodies; far more than either side of the stop takes
    confirming = clients.spawn(clients.publisher, c.amqp_base_port, "flow.confirmed", n_confirmed, 1000, stall=60.0)
    try:
        _stop_a_mirror_under_two_publishers(c, hosts, before, confirming, n_confirmed)
    finally:
        if confirming.proc.is_alive():  # the test failed before it took the result
            confirming.proc.kill()
            confirming.proc.join()


def _stop_a_mirror_under_two_publishers(c, hosts: set[int], before: int, confirming, n_confirmed: int) -> None:
    pub = _Blaster(c.amqp_base_port, "flow.stopped")
    pub.start()
    stopped = False
    try:
        wait_for(lambda: (pub.sent > 2000 or pub.error is not None, pub.sent), 30, "the publisher to get going")
        assert pub.error is None, pub.error
        wait_for(
            lambda: ((m := _messages(c, "flow.confirmed")) is not None and m > 2000, m),
            30,
            "the confirming publisher to get going",
        )
        for pid in hosts:
            os.kill(pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        peak = before
        progress = []
        confirmed_at3: int | None = None
        while time.monotonic() - t0 < 10:
            peak = max(peak, group_rss(_pgid(c, "node1")))
            progress.append((time.monotonic() - t0, pub.sent))
            if confirmed_at3 is None and progress[-1][0] >= 3:
                confirmed_at3 = _messages(c, "flow.confirmed")
            time.sleep(0.2)
        confirmed_at10 = _messages(c, "flow.confirmed")
        for pid in hosts:
            os.kill(pid, signal.SIGCONT)
        stopped = False
        # the confirming publisher waits on its window: with no confirm
        # coming, the queue takes at most that window's 1,000 more
        assert confirmed_at3 is not None and confirmed_at10 is not None
        assert confirmed_at10 < n_confirmed, f"the confirming publisher was done by then: {confirmed_at10}"
        assert confirmed_at10 - confirmed_at3 <= 1000, (
            f"flow.confirmed went from {confirmed_at3} to {confirmed_at10} while its ring was stuck"
        )
        # slowed: once the front end's credit ran out, the publisher barely moves
        at3 = next(s for t, s in progress if t >= 3)
        assert progress[-1][1] - at3 < 2000, f"the publisher went on while the ring was stuck: {progress[::10]}"
        assert peak - before < 160 * MiB, f"node1 grew {(peak - before) / MiB:.0f} MiB while node3's mirror was stopped"
        wait_for(
            lambda: (pub.sent > progress[-1][1] + 2000 or pub.error is not None, pub.sent),
            60,
            "the publisher to go on after SIGCONT",
        )
    finally:
        if stopped:
            for pid in hosts:
                os.kill(pid, signal.SIGCONT)
        pub.stop.set()
        pub.join(60)
    assert pub.error is None and pub.closed, pub.error
    wait_for(
        lambda: ((m := _messages(c, "flow.stopped")) == pub.sent, m),
        60,
        f"the queue to hold all {pub.sent} messages written before close-ok",
    )
    c.wait_mirrored("flow.stopped")
    row = c.queue_row("flow.stopped", "node3")
    assert row.get("messages") == pub.sent
    # the confirming publisher: every message confirmed at the rate the ring
    # sustained, none nacked, none unanswered (its watchdog fails it after
    # 60 s without a confirm), and every one of them in the queue
    got = confirming.result(300)
    assert got["error"] is None and got["stalled"] is None, got
    assert (got["confirmed"], got["nacked"]) == (n_confirmed, 0), got
    for node in ("node1", "node3"):
        wait_for(
            lambda node=node: ((m := _messages(c, "flow.confirmed", node)) == n_confirmed, m),
            60,
            f"flow.confirmed on {node} to hold all {n_confirmed} confirmed messages",
        )
    print(
        f"confirming publisher: {got['rate']:.0f} msg/s, confirm p50 {got['latency_p50'] * 1e3:.1f} ms, "
        f"p99 {got['latency_p99'] * 1e3:.1f} ms"
    )
