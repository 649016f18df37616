"""The data path as applications use it, on a real 3-node cluster.

A queue mirrored on all three nodes (policy ``ha-mode: all``), pika clients
in their own processes (bench/clients.py, the same code the benchmark runs):
a publisher with confirms and a consumer that acks every message on its own
(``multiple=false``), running at the same time.  This is the shape in which
publishers used to wait forever for a confirm (issue #12): an actor that
queued more sends than Thespian drains entered "tx-only mode" (seen in the
nodes' Thespian logs on every such run), where Thespian stops reading,
reorders, and past ~1050 queued sends drops messages -- a dropped
``Publish`` or ``Confirm`` was a confirm that never came.  Every actor now
sends through its outbox (mirrorq/outbox.py: one bundle in flight per
destination, failed transmits retried), so each test also checks that no
node's Thespian log mentions tx-only mode or a dropped transmit.

Checks: every publish confirmed (none nacked), every message consumed
exactly once, the queue empty at the end (every per-message ack applied),
and no client stalled (no progress for 30 s fails the client).
"""

from __future__ import annotations

from pathlib import Path

import conftest
import pytest
from conftest import wait_for

from bench import clients

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        assert (
            c.ctl(
                "set_policy", "--apply-to", "queues", "ha-dp", r"^dp\.", '{"ha-mode":"all","ha-sync-mode":"automatic"}'
            )
            == 0
        )
        yield c


def _declare_mirrored(c, name: str) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port))
    try:
        conn.channel().queue_declare(name, durable=True)
    finally:
        conn.close()

    def synced():
        rows = [r for r in c.json("list_queues", "name", "synchronised_slave_pids") if r["name"] == name]
        return bool(rows) and len(rows[0]["synchronised_slave_pids"]) == 2, rows

    wait_for(synced, 30, f"{name} mirrored on both other nodes")


def _queue_row(c, name: str) -> dict:
    rows = [
        r
        for r in c.json("list_queues", "name", "messages", "messages_unacknowledged", "consumers")
        if r["name"] == name
    ]
    return rows[0] if rows else {}


def _thespian_trouble(c) -> list[str]:
    bad = []
    for node in ("node1", "node2", "node3"):
        p = Path(c.data_dir) / node / "thespian.log"
        if p.exists():
            for line in p.read_text(errors="replace").splitlines():
                if "tx-only mode" in line or "Dropping TX" in line:
                    bad.append(f"{node}: {line[:200]}")
    return bad


def _run(c, queue: str, n: int, window: int, prefetch: int) -> dict:
    r = clients.concurrent(c.amqp_base_port, [queue], n, window, prefetch, stall=30, keep_ids=True, timeout=300)
    pub, con = r["publishers"][0], r["consumers"][0]
    assert pub["stalled"] is None and pub["error"] is None, pub["stalled"] or pub["error"]
    assert con["stalled"] is None and con["error"] is None, con["stalled"] or con["error"]
    assert pub["confirmed"] == n and pub["nacked"] == 0, pub
    ids = con["ids"]
    want = {f"p0:{i}" for i in range(1, n + 1)}
    assert len(ids) == n, f"consumed {len(ids)} of {n}"
    assert set(ids) == want, f"missing {sorted(want - set(ids))[:10]}, unexpected {sorted(set(ids) - want)[:10]}"
    wait_for(
        lambda: (_queue_row(c, queue).get("messages") == 0, _queue_row(c, queue)),
        30,
        f"{queue} empty once every per-message ack is applied",
    )
    assert not _thespian_trouble(c), _thespian_trouble(c)
    return r


@pytest.mark.parametrize("prefetch", [100, 1000])
def test_concurrent_publisher_and_per_message_ack_consumer_20k(cluster, prefetch):
    q = f"dp.concurrent.{prefetch}"
    _declare_mirrored(cluster, q)
    _run(cluster, q, 20_000, 1000, prefetch)


def test_one_at_a_time_publisher_with_a_consumer_running(cluster):
    """Window 1 (each publish waits for its confirm) while a consumer acks each
    message: the configuration in which a single confirm never came."""
    q = "dp.window1"
    _declare_mirrored(cluster, q)
    _run(cluster, q, 300, 1, 10)


def test_concurrent_declares_of_one_queue_from_every_node(cluster):
    """Three clients on three nodes declare the same mirrored queue at the same
    instant (what every worker of an application does at start): one queue,
    mirrored on all nodes, every declare answered; before the declares
    claimed the name, each node's manager placed its own copy (two replicas
    fought over one store, the declare timed out, mirrors never came)."""
    import threading

    import pika

    names = [f"dp.race.{i}" for i in range(4)]
    for name in names:
        barrier = threading.Barrier(3)
        errors: list = []

        def declare(node: int) -> None:
            try:
                conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", cluster.amqp_base_port + node))
                try:
                    barrier.wait(10)
                    conn.channel().queue_declare(name, durable=True)
                finally:
                    conn.close()
            except Exception as e:  # reported below with the node
                errors.append(f"node{node + 1}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=declare, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

    def all_mirrored():
        rows = {r["name"]: r for r in cluster.json("list_queues", "name", "pid", "synchronised_slave_pids")}
        return all(n in rows and len(rows[n]["synchronised_slave_pids"]) == 2 for n in names), rows

    wait_for(all_mirrored, 30, "every raced queue mirrored on both other nodes")
    for node in ("node1", "node2", "node3"):
        log = (Path(cluster.data_dir) / node / "node.log").read_text()
        assert "LOCK held" not in log, f"{node}: two replicas of one queue opened its store"
