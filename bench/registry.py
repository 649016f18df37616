"""Registry figures on a real 3-node cluster: write latency p50/p99 (one
writer, each write waits for commit + apply on the leader), and Raft leader
failover (kill -9 of the leader's node -> first committed write through a
survivor), median over --rounds.

    .venv/bin/python bench/registry.py [--writes 500] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")

from ctl.cluster import Cluster  # noqa: E402
from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.node.client import NodeClient  # noqa: E402
from mirrorq.node.messages import RegistryResult, RegistryTxn  # noqa: E402


def put(name):
    return RegistryTxn({"ops": [{"op": "put", "table": "vhost", "key": name, "record": {"name": name}}]})


def leader_of(cluster, names):
    for n in names:
        st = cluster.status(n)
        if st and st.registry.get("role") == "leader":
            return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    base = s.getsockname()[1] % 40000 + 20000
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
            print(f"writes via {label}: p50 {statistics.median(lat):.2f} ms, p99 {lat[int(len(lat) * 0.99) - 1]:.2f} ms, "
                  f"{a.writes / total:.0f} writes/s (one writer, sequential)")
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
        print(f"leader failover over {a.rounds} kills: median {statistics.median(failovers):.2f}s, "
              f"min {min(failovers):.2f}s, max {max(failovers):.2f}s (election timeout 0.5-1.0s)")
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
