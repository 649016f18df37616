"""AMQP front-end figures with pika: publish (with confirms) and consume rates
against a 1-node cluster (a single-replica queue) and a 3-node cluster (a
3-replica queue: the manager mirrors on every node), 1 KiB persistent messages.

    .venv/bin/python bench/amqp.py [--messages 20000] [--window 500] [--sync 1000]

* ``publish (sync confirms)``: BlockingChannel.confirm_delivery, one publish
  waits for its ack before the next (latency bound);
* ``publish (pipelined confirms)``: SelectConnection keeping ``--window``
  unconfirmed publishes in flight (how RabbitMQ benchmarks publish);
* ``consume``: basic.consume with prefetch 1000, an ack (multiple) every 100.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")

import pika  # noqa: E402

from ctl.cluster import Cluster  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402

BODY = b"x" * 1024
PROPS = pika.BasicProperties(delivery_mode=2)


def sync_publish(port: int, queue: str, n: int) -> float:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    ch = conn.channel()
    ch.confirm_delivery()
    t0 = time.monotonic()
    for _ in range(n):
        ch.basic_publish("", queue, BODY, PROPS)
    dt = time.monotonic() - t0
    conn.close()
    return n / dt


def pipelined_publish(port: int, queue: str, n: int, window: int) -> float:
    st = {"sent": 0, "acked": 0, "t0": 0.0, "t1": 0.0}

    def pump(ch):
        while st["sent"] < n and st["sent"] - st["acked"] < window:
            ch.basic_publish("", queue, BODY, PROPS)
            st["sent"] += 1

    def on_confirm(frame):
        m = frame.method
        if m.multiple:
            st["acked"] = max(st["acked"], m.delivery_tag)
        else:
            st["acked"] += 1
        if st["acked"] >= n:
            st["t1"] = time.monotonic()
            conn.close()
        else:
            pump(st["ch"])

    def on_channel(ch):
        st["ch"] = ch
        ch.confirm_delivery(on_confirm, callback=lambda _: (st.__setitem__("t0", time.monotonic()), pump(ch)))

    conn = pika.SelectConnection(pika.ConnectionParameters("127.0.0.1", port),
                                 on_open_callback=lambda c: c.channel(on_open_callback=on_channel))
    conn.add_on_close_callback(lambda *a: conn.ioloop.stop())
    conn.ioloop.call_later(300, conn.ioloop.stop)
    conn.ioloop.start()
    if not st["t1"]:
        raise RuntimeError(f"pipelined publish: only {st['acked']} of {n} confirmed")
    return n / (st["t1"] - st["t0"])


def consume(port: int, queue: str, n: int) -> float:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1000)
    st = {"got": 0}

    def cb(c, m, p, b):
        st["got"] += 1
        if st["got"] % 100 == 0 or st["got"] == n:
            c.basic_ack(m.delivery_tag, multiple=True)

    ch.basic_consume(queue, cb)
    t0 = time.monotonic()
    deadline = t0 + 300
    while st["got"] < n and time.monotonic() < deadline:
        conn.process_data_events(0.05)
    dt = time.monotonic() - t0
    conn.close()
    if st["got"] < n:
        raise RuntimeError(f"consume: only {st['got']} of {n} delivered")
    return n / dt


def run(nodes: int, a) -> None:
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-amqp-"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    base = s.getsockname()[1] % 40000 + 20000
    s.close()
    cluster = Cluster(root)
    ctl = lambda *x: mirrorctl(["--data-dir", str(root), "--formatter", "json", *x])  # noqa: E731
    try:
        assert ctl("cluster", "start", "--nodes", str(nodes), "--base-port", str(base), "--amqp-base-port", str(base + nodes)) == 0
        port = base + nodes
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        conn.channel().queue_declare("bench", durable=True)
        conn.close()
        label = f"{nodes}-node cluster, {nodes}-replica queue"
        r = sync_publish(port, "bench", a.sync)
        print(f"{label}: publish (sync confirms)      {r:8.0f} msg/s  ({a.sync} msgs)", flush=True)
        r = pipelined_publish(port, "bench", a.messages, a.window)
        print(f"{label}: publish (pipelined confirms) {r:8.0f} msg/s  ({a.messages} msgs, window {a.window})", flush=True)
        r = consume(port, "bench", a.sync + a.messages)
        print(f"{label}: consume (prefetch 1000)      {r:8.0f} msg/s  ({a.sync + a.messages} msgs)", flush=True)
    finally:
        cluster.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--sync", type=int, default=1000)
    ap.add_argument("--nodes", default="1,3")
    a = ap.parse_args()
    for n in [int(x) for x in a.nodes.split(",")]:
        run(n, a)


if __name__ == "__main__":
    main()
