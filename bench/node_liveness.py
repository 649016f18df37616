"""Foundation figures: 3-node startup time, kill-detection time, idle node memory.

    .venv/bin/python bench/node_liveness.py [--rounds 10]

Starts a throwaway cluster under a temp dir on free loopback ports, and
always stops it.  Kill detection is measured from the moment of the SIGKILL
to the timestamp of the survivor's own ``node_down`` log record (the moment
it decided), for each of the two survivors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")

from ctl.mirrorctl import main as mirrorctl  # noqa: E402
from mirrorq.admin.cluster import Cluster  # noqa: E402
from mirrorq.node import daemon  # noqa: E402
from mirrorq.node import log as nodelog  # noqa: E402


def free_base(n: int) -> int:
    from mirrorq.admin.cluster import free_port_block

    return free_port_block(n)  # below the ephemeral range (32768)


def group_memory(pgid: int) -> tuple[int, int, int]:
    """(processes, RSS KiB, PSS KiB) of a live process group."""
    procs = rss = pss = 0
    for pid in daemon._group_members(pgid):
        if daemon._state(pid) == "Z":
            continue
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                vals = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split(":")[0] in ("Rss", "Pss")}
        except OSError:
            continue
        procs += 1
        rss += vals.get("Rss", 0)
        pss += vals.get("Pss", 0)
    return procs, rss, pss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mirrorq-bench-"))
    ctl = lambda *a: mirrorctl(["--data-dir", str(root), "--formatter", "json", *a])  # noqa: E731
    cluster = Cluster(root)
    base = free_base(6)
    try:
        starts = []
        for i in range(3):
            t0 = time.monotonic()
            if i == 0:
                rc = ctl(
                    "cluster", "start", "--nodes", "3", "--base-port", str(base), "--amqp-base-port", str(base + 3)
                )
            else:
                rc = ctl("cluster", "start")
            starts.append(time.monotonic() - t0)
            assert rc == 0
            if i < 2:
                ctl("cluster", "stop")
        time.sleep(5)  # let the idle node settle before measuring memory
        mem = [group_memory(int(cluster.pid_info(n)["pgid"])) for n in cluster.node_names()]
        detections = []
        names = cluster.node_names()
        for r in range(args.rounds):
            victim = names[r % 3]
            others = [n for n in names if n != victim]
            t_kill = time.time()
            cluster.kill_node(victim)
            deadline = time.monotonic() + 10
            got = {}
            while time.monotonic() < deadline and len(got) < 2:
                for o in others:
                    for rec in nodelog.read(str(root / o)):
                        if rec["event"] == "node_down" and rec["peer"] == victim and rec["ts"] >= t_kill:
                            got[o] = rec["ts"] - t_kill
                time.sleep(0.05)
            detections += list(got.values())
            ctl("start_node", victim)
        print("3-node cluster start (s), 3 runs:", ", ".join(f"{s:.2f}" for s in starts))
        print(
            f"kill detection over {args.rounds} kills x 2 survivors: median {statistics.median(detections):.2f}s, "
            f"min {min(detections):.2f}s, max {max(detections):.2f}s  (heartbeat 0.2s, timeout 1.5s)"
        )
        for n, (procs, rss, pss) in zip(names, mem):
            print(f"idle {n}: {procs} processes, RSS {rss / 1024:.1f} MiB, PSS {pss / 1024:.1f} MiB")
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
