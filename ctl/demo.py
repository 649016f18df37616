"""The README's demo: a local 3-node cluster, a node killed and detected, the
node restarted and rejoined.  Stops the cluster at the end unless --keep.

    python -m ctl.demo [--data-dir D] [--base-port P] [--amqp-base-port A] [--keep]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ctl.cluster import DEFAULT_AMQP_BASE_PORT, DEFAULT_BASE_PORT, Cluster, ClusterError
from ctl.mirrorctl import main as mirrorctl


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def run(data_dir: str, base_port: int, amqp_base_port: int, keep: bool) -> int:
    ctl = lambda *a: mirrorctl(["--data-dir", data_dir, *a])  # noqa: E731
    cluster = Cluster(__import__("pathlib").Path(data_dir).resolve())
    print("== 1. start a 3-node cluster on loopback")
    if ctl("cluster", "start", "--nodes", "3", "--base-port", str(base_port),
           "--amqp-base-port", str(amqp_base_port)) != 0:
        return 1
    try:
        print("\n== 2. kill -9 node1 (the first node started) and watch the others notice")
        t0 = time.monotonic()
        ctl("kill_node", "node1")
        seen = _wait(
            lambda: all((st := cluster.status(o)) and st.view["node1"]["state"] == "down" for o in ("node2", "node3")),
            10,
        )
        print(f"node1 reported down by node2 and node3 after {time.monotonic() - t0:.2f}s" if seen
              else "node1 was NOT reported down within 10s")
        ctl("cluster_status")
        print("\n== 3. start node1 again: it rejoins")
        ctl("start_node", "node1")
        ctl("cluster_status")
        return 0 if seen else 1
    finally:
        if keep:
            print(f"\ncluster left running; stop it with: mirrorctl --data-dir {data_dir} cluster stop")
        else:
            print("\n== 4. stop the cluster")
            ctl("cluster", "stop")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="demo")
    p.add_argument("--data-dir", default=os.environ.get("MIRRORQ_DATA_DIR", "mirrorq-data/demo"))
    p.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    p.add_argument("--amqp-base-port", type=int, default=DEFAULT_AMQP_BASE_PORT)
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    a = p.parse_args(argv)
    try:
        return run(a.data_dir, a.base_port, a.amqp_base_port, a.keep)
    except ClusterError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
