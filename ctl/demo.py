"""The README's demo: the user's story, end to end.

1. a local 3-node cluster comes up;
2. ``mirrorctl set_policy`` mirrors every ``demo.*`` queue on all nodes;
3. pika declares ``demo.orders`` through node2 (its master goes there) and a
   publisher on node3 publishes persistent messages with publisher confirms;
4. half-way, node2 -- the master's node -- is killed with SIGKILL; the oldest
   mirror takes over and the publisher's unconfirmed messages go to it;
5. the ring heals: ``mirrorctl ring`` shows the new master and node2's
   replica down;
6. the policy switches to ``ha-sync-mode: manual`` and more messages are
   published while node2 is down;
7. node2 comes back: its mirror restarts from its own store (it keeps its
   data) and waits, unsynchronised, in the ring;
8. ``mirrorctl sync_queue`` catches it up by delta: the ring shows it
   synchronised and how few records sync sent;
9. every confirmed message is consumed from a survivor (node1), and counted;
10. where to look: each node's live ring page and Prometheus ``/metrics``
    (the demo reads them and shows the queue's gauges).

The cluster is stopped at the end unless --keep.

    python -m ctl.demo [--data-dir D] [--base-port P] [--amqp-base-port A] [--messages N] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from ctl.mirrorctl import main as mirrorctl
from mirrorq.admin.cluster import DEFAULT_AMQP_BASE_PORT, DEFAULT_BASE_PORT, Cluster, ClusterError
from mirrorq.admin.cluster import poll as _wait

QUEUE = "demo.orders"


def _amqp(cluster: Cluster, node: str):
    import pika

    info = cluster.pid_info(node)
    assert info is not None, f"{node} is not running"  # the demo started it
    port = int(info["amqp_port"])
    params = pika.ConnectionParameters(
        "127.0.0.1",
        port,
        credentials=pika.PlainCredentials("guest", "guest"),
        heartbeat=0,
        blocked_connection_timeout=60,
    )
    return pika.BlockingConnection(params)


class Publisher(threading.Thread):
    """Publishes persistent messages with confirms, one at a time, and
    remembers exactly which ones the broker confirmed."""

    def __init__(self, cluster: Cluster, node: str, total: int, start: int = 0):
        super().__init__(daemon=True)
        self.cluster, self.node, self.total, self.first = cluster, node, total, start
        self.confirmed: list[str] = []
        self.error: str = ""

    def run(self) -> None:
        import pika

        try:
            conn = _amqp(self.cluster, self.node)
            ch = conn.channel()
            ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            for i in range(self.first, self.first + self.total):
                body = f"order-{i}"
                ch.basic_publish("", QUEUE, body.encode(), props, mandatory=True)  # returns once confirmed
                self.confirmed.append(body)
            conn.close()
        except Exception as e:  # noqa: BLE001 -- reported by the demo
            self.error = f"{type(e).__name__}: {e}"


def run(data_dir: str, base_port: int, amqp_base_port: int, total: int, keep: bool) -> int:
    ctl = lambda *a: mirrorctl(["--data-dir", data_dir, *a])  # noqa: E731
    cluster = Cluster(__import__("pathlib").Path(data_dir).resolve())
    print("== 1. start a 3-node cluster on loopback")
    if (
        ctl("cluster", "start", "--nodes", "3", "--base-port", str(base_port), "--amqp-base-port", str(amqp_base_port))
        != 0
    ):
        return 1
    try:
        print("\n== 2. mirror every demo.* queue on all nodes")
        if ctl("set_policy", "ha-demo", r"^demo\.", json.dumps({"ha-mode": "all", "ha-sync-mode": "automatic"})) != 0:
            return 1
        print(
            f"\n== 3. pika declares {QUEUE} through node2 (its master goes there); a publisher on node3 publishes "
            f"{total} persistent messages with confirms"
        )
        conn = _amqp(cluster, "node2")
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()
        _wait(
            lambda: _synced(
                ctl_json(data_dir, "list_queues", "name", "pid", "slave_pids", "synchronised_slave_pids"), 2
            ),
            30,
        )
        ctl("list_queues", "name", "pid", "slave_pids", "synchronised_slave_pids", "messages")
        pub = Publisher(cluster, "node3", total)
        pub.start()
        _wait(lambda: len(pub.confirmed) >= total // 2 or pub.error or not pub.is_alive(), 120)
        print(f"\n== 4. {len(pub.confirmed)} confirmed so far: kill -9 node2, the master's node")
        t0 = time.monotonic()
        ctl("kill_node", "node2")
        before = len(pub.confirmed)
        _wait(lambda: len(pub.confirmed) > before or pub.error or not pub.is_alive(), 60)
        print(f"first confirm from the new master {time.monotonic() - t0:.2f}s after the kill")
        pub.join(300)
        if pub.error:
            print(f"publisher failed: {pub.error}")
            return 1
        print("\n== 5. the ring heals: a new master on a survivor, node2's replica down")
        ctl("-n", "node1", "ring")
        print("\n== 6. sync by hand from now on (ha-sync-mode: manual); publish more while node2 is down")
        if ctl("set_policy", "ha-demo", r"^demo\.", json.dumps({"ha-mode": "all", "ha-sync-mode": "manual"})) != 0:
            return 1
        more = Publisher(cluster, "node3", total // 5, start=total)
        more.run()
        if more.error:
            print(f"publisher failed: {more.error}")
            return 1
        confirmed = pub.confirmed + more.confirmed
        print(f"{len(more.confirmed)} more confirmed")
        print("\n== 7. bring node2 back: its mirror restarts from its own store and waits, unsynchronised")
        if ctl("start_node", "node2") != 0:
            return 1
        _wait(lambda: _ring_state(data_dir, "node2") not in (None, "down"), 60)
        ctl("-n", "node1", "ring")
        print("\n== 8. mirrorctl sync_queue: the mirror catches up by delta (records sent: what it missed)")
        ctl("-n", "node1", "sync_queue", QUEUE)
        _wait(lambda: _ring_state(data_dir, "node2") == "synchronised", 60)
        ctl("-n", "node1", "ring")
        print(f"\n== 9. consume from node1 (a survivor) and check all {len(confirmed)} confirmed messages")
        got = _drain(cluster, "node1", len(confirmed))
        missing = set(confirmed) - got
        print(f"confirmed {len(confirmed)}, consumed {len(got)} distinct, lost {len(missing)}")
        _point_at_the_page(cluster)
        return 0 if not missing else 1
    finally:
        if keep:
            print(f"\ncluster left running; stop it with: mirrorctl --data-dir {data_dir} cluster stop")
        else:
            print("\n== 11. stop the cluster")
            ctl("cluster", "stop")


def ctl_json(data_dir: str, *argv: str) -> list:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = mirrorctl(["--data-dir", data_dir, "--formatter", "json", *argv])
    try:
        return json.loads(buf.getvalue()) if rc == 0 else []
    except ValueError:
        return []


def _point_at_the_page(cluster: Cluster) -> None:
    """Step 10: the management page and /metrics of each node."""
    import urllib.request

    ports = {n: cluster.config(n).management_port for n in cluster.node_names()}
    if not any(ports.values()):
        return
    print("\n== 10. watch it live: each node serves the rings page and Prometheus /metrics (guest/guest)")
    for n, port in sorted(ports.items()):
        if port:
            print(f"{n}: http://127.0.0.1:{port}/   metrics: http://127.0.0.1:{port}/metrics")

    def metrics(port: int) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""  # the server starts a moment after its node: asked again

    # a node's /metrics covers the queues mastered there: the demo queue's is on one of them
    for n, port in sorted(ports.items()):
        if not port or not cluster.is_running(n):
            continue
        for line in (_wait(lambda port=port: metrics(port), 30) or "").splitlines():
            if f'queue="{QUEUE}"' in line and line.startswith("rabbitmq_queue_messages"):
                print(f"{n} /metrics: {line}")


def _ring_state(data_dir: str, node: str) -> str | None:
    """The state ``mirrorctl ring`` shows for the demo queue's replica on ``node``."""
    for row in ctl_json(data_dir, "-n", "node1", "ring"):
        if row.get("name") == QUEUE:
            return next((m["state"] for m in row["ring"] if m["node"] == node), None)
    return None


def _synced(rows: list, n: int) -> bool:
    return any(r.get("name") == QUEUE and len(r.get("synchronised_slave_pids") or []) >= n for r in rows)


def _drain(cluster: Cluster, node: str, expect: int) -> set[str]:
    got: set[str] = set()
    conn = _amqp(cluster, node)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=500)
    deadline = time.monotonic() + 60
    for method, _props, body in ch.consume(QUEUE, inactivity_timeout=5):
        if method is None:
            if len(got) >= expect or time.monotonic() > deadline:
                break
            continue
        got.add(body.decode())
        ch.basic_ack(method.delivery_tag)
    ch.cancel()
    conn.close()
    return got


def fresh_data_dir(data_dir: str) -> None:
    """The demo tells its story from a new cluster: a previous demo's data
    dir is removed, unless one of its nodes still runs (ClusterError)."""
    path = __import__("pathlib").Path(data_dir).resolve()
    if not path.exists():
        return
    cluster = Cluster(path)
    running = [n for n in cluster.node_names() if cluster.is_running(n)] if (path / "cluster.yaml").exists() else []
    if running:
        raise ClusterError(
            f"a cluster in {path} is still running ({', '.join(running)}): "
            f"stop it with 'mirrorctl --data-dir {data_dir} cluster stop' first"
        )
    import shutil

    shutil.rmtree(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="demo")
    p.add_argument("--data-dir", default=os.environ.get("MIRRORQ_DATA_DIR", "mirrorq-data/demo"))
    p.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    p.add_argument("--amqp-base-port", type=int, default=DEFAULT_AMQP_BASE_PORT)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    a = p.parse_args(argv)
    try:
        fresh_data_dir(a.data_dir)
        return run(a.data_dir, a.base_port, a.amqp_base_port, a.messages, a.keep)
    except ClusterError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
