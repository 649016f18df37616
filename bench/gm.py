"""GM ring figures on a real local cluster (loopback): broadcasts/s and round
latency (broadcast -> Confirmed at the origin) for rings of 1..5 members.

Each member is a GMMemberActor (its own OS process), placed round-robin on
the cluster's nodes; member 1 broadcasts ``--count`` payloads of
``--payload`` bytes keeping at most ``--window`` unconfirmed, handing
``--chunk`` at a time to its shell.  Throughput is count / (first broadcast
-> last confirm); every member's per-origin count and digest are checked
equal afterwards.  Round latency is measured twice: under that load
(p50/p99 of a 1-in-10 sample) and unloaded (one broadcast at a time,
``--ping`` rounds).

    .venv/bin/python bench/gm.py [--rings 1,2,3,4,5] [--count 100000] [--payload 1024]
                                 [--window 16000] [--chunk 400] [--nodes 3] [--profile DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from thespian.actors import ActorExitRequest  # noqa: E402

from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster  # noqa: E402
from mirrorq.admin.cluster import wait_until as wait  # noqa: E402
from mirrorq.gm.actor import ask_info, ask_ok, ask_report, spawn_member  # noqa: E402
from mirrorq.gm.messages import GMBroadcastMany, GMCreateGroup  # noqa: E402
from mirrorq.node.client import NodeClient  # noqa: E402


def free_base_port(n: int) -> int:
    from mirrorq.admin.cluster import free_port_block

    return free_port_block(n)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def run_ring(clients: dict, nodes: list[str], size: int, a) -> dict:
    asys = clients[nodes[0]].asys
    group = f"bench-{size}-{os.getpid()}-{time.monotonic_ns()}"
    addrs = [spawn_member(clients[nodes[i % len(nodes)]].asys, group, nodes[i % len(nodes)]) for i in range(size)]
    try:
        names = [ask_info(asys, x).name for x in addrs]
        ask_ok(asys, addrs[0], GMCreateGroup(tuple(names)))
        wait(lambda: all((i := ask_info(asys, x)).view and len(i.view[1]) == size for x in addrs), 20, "the view")
        origin = addrs[0]
        ask_ok(asys, origin, GMBroadcastMany(a.count, a.payload, a.window, a.chunk))
        rep = wait(lambda: (r := ask_report(asys, origin)).finished and r, 300, "all confirms", step=0.2)
        tput = a.count / (rep.finished - rep.started)
        loaded = rep.latencies_ms
        reps = [ask_report(asys, x) for x in addrs]
        want = reps[0].delivered[names[0]]
        for r in reps:
            assert r.delivered.get(names[0]) == want, f"{r.name} delivered {r.delivered} != {want}"
            assert not r.errors, r.errors
        # unloaded round latency: one broadcast in flight at a time
        before = rep.confirmed
        ask_ok(asys, origin, GMBroadcastMany(a.ping, a.payload, 1, 1, sample_every=1))
        rep2 = wait(
            lambda: (r := ask_report(asys, origin)).confirmed >= before + a.ping and r, 120, "ping rounds", step=0.1
        )
        ping = rep2.latencies_ms
        return {
            "size": size,
            "tput": tput,
            "loaded_p50": pct(loaded, 0.5),
            "loaded_p99": pct(loaded, 0.99),
            "ping_p50": pct(ping, 0.5),
            "ping_p99": pct(ping, 0.99),
            "frames": rep.stats.get("frames_out", 0),
            "cpu_s": [round(r.stats.get("cpu_s", 0.0), 2) for r in reps],
            "retransmits": sum(r.stats.get("retransmits", 0) for r in reps),
            "gaps": sum(r.stats.get("gaps", 0) for r in reps),
        }
    finally:
        for x in addrs:
            asys.tell(x, ActorExitRequest())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rings", default="1,2,3,4,5")
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--payload", type=int, default=1024)
    ap.add_argument("--window", type=int, default=16_000)
    ap.add_argument("--chunk", type=int, default=400)
    ap.add_argument("--ping", type=int, default=200, help="unloaded rounds (ping-pong) per ring")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--profile", default="", help="dir: cProfile every member process into it")
    a = ap.parse_args()
    rings = [int(x) for x in a.rings.split(",")]
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        os.environ["MIRRORQ_GM_PROFILE"] = os.path.join(os.path.abspath(a.profile), "gm.prof")
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-gm-"))
    cluster = Cluster(root)
    base = free_base_port(2 * a.nodes)
    clients: dict = {}
    try:
        rc = mirrorctl(
            [
                "--data-dir",
                str(root),
                "--formatter",
                "json",
                "cluster",
                "start",
                "--nodes",
                str(a.nodes),
                "--base-port",
                str(base),
                "--amqp-base-port",
                str(base + a.nodes),
            ]
        )
        assert rc == 0, "cluster start failed"
        nodes = cluster.node_names()
        clients = {n: NodeClient(int(cluster.pid_info(n)["admin_port"])) for n in nodes}
        print(
            f"GM ring bench: {a.count} broadcasts of {a.payload} B, window {a.window}, chunk {a.chunk}, "
            f"{a.nodes} nodes, {os.cpu_count()} CPUs"
        )
        print(
            f"{'members':>7} {'bcast/s':>9} {'x size':>8} {'loaded p50/p99 ms':>18} {'unloaded p50/p99 ms':>20} "
            f"{'frames':>7} {'retx':>4} {'gaps':>4}  cpu s per member"
        )
        results = []
        for size in rings:
            r = run_ring(clients, nodes, size, a)
            results.append(r)
            print(
                f"{size:>7} {r['tput']:>9.0f} {r['tput'] * size:>8.0f} "
                f"{r['loaded_p50']:>8.1f}/{r['loaded_p99']:<9.1f} {r['ping_p50']:>9.2f}/{r['ping_p99']:<10.2f} "
                f"{r['frames']:>7} {r['retransmits']:>4} {r['gaps']:>4}  {r['cpu_s']}",
                flush=True,
            )
    finally:
        for c in clients.values():
            c.close()
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
