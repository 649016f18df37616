"""A node under sustained client load is not marked down.

300 AMQP connections to one node (three client processes of 100 pika
connections each, every connection publishing persistent messages with
confirms) and a consumer acking each message, on a queue mirrored on all 3
nodes, with the default liveness settings (heartbeat every 0.2 s, down after
1.5 s of silence).  Checked: no node reports any peer down or unreachable
during the run, every publish is confirmed, every message is consumed
exactly once.
"""

from __future__ import annotations

import time
from collections import Counter

import conftest
import pytest
from conftest import wait_for

from bench import clients
from mirrorq.node.log import read

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

QUEUE = "load.q"
PROCESSES, CONNECTIONS, PER_CONNECTION = 3, 100, 60
TOTAL = PROCESSES * CONNECTIONS * PER_CONNECTION


def _liveness_events(c, since: float) -> list[str]:
    out = []
    for n in ("node1", "node2", "node3"):
        for rec in read(str(c.data_dir / n)):
            if rec.get("ts", 0) >= since and rec.get("event") in ("node_down", "peer_unreachable"):
                out.append(f"{n}: {rec['event']} {rec.get('peer')} ({rec.get('reason', '')})")
    return out


def test_several_hundred_connections_do_not_get_their_node_marked_down():
    with conftest.running_cluster() as c:
        assert (
            c.ctl(
                "set_policy",
                "--apply-to",
                "queues",
                "ha-load",
                r"^load\.",
                '{"ha-mode":"all","ha-sync-mode":"automatic"}',
            )
            == 0
        )
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port))
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()
        wait_for(
            lambda: (lambda r: (len(r.get("synchronised_slave_pids") or []) == 2, r))(
                next((r for r in c.json("list_queues", "name", "synchronised_slave_pids") if r["name"] == QUEUE), {})
            ),
            30,
            f"{QUEUE} mirrored on both other nodes",
        )

        since = time.time()
        consumer = clients.spawn(clients.consumer, c.amqp_base_port, QUEUE, TOTAL, 100, stall=60.0)
        pubs = [
            clients.spawn(
                clients.many_publishers,
                c.amqp_base_port,
                QUEUE,
                CONNECTIONS,
                PER_CONNECTION,
                5,
                tag=f"p{k}-",
                stall=60.0,
            )
            for k in range(PROCESSES)
        ]
        results = [p.result(900) for p in pubs]
        got = consumer.result(900)

        for r in results:
            assert not r["stalled"] and not r["errors"], (r["stalled"][:3], r["errors"][:3])
            assert r["confirmed"] == r["published"] == CONNECTIONS * PER_CONNECTION and r["nacked"] == 0
        assert got["stalled"] is None and got["consumed"] == TOTAL, got.get("stalled")
        dups = [i for i, k in Counter(got["ids"]).items() if k > 1]
        assert not dups, f"consumed twice: {dups[:5]}"
        assert len(set(got["ids"])) == TOTAL
        assert _liveness_events(c, since) == [], "a node was marked down under client load"
