"""mirrorctl: rabbitmqctl for mirrorq, plus a local-cluster launcher.

    mirrorctl cluster start --nodes 3 [--base-port 19500] [--amqp-base-port 5672] [--data-dir D]
    mirrorctl cluster stop | cluster status
    mirrorctl cluster_status [-n NODE]
    mirrorctl stop_node NAME | kill_node NAME | start_node NAME
    mirrorctl add_node [NAME] [--admin-port P] [--amqp-port P]
    mirrorctl forget_cluster_node NAME [-n NODE]

Every command finds the cluster through its data dir: ``--data-dir``, else the
environment variable ``MIRRORQ_DATA_DIR``, else ``~/.mirrorq``.  ``-n NODE``
picks the node to talk to; ``--formatter json`` prints JSON wherever a table
is printed.  Errors are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ctl.cluster import (
    DEFAULT_AMQP_BASE_PORT,
    DEFAULT_BASE_PORT,
    Cluster,
    ClusterError,
    resolve_data_dir,
)

START_WAIT = 30.0


# ---- output -----------------------------------------------------------------
def emit(args, rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> None:
    if args.formatter == "json":
        print(json.dumps(rows, indent=None, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    Console(width=max(100, len(columns) * 14)).print(table)


def node_rows(cluster: Cluster, names: list[str]) -> list[dict]:
    rows = []
    for n in names:
        cfg = cluster.config(n)
        info = cluster.pid_info(n) or {}
        st = cluster.status(n) if cluster.is_running(n) else None
        if st is not None:
            state = "running"
        elif cluster.is_running(n):
            state = "unresponsive"
        else:
            state = "stopped"
        rows.append(
            {
                "name": n,
                "admin_port": cfg.admin_port,
                "amqp_port": cfg.amqp_port,
                "pid": info.get("pgid") if state != "stopped" else None,
                "state": state,
                "sees_up": sorted(m for m, v in st.view.items() if v["state"] == "up") if st else [],
            }
        )
    return rows


def _node_table(args, cluster: Cluster, names: list[str]) -> None:
    rows = node_rows(cluster, names)
    if args.formatter == "json":
        emit(args, rows, [])
    else:
        for r in rows:
            r["sees_up"] = ", ".join(r["sees_up"])
        emit(args, rows, ["name", "state", "pid", "admin_port", "amqp_port", "sees_up"], title="mirrorq cluster")


# ---- commands -------------------------------------------------------------------
def cmd_cluster_start(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    if cluster.exists():
        names = cluster.node_names()
        if args.nodes is not None and args.nodes != len(names):
            raise ClusterError(
                f"{cluster.data_dir} already holds a {len(names)}-node cluster; "
                f"use --nodes {len(names)} or another --data-dir"
            )
        running = [n for n in names if cluster.is_running(n)]
        if running:
            raise ClusterError(f"cluster in {cluster.data_dir} is already running (nodes: {', '.join(running)})")
    else:
        names = cluster.create(
            args.nodes or 3,
            args.base_port,
            args.amqp_base_port,
            args.heartbeat_interval,
            args.heartbeat_timeout,
            args.registry_snapshot_every,
        )
    t0 = time.monotonic()
    started = []
    try:
        for n in names:
            cluster.start_node(n)
            started.append(n)
        cluster.wait_all_up(names, START_WAIT)
    except BaseException:
        for n in started:
            cluster.kill_node(n)
            cluster._forget_pid(n)
        raise
    elapsed = time.monotonic() - t0
    if args.formatter != "json":
        print(f"started {len(names)} nodes in {elapsed:.2f}s (data dir {cluster.data_dir})")
    _node_table(args, cluster, names)
    return 0


def cmd_cluster_stop(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    stopped = [n for n in cluster.node_names() if cluster.stop_node(n)]
    left = [n for n in cluster.node_names() if cluster.is_running(n)]
    if left:
        raise ClusterError(f"nodes still running after stop: {', '.join(left)}")
    if args.formatter == "json":
        print(json.dumps({"stopped": stopped}))
    else:
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def cmd_cluster_status(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    names = cluster.node_names()
    if args.node:
        cluster.config_path(args.node)
        names = [args.node]
    _node_table(args, cluster, names)
    return 0


def cmd_cluster_view(args) -> int:
    """cluster_status: every node as seen by every node (or by -n NODE)."""
    cluster = Cluster(resolve_data_dir(args.data_dir))
    names = cluster.node_names()
    observers = names
    if args.node:
        cluster.config_path(args.node)
        observers = [args.node]
    rows = []
    for obs in observers:
        st = cluster.status(obs)
        row: dict[str, Any] = {"observer": obs, "reachable": st is not None}
        for n in names:
            if st is None:
                row[n] = "?"
            else:
                v = st.view.get(n)
                row[n] = v["state"] if v else "unknown"
        rows.append(row)
    if args.node and rows and not rows[0]["reachable"]:
        raise ClusterError(f"node {args.node} is not running")
    emit(args, rows, ["observer", *names], title="cluster_status: rows see columns")
    return 0


def cmd_start_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    cluster.start_node(args.name)
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    cluster.wait_all_up(running, START_WAIT)
    print(f"started {args.name}")
    return 0


def cmd_stop_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    if not cluster.stop_node(args.name):
        raise ClusterError(f"node {args.name} is not running")
    print(f"stopped {args.name}")
    return 0


def cmd_kill_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    if not cluster.kill_node(args.name):
        raise ClusterError(f"node {args.name} is not running")
    print(f"killed {args.name}")
    return 0


def cmd_add_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    name = cluster.add_node(args.name, args.admin_port, args.amqp_port)
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    cluster.wait_all_up(running, START_WAIT)
    print(f"added {name} (it joins the registry through its Raft leader)")
    return 0


def cmd_forget_cluster_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    via = cluster.forget_node(args.name, args.node)
    print(f"forgot {args.name} (through {via})")
    return 0


# ---- parser ---------------------------------------------------------------------
def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data-dir", default=argparse.SUPPRESS, help="cluster data dir (else $MIRRORQ_DATA_DIR, else ~/.mirrorq)")
    p.add_argument("-n", "--node", default=argparse.SUPPRESS, help="node to talk to")
    p.add_argument("--formatter", choices=["table", "json"], default=argparse.SUPPRESS)
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(prog="mirrorctl", parents=[common], description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cl = sub.add_parser("cluster", parents=[common], help="local cluster launcher")
    clsub = cl.add_subparsers(dest="action", required=True)
    st = clsub.add_parser("start", parents=[common], help="start N nodes on loopback")
    st.add_argument("--nodes", type=int, default=None)
    st.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="first Thespian admin port")
    st.add_argument("--amqp-base-port", type=int, default=DEFAULT_AMQP_BASE_PORT, help="first AMQP port")
    st.add_argument("--heartbeat-interval", type=float, default=0.2)
    st.add_argument("--heartbeat-timeout", type=float, default=1.5)
    st.add_argument("--registry-snapshot-every", type=int, default=1000)
    st.set_defaults(func=cmd_cluster_start)
    clsub.add_parser("stop", parents=[common], help="stop every node").set_defaults(func=cmd_cluster_stop)
    clsub.add_parser("status", parents=[common], help="one row per node").set_defaults(func=cmd_cluster_status)

    sub.add_parser("cluster_status", parents=[common], help="every node as seen by every node").set_defaults(
        func=cmd_cluster_view
    )
    for name, func, help_ in (
        ("start_node", cmd_start_node, "start a stopped node (it rejoins)"),
        ("stop_node", cmd_stop_node, "graceful stop of one node"),
        ("kill_node", cmd_kill_node, "SIGKILL one node's whole process group"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_)
        p.add_argument("name")
        p.set_defaults(func=func)
    p = sub.add_parser("add_node", parents=[common], help="add a node to the running cluster (it joins the registry)")
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--admin-port", type=int, default=None)
    p.add_argument("--amqp-port", type=int, default=None)
    p.set_defaults(func=cmd_add_node)
    p = sub.add_parser("forget_cluster_node", parents=[common],
                       help="remove a stopped node from the registry's Raft configuration")
    p.add_argument("name")
    p.set_defaults(func=cmd_forget_cluster_node)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("THESPIAN_BASE_IPADDR", "127.0.0.1")
    args = build_parser().parse_args(argv)
    for attr, default in (("data_dir", None), ("node", None), ("formatter", "table")):
        if not hasattr(args, attr):
            setattr(args, attr, default)
    try:
        return args.func(args)
    except ClusterError as e:
        print(f"mirrorctl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
