"""What applications do, through pika, against mirrorq and RabbitMQ 3.10 in the same run.

    .venv/bin/python bench/amqp.py [--runs 3] [--messages 20000] [--backlog 30000] [--latency 1000]
                                   [--prefetch 10,100,1000] [--only a,b,c,d,e] [--kinds plain,mirrored,quorum]
                                   [--no-rabbitmq]

Both sides are 3-node clusters on loopback (mirrorq: ``mirrorctl cluster
start``; RabbitMQ: bench/rabbitmq.py, installed by bench/install_rabbitmq.sh),
with a policy mirroring ``^mirrored\\.`` queues on every node (``ha-mode:
all``, ``ha-sync-mode: automatic``); ``plain.*`` queues are not mirrored;
``quorum.*`` queues are declared ``x-queue-type: quorum`` (a Raft group
over the 3 nodes, confirms once a majority has them on disk).
Every queue is durable, every message persistent, 1 KiB; the clients connect
to the node where the queue was declared (its master).  The clock starts
only once a mirrored queue's mirrors are synchronised.  Clients are pika
``SelectConnection`` processes of their own (bench/clients.py): the
publisher keeps a window of unconfirmed publishes, the consumer sets
``basic.qos(prefetch)`` and sends ONE ``basic.ack`` per message.

Workloads (each on a ``plain``, a ``mirrored`` and a ``quorum`` queue):

(a) ``concurrent``: 1 publisher (window 1000) and 1 consumer at the same
    time, ``--messages`` messages, for each ``--prefetch``;
(b) ``4x4``: 4 publishers and 4 consumers on 4 queues, prefetch 100;
(c) ``drain``: a backlog of ``--backlog`` messages (published first with
    window 1000: that rate is reported too) drained with prefetch 100;
(d) ``latency``: ``--latency`` publishes one at a time (window 1), no
    consumer: confirm latency p50 and p99;
(e) ``deliver``: publish -> delivery latency to a waiting consumer: a
    consumer (prefetch 100) is consuming the queue (its consume-ok came)
    before a publisher publishes ``--latency`` messages one at a time
    (window 1); each body carries the ``time.monotonic_ns()`` of its
    publish (Linux's monotonic clock is one clock for all processes) and
    the consumer subtracts it from its own at the delivery: p50 and p99,
    with the publisher's confirm latency of the same run beside them.

Runs alternate sides (mirrorq, RabbitMQ, mirrorq, ...), each with fresh
clusters, so a change of load on the machine hits both; the table gives the
median of the runs and the ratio mirrorq/RabbitMQ (for rates higher is
better, for latencies lower is better).  ``client cpu`` is the CPU the
client processes used as a fraction of one core over the workload's wall
time (2 cores here: near 1.0 would mean the client is the bottleneck).
The last line is one JSON object with every run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pika  # noqa: E402

from bench import clients  # noqa: E402
from bench.rabbitmq import RabbitMQCluster, available, free_port_block  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster, poll  # noqa: E402

POLICY = ("ha-bench", r"^mirrored\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
KINDS = ("plain", "mirrored", "quorum")


# ---- the two sides ---------------------------------------------------------------------------
class MirrorqSide:
    """A fresh 3-node mirrorq cluster with ``policy`` set; ``ports``: the nodes' AMQP ports."""

    name = "mirrorq"
    policy = POLICY
    prefix = "mirrorq-bench-amqp-"

    def __enter__(self):
        self.root = Path(tempfile.mkdtemp(prefix=self.prefix))
        base = free_port_block(6)
        self.cluster = Cluster(self.root)
        self.port = base + 3
        self.ports = [base + 3 + i for i in range(3)]
        pol = self.policy
        try:
            # no management server: the RabbitMQ side runs without its management plugin
            if (
                self._ctl(
                    "cluster",
                    "start",
                    "--nodes",
                    "3",
                    "--base-port",
                    str(base),
                    "--amqp-base-port",
                    str(base + 3),
                    "--management-base-port",
                    "0",
                )[0]
                != 0
            ):
                raise RuntimeError("mirrorq: cluster start failed")
            if self._ctl("set_policy", "--apply-to", "queues", pol[0], pol[1], json.dumps(pol[2]))[0] != 0:
                raise RuntimeError("mirrorq: set_policy failed")
        except BaseException:
            self.cluster.stop_all()
            raise
        return self

    def __exit__(self, *exc):
        self.cluster.stop_all()
        if exc[0] is None:
            shutil.rmtree(self.root, ignore_errors=True)  # kept (logs) when the run failed

    def _ctl(self, *argv: str):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = mirrorctl(["--data-dir", str(self.root), "--formatter", "json", *argv])
        return rc, out.getvalue()

    def synced_mirrors(self) -> dict:
        rc, out = self._ctl("list_queues", "name", "synchronised_slave_pids")
        return {r["name"]: len(r["synchronised_slave_pids"] or []) for r in json.loads(out)} if rc == 0 else {}


class RabbitMQSide:
    name = "RabbitMQ"

    def __enter__(self):
        self.rmq = RabbitMQCluster(3, policy=POLICY)
        self.rmq.__enter__()
        self.port = self.rmq.amqp_port(0)
        return self

    def __exit__(self, *exc):
        self.rmq.__exit__(*exc)

    def synced_mirrors(self) -> dict:
        return {
            r["name"]: len(r.get("synchronised_slave_pids") or [])
            for r in self.rmq.list_queues("name", "synchronised_slave_pids")
        }


def declare(side, queues: list[str]) -> None:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", side.port))
    try:
        ch = conn.channel()
        for q in queues:
            ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"} if q.startswith("quorum.") else None)
    finally:
        conn.close()
    mirrored = [q for q in queues if q.startswith("mirrored.")]
    if mirrored and not poll(lambda: all(side.synced_mirrors().get(q, 0) >= 2 for q in mirrored), 60, step=0.2):
        raise RuntimeError(f"{side.name}: {mirrored} not synchronised on 2 mirrors within 60 s")


# ---- workloads -------------------------------------------------------------------------------
def _cpu(res: dict, wall_from: str = "t0", wall_to: str = "t1") -> float:
    wall = res[wall_to] - res[wall_from]
    return res["cpu"] / wall if wall > 0 else 0.0


def _check(res: dict, what: str) -> None:
    bad = res.get("stalled") or res.get("error")
    if bad:
        raise RuntimeError(f"{what}: {bad}")


def run_side(side, a, run: int) -> dict:
    """Every workload on one side; returns {(workload, kind): {metric: value}}."""
    figs: dict = {}
    wl = set(a.only.split(","))
    for kind in a.kinds:
        tag = f"{kind}.r{run}"
        if "a" in wl:
            for p in a.prefetch:
                q = f"{tag}.concurrent.p{p}"
                declare(side, [q])
                r = clients.concurrent(side.port, [q], a.messages, 1000, p, stall=60)
                if r["stalled"] or not r["complete"]:
                    raise RuntimeError(f"{side.name} {q}: {r['stalled'] or 'incomplete'}")
                figs[(f"(a) concurrent, prefetch {p}", kind)] = {
                    "publish msg/s": r["publish_rate"],
                    "consume msg/s": r["consume_rate"],
                    "client cpu": r["client_cpu"],
                }
        if "b" in wl:
            qs = [f"{tag}.4x4.{i}" for i in range(4)]
            declare(side, qs)
            r = clients.concurrent(side.port, qs, a.messages // 4, 1000, 100, stall=60)
            if r["stalled"] or not r["complete"]:
                raise RuntimeError(f"{side.name} 4x4: {r['stalled'] or 'incomplete'}")
            figs[("(b) 4 publishers + 4 consumers, 4 queues", kind)] = {
                "publish msg/s": r["publish_rate"],
                "consume msg/s": r["consume_rate"],
                "client cpu": r["client_cpu"],
            }
        if "c" in wl:
            q = f"{tag}.drain"
            declare(side, [q])
            f = clients.fill(side.port, q, a.backlog, 1000, stall=60)
            _check(f, f"{side.name} fill {q}")
            d = clients.drain(side.port, q, a.backlog, 100, stall=60)
            _check(d, f"{side.name} drain {q}")
            figs[("(c) backlog drained, prefetch 100", kind)] = {"consume msg/s": d["rate"], "client cpu": _cpu(d)}
            figs[("    (backlog publish, window 1000, no consumer)", kind)] = {
                "publish msg/s": f["rate"],
                "client cpu": _cpu(f),
            }
        if "d" in wl:
            q = f"{tag}.latency"
            declare(side, [q])
            r = clients.fill(side.port, q, a.latency, 1, stall=60)
            _check(r, f"{side.name} latency {q}")
            figs[("(d) one publish at a time (window 1)", kind)] = {
                "confirm p50 ms": r["latency_p50"] * 1e3,
                "confirm p99 ms": r["latency_p99"] * 1e3,
                "client cpu": _cpu(r),
            }
        if "e" in wl:
            q = f"{tag}.deliver"
            declare(side, [q])
            r = clients.deliver_latency(side.port, q, a.latency, 100, stall=60)
            _check(r, f"{side.name} deliver latency {q} (consumer)")
            _check(r["publisher"], f"{side.name} deliver latency {q} (publisher)")
            figs[("(e) publish -> delivery, waiting consumer", kind)] = {
                "deliver p50 ms": r["delivery_p50"] * 1e3,
                "deliver p99 ms": r["delivery_p99"] * 1e3,
                "confirm p50 ms": r["publisher"]["latency_p50"] * 1e3,
                "confirm p99 ms": r["publisher"]["latency_p99"] * 1e3,
            }
    return figs


# ---- the table -------------------------------------------------------------------------------
def table(results: dict, runs: int) -> list[str]:
    sides = [s for s in ("mirrorq", "RabbitMQ") if s in results]
    keys: list = []
    for s in sides:
        for fig in results[s]:
            for k, metrics in fig.items():
                for m in metrics:
                    if (k, m) not in keys:
                        keys.append((k, m))
    lines = [
        f"{'workload':46s} {'queue':9s} {'metric':15s}"
        + "".join(f" {s:>10s}" for s in sides)
        + ("   mirrorq/RMQ" if len(sides) == 2 else "")
    ]
    for (wk, kind), metric in keys:
        meds = []
        for s in sides:
            vals = [fig[(wk, kind)][metric] for fig in results[s] if (wk, kind) in fig]
            meds.append(statistics.median(vals) if vals else float("nan"))
        fmt = (lambda v: f"{v:10.2f}") if metric.endswith("ms") or metric == "client cpu" else (lambda v: f"{v:10.0f}")
        row = f"{wk:46s} {kind:9s} {metric:15s}" + "".join(" " + fmt(v) for v in meds)
        if len(sides) == 2 and metric != "client cpu" and meds[1]:
            row += f"   {meds[0] / meds[1]:10.2f}x"
        lines.append(row)
    lines.append(
        f"median of {runs} run(s) per side, sides alternating; rates in msg/s (higher is better), "
        "latencies in ms (lower is better); client cpu: cores used by the client processes"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--backlog", type=int, default=30000)
    ap.add_argument("--latency", type=int, default=1000)
    ap.add_argument("--prefetch", default="10,100,1000")
    ap.add_argument("--only", default="a,b,c,d,e", help="workloads to run, e.g. a,d")
    ap.add_argument("--kinds", default="plain,mirrored,quorum", help=f"queue kinds to run, of {', '.join(KINDS)}")
    ap.add_argument("--no-rabbitmq", action="store_true", help="mirrorq alone")
    a = ap.parse_args()
    a.kinds = [k for k in a.kinds.split(",") if k]
    if not a.kinds or set(a.kinds) - set(KINDS):
        ap.error(f"--kinds: expected some of {', '.join(KINDS)}, got {','.join(a.kinds)!r}")
    a.prefetch = [int(x) for x in a.prefetch.split(",")]
    sides = [MirrorqSide]
    if not a.no_rabbitmq:
        why = available()
        if why:
            raise SystemExit(f"RabbitMQ: {why} (or --no-rabbitmq)")
        sides.append(RabbitMQSide)
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    print(
        f"bench/amqp.py: 3-node clusters, pika, 1 KiB persistent, one ack per message; {os.cpu_count()} CPUs, "
        f"loadavg {load()}",
        flush=True,
    )
    results: dict = {}
    for run in range(a.runs):
        for cls in sides:
            t0 = time.monotonic()
            with cls() as side:
                figs = run_side(side, a, run)
            results.setdefault(cls.name, []).append(figs)
            print(
                f"  run {run + 1}/{a.runs} {cls.name:8s} done in {time.monotonic() - t0:.0f} s, loadavg {load()}",
                flush=True,
            )
    print()
    for line in table(results, a.runs):
        print(line)
    print(
        json.dumps(
            {
                "cpus": os.cpu_count(),
                "args": vars(a),
                "loadavg_end": os.getloadavg(),
                "results": {
                    s: [{f"{k[0]} | {k[1]}": v for k, v in fig.items()} for fig in figs] for s, figs in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
