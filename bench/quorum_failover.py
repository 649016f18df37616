"""Quorum-queue leader failover, mirrorq against RabbitMQ 3.10 in the same run.

    .venv/bin/python bench/quorum_failover.py [--rounds 5] [--no-rabbitmq]

Both sides are 3-node clusters on loopback.  Per round a fresh quorum queue
(``x-queue-type: quorum``, members on all 3 nodes) is declared through the
victim node, so its leader is there (``client-local``, the default leader
locator on both); a publisher process on a survivor (pika SelectConnection,
100-message bursts, persistent 1 KiB, confirms, at most 1000 unconfirmed;
bench/sync_rabbitmq.py's load) runs until 2000 are confirmed; then the
victim node's processes get SIGKILL and a second channel on a survivor
(opened before, with confirms) publishes one marker message: failover =
kill -> the marker's confirm (BlockingChannel.basic_publish returns when it
is acked; a nacked marker -- RabbitMQ nacks while the queue has no leader --
is published again, on a new channel).  The publisher's nacks are counted; the victim is started again
between rounds and the queue deleted.  Medians over the rounds, and the
ratio mirrorq/RabbitMQ (lower is better).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pika  # noqa: E402

from bench import amqp as amqp_bench  # noqa: E402
from bench.load import stop_load, wait_confirmed  # noqa: E402
from bench.rabbitmq import RabbitMQCluster, available  # noqa: E402
from bench.sync_rabbitmq import _load  # noqa: E402
from mirrorq.admin.cluster import poll  # noqa: E402

NODES = 3
QUORUM = {"x-queue-type": "quorum"}


class MirrorqSide(amqp_bench.MirrorqSide):
    """bench/amqp.py's 3-node cluster (its ha policy matches no quorum queue)."""

    prefix = "mirrorq-bench-qfailover-"

    def __enter__(self):
        super().__enter__()
        self.names = self.cluster.node_names()
        return self

    def amqp_port(self, i: int) -> int:
        return self.ports[i]

    def online(self, q: str, via: int) -> tuple[str | None, int]:
        rc, out = self._ctl("list_queues", "-n", self.names[via], "name", "leader", "online")
        row = next((r for r in json.loads(out) if r["name"] == q), {}) if rc == 0 else {}
        return row.get("leader"), len(row.get("online") or [])

    def kill(self, i: int) -> None:
        self.cluster.kill_node(self.names[i])

    def restart(self, i: int) -> None:
        self.cluster.start_node(self.names[i])


class RabbitMQSide:
    name = "RabbitMQ"

    def __enter__(self):
        self.rmq = RabbitMQCluster(NODES)
        self.rmq.__enter__()
        self.names = self.rmq.names
        return self

    def __exit__(self, *exc):
        self.rmq.__exit__(*exc)

    def amqp_port(self, i: int) -> int:
        return self.rmq.amqp_port(i)

    def online(self, q: str, via: int) -> tuple[str | None, int]:
        row = next((r for r in self.rmq.list_queues("name", "leader", "online", node=via) if r["name"] == q), {})
        leader = str(row.get("leader") or "").split("@")[0] or None
        return leader, len(row.get("online") or [])

    def kill(self, i: int) -> None:
        self.rmq.kill_node(i)

    def restart(self, i: int) -> None:
        self.rmq.start_node(i)
        self.rmq.await_node(i)


def one_round(side, r: int) -> dict:
    vi, si = r % NODES, (r + 1) % NODES
    q = f"qfailover-{r}"
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", side.amqp_port(vi)))
    c.channel().queue_declare(q, durable=True, arguments=QUORUM)
    c.close()
    if not poll(lambda: side.online(q, si)[1] == NODES, 60, step=0.2):
        raise RuntimeError(f"{side.name} {q}: not {NODES} members online: {side.online(q, si)}")
    leader = side.online(q, si)[0]
    mconn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", side.amqp_port(si)))
    mch = mconn.channel()
    mch.confirm_delivery()
    ctx = multiprocessing.get_context("spawn")
    ready, stop, sq = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_load, args=(side.amqp_port(si), q, ready, stop, sq, False), daemon=True)
    samples: list = []
    try:
        proc.start()
        wait_confirmed(sq, samples, ready, 2000, f"{side.name} {q}")
        t_kill = time.monotonic()
        side.kill(vi)
        nacks = 0
        while True:  # a queue without a leader may nack (RabbitMQ does): publish again until one is acked
            try:
                mch.basic_publish("", q, b"marker", pika.BasicProperties(delivery_mode=2))
                break
            except pika.exceptions.NackError:
                nacks += 1
                if time.monotonic() - t_kill > 120:
                    raise RuntimeError(f"{side.name} {q}: every marker nacked for 120 s") from None
                mch = mconn.channel()  # a fresh channel looks the queue's leader up again
                mch.confirm_delivery()
        t_conf = time.monotonic()
    finally:
        end = stop_load(stop, proc, sq, samples)
        with contextlib.suppress(Exception):
            mconn.close()
    side.restart(vi)
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", side.amqp_port(si)))
    c.channel().queue_delete(q)
    c.close()
    if end is None or end[0] == "error":
        raise RuntimeError(f"{side.name} {q}: publisher failed: {end}")
    return {
        "victim": side.names[vi],
        "leader_before": leader,
        "failover_s": t_conf - t_kill,
        "marker_nacks": nacks,
        "publisher": end[1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-rabbitmq", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    sides = [MirrorqSide]
    if not a.no_rabbitmq:
        why = available()
        if why:
            raise SystemExit(f"RabbitMQ: {why} (or --no-rabbitmq)")
        sides.append(RabbitMQSide)
    results: dict = {}
    for cls in sides:
        with cls() as side:
            for r in range(a.rounds):
                x = one_round(side, r)
                results.setdefault(cls.name, []).append(x)
                p = x["publisher"]
                print(
                    f"  {cls.name:8s} round {r + 1}: kill -9 {x['victim']} (leader {x['leader_before']}): "
                    f"failover {x['failover_s'] * 1000:.0f} ms ({x['marker_nacks']} marker nacks); publisher {p['published']} published, "
                    f"{p['confirmed']} confirmed, {p['nacked']} nacked",
                    flush=True,
                )
    med = {s: statistics.median(x["failover_s"] for x in rows) for s, rows in results.items()}
    print()
    line = "quorum leader failover (kill -9 leader's node -> 1st confirm of a new publish), median ms: " + ", ".join(
        f"{s} {v * 1000:.0f}" for s, v in med.items()
    )
    if len(med) == 2:
        line += f"; mirrorq/RabbitMQ {med['mirrorq'] / med['RabbitMQ']:.2f}x (lower is better)"
    print(line)
    print(json.dumps({"cpus": os.cpu_count(), "rounds": results, "median_s": med}))


if __name__ == "__main__":
    main()
