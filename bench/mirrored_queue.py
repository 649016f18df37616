"""Mirrored-queue figures on a real 3-node cluster (loopback), through the
internal client: the closing-note numbers of issue #5.

    .venv/bin/python bench/mirrored_queue.py [--messages 20000] [--batch 500] [--window 5000]
                                    [--rate-repeats 2] [--rounds 5] [--heartbeat-timeouts 1.5,0.6]
                                    [--queues 20] [--parts rate,failover,memory]

* ``rate``: ``--messages`` persistent 1 KiB publishes with confirms on one
  channel (``--batch`` per publish call, at most ``--window`` unconfirmed),
  timed from the first publish to the last confirm; then one consumer
  (prefetch 1000, acks on hand-over) drains them, timed from basic.consume
  to the last delivery.  For a queue mirrored on all 3 nodes
  (``declare_queue(nodes=[3 nodes])``) and an unmirrored one (declared with
  no nodes and no policy: ``nodes=[one]`` nacks every publish, see bench_rate),
  ``--rate-repeats`` fresh queues each.
* ``failover`` (run first, on a cluster with no other queue; each queue
  is deleted after its round): per round a fresh queue mirrored on all 3 nodes with its
  master on the victim node; a publisher process (its own channel on a
  survivor) publishes 100-message batches with at most 2000 unconfirmed; once
  it has 2000 confirms the victim node is SIGKILLed (whole process group);
  right after the kill a second channel (also on a survivor, opened before)
  publishes one marker message and polls its confirms every 5 ms.  Failover
  = kill -> the marker's confirm (the first confirm of a publish sent after
  the kill).  It includes failure detection (the survivors' ``node_down``
  log record, also reported), promotion, the new master's amqqueue record
  and the channel noticing it (the channel re-reads the record every 0.2 s).
  The publisher's confirms are checked afterwards (all confirmed, none
  nacked).  The victim rotates over the nodes and is restarted between
  rounds; whether it also hosted the registry's Raft leader is reported (the
  promotion's registry transaction then waits for a new leader).  One
  cluster per ``--heartbeat-timeouts`` value (heartbeat interval 0.2 s).
* ``memory``: processes and PSS of each node's process group (Thespian: one
  OS process per actor) before and after declaring ``--queues`` queues
  mirrored on all 3 nodes (idle, empty, after a settle time); delta / K is
  the cost of one replica on one node.

Prints tables and, last, one JSON line with every figure.  The cluster(s)
live in a temp dir and are always stopped.

(Not ``bench/queue.py``: a script's directory comes first on ``sys.path``,
so a ``bench/queue.py`` would shadow the standard library's ``queue`` for
every script in bench/ -- logging.handlers, multiprocessing and Thespian
import it.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gm import free_base_port  # noqa: E402
from bench.node_liveness import group_memory  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster  # noqa: E402
from mirrorq.gm.shell import parse_member_name  # noqa: E402
from mirrorq.node import log as nodelog  # noqa: E402
from mirrorq.queues.client import InternalClient  # noqa: E402

BODY = b"x" * 1024
NODES = 3


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
        "all": [round(x, 4) for x in xs],
    }


def fmt(s: dict, unit: str = "", scale: float = 1.0, prec: int = 0) -> str:
    f = f"{{:.{prec}f}}"
    return (
        f"{f.format(s['median'] * scale)}{unit} (min {f.format(s['min'] * scale)}, "
        f"max {f.format(s['max'] * scale)}, n={s['n']})"
    )


class BenchCluster:
    """A throwaway 3-node cluster under a temp dir; ``stop()`` always runs."""

    def __init__(self, heartbeat_timeout: float, interval: float = 0.2):
        self.root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-queue-"))
        self.cluster = Cluster(self.root)
        self.timeout = heartbeat_timeout
        base = free_base_port(2 * NODES)
        rc = mirrorctl(
            [
                "--data-dir",
                str(self.root),
                "--formatter",
                "json",
                "cluster",
                "start",
                "--nodes",
                str(NODES),
                "--base-port",
                str(base),
                "--amqp-base-port",
                str(base + NODES),
                "--heartbeat-interval",
                str(interval),
                "--heartbeat-timeout",
                str(heartbeat_timeout),
            ]
        )
        if rc != 0:
            self.stop()
            raise RuntimeError("cluster start failed")
        self.nodes = self.cluster.node_names()

    def port(self, node: str) -> int:
        return int(self.cluster.pid_info(node)["admin_port"])

    def registry_leader(self) -> str | None:
        for n in self.nodes:
            st = self.cluster.status(n)
            if st and st.registry.get("role") == "leader":
                return n
        return None

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every node; with ``keep_logs`` copy the nodes' logs out first
        (to ``<temp>/mirrorq-bench-logs-*``, printed) for a failed run."""
        try:
            self.cluster.stop_all()
        finally:
            if keep_logs:
                dst = Path(tempfile.mkdtemp(prefix="mirrorq-bench-logs-"))
                for f in self.root.glob("*/*"):
                    if f.name in ("node.log", "daemon.out", "thespian.log"):
                        (dst / f.parent.name).mkdir(exist_ok=True)
                        shutil.copy(f, dst / f.parent.name / f.name)
                print(f"node logs kept in {dst}", file=sys.stderr)
            shutil.rmtree(self.root, ignore_errors=True)


# ---- publish + consume rate ----------------------------------------------------------------
def publish_confirmed(cl: InternalClient, q: str, n: int, batch: int, window: int) -> float:
    """Publish n messages keeping at most ``window`` unconfirmed; seconds to the last confirm."""
    t0 = time.monotonic()
    sent = 0
    while sent < n:
        k = min(batch, n - sent)
        cl.publish(q, [BODY] * k)
        sent += k
        while cl.confirms(q)["unconfirmed"] > window:
            time.sleep(0.002)  # flow control: wait for confirms
    st = cl.wait_confirms(q, timeout=300, poll=0.002)
    dt = time.monotonic() - t0
    if st["confirmed"] != n or st["nacked"]:
        raise RuntimeError(f"publish {q}: {st}")
    return dt


def consume_all(cl: InternalClient, q: str, n: int) -> float:
    t0 = time.monotonic()
    cl.consume(q, prefetch=1000)
    got = cl.fetch_until(q, n, timeout=300, idle=20.0)
    dt = time.monotonic() - t0
    if len(got) != n:
        raise RuntimeError(f"consume {q}: {len(got)} of {n} delivered")
    return dt


def bench_rate(bc: BenchCluster, a) -> dict:
    out = {}
    # the unmirrored queue is declared with no nodes (no policy matches: the
    # master alone, on the declaring node): declare_queue(nodes=[one]) gives it
    # ha-mode nodes, and a queue with ha-mode alone in its view nacks every
    # publish (SLAVE_NOT_AVAILABLE, ha-confirm-mode sync)
    for label, nodes in (("mirrored x3", bc.nodes), ("unmirrored", ())):
        pub, con = [], []
        for r in range(a.rate_repeats):
            q = f"rate-{len(nodes) or 1}-{r}"
            with InternalClient(bc.port(bc.nodes[0])) as cl:
                cl.declare_queue(q, durable=True, nodes=nodes)
                cl.open(q)
                pub.append(a.messages / publish_confirmed(cl, q, a.messages, a.batch, a.window))
                con.append(a.messages / consume_all(cl, q, a.messages))
                cl.command(q, "delete", timeout=15)
            print(f"  {label} run {r + 1}: publish {pub[-1]:.0f} msg/s, consume {con[-1]:.0f} msg/s", flush=True)
        out[label] = {"publish": spread(pub), "consume": spread(con)}
    return out


def delete_queue(bc: BenchCluster, node: str, q: str) -> None:
    """Delete a used queue, so that later kills fail over only the queue they measure."""
    with InternalClient(bc.port(node)) as cl:
        cl.open(q)
        cl.command(q, "delete", timeout=15)


# ---- failover ------------------------------------------------------------------------------
def _publisher(port: int, q: str, ready, stop, counters, result) -> None:
    """Publish 100-message batches, at most 2000 unconfirmed, until ``stop``."""
    try:
        with InternalClient(port) as cl:
            cl.open(q)
            ready.set()
            while not stop.is_set():
                st = cl.confirms(q)
                counters[0], counters[1] = st["published"], st["confirmed"]
                if st["unconfirmed"] < 2000:
                    cl.publish(q, [BODY] * 100)
                else:
                    time.sleep(0.005)  # flow control: wait for confirms
            st = cl.wait_confirms(q, timeout=60)
            result.put(st)
    except Exception as e:  # reported by the parent
        ready.set()
        result.put({"error": repr(e)})


def node_down_at(bc: BenchCluster, victim: str, since: float) -> list[float]:
    out = []
    for n in bc.nodes:
        if n == victim:
            continue
        for rec in nodelog.read(str(bc.root / n)):
            if rec["event"] == "node_down" and rec.get("peer") == victim and rec["ts"] >= since:
                out.append(rec["ts"] - since)
                break
    return out


def promoted_at(bc: BenchCluster, q: str, since: float) -> float | None:
    for n in bc.nodes:
        for rec in nodelog.read(str(bc.root / n)):
            if rec["event"] == "promoted" and rec.get("queue") == q and rec["ts"] >= since:
                return rec["ts"] - since
    return None


def failover_round(bc: BenchCluster, r: int) -> dict:
    victim = bc.nodes[r % NODES]
    survivor = bc.nodes[(r + 1) % NODES]
    q = f"failover-{bc.timeout}-{r}"
    order = [victim] + [n for n in bc.nodes if n != victim]
    leader = bc.registry_leader()
    ctx = multiprocessing.get_context("spawn")
    ready, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    counters = ctx.Array("q", 2)
    proc = None
    with InternalClient(bc.port(survivor)) as marker:
        rec = marker.declare_queue(q, durable=True, nodes=order)
        assert parse_member_name(rec["pid"]).node == victim, rec
        marker.open(q)
        try:
            proc = ctx.Process(target=_publisher, args=(bc.port(survivor), q, ready, stop, counters, result))
            proc.start()
            ready.wait(30)
            deadline = time.monotonic() + 60
            while counters[1] < 2000:
                if time.monotonic() > deadline or not proc.is_alive():
                    raise RuntimeError(f"publisher made no progress: {list(counters)}")
                time.sleep(0.01)
            wall_kill = time.time()
            t_kill = time.monotonic()
            bc.cluster.kill_node(victim)
            t_killed = time.monotonic()
            marker.publish(q, [b"marker"])
            t_conf = None
            deadline = t_kill + 60
            while time.monotonic() < deadline:
                if marker.confirms(q)["confirmed"] >= 1:
                    t_conf = time.monotonic()
                    break
                time.sleep(0.005)  # polling interval of a condition with a deadline
            st_marker = marker.confirms(q)
        finally:
            stop.set()
            pub = result.get(timeout=90) if proc is not None else {}
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if t_conf is None:
        raise RuntimeError(f"round {r}: the marker was never confirmed: {st_marker}")
    if "error" in pub or pub["unconfirmed"] or pub["nacked"] or pub["confirmed"] != pub["published"]:
        raise RuntimeError(f"round {r}: publisher {pub}")
    det = node_down_at(bc, victim, wall_kill)
    prom = promoted_at(bc, q, wall_kill)
    bc.cluster.start_node(victim)
    bc.cluster.wait_all_up(bc.nodes, timeout=60)
    delete_queue(bc, survivor, q)
    return {
        "victim": victim,
        "registry_leader_killed": leader == victim,
        "failover": t_conf - t_kill,
        "kill_call": t_killed - t_kill,
        "detect": det,
        "promoted": prom,
        "published": pub["published"],
    }


def bench_failover(bc: BenchCluster, a) -> dict:
    rows = []
    for r in range(a.rounds):
        x = failover_round(bc, r)
        rows.append(x)
        det = "/".join(f"{d * 1000:.0f}" for d in x["detect"]) or "-"
        prom = f"{x['promoted'] * 1000:.0f}" if x["promoted"] is not None else "-"
        print(
            f"  hb-timeout {bc.timeout}s round {r + 1}: kill {x['victim']}"
            f"{' (registry leader)' if x['registry_leader_killed'] else ''}: failover {x['failover'] * 1000:.0f} ms "
            f"(node_down at {det} ms, promoted at {prom} ms), {x['published']} publishes, none lost",
            flush=True,
        )
    return {
        "heartbeat_timeout": bc.timeout,
        "failover_s": spread([x["failover"] for x in rows]),
        "detect_s": spread([d for x in rows for d in x["detect"]]) if any(x["detect"] for x in rows) else None,
        "rounds": rows,
    }


# ---- memory --------------------------------------------------------------------------------
def node_memory(bc: BenchCluster) -> dict:
    return {n: group_memory(int(bc.cluster.pid_info(n)["pgid"])) for n in bc.nodes}


def bench_memory(bc: BenchCluster, a) -> dict:
    time.sleep(a.settle)  # let the nodes settle before measuring
    before = node_memory(bc)
    with InternalClient(bc.port(bc.nodes[0])) as cl:
        for k in range(a.queues):
            cl.declare_queue(f"mem-{k}", durable=True, nodes=bc.nodes)
    time.sleep(a.settle)
    after = node_memory(bc)
    per = {}
    for n in bc.nodes:
        (p0, r0, s0), (p1, r1, s1) = before[n], after[n]
        per[n] = {
            "procs_before": p0,
            "procs_after": p1,
            "pss_before_kib": s0,
            "pss_after_kib": s1,
            "procs_per_replica": (p1 - p0) / a.queues,
            "pss_per_replica_kib": (s1 - s0) / a.queues,
            "rss_per_replica_kib": (r1 - r0) / a.queues,
        }
    return per


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--messages", type=int, default=20_000, help="messages per rate run")
    ap.add_argument("--batch", type=int, default=500, help="messages per publish call")
    ap.add_argument("--window", type=int, default=5000, help="max unconfirmed publishes in the rate runs")
    ap.add_argument("--rate-repeats", type=int, default=2, help="fresh queues per rate figure")
    ap.add_argument("--rounds", type=int, default=5, help="master kills per heartbeat timeout")
    ap.add_argument("--heartbeat-timeouts", default="1.5,0.6", help="comma-separated; one cluster each")
    ap.add_argument("--queues", type=int, default=20, help="K queues declared for the memory figure")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle before each memory sample")
    ap.add_argument("--parts", default="rate,failover,memory", help="any of rate,failover,memory")
    a = ap.parse_args()
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    if not parts <= {"rate", "failover", "memory"}:
        ap.error(f"--parts: unknown part(s) {sorted(parts - {'rate', 'failover', 'memory'})}")
    try:
        timeouts = [float(x) for x in a.heartbeat_timeouts.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--heartbeat-timeouts must be comma-separated numbers, got {a.heartbeat_timeouts!r}")
    for name in ("messages", "batch", "window", "rate_repeats", "queues"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    result: dict = {"cpus": os.cpu_count(), "messages": a.messages, "body_bytes": len(BODY)}
    print(f"mirrored queue bench: 3 nodes on loopback, {os.cpu_count()} CPUs, 1 KiB persistent messages", flush=True)
    for i, hb in enumerate(timeouts):
        if i > 0 and "failover" not in parts:
            break
        bc = BenchCluster(hb)
        try:
            # failover first, on a cluster with no other queue: a node's death
            # fails over every queue mastered there, all at once
            if "failover" in parts:
                print(f"failover: heartbeat interval 0.2 s, timeout {hb} s, {a.rounds} rounds", flush=True)
                result.setdefault("failover", []).append(bench_failover(bc, a))
            if i == 0 and "rate" in parts:
                print(f"rate: {a.messages} msgs, batch {a.batch}, window {a.window}", flush=True)
                result["rate"] = bench_rate(bc, a)
            if i == 0 and "memory" in parts:
                print(f"memory: {a.queues} queues mirrored on all 3 nodes", flush=True)
                result["memory"] = bench_memory(bc, a)
        except BaseException:
            bc.stop(keep_logs=True)
            raise
        else:
            bc.stop()

    print()
    print("=== results ===")
    if "rate" in result:
        print(f"{'queue':<12} {'publish msg/s (confirmed)':<40} {'consume msg/s':<40}")
        for label, r in result["rate"].items():
            print(f"{label:<12} {fmt(r['publish']):<40} {fmt(r['consume']):<40}")
    if "failover" in result:
        print(
            f"{'hb timeout':<11} {'failover ms (kill -> 1st confirm of a new publish)':<52} {'node_down detected ms':<40}"
        )
        for f in result["failover"]:
            det = fmt(f["detect_s"], scale=1000) if f["detect_s"] else "-"
            print(f"{f['heartbeat_timeout']:<11} {fmt(f['failover_s'], scale=1000):<52} {det:<40}")
        print("RabbitMQ (issue #5): 137 ms")
    if "memory" in result:
        print(
            f"{'node':<7} {'procs before/after':<20} {'PSS MiB before/after':<22} {'procs/replica':<14} {'PSS KiB/replica':<16} RSS KiB/replica"
        )
        for n, m in result["memory"].items():
            print(
                f"{n:<7} {m['procs_before']:>4} / {m['procs_after']:<13} {m['pss_before_kib'] / 1024:>7.1f} / {m['pss_after_kib'] / 1024:<12.1f} "
                f"{m['procs_per_replica']:<14.2f} {m['pss_per_replica_kib']:<16.0f} {m['rss_per_replica_kib']:.0f}"
            )
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
