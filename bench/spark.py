"""Spark figures: a 3-replica queue into parquet vs draining it with pika; the audit's time.

    .venv/bin/python bench/spark.py [--messages 50000] [--size 1024] [--audit-events 1000000,10000000]

Run under the shared lock (``flock /tmp/mirrorq-heavy.lock ...``).  In one run:

1. a 3-node cluster (ports below 32768), policy ``ha-mode: all``, a durable
   queue filled with ``--messages`` persistent messages (pipelined
   confirms), both mirrors synchronised;
2. **pika drain**: ``basic.consume`` (prefetch 1000) with one
   ``basic.ack`` per message until the queue is empty -> messages/s;
3. the queue filled again the same way;
4. **spark -> parquet**: ``mirrorq.spark.pipe`` (a streaming query,
   ``maxMessagesPerTrigger`` 10000, checkpoint, until the queue is empty
   and its last batch committed) -> messages/s three ways: ``total`` from
   process start (includes the ~10 s SparkSession start), ``query`` from
   the query's start to its last batch (includes the first batch, which
   waits for Spark's Python planning processes and workers to start:
   ``first_batch_s``), ``steady`` the batches after the first (rows over
   the sum of their trigger times as Spark reports them); ``ratio_*`` are
   against the pika drain of the same run;
5. **many queues**: ``--queues`` queues (masters on different nodes)
   holding ``--messages`` in all, read by one query (``queuePattern``,
   ``minPartitions`` = queues x ``--partitions``) -> the same figures, and
   their ratio to the one queue's;
6. **audit**: synthetic histories of N events (``audit.synthesize``) audited
   with ``local[*]``: seconds per size (generation not counted).

Prints a table and one JSON line.  Always stops the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pika  # noqa: E402
from pamqp import commands as C  # noqa: E402

from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster, free_port_block, poll  # noqa: E402
from mirrorq.amqp.client import BlockingClient  # noqa: E402

QUEUE = "bench.spark"


def fill(port: int, n: int, size: int, queue: str = QUEUE) -> float:
    body = b"x" * size
    t0 = time.monotonic()
    with BlockingClient("127.0.0.1", port) as cl:
        for i in range(0, n, 5000):
            k = min(5000, n - i)
            cl.publish_confirmed("", queue, [(body, C.Basic.Properties(delivery_mode=2))] * k, time.monotonic() + 300)
    return n / (time.monotonic() - t0)


def messages(root: Path, queue: str = QUEUE) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mirrorctl(
            [
                "--data-dir",
                str(root),
                "--formatter",
                "json",
                "list_queues",
                "name",
                "messages",
                "synchronised_slave_pids",
            ]
        )
    row = next(r for r in json.loads(buf.getvalue()) if r["name"] == queue)
    return row


def wait_synced(root: Path, n: int, queue: str = QUEUE) -> None:
    ok = poll(
        lambda: (lambda r: r["messages"] == n and len(r["synchronised_slave_pids"] or []) == 2)(messages(root, queue)),
        120,
        step=0.5,
    )
    if not ok:
        raise SystemExit(f"queue not at {n} messages on 3 synchronised replicas: {messages(root, queue)}")


def pika_drain(port: int, n: int) -> float:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1000)
    got = {"n": 0, "t0": None}

    def on_msg(c, m, p, body):
        if got["t0"] is None:
            got["t0"] = time.monotonic()
        c.basic_ack(m.delivery_tag)  # one basic.ack per message
        got["n"] += 1
        if got["n"] >= n:
            c.stop_consuming()

    t0 = time.monotonic()
    ch.basic_consume(QUEUE, on_msg)
    ch.start_consuming()
    dt = time.monotonic() - t0
    conn.close()
    return n / dt


def spark_drain(nodes: str, n: int, work: Path, which: tuple[str, ...] = ("--queue", QUEUE)) -> dict:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    t0 = time.monotonic()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mirrorq.spark.pipe",
            "--nodes",
            nodes,
            *which,
            "--checkpoint",
            str(work / "ck"),
            "--output",
            str(work / "out"),
            "--max-per-trigger",
            "10000",
            "--until-empty",
            "--idle",
            "0.5",
        ],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first = last = None
    rows = 0
    batches: list[dict] = []
    try:
        for line in p.stdout:
            ev = json.loads(line) if line.startswith("{") else {}
            if ev.get("event") == "started":
                first = time.monotonic()
            if ev.get("event") == "progress":
                rows += ev.get("rows") or 0
                batches.append(ev)
                last = time.monotonic()
        rc = p.wait(timeout=900)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    total = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"spark pipe failed rc={rc}")
    later = [b for b in batches if b.get("batch") != 0 and b.get("rows")]
    steady_ms = sum((b.get("ms") or {}).get("triggerExecution", 0) for b in later)
    first_batch = next((b for b in batches if b.get("batch") == 0), {})
    return {
        "rate_total": n / total,
        "rate_query": n / (last - first) if first and last else None,
        "rate_steady": sum(b["rows"] for b in later) * 1000 / steady_ms if steady_ms else None,
        "first_batch_s": (first_batch.get("ms") or {}).get("triggerExecution", 0) / 1000,
        "seconds_total": total,
    }


def audit_times(sizes: list[int], work: Path) -> dict:
    from mirrorq.spark import audit
    from mirrorq.spark.session import session

    spark = session("bench-audit", master="local[*]")
    out = {}
    try:
        for n in sizes:
            path = str(work / f"synth-{n}.jsonl")
            t0 = time.monotonic()
            audit.synthesize(path, n, plant=("lost", "duplicate", "reorder"))
            gen = time.monotonic() - t0
            t0 = time.monotonic()
            res = audit.run(spark, [path], [])
            dt = time.monotonic() - t0
            assert res.counts["lost"] == 1 and res.counts["duplicated"] == 1, res.counts
            out[n] = {"audit_s": round(dt, 1), "generate_s": round(gen, 1), "events_per_s": round(n / dt)}
            os.unlink(path)
    finally:
        spark.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=50000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--audit-events", default="1000000,10000000")
    ap.add_argument("--skip-queue", action="store_true")
    ap.add_argument("--queues", type=int, default=4, help="the many-queue figure's queues (0: none)")
    ap.add_argument("--partitions", type=int, default=2, help="partitions per queue in the many-queue figure")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mirrorq-bench-spark-"))
    res: dict = {"messages": a.messages, "size": a.size}
    if not a.skip_queue:
        root = work / "cluster"
        base = free_port_block(3, 20000, 32000)
        amqp = free_port_block(3, base + 4, 32700)
        cl = Cluster(root)
        try:
            assert (
                mirrorctl(
                    [
                        "--data-dir",
                        str(root),
                        "cluster",
                        "start",
                        "--nodes",
                        "3",
                        "--base-port",
                        str(base),
                        "--amqp-base-port",
                        str(amqp),
                        "--management-base-port",
                        "0",
                    ]
                )
                == 0
            )
            mirrorctl(
                [
                    "--data-dir",
                    str(root),
                    "set_policy",
                    "ha",
                    "^bench",
                    '{"ha-mode": "all", "ha-sync-mode": "automatic"}',
                ]
            )
            c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp))
            c.channel().queue_declare(QUEUE, durable=True)
            c.close()
            res["fill_rate"] = round(fill(amqp, a.messages, a.size))
            wait_synced(root, a.messages)
            res["pika_drain_rate"] = round(pika_drain(amqp + 1, a.messages))
            fill(amqp, a.messages, a.size)
            wait_synced(root, a.messages)
            nodes = ",".join(f"127.0.0.1:{amqp + i}" for i in range(3))
            s = spark_drain(nodes, a.messages, work)
            res["spark_parquet_rate_total"] = round(s["rate_total"])
            res["spark_parquet_rate_query"] = round(s["rate_query"]) if s["rate_query"] else None
            res["spark_parquet_rate_steady"] = round(s["rate_steady"]) if s["rate_steady"] else None
            res["spark_first_batch_s"] = round(s["first_batch_s"], 1)
            res["spark_seconds_total"] = round(s["seconds_total"], 1)
            for k in ("query", "steady"):
                r = res[f"spark_parquet_rate_{k}"]
                res[f"ratio_{k}_vs_pika"] = round(r / res["pika_drain_rate"], 2) if r else None
            res["queue_left"] = messages(root)["messages"]
            if a.queues:
                # the same number of messages in --queues queues (masters spread over the nodes), read by
                # one query (queuePattern) in --partitions partitions per queue
                names = [f"{QUEUE}.m{i}" for i in range(a.queues)]
                for i, qn in enumerate(names):
                    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp + i % 3))
                    c.channel().queue_declare(qn, durable=True)
                    c.close()
                    fill(amqp + i % 3, a.messages // a.queues, a.size, qn)
                for qn in names:
                    wait_synced(root, a.messages // a.queues, qn)
                which = ("--queue-pattern", rf"{QUEUE}\.m\d+", "--min-partitions", str(a.queues * a.partitions))
                m = spark_drain(nodes, a.messages // a.queues * a.queues, work / "multi", which)
                key = f"spark_{a.queues}q_x_{a.partitions}p"
                res[f"{key}_rate_query"] = round(m["rate_query"]) if m["rate_query"] else None
                res[f"{key}_rate_steady"] = round(m["rate_steady"]) if m["rate_steady"] else None
                res[f"{key}_first_batch_s"] = round(m["first_batch_s"], 1)
                for k in ("query", "steady"):
                    one, many = res[f"spark_parquet_rate_{k}"], res[f"{key}_rate_{k}"]
                    res[f"ratio_{k}_{a.queues}q_vs_1q"] = round(many / one, 2) if one and many else None
                res["multi_left"] = sum(messages(root, qn)["messages"] for qn in names)
        finally:
            cl.stop_all()
    sizes = [int(x) for x in a.audit_events.split(",") if x]
    if sizes:
        res["audit"] = audit_times(sizes, work)
    print(f"{'figure':40s} value")
    for k, v in res.items():
        print(f"{k:40s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
