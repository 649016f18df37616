"""Many mirrored queues, as applications hold them, against RabbitMQ 3.10 in the same run.

    .venv/bin/python bench/queues.py [--queues 1000] [--connections 8] [--messages 10]
                                     [--idle 10] [--no-rabbitmq | --no-mirrorq] [--no-kill]
                                     [--queue-type classic|quorum]

Both sides are 3-node clusters on loopback with a policy mirroring
``^scale\\.`` queues on every node (``ha-mode: all``, ``ha-sync-mode:
automatic``).  Steps, each timed, for each side:

1. declare ``--queues`` durable queues through pika, ``--connections``
   connections at once (spread over the three nodes, so masters spread:
   queue-master-locator client-local), one ``queue.declare`` at a time per
   connection: the declare rate;
2. wait until every queue has its 2 mirrors (registry / rabbitmqctl);
3. memory: PSS (``/proc/PID/smaps_rollup``) of each node's processes, per
   node and per queue replica (node PSS / queues, since each node holds one
   replica of every queue), and the number of OS processes per node;
4. ``--messages`` persistent messages published to every queue with
   publisher confirms (window ``--messages``), all confirmed;
5. idle CPU of the nodes over ``--idle`` seconds (fraction of one core);
6. kill -9 one node that is not the first (``--no-kill`` skips): time until
   every queue mastered there has a new master (per queue: the first poll
   that shows it, polls every 0.5 s; the table gives the median and the
   slowest), then every
   queue's message count, which must be ``--messages`` (none lost).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pika  # noqa: E402

from bench import amqp  # noqa: E402
from bench.rabbitmq import RabbitMQCluster, available  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import poll  # noqa: E402

POLL = 0.5  # seconds between two looks at every queue's master after the kill
POLICY = ("ha-scale", r"^scale\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})


# ---- processes ---------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _group(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except OSError:
                continue
    return out


def _tree(pid: int) -> list[int]:
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _pss_kib(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


# ---- the two sides ---------------------------------------------------------------------------
class MirrorqSide(amqp.MirrorqSide):
    policy = POLICY
    prefix = "mirrorq-bench-queues-"

    def __enter__(self):
        super().__enter__()
        self.names = self.cluster.node_names()
        return self

    def _ctl(self, *argv: str, node: str | None = None):
        out = io.StringIO()
        pre = ["--data-dir", str(self.root), "--formatter", "json"] + (["-n", node] if node else [])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = mirrorctl([*pre, *argv])
        return rc, out.getvalue()

    def queues(self, node: int = 0) -> list[dict]:
        rc, out = self._ctl("list_queues", "name", "pid", "slave_pids", "messages", node=self.names[node])
        return json.loads(out) if rc == 0 else []

    def masters(self, node: int = 0) -> dict[str, str]:
        """queue -> its master's node, from the registry (the record a
        promotion updates), without asking any master."""
        from mirrorq.node.client import NodeClient
        from mirrorq.node.registry_client import RegistryClient

        nc = NodeClient(self.cluster.config(self.names[node]).admin_port)
        try:
            r = nc.ask(RegistryClient("bench").get(0.0, "amqqueue", None, None), 30)
        finally:
            nc.close()
        if r is None or not getattr(r, "ok", False):
            return {}
        return {row["name"]: self.master_node(row) for row in r.rows}

    def node_pids(self, i: int) -> list[int]:
        info = self.cluster.pid_info(self.names[i])
        return _group(int(info["pgid"])) if info else []

    def master_node(self, row: dict) -> str:
        pid = row.get("pid") or ""
        return pid.split("/")[0] if isinstance(pid, str) else ""

    def kill(self, i: int) -> None:
        self.cluster.kill_node(self.names[i])


class RabbitMQSide:
    name = "RabbitMQ"

    def __enter__(self):
        self.rmq = RabbitMQCluster(3, policy=POLICY)
        self.rmq.__enter__()
        self.ports = [self.rmq.amqp_port(i) for i in range(3)]
        self.names = list(self.rmq.names)
        return self

    def __exit__(self, *exc):
        self.rmq.__exit__(*exc)

    def queues(self, node: int = 0) -> list[dict]:
        rows = self.rmq.list_queues("name", "pid", "slave_pids", "messages", node=node)
        return [{**r, "slave_pids": r.get("slave_pids") or []} for r in rows]

    def masters(self, node: int = 0) -> dict[str, str]:
        return {r["name"]: self.master_node(r) for r in self.rmq.list_queues("name", "pid", node=node)}

    def node_pids(self, i: int) -> list[int]:
        p = self.rmq.procs.get(self.names[i])
        return _tree(p.pid) if p is not None else []

    def master_node(self, row: dict) -> str:
        # a pid as rabbitmqctl prints it: "<rabbit2@localhost.1669.57.0>"; a pid
        # local to the node asked (node 0) may print as "<0.57.0>"
        pid = str(row.get("pid") or "")
        m = re.search(r"(rabbit\d+)@", pid)
        if m:
            return m.group(1)
        return self.names[0].split("@")[0] if pid.startswith("<0.") else ""

    def kill(self, i: int) -> None:
        self.rmq.kill_node(i)


# ---- steps -------------------------------------------------------------------------------------
def _per_connection(side, names: list[str], connections: int, work, what: str) -> float:
    """Run ``work(channel, queues)`` on ``connections`` pika connections at
    once (spread over the nodes), each with its share of ``names``; the wall time."""
    errors: list[str] = []
    chunks = [names[i::connections] for i in range(connections)]

    def one(k: int) -> None:
        try:
            conn = pika.BlockingConnection(
                pika.ConnectionParameters(
                    "127.0.0.1", side.ports[k % 3], blocked_connection_timeout=300, socket_timeout=60
                )
            )
            try:
                work(conn.channel(), chunks[k])
            finally:
                conn.close()
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(f"connection {k}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{side.name}: {what} failed: {errors[:3]}")
    return time.monotonic() - t0


def _declare_all(side, names: list[str], connections: int, arguments: dict | None = None) -> float:
    def work(ch, queues):
        for q in queues:
            ch.queue_declare(q, durable=True, arguments=arguments)

    return _per_connection(side, names, connections, work, "declares")


def _publish_all(side, names: list[str], connections: int, messages: int) -> float:
    body = b"x" * 1024

    def work(ch, queues):
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2)
        for q in queues:
            for _ in range(messages):
                ch.basic_publish("", q, body, props)

    return _per_connection(side, names, connections, work, "publishes")


def run_side(side_cls, a) -> dict:
    res: dict = {"side": side_cls.name}
    names = [f"scale.{i:05d}" for i in range(a.queues)]
    with side_cls() as side:
        quorum = a.queue_type == "quorum"
        res["queue_type"] = a.queue_type
        res["declare_s"] = _declare_all(side, names, a.connections, {"x-queue-type": "quorum"} if quorum else None)
        res["declare_rate"] = a.queues / res["declare_s"]
        print(f"{side.name}: declared {a.queues} in {res['declare_s']:.1f} s ({res['declare_rate']:.1f}/s)", flush=True)
        t0 = time.monotonic()
        # a quorum queue's members are all in place when its declare is answered (both sides)
        ok = quorum or poll(
            lambda: (
                sum(1 for r in side.queues() if r["name"].startswith("scale.") and len(r.get("slave_pids") or []) >= 2)
                >= a.queues
            ),
            1800,
            step=2.0,
        )
        res["mirrored_s"] = time.monotonic() - t0 if ok else None
        print(f"{side.name}: all mirrored after {res['mirrored_s']}", flush=True)
        pids = [side.node_pids(i) for i in range(3)]
        res["processes_per_node"] = [len(p) for p in pids]
        res["pss_mib_per_node"] = [round(_pss_kib(p) / 1024, 1) for p in pids]
        res["pss_kib_per_replica"] = round(statistics.mean(_pss_kib(p) for p in pids) / a.queues, 1)
        print(
            f"{side.name}: processes per node {res['processes_per_node']}, PSS MiB per node "
            f"{res['pss_mib_per_node']}, {res['pss_kib_per_replica']} KiB per replica",
            flush=True,
        )
        res["publish_s"] = _publish_all(side, names, a.connections, a.messages)
        print(f"{side.name}: published {a.messages} x {a.queues} confirmed in {res['publish_s']:.1f} s", flush=True)
        all_pids = [p for ps in pids for p in ps]
        c0, t0 = _cpu_seconds(all_pids), time.monotonic()
        time.sleep(a.idle)  # the measurement window itself: the cluster is left idle
        res["idle_cpu_cores"] = round((_cpu_seconds(all_pids) - c0) / (time.monotonic() - t0), 3)
        print(f"{side.name}: idle CPU {res['idle_cpu_cores']} cores", flush=True)
        if not a.no_kill:
            victim = 1
            vname = side.names[victim]
            before = side.masters(0)
            short = vname.split("@")[0]
            on_victim = {q for q, n in before.items() if q.startswith("scale.") and n == short}
            res["masters_on_killed_node"] = len(on_victim)
            side.kill(victim)
            t_kill = time.monotonic()
            moved: dict[str, float] = {}
            while len(moved) < len(on_victim) and time.monotonic() - t_kill < 600:
                if moved or time.monotonic() - t_kill > 0.2:
                    # a poll reads every queue's record: asking without pause
                    # would load the node being measured (the figures are to +-POLL)
                    time.sleep(POLL)
                masters = side.masters(0)
                now = time.monotonic() - t_kill
                for q in on_victim:
                    n = masters.get(q)
                    if q not in moved and n and n != short:
                        moved[q] = now
            times = sorted(moved.values())
            res["failed_over"] = len(moved)
            res["failover_median_s"] = round(statistics.median(times), 2) if times else None
            res["failover_all_s"] = round(times[-1], 2) if len(moved) == len(on_victim) and times else None
            print(
                f"{side.name}: {len(moved)}/{len(on_victim)} failed over; all after {res['failover_all_s']} s",
                flush=True,
            )
            counts = {}
            poll(
                lambda: (
                    counts.update({r["name"]: r.get("messages") for r in side.queues(0)})
                    or all(isinstance(counts.get(q), int) for q in names)
                ),
                120,
                step=2.0,
            )
            res["queues_with_all_messages"] = sum(1 for q in names if counts.get(q) == a.messages)
            res["lost_messages"] = sum(max(0, a.messages - (counts.get(q) or 0)) for q in names)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queues", type=int, default=1000)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--messages", type=int, default=10)
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--no-rabbitmq", action="store_true")
    ap.add_argument(
        "--no-mirrorq", action="store_true", help="RabbitMQ alone (its figures for a mirrorq run made apart)"
    )
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        default="classic",
        help="quorum: x-queue-type quorum queues (members on the 3 nodes; use with --no-kill, "
        "bench/quorum_failover.py measures their failover)",
    )
    a = ap.parse_args()
    if a.queue_type == "quorum" and not a.no_kill:
        ap.error("--queue-type quorum: pass --no-kill (bench/quorum_failover.py measures quorum failover)")
    if a.queues < 1 or a.connections < 1 or a.messages < 0:
        ap.error("--queues and --connections must be >= 1, --messages >= 0")
    sides = [] if a.no_mirrorq else [MirrorqSide]
    if not a.no_rabbitmq:
        why = available()
        if why:
            ap.error(f"RabbitMQ is not usable ({why}); install it with bench/install_rabbitmq.sh or pass --no-rabbitmq")
        sides.append(RabbitMQSide)
    results = [run_side(s, a) for s in sides]
    keys = [
        "declare_rate",
        "mirrored_s",
        "processes_per_node",
        "pss_mib_per_node",
        "pss_kib_per_replica",
        "publish_s",
        "idle_cpu_cores",
        "masters_on_killed_node",
        "failover_median_s",
        "failover_all_s",
        "lost_messages",
    ]
    print(f"\n{'':24}" + "".join(f"{r['side']:>24}" for r in results))
    for k in keys:
        print(f"{k:24}" + "".join(f"{json.dumps(r.get(k)):>24}" for r in results))
    print(json.dumps({"queues": a.queues, "connections": a.connections, "results": results}))


if __name__ == "__main__":
    main()
