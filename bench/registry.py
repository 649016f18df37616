"""Registry figures on a real 3-node cluster: write latency p50/p99 (one
writer, each write waits for commit + apply on the leader), throughput with
many concurrent writers, and Raft leader failover (kill -9 of the leader's
node -> first committed write through a survivor), median over --rounds.

    .venv/bin/python bench/registry.py [--writes 500] [--writers 1,8,32]
                                       [--conc-writes 2000] [--rounds 10]

Concurrent writers: W outstanding RegistryTxn at all times, spread over
min(W, 4) client processes (each its own Thespian connection, keeping W/4
requests in flight and sending a new one per answer), aimed at the leader and
at a follower (forwarded).  writes/s = answered writes / wall time from the
first send to the last answer; mean latency follows by Little's law (W / rate).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")

from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster  # noqa: E402
from mirrorq.node.client import NodeClient  # noqa: E402
from mirrorq.node.messages import RegistryResult, RegistryTxn  # noqa: E402


def put(name):
    return RegistryTxn({"ops": [{"op": "put", "table": "vhost", "key": name, "record": {"name": name}}]})


def _writer(port, window, count, label, barrier, results):
    """One client process: keep ``window`` writes in flight until ``count``
    are answered."""
    with NodeClient(port) as c:
        agent = c.agent
        barrier.wait()
        t0 = time.monotonic()
        sent = done = failed = 0
        while sent < min(window, count):
            c.asys.tell(agent, put(f"{label}-{sent}"))
            sent += 1
        while done < count:
            r = c.asys.listen(10)
            if r is None:
                break
            if not isinstance(r, RegistryResult):
                continue
            done += 1
            failed += not r.ok
            if sent < count:
                c.asys.tell(agent, put(f"{label}-{sent}"))
                sent += 1
        results.put((t0, time.monotonic(), done, failed))


def concurrent_writes(port, writers, total, label):
    """-> (writes/s, failed) with ``writers`` requests in flight."""
    procs_n = min(writers, 4)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs_n)
    results = ctx.Queue()
    procs = []
    for k in range(procs_n):
        window = writers // procs_n + (1 if k < writers % procs_n else 0)
        args = (port, window, total // procs_n, f"{label}-{k}", barrier, results)
        procs.append(ctx.Process(target=_writer, args=args))
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    t0 = min(g[0] for g in got)
    t1 = max(g[1] for g in got)
    done = sum(g[2] for g in got)
    return done / (t1 - t0), sum(g[3] for g in got), total // procs_n * procs_n - done


def nodes_cpu(root: Path) -> float:
    """CPU seconds used so far by every process of the cluster (their command
    lines name the data dir): on a shared machine, CPU per write is the
    steadier figure."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                if str(root).encode() not in f.read():
                    continue
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def leader_of(cluster, names):
    for n in names:
        st = cluster.status(n)
        if st and st.registry.get("role") == "leader":
            return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--writers", default="1,8,32", help="comma-separated in-flight writer counts")
    ap.add_argument("--conc-writes", type=int, default=2000, help="writes per concurrency level")
    ap.add_argument("--rounds", type=int, default=10, help="leader kills (0: skip the failover figure)")
    a = ap.parse_args()
    try:
        levels = [int(w) for w in a.writers.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--writers must be comma-separated integers, got {a.writers!r}")
    if any(w < 1 for w in levels):
        ap.error(f"--writers must all be >= 1, got {a.writers!r}")
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    base = s.getsockname()[1] % 22000 + 10000  # below the ephemeral range (32768)
    s.close()
    cluster = Cluster(root)
    ctl = lambda *x: mirrorctl(["--data-dir", str(root), "--formatter", "json", *x])  # noqa: E731
    try:
        assert ctl("cluster", "start", "--nodes", "3", "--base-port", str(base), "--amqp-base-port", str(base + 3)) == 0
        names = cluster.node_names()
        while leader_of(cluster, names) is None:
            time.sleep(0.05)
        lead = leader_of(cluster, names)
        follower = next(n for n in names if n != lead)
        for target, label in ((lead, "leader"), (follower, "follower (forwarded)")):
            with NodeClient(int(cluster.pid_info(target)["admin_port"])) as c:
                lat = []
                t_all = time.monotonic()
                for i in range(a.writes):
                    t0 = time.monotonic()
                    r = c.ask(put(f"{label[:3]}-{i}"), 5)
                    assert isinstance(r, RegistryResult) and r.ok, r
                    lat.append((time.monotonic() - t0) * 1000)
                total = time.monotonic() - t_all
            lat.sort()
            print(
                f"writes via {label}: p50 {statistics.median(lat):.2f} ms, p99 {lat[int(len(lat) * 0.99) - 1]:.2f} ms, "
                f"{a.writes / total:.0f} writes/s (one writer, sequential)"
            )
        for target, label in ((lead, "leader"), (follower, "follower")):
            port = int(cluster.pid_info(target)["admin_port"])
            for w in levels:
                cpu0 = nodes_cpu(root)
                rate, failed, missing = concurrent_writes(port, w, a.conc_writes, f"c{w}{label[0]}")
                cpu = (nodes_cpu(root) - cpu0) / max(1, a.conc_writes - missing) * 1000
                print(
                    f"{w:3d} writers in flight via {label}: {rate:7.0f} writes/s, "
                    f"mean latency {w / rate * 1000:.1f} ms (Little), node CPU {cpu:.2f} ms/write "
                    f"(3 nodes), failed {failed}, unanswered {missing}"
                )
        failovers = []
        for r in range(a.rounds):
            lead = None
            while lead is None:
                lead = leader_of(cluster, names)
            survivors = [n for n in names if n != lead]
            t_kill = time.monotonic()
            cluster.kill_node(lead)
            done = None
            k = 0
            while done is None and time.monotonic() - t_kill < 15:
                k += 1
                with NodeClient(int(cluster.pid_info(survivors[k % 2])["admin_port"])) as c:
                    res = c.ask(put(f"fo-{r}-{k}"), 3)
                if isinstance(res, RegistryResult) and res.ok:
                    done = time.monotonic() - t_kill
            failovers.append(done if done is not None else float("inf"))
            ctl("start_node", lead)
        if failovers:
            print(
                f"leader failover over {a.rounds} kills: median {statistics.median(failovers):.2f}s, "
                f"min {min(failovers):.2f}s, max {max(failovers):.2f}s (election timeout 0.5-1.0s)"
            )
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
