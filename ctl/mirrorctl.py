"""mirrorctl: rabbitmqctl for mirrorq, plus a local-cluster launcher.

    mirrorctl cluster start --nodes 3 [--base-port 19500] [--amqp-base-port 5672] [--amqp-shell watch|asyncio] [--data-dir D]
    mirrorctl cluster stop | cluster status
    mirrorctl cluster_status [-n NODE]
    mirrorctl stop_node NAME | kill_node NAME | start_node NAME
    mirrorctl add_node [NAME] [--admin-port P] [--amqp-port P]
    mirrorctl forget_cluster_node NAME [-n NODE]
    mirrorctl set_policy [-p VHOST] [--priority N] [--apply-to queues|exchanges|all] NAME PATTERN DEFINITION
    mirrorctl clear_policy [-p VHOST] NAME
    mirrorctl list_policies [-p VHOST]
    mirrorctl list_queues [-p VHOST] [INFO_ITEM ...]
    mirrorctl add_user NAME PASSWORD | delete_user NAME | add_vhost NAME
    mirrorctl set_permissions [-p VHOST] USER CONF WRITE READ
    mirrorctl sync_queue [-p VHOST] NAME | cancel_sync_queue [-p VHOST] NAME
    mirrorctl ring [-p VHOST] [--watch [--interval S] [--count N]]   # live view of every queue's ring

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
from mirrorq.node.config import AMQP_SHELLS
from mirrorq.policy.records import Policy, PolicyValidationError
from mirrorq.policy.store import (
    clear_policy_txn,
    definition_json,
    parse_definition,
    policies_from_rows,
    policy_listing,
    set_policy_txn,
)

START_WAIT = 30.0
QUEUE_OP_TIMEOUT = 5.0


# ---- output -----------------------------------------------------------------
def emit(args, rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> None:
    if args.formatter == "json":
        print(json.dumps(rows, indent=None, default=str))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=False)
    for c in columns:
        table.add_column(c)
    for r in rows:  # Text: cells are data, never rich markup ("[node2, node3]")
        table.add_row(*(Text("" if r.get(c) is None else str(r.get(c))) for c in columns))
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
            amqp_shell=args.amqp_shell,
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
    cluster.wait_all_up(running, START_WAIT, managers=False)
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
    cluster.wait_all_up(running, START_WAIT, managers=False)
    print(f"added {name} (it joins the registry through its Raft leader)")
    return 0


def cmd_forget_cluster_node(args) -> int:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    via = cluster.forget_node(args.name, args.node)
    print(f"forgot {args.name} (through {via})")
    return 0


# ---- policies and queues: through one node's agent and queue manager -----------------
class NodeSession:
    """A short-lived connection to one running node: its agent (registry
    reads and transactions, membership view) and its queue manager (commands
    to queue masters)."""

    def __init__(self, cluster: Cluster, node: str):
        from mirrorq.node.client import NodeClient

        info = cluster.pid_info(node) or {}
        self.node = node
        self.client = NodeClient(int(info["admin_port"]))
        self._manager = None

    def txn(self, txn: dict, timeout: float = 10.0):
        from mirrorq.node.messages import RegistryResult, RegistryTxn

        res = self.client.ask(RegistryTxn(txn), timeout)
        if not isinstance(res, RegistryResult):
            raise ClusterError(f"node {self.node} did not answer a registry transaction within {timeout:g}s")
        return res

    def rows(self, table: str, timeout: float = 5.0) -> list[dict]:
        from mirrorq.node.messages import RegistryGet, RegistryRows

        # linearizable: a list right after a set shows it (read through the Raft leader);
        # a leader change meanwhile is answered "retry": do, until the timeout
        deadline = time.monotonic() + timeout
        while True:
            res = self.client.ask(RegistryGet(table, linearizable=True), max(0.5, deadline - time.monotonic()))
            if not isinstance(res, RegistryRows):
                raise ClusterError(f"node {self.node} did not answer a registry read within {timeout:g}s")
            if res.ok:
                return res.rows
            if "retry" not in res.error or time.monotonic() > deadline:
                raise ClusterError(f"reading table {table} on node {self.node} failed: {res.error}")
            time.sleep(0.05)  # a new leader is being elected

    def nodes_up(self) -> set[str]:
        st = self.client.status()
        return {n for n, v in st.view.items() if v.get("state") == "up"}

    def queue_ops(self, command: str, queues: list[tuple[str, str]], args: dict | None = None,
                  timeout: float = QUEUE_OP_TIMEOUT) -> list[dict]:
        from mirrorq.queue_process.manager import MANAGER_GLOBAL_NAME, QueueOps, QueueOpsResult

        if self._manager is None:
            self._manager = self.client.asys.createActor(
                "mirrorq.queue_process.manager.QueueManager", globalName=MANAGER_GLOBAL_NAME)
        res = self.client.asys.ask(self._manager, QueueOps(command, tuple(queues), dict(args or {}), timeout),
                                   timeout + 3.0)
        if not isinstance(res, QueueOpsResult):
            raise ClusterError(f"the queue manager on node {self.node} did not answer {command!r} within {timeout + 3:g}s")
        return res.results

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "NodeSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(args) -> NodeSession:
    """A session with ``-n NODE``, else with the first running node of the layout."""
    from mirrorq.node.client import NodeUnreachable

    cluster = Cluster(resolve_data_dir(args.data_dir))
    names = cluster.node_names()
    if args.node:
        cluster.config_path(args.node)
        candidates = [args.node]
    else:
        candidates = names
    for n in candidates:
        if not cluster.is_running(n):
            continue
        try:
            return NodeSession(cluster, n)
        except NodeUnreachable:
            continue
    if args.node:
        raise ClusterError(f"node {args.node} is not running")
    raise ClusterError(f"no node of the cluster in {cluster.data_dir} is running")


def _policy_error(e: PolicyValidationError) -> ClusterError:
    return ClusterError(f"Validation failed: {e}")


def cmd_set_policy(args) -> int:
    try:
        policy = Policy(vhost=args.vhost, name=args.name, pattern=args.pattern,
                        definition=parse_definition(args.definition), priority=args.priority,
                        apply_to=args.apply_to)
    except PolicyValidationError as e:
        raise _policy_error(e) from None
    if args.formatter != "json":
        print(f'Setting policy "{policy.name}" for pattern "{policy.pattern}" to '
              f'"{definition_json(policy.definition.to_dict())}" with priority "{policy.priority}" '
              f'for vhost "{policy.vhost}" ...')
    with connect(args) as s:
        res = s.txn(set_policy_txn(policy))
    if not res.ok:
        raise ClusterError(f"set_policy {policy.name}: {res.error}")
    if args.formatter == "json":
        print(json.dumps(policy.to_dict()))
    return 0


def cmd_clear_policy(args) -> int:
    try:
        txn = clear_policy_txn(args.vhost, args.name)
    except PolicyValidationError as e:
        raise _policy_error(e) from None
    if args.formatter != "json":
        print(f'Clearing policy "{args.name}" on vhost "{args.vhost}" ...')
    with connect(args) as s:
        res = s.txn(txn)
    if not res.ok:
        if "precondition failed" in res.error:
            raise ClusterError(f"no policy '{args.name}' in vhost '{args.vhost}' (Parameter does not exist)")
        raise ClusterError(f"clear_policy {args.name}: {res.error}")
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "cleared": True}))
    return 0


def _load_policies(s: NodeSession) -> list[Policy]:
    policies, errors = policies_from_rows(s.rows("policy"))
    for e in errors:
        print(f"mirrorctl: warning: {e}", file=sys.stderr)
    return policies


POLICY_COLUMNS = ["vhost", "name", "pattern", "apply-to", "definition", "priority"]


def cmd_list_policies(args) -> int:
    with connect(args) as s:
        policies = _load_policies(s)
    rows = policy_listing(policies, args.vhost)
    if args.formatter == "json":
        emit(args, rows, POLICY_COLUMNS)
        return 0
    print(f'Listing policies for vhost "{args.vhost}" ...')
    emit(args, [dict(r, definition=definition_json(r["definition"])) for r in rows], POLICY_COLUMNS)
    return 0


#: list_queues info items (rabbitmqctl's names), and the default ones
QUEUE_ITEMS = ("name", "pid", "slave_pids", "synchronised_slave_pids", "messages", "messages_ready",
               "messages_unacknowledged", "consumers", "policy", "effective_policy_definition", "state")
DEFAULT_QUEUE_ITEMS = ("name", "messages")
LIVE_ITEMS = frozenset({"messages", "messages_ready", "messages_unacknowledged", "consumers", "state"})
_SYNCED_WORDS = frozenset({"synchronised", "synchronized", "synced", "in_sync", "in-sync"})


def _node(member: Any) -> str | None:
    from mirrorq.policy.converge import node_of

    try:
        return node_of(member)
    except ValueError:
        return None


def _sync_progress(state: Any) -> int | None:
    """Messages a mirror's sync transferred so far, or None if it is not syncing.

    The master's info reports each mirror as "synchronised",
    "unsynchronised" or "syncing N" (N records sent so far); a dict with
    "state" and a count ("transferred", "sent" or "records") is taken too."""
    if isinstance(state, str):
        word, _, count = state.partition(" ")
        if word != "syncing":
            return None
        return int(count) if count.strip().isdigit() else 0
    if isinstance(state, dict):
        word = state.get("state")
        if word not in ("syncing", None) or (word is None and state.get("synchronised")):
            return None
        for k in ("transferred", "sent", "records"):
            if isinstance(state.get(k), int):
                return state[k]
        return 0 if word == "syncing" else None
    return None


def queue_state(record: dict, info: dict | None, nodes_up: set[str]) -> str:
    """running / syncing N / down (N: messages transferred so far by the
    running syncs, RabbitMQ's {syncing, N})."""
    master = _node(record.get("pid"))
    if master is None or master not in nodes_up or info is None or not info.get("ok"):
        return "down"
    value = info.get("value") or {}
    progress = [p for p in (_sync_progress(st) for st in (value.get("sync") or {}).values()) if p is not None]
    if progress:
        return f"syncing {sum(progress)}"
    return "running"


def queue_rows(records: list[dict], policies: list[Policy], infos: dict, nodes_up: set[str],
               items: list[str], alerts: list[dict] | None = None) -> list[dict]:
    """One dict per queue with the asked info items (pure: tests call it).
    ``alerts``: queue_alert rows (a replica's corrupt store, see
    mirrorq.queue_process.corruption), shown after the queue's ``state``."""
    from mirrorq.queue_process.corruption import describe

    by_name = {(p.vhost, p.name): p for p in policies}
    alerts_of: dict = {}
    for a in alerts or ():
        alerts_of.setdefault((a["vhost"], a["name"]), []).append(describe(a))
    out = []
    for r in records:
        key = (r["vhost"], r["name"])
        info = infos.get(key)
        live = (info or {}).get("value") if (info or {}).get("ok") else None
        applied = by_name.get((r["vhost"], r.get("policy"))) if r.get("policy") else None
        row: dict[str, Any] = {}
        for item in items:
            if item == "name":
                row[item] = r["name"]
            elif item == "pid":
                row[item] = _node(r.get("pid"))
            elif item == "slave_pids":
                row[item] = [_node(m) for m in r.get("slave_pids") or ()]
            elif item == "synchronised_slave_pids":
                row[item] = [_node(m) for m in r.get("sync_slave_pids") or ()]
            elif item in ("messages", "messages_ready", "messages_unacknowledged", "consumers"):
                row[item] = None if live is None else live.get(item)
            elif item == "policy":
                row[item] = r.get("policy")
            elif item == "effective_policy_definition":
                row[item] = applied.definition.to_dict() if applied is not None else {}
            elif item == "state":
                row[item] = "; ".join([queue_state(r, info, nodes_up), *alerts_of.get(key, [])])
        out.append(row)
    return out


def live_infos(s: "NodeSession", records: list[dict], up: set[str], timeout: float) -> dict:
    """``info`` of every queue whose master's node is up: (vhost, name) -> result."""
    ask = [(r["vhost"], r["name"]) for r in records if _node(r.get("pid")) in up]
    return {(res["vhost"], res["name"]): res for res in s.queue_ops("info", ask, timeout=timeout)} if ask else {}


def _cell(value: Any) -> Any:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return definition_json(value) if value else ""
    return value


def cmd_list_queues(args) -> int:
    items = list(args.items) or list(DEFAULT_QUEUE_ITEMS)
    bad = [i for i in items if i not in QUEUE_ITEMS]
    if bad:
        raise ClusterError(f"Info key(s) {', '.join(bad)} are not supported; "
                           f"known: {', '.join(QUEUE_ITEMS)}")
    with connect(args) as s:
        records = sorted((r for r in s.rows("amqqueue") if r["vhost"] == args.vhost), key=lambda r: r["name"])
        policies = _load_policies(s)
        up = s.nodes_up()
        infos = live_infos(s, records, up, args.timeout) if LIVE_ITEMS & set(items) else {}
        alerts = [a for a in s.rows("queue_alert") if a["vhost"] == args.vhost] if "state" in items else []
    rows = queue_rows(records, policies, infos, up, items, alerts)
    if args.formatter == "json":
        emit(args, rows, items)
        return 0
    print(f"Listing queues for vhost {args.vhost} ...")
    emit(args, [{k: _cell(v) for k, v in r.items()} for r in rows], items)
    return 0


def _queue_command(args, command: str, banner: str) -> int:
    if args.formatter != "json":
        print(banner)
    with connect(args) as s:
        (res,) = s.queue_ops(command, [(args.vhost, args.name)], timeout=args.timeout)
    if not res["ok"]:
        raise ClusterError(f"{command} of queue '{args.name}' in vhost '{args.vhost}' failed: {res['error']}")
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "command": command, "result": res["value"]},
                         default=str))
    elif res["value"] not in (None, True, {}):
        print(res["value"] if isinstance(res["value"], str) else json.dumps(res["value"], default=str))
    return 0


def cmd_sync_queue(args) -> int:
    return _queue_command(args, "sync", f"Synchronising queue '{args.name}' in vhost '{args.vhost}' ...")


def cmd_cancel_sync_queue(args) -> int:
    return _queue_command(args, "cancel_sync",
                          f"Stopping synchronising queue '{args.name}' in vhost '{args.vhost}' ...")


# ---- parser ---------------------------------------------------------------------
# ---- users, vhosts, permissions (rabbitmqctl's forms) ---------------------------------
def _txn_or_error(args, txn: dict, what: str, when_refused: str) -> None:
    """Run a transaction; a failed precondition becomes ``when_refused``."""
    with connect(args) as s:
        res = s.txn(txn)
    if not res.ok:
        raise ClusterError(f"{what}: {when_refused if 'precondition failed' in res.error else res.error}")


def cmd_add_user(args) -> int:
    from mirrorq.amqp.topology import hash_password

    if not args.username or not args.password:
        raise ClusterError("add_user: a user name and a non-empty password are needed")
    print(f'Adding user "{args.username}" ...')
    row = {"name": args.username, "password_hash": hash_password(args.password), "tags": list(args.tags or [])}
    _txn_or_error(args, {"checks": [{"table": "user", "key": args.username, "absent": True}],
                         "ops": [{"op": "put", "table": "user", "key": args.username, "record": row}]},
                  "add_user", f"user '{args.username}' already exists")
    return 0


def cmd_delete_user(args) -> int:
    print(f'Deleting user "{args.username}" ...')
    with connect(args) as s:
        perms = [p for p in s.rows("permission") if p["user"] == args.username]
        res = s.txn({"checks": [{"table": "user", "key": args.username, "exists": True}],
                     "ops": [{"op": "delete", "table": "user", "key": args.username}]
                     + [{"op": "delete", "table": "permission", "key": [p["user"], p["vhost"]]} for p in perms]})
    if not res.ok:
        raise ClusterError(f"delete_user: no user '{args.username}'" if "precondition failed" in res.error
                           else f"delete_user: {res.error}")
    return 0


def cmd_add_vhost(args) -> int:
    print(f'Adding vhost "{args.vhost_name}" ...')
    _txn_or_error(args, {"checks": [{"table": "vhost", "key": args.vhost_name, "absent": True}],
                         "ops": [{"op": "put", "table": "vhost", "key": args.vhost_name, "record": {"name": args.vhost_name}}]},
                  "add_vhost", f"vhost '{args.vhost_name}' already exists")
    return 0


def cmd_set_permissions(args) -> int:
    import re

    for what, rx in (("configure", args.conf), ("write", args.write), ("read", args.read)):
        try:
            re.compile(rx)
        except re.error as e:
            raise ClusterError(f"set_permissions: the {what} pattern {rx!r} is not a valid regular expression: {e}") from None
    print(f'Setting permissions for user "{args.username}" in vhost "{args.vhost}" ...')
    checks = [{"table": "user", "key": args.username, "exists": True}]
    if args.vhost != "/":
        checks.append({"table": "vhost", "key": args.vhost, "exists": True})
    row = {"user": args.username, "vhost": args.vhost, "configure": args.conf, "write": args.write, "read": args.read}
    _txn_or_error(args, {"checks": checks,
                         "ops": [{"op": "put", "table": "permission", "key": [args.username, args.vhost], "record": row}]},
                  "set_permissions", f"no user '{args.username}' or no vhost '{args.vhost}'")
    return 0


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
    st.add_argument("--amqp-shell", choices=AMQP_SHELLS, default=None,
                    help="AMQP socket shell of the new nodes: watch (default) or asyncio")
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

    def vhost_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("-p", "--vhost", default="/", help="virtual host (default /)")

    p = sub.add_parser("set_policy", parents=[common], help="set (create or replace) a policy")
    vhost_arg(p)
    p.add_argument("--priority", type=int, default=0, help="integer; the highest-priority match applies")
    p.add_argument("--apply-to", choices=["queues", "exchanges", "all"], default="all")
    p.add_argument("name")
    p.add_argument("pattern", help="regular expression searched in entity names")
    p.add_argument("definition", help='JSON object, e.g. \'{"ha-mode":"exactly","ha-params":2}\'')
    p.set_defaults(func=cmd_set_policy)
    p = sub.add_parser("clear_policy", parents=[common], help="remove a policy")
    vhost_arg(p)
    p.add_argument("name")
    p.set_defaults(func=cmd_clear_policy)
    p = sub.add_parser("list_policies", parents=[common], help="policies of a vhost")
    vhost_arg(p)
    p.set_defaults(func=cmd_list_policies)
    p = sub.add_parser("add_user", parents=[common], help="create a user (SASL PLAIN logins)")
    p.add_argument("username")
    p.add_argument("password")
    p.add_argument("--tags", nargs="*", default=[])
    p.set_defaults(func=cmd_add_user)
    p = sub.add_parser("delete_user", parents=[common], help="remove a user and its permissions")
    p.add_argument("username")
    p.set_defaults(func=cmd_delete_user)
    p = sub.add_parser("add_vhost", parents=[common], help="create a virtual host")
    p.add_argument("vhost_name")
    p.set_defaults(func=cmd_add_vhost)
    p = sub.add_parser("set_permissions", parents=[common], help="a user's configure/write/read regexes in a vhost")
    vhost_arg(p)
    p.add_argument("username")
    p.add_argument("conf")
    p.add_argument("write")
    p.add_argument("read")
    p.set_defaults(func=cmd_set_permissions)
    p = sub.add_parser("list_queues", parents=[common], help="queues of a vhost with info items")
    vhost_arg(p)
    p.add_argument("-t", "--timeout", type=float, default=QUEUE_OP_TIMEOUT, help="seconds to wait for each master")
    p.add_argument("items", nargs="*", metavar="INFO_ITEM", help=f"any of: {' '.join(QUEUE_ITEMS)}")
    p.set_defaults(func=cmd_list_queues)
    for name, func, help_ in (
        ("sync_queue", cmd_sync_queue, "synchronise a queue's unsynchronised mirrors"),
        ("cancel_sync_queue", cmd_cancel_sync_queue, "stop a queue's running synchronisation"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_)
        vhost_arg(p)
        p.add_argument("-t", "--timeout", type=float, default=QUEUE_OP_TIMEOUT, help="seconds to wait for the master")
        p.add_argument("name")
        p.set_defaults(func=func)
    p = sub.add_parser("ring", parents=[common], help="every queue's GM ring: replicas in ring order and their states")
    p.add_argument("-p", "--vhost", default=None, help="only this virtual host (default: all)")
    p.add_argument("--watch", action="store_true", help="redraw until Ctrl-C (a live view)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames with --watch")
    p.add_argument("--count", type=int, default=0, help="stop after N frames with --watch (0: never)")
    p.add_argument("-t", "--timeout", type=float, default=QUEUE_OP_TIMEOUT, help="seconds to wait for each master")
    p.set_defaults(func=cmd_ring)
    p = sub.add_parser("audit", parents=[common],
                       help="check the nodes' and clients' histories with Spark (report.md + timeline.png)")
    p.add_argument("--history", action="append", default=[], metavar="FILE",
                   help="a client history (JSON lines, format in mirrorq/spark/audit.py); repeatable, globs allowed")
    p.add_argument("--no-node-logs", action="store_true", help="only the client histories")
    p.add_argument("--out", default=None, help="output directory (default: <data dir>/audit)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.set_defaults(func=cmd_audit)
    return parser


def cmd_audit(args) -> int:
    import glob as _glob

    from mirrorq.spark import audit

    data_dir = None if args.no_node_logs else str(resolve_data_dir(args.data_dir))
    files = sorted({f for pat in args.history for f in (_glob.glob(pat) or [pat])})
    out = args.out or os.path.join(data_dir or ".", "audit")
    return audit.main(data_dir, files, out, master=args.master)


def cmd_ring(args) -> int:
    from ctl import ring_view

    return ring_view.run(args, connect)


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
