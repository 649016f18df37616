"""AMQP front-end figures with pika: publish (with confirms) and consume rates
against a 1-node cluster (a single-replica queue) and a 3-node cluster (a
3-replica queue: policy ``ha-mode: all`` on ``^bench$``, and the clock starts
only once both mirrors are synchronised), 1 KiB persistent messages.

    .venv/bin/python bench/amqp.py [--messages 20000] [--window 500] [--sync 1000]
        [--amqp-shell watch|asyncio|both] [--runs N]

* ``publish (sync confirms)``: BlockingChannel.confirm_delivery, one publish
  waits for its ack before the next (latency bound);
* ``publish (pipelined confirms)``: SelectConnection keeping ``--window``
  unconfirmed publishes in flight (how RabbitMQ benchmarks publish);
* ``consume``: basic.consume with prefetch 1000, an ack (multiple) every 100.

``--rabbitmq``: the same workloads, in the same run, against a local RabbitMQ
3.10 (bench/rabbitmq.py; bench/install_rabbitmq.sh installs it): 1 node
unmirrored next to mirrorq's 1 node, 3 nodes with ha-mode all next to
mirrorq's 3-replica queue; one table with the ratio mirrorq/RabbitMQ.
"""

from __future__ import annotations

import argparse
import os
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


def run(nodes: int, a, shell: str = "watch") -> None:
    label = f"{nodes}-node cluster, {nodes}-replica queue, {shell} shell"
    figs = mirrorq_figures(nodes, a, shell)
    for w in WORKLOADS:
        print(f"{label}: {w:30s} {figs[w]:8.0f} msg/s", flush=True)
    print(f"({a.sync} sync-confirmed, {a.messages} pipelined with window {a.window}, all consumed)")


# ---- side by side with a real RabbitMQ (--rabbitmq) -------------------------------------------
# The same three workloads, the same pika code, against mirrorq and RabbitMQ 3.10 in one run:
# mirrorq 1 node (1-replica queue) vs RabbitMQ 1 node (unmirrored); mirrorq 3 nodes (3-replica
# queue) vs RabbitMQ 3 nodes, policy ha-mode all + ha-sync-mode automatic.  The client always
# talks to the node hosting the queue's master (the first node).  Configurations alternate
# (mirrorq, RabbitMQ, mirrorq, RabbitMQ) so a load change on the machine hits both sides alike.
WORKLOADS = ("publish (pipelined confirms)", "publish (sync confirms)", "consume (prefetch 1000)")


def _rabbitmq_module():
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    import bench.rabbitmq

    return bench.rabbitmq


def _mirrorq_mirrors(root: Path) -> int:
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mirrorctl(["--data-dir", str(root), "--formatter", "json", "list_queues", "name", "synchronised_slave_pids"])
    rows = [r for r in json.loads(out.getvalue()) if r["name"] == "bench"]
    return len(rows[0]["synchronised_slave_pids"]) if rows else -1


def workloads(port: int, queue: str, a, check=None) -> dict:
    """The three figures (msg/s) on an empty durable ``queue`` reachable at
    127.0.0.1:port; ``check()`` (if given) returns the queue's synchronised
    mirror count, which must reach ``nodes - 1`` before the clock starts."""
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    conn.channel().queue_declare(queue, durable=True)
    conn.close()
    if check is not None and a.want_mirrors:
        deadline = time.monotonic() + 30
        while check() < a.want_mirrors:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the queue never had {a.want_mirrors} synchronised mirrors")
            time.sleep(0.2)  # polling interval of a condition with a deadline
    out = {WORKLOADS[1]: sync_publish(port, queue, a.sync),
           WORKLOADS[0]: pipelined_publish(port, queue, a.messages, a.window)}
    out[WORKLOADS[2]] = consume(port, queue, a.sync + a.messages)
    return out


def mirrorq_figures(nodes: int, a, shell: str = "watch") -> dict:
    """The three figures against a fresh mirrorq cluster of ``nodes`` (its queue mirrored on all)."""
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-amqp-"))
    base = _rabbitmq_module().free_port_block(2 * nodes)  # admin ports, then AMQP ports: all checked free
    cluster = Cluster(root, amqp_shell=shell)

    def ctl(*x: str) -> int:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            return mirrorctl(["--data-dir", str(root), "--formatter", "json", *x])

    a.want_mirrors = nodes - 1
    try:
        if ctl("cluster", "start", "--nodes", str(nodes), "--base-port", str(base),
               "--amqp-base-port", str(base + nodes), "--amqp-shell", shell) != 0:
            raise RuntimeError(f"mirrorq: cluster start --nodes {nodes} failed")
        if nodes > 1 and ctl("set_policy", "--apply-to", "queues", "ha-bench", "^bench$",
                             '{"ha-mode":"all","ha-sync-mode":"automatic"}') != 0:
            raise RuntimeError("mirrorq: set_policy failed")
        figs = workloads(base + nodes, "bench", a, check=lambda: _mirrorq_mirrors(root))
    finally:
        cluster.stop_all()
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # kept (logs) when the run failed
    return figs


def rabbitmq_rabbit_figures(nodes: int, a) -> dict:
    RabbitMQCluster = _rabbitmq_module().RabbitMQCluster

    policy = ("ha-bench", "^bench$", {"ha-mode": "all", "ha-sync-mode": "automatic"}) if nodes > 1 else None
    with RabbitMQCluster(nodes, policy=policy) as rmq:
        figs = workloads(rmq.amqp_port(0), "bench", a)
        if nodes > 1:  # the queue really was mirrored on every node
            q = rmq.list_queues("name", "slave_pids")
            if len(q[0]["slave_pids"] or []) != nodes - 1:
                raise RuntimeError(f"RabbitMQ: queue not mirrored on all nodes: {q}")
        return figs


def rabbitmq_side_by_side(a) -> None:
    import json
    import statistics

    why = _rabbitmq_module().available()
    if why:
        raise SystemExit(f"--rabbitmq: {why}")
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    shells = ("watch", "asyncio") if a.amqp_shell == "both" else (a.amqp_shell,)
    print(f"pika side by side: mirrorq ({'/'.join(shells)} AMQP shell) vs RabbitMQ 3.10, 1 KiB persistent, "
          f"{os.cpu_count()} CPUs, loadavg {load()}", flush=True)
    configs = [(n, f"{n} node{'s' if n > 1 else ''}") for n in [int(x) for x in a.nodes.split(",")]]
    sides = [(f"mirrorq/{sh}" if len(shells) > 1 else "mirrorq", lambda n, a, sh=sh: mirrorq_figures(n, a, sh))
             for sh in shells] + [("RabbitMQ", rabbitmq_rabbit_figures)]
    res: dict = {}
    for r in range(a.runs):
        for n, label in configs:
            for side, fn in sides:
                t0 = time.monotonic()
                figs = fn(n, a)
                res.setdefault((label, side), []).append(figs)
                print(f"  run {r + 1}/{a.runs} {side:16s} {label}: " + ", ".join(f"{k} {v:.0f}" for k, v in figs.items())
                      + f"  ({time.monotonic() - t0:.0f} s, loadavg {load()})", flush=True)
    med = {k: {w: statistics.median(f[w] for f in v) for w in WORKLOADS} for k, v in res.items()}
    print()
    mq_sides = [sd for sd, _ in sides if sd != "RabbitMQ"]
    head = "".join(f" {sd:>16s}" for sd in mq_sides)
    ratios = "".join(f" {sd + '/RMQ':>20s}" for sd in mq_sides)
    print(f"{'workload':30s} {'cluster':8s} {'queue':27s}{head} {'RabbitMQ':>9s}{ratios}")
    for w in WORKLOADS:
        for n, label in configs:
            qd = "1 replica / unmirrored" if n == 1 else f"{n} replicas / ha-mode all"
            rr = med[(label, "RabbitMQ")][w]
            ms = [med[(label, sd)][w] for sd in mq_sides]
            print(f"{w:30s} {label:8s} {qd:27s}" + "".join(f" {m:16.0f}" for m in ms) + f" {rr:9.0f}"
                  + "".join(f" {m / rr:19.2f}x" for m in ms))
    print(f"msg/s{', median of ' + str(a.runs) + ' runs' if a.runs > 1 else ''}; {a.messages} pipelined "
          f"(window {a.window}), {a.sync} sync, consume all; loadavg at end {load()}")
    print(json.dumps({"cpus": os.cpu_count(), "messages": a.messages, "window": a.window, "sync": a.sync,
                      "runs": a.runs, "loadavg_end": os.getloadavg(), "results": [
                          {"cluster": label, "side": side, "run": i + 1, **figs}
                          for (label, side), runs in res.items() for i, figs in enumerate(runs)]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--sync", type=int, default=1000)
    ap.add_argument("--nodes", default="1,3")
    ap.add_argument("--amqp-shell", choices=("watch", "asyncio", "both"), default="watch",
                    help="the nodes' AMQP shell; both: each configuration with each shell, back to back")
    ap.add_argument("--runs", type=int, default=1, help="repeat each configuration (shells alternate within a run)")
    ap.add_argument("--rabbitmq", action="store_true",
                    help="also run each configuration against a local RabbitMQ and print one table (bench/rabbitmq.py)")
    a = ap.parse_args()
    if a.rabbitmq:
        return rabbitmq_side_by_side(a)
    shells = ("watch", "asyncio") if a.amqp_shell == "both" else (a.amqp_shell,)
    for n in [int(x) for x in a.nodes.split(",")]:
        for r in range(a.runs):
            for shell in shells:
                print(f"-- run {r + 1}/{a.runs}, loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
                run(n, a, shell)


if __name__ == "__main__":
    main()
