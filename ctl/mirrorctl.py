"""mirrorctl: rabbitmqctl for mirrorq, plus a local-cluster launcher.

    mirrorctl cluster start --nodes 3 [--base-port 19500] [--amqp-base-port 5672] [--management-base-port 15672]
                            [--amqp-shell watch|asyncio] [--data-dir D]
    mirrorctl cluster stop | cluster status
    mirrorctl cluster_status [-n NODE]
    mirrorctl stop_node NAME | kill_node NAME | start_node NAME
    mirrorctl add_node [NAME] [--admin-port P] [--amqp-port P] [--management-port P]
    mirrorctl forget_cluster_node NAME [-n NODE]
    mirrorctl set_policy [-p VHOST] [--priority N] [--apply-to queues|exchanges|all] NAME PATTERN DEFINITION
    mirrorctl clear_policy [-p VHOST] NAME
    mirrorctl list_policies [-p VHOST]
    mirrorctl list_queues [-p VHOST] [INFO_ITEM ...]
    mirrorctl add_user NAME PASSWORD | delete_user NAME | add_vhost NAME
    mirrorctl set_permissions [-p VHOST] USER CONF WRITE READ | clear_permissions [-p VHOST] USER
    mirrorctl sync_queue [-p VHOST] NAME | cancel_sync_queue [-p VHOST] NAME
    mirrorctl quorum_status [-p VHOST] NAME          # rabbitmq-queues' forms, for quorum queues
    mirrorctl add_member [-p VHOST] NAME NODE | delete_member [-p VHOST] NAME NODE
    mirrorctl grow NODE [all|even] [--vhost-pattern RE] [--queue-pattern RE] [--errors-only]
    mirrorctl shrink NODE [--errors-only]
    mirrorctl ring [-p VHOST] [--watch [--interval S] [--count N]]   # live view of every queue's ring
    mirrorctl list_exchanges | list_bindings | list_consumers [-p VHOST] [INFO_ITEM ...]
    mirrorctl list_connections | list_channels | list_vhosts [INFO_ITEM ...] | list_users
    mirrorctl list_permissions [-p VHOST] | list_user_permissions USER
    mirrorctl change_password NAME PASSWORD | set_user_tags NAME [TAG ...] | delete_vhost NAME
    mirrorctl purge_queue [-p VHOST] NAME | delete_queue [-p VHOST] [-e] [-u] NAME
    mirrorctl close_connection PID EXPLANATION
    mirrorctl status | environment | report | await_startup | ping | node_health_check [-n NODE]
    mirrorctl set_vm_memory_high_watermark FRACTION | set_vm_memory_high_watermark absolute SIZE [-n NODE]
    mirrorctl set_disk_free_limit SIZE | set_disk_free_limit mem_relative X [-n NODE]

Every command finds the cluster through its data dir: ``--data-dir``, else the
environment variable ``MIRRORQ_DATA_DIR``, else ``~/.mirrorq``.  ``-n NODE``
picks the node to talk to; ``--formatter json`` prints JSON wherever a table
is printed (rabbitmqctl's shapes: a list command prints a list of objects
keyed by info item); ``--timeout`` bounds the command's wait.  Errors are one
line on stderr and rabbitmqctl's exit codes: 64 usage, 69 node unavailable,
70 software error (the operation failed), 75 timed out.
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
    CommandTimeout,
    Invalid,
    NodeUnavailable,
    NotFound,
    UsageError,
    resolve_data_dir,
)
from ctl.session import NodeSession, live_infos, node_of_member, open_session
from mirrorq.amqp.topology import client_arguments
from mirrorq.node import alarms as alarmsmod
from mirrorq.node.config import AMQP_SHELLS
from mirrorq.node.daemon import group_rss
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
MEMBER_OP_TIMEOUT = 30.0  # add_member waits for the new member to catch up and be promoted


# ---- output -----------------------------------------------------------------
def banner(args, text: str) -> None:
    """rabbitmqctl's informational line ("Adding user ..."): not with --formatter json."""
    if args.formatter != "json":
        print(text)


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


def partition_state(st: Any) -> str | None:
    """What a node's ``cluster_partition_handling`` decided: "paused" (it
    reaches only a minority of the cluster) or "serving"; None if unknown."""
    part = getattr(st, "partition", None) if st is not None else None
    if not part:
        return None
    return "paused" if part.get("paused") else "serving"


def node_alarms(st: Any) -> list[str]:
    """The resource alarms a node has raised itself: "memory", "disk"."""
    a = getattr(st, "alarms", None) if st is not None else None
    if not a:
        return []
    return [r for r, key in ((alarmsmod.MEMORY, "mem_alarm"), (alarmsmod.DISK, "disk_free_alarm")) if a.get(key)]


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
                "management_port": cfg.management_port or None,
                "pid": info.get("pgid") if state != "stopped" else None,
                "state": state,
                "sees_up": sorted(m for m, v in st.view.items() if v["state"] == "up") if st else [],
                "partition": partition_state(st),
                "alarms": node_alarms(st),
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
            r["alarms"] = ", ".join(r["alarms"])
        emit(
            args,
            rows,
            ["name", "state", "pid", "admin_port", "amqp_port", "management_port", "sees_up", "partition", "alarms"],
            title="mirrorq cluster",
        )


# ---- commands -------------------------------------------------------------------
def cmd_cluster_start(args) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {args.nodes}")
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
            3 if args.nodes is None else args.nodes,
            args.base_port,
            args.amqp_base_port,
            args.heartbeat_interval,
            args.heartbeat_timeout,
            args.registry_snapshot_every,
            amqp_shell=args.amqp_shell,
            management_base_port=args.management_base_port,
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
    name = cluster.add_node(args.name, args.admin_port, args.amqp_port, management_port=args.management_port)
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
def connect(args) -> NodeSession:
    """A session (ctl.session) with ``-n NODE``, else with the first running
    node of the layout; its registry work has ``--timeout`` seconds."""
    return open_session(Cluster(resolve_data_dir(args.data_dir)), args.node, args.timeout)


def op_timeout(args) -> float:
    """Seconds a queue master has to answer (``--timeout``, default 5)."""
    return QUEUE_OP_TIMEOUT if args.timeout is None else args.timeout


# The operations below (make_policy ... delete_queue) take an open
# NodeSession and raise ClusterError (NotFound, Invalid): mirrorctl's
# commands and the HTTP management API (mirrorq.mgmt) both run them.
def make_policy(
    vhost: str, name: str, pattern: Any, definition: Any, priority: Any = 0, apply_to: Any = "all"
) -> Policy:
    """A valid Policy, or Invalid naming the broken rule."""
    try:
        return Policy(
            vhost=vhost, name=name, pattern=pattern, definition=definition, priority=priority, apply_to=apply_to
        )
    except PolicyValidationError as e:
        raise Invalid(f"Validation failed: {e}") from None


def set_policy(s: NodeSession, policy: Policy) -> None:
    res = s.txn(set_policy_txn(policy), idempotent=True)  # one put: a repeat changes nothing
    if not res.ok:
        raise ClusterError(f"set_policy {policy.name}: {res.error}")


def clear_policy(s: NodeSession, vhost: str, name: str) -> None:
    try:
        txn = clear_policy_txn(vhost, name)
    except PolicyValidationError as e:
        raise Invalid(f"Validation failed: {e}") from None
    res = s.txn(txn)
    if not res.ok:
        if "precondition failed" in res.error:
            raise NotFound(f"no policy '{name}' in vhost '{vhost}' (Parameter does not exist)")
        raise ClusterError(f"clear_policy {name}: {res.error}")


def load_policies(s: NodeSession, warn=None) -> list[Policy]:
    """The valid policies; ``warn(text)`` hears of each invalid row (default: a warning on stderr)."""
    policies, errors = policies_from_rows(s.rows("policy"))
    for e in errors:
        (warn or (lambda t: print(f"mirrorctl: warning: {t}", file=sys.stderr)))(e)
    return policies


def cmd_set_policy(args) -> int:
    try:
        definition = parse_definition(args.definition)
    except PolicyValidationError as e:
        raise Invalid(f"Validation failed: {e}") from None
    policy = make_policy(args.vhost, args.name, args.pattern, definition, args.priority, args.apply_to)
    if args.formatter != "json":
        print(
            f'Setting policy "{policy.name}" for pattern "{policy.pattern}" to '
            f'"{definition_json(policy.definition.to_dict())}" with priority "{policy.priority}" '
            f'for vhost "{policy.vhost}" ...'
        )
    with connect(args) as s:
        set_policy(s, policy)
    if args.formatter == "json":
        print(json.dumps(policy.to_dict()))
    return 0


def cmd_clear_policy(args) -> int:
    if args.formatter != "json":
        print(f'Clearing policy "{args.name}" on vhost "{args.vhost}" ...')
    with connect(args) as s:
        clear_policy(s, args.vhost, args.name)
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "cleared": True}))
    return 0


POLICY_COLUMNS = ["vhost", "name", "pattern", "apply-to", "definition", "priority"]


def cmd_list_policies(args) -> int:
    with connect(args) as s:
        policies = load_policies(s)
    rows = policy_listing(policies, args.vhost)
    if args.formatter == "json":
        emit(args, rows, POLICY_COLUMNS)
        return 0
    print(f'Listing policies for vhost "{args.vhost}" ...')
    emit(args, [dict(r, definition=definition_json(r["definition"])) for r in rows], POLICY_COLUMNS)
    return 0


#: list_queues info items (rabbitmqctl's names), and the default ones
QUEUE_ITEMS = (
    "name",
    "durable",
    "auto_delete",
    "exclusive",
    "arguments",
    "pid",
    "slave_pids",
    "synchronised_slave_pids",
    "messages",
    "messages_ready",
    "messages_unacknowledged",
    "consumers",
    "policy",
    "effective_policy_definition",
    "state",
    "type",
    "leader",
    "members",
    "online",
)
DEFAULT_QUEUE_ITEMS = ("name", "messages")
LIVE_ITEMS = frozenset({"messages", "messages_ready", "messages_unacknowledged", "consumers", "state"})
_SYNCED_WORDS = frozenset({"synchronised", "synchronized", "synced", "in_sync", "in-sync"})


_node = node_of_member


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
        phase = state.get("state")
        if phase not in ("syncing", None) or (phase is None and state.get("synchronised")):
            return None
        for k in ("transferred", "sent", "records"):
            if isinstance(state.get(k), int):
                return state[k]
        return 0 if phase == "syncing" else None
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


def queue_rows(
    records: list[dict],
    policies: list[Policy],
    infos: dict,
    nodes_up: set[str],
    items: list[str],
    alerts: list[dict] | None = None,
) -> list[dict]:
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
        applied = by_name.get((r["vhost"], r["policy"])) if r.get("policy") else None
        row: dict[str, Any] = {}
        for item in items:
            if item == "name":
                row[item] = r["name"]
            elif item in ("durable", "auto_delete"):
                row[item] = bool(r.get(item))
            elif item == "exclusive":
                row[item] = r.get("exclusive_owner") is not None
            elif item == "arguments":  # as clients declared them: never the broker's own
                row[item] = client_arguments(r.get("arguments"))
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
            elif item == "type":
                row[item] = r.get("type") or "classic"
            elif item == "leader":  # a quorum queue's leader; a classic queue's master
                row[item] = _node(r.get("pid"))
            elif item in ("members", "online"):
                members = [_node(m) for m in _members(r)]
                row[item] = members if item == "members" else [n for n in members if n in nodes_up]
        out.append(row)
    return out


def _members(record: dict) -> list:
    """A queue's replicas: a quorum queue's Raft members, a classic queue's master and mirrors."""
    if record.get("type") == "quorum":
        return list(record.get("members") or ())
    return [m for m in [record.get("pid"), *(record.get("slave_pids") or ())] if m]


def _cell(value: Any) -> Any:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return definition_json(value) if value else ""
    return value


def queue_snapshot(
    s: NodeSession, vhost: str | None, timeout: float, live: bool = True, alerts: bool = True, warn=None
) -> dict:
    """What queue_rows shapes, read through ``s``: ``records`` (of ``vhost``;
    None: all, by vhost and name), ``policies``, ``up`` (nodes), ``infos``
    (each live master's ``info``, with ``live``) and ``alerts``."""
    records = sorted(
        (r for r in s.rows("amqqueue") if vhost is None or r["vhost"] == vhost), key=lambda r: (r["vhost"], r["name"])
    )
    up = s.nodes_up()
    return {
        "records": records,
        "policies": load_policies(s, warn),
        "up": up,
        "infos": live_infos(s, records, up, timeout) if live else {},
        "alerts": [a for a in s.rows("queue_alert") if vhost is None or a["vhost"] == vhost] if alerts else [],
    }


def cmd_list_queues(args) -> int:
    items = _items(args, QUEUE_ITEMS, DEFAULT_QUEUE_ITEMS)
    with connect(args) as s:
        snap = queue_snapshot(
            s, args.vhost, op_timeout(args), live=bool(LIVE_ITEMS & set(items)), alerts="state" in items
        )
    rows = queue_rows(snap["records"], snap["policies"], snap["infos"], snap["up"], items, snap["alerts"])
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
        (res,) = s.queue_ops(command, [(args.vhost, args.name)], timeout=op_timeout(args))
    if not res["ok"]:
        raise ClusterError(f"{command} of queue '{args.name}' in vhost '{args.vhost}' failed: {res['error']}")
    if args.formatter == "json":
        print(
            json.dumps(
                {"vhost": args.vhost, "name": args.name, "command": command, "result": res["value"]}, default=str
            )
        )
    elif res["value"] not in (None, True, {}):
        print(res["value"] if isinstance(res["value"], str) else json.dumps(res["value"], default=str))
    return 0


def cmd_sync_queue(args) -> int:
    return _queue_command(args, "sync", f"Synchronising queue '{args.name}' in vhost '{args.vhost}' ...")


def cmd_cancel_sync_queue(args) -> int:
    return _queue_command(
        args, "cancel_sync", f"Stopping synchronising queue '{args.name}' in vhost '{args.vhost}' ..."
    )


# ---- quorum queues: status and membership (rabbitmq-queues' commands) -----------------
#: quorum_status columns: rabbitmq-queues' (their JSON keys too), then the member and its lag
QUORUM_STATUS_COLUMNS = [
    "Node Name",
    "Member",
    "Raft State",
    "Membership",
    "Last Log Index",
    "Last Applied",
    "Commit Index",
    "Snapshot Index",
    "Term",
    "Lag",
]


def quorum_status_rows(statuses: list[dict]) -> list[dict]:
    """One row per member (the manager's ``status`` answers, in the record's
    order).  ``Lag``: entries the member's log is behind the leader's last
    index (None when there is no leader answering or the member did not
    answer)."""
    leader = next((st for st in statuses if st.get("raft_state") == "leader"), None)
    top = leader.get("last_index") if leader else None
    rows = []
    for st in statuses:
        member = st.get("member")
        last = st.get("last_index")
        rows.append(
            {
                "Node Name": _node(member) if member else None,
                "Member": member,
                "Raft State": st.get("raft_state"),
                "Membership": st.get("membership"),
                "Last Log Index": last,
                "Last Applied": st.get("applied_index"),
                "Commit Index": st.get("commit_index"),
                "Snapshot Index": st.get("snapshot_index"),
                "Term": st.get("term"),
                "Lag": max(0, top - last) if isinstance(top, int) and isinstance(last, int) else None,
            }
        )
    return rows


def member_error(res: Any, what: str) -> ClusterError:
    """The exception (rabbitmqctl's exit code) for a failed QuorumMembersResult."""
    text = f"{what}: {res.error}"
    reason = res.reason
    if reason == "not_found":
        return NotFound(text)
    if reason in ("no_node", "node_down"):
        return NodeUnavailable(text)
    if reason == "timeout":
        return CommandTimeout(text)
    if reason == "bad_request":
        return UsageError(text)
    return ClusterError(text)


def member_timeout(args) -> float:
    return MEMBER_OP_TIMEOUT if args.timeout is None else args.timeout


def cmd_quorum_status(args) -> int:
    banner(args, f"Status of quorum queue {args.name} on node {args.node or 'any'} ...")
    with connect(args) as s:
        res = s.quorum_members("status", args.vhost, args.name, timeout=op_timeout(args))
    if not res.ok:
        raise member_error(res, f"quorum_status of queue '{args.name}' in vhost '{args.vhost}'")
    emit(args, quorum_status_rows(res.value), QUORUM_STATUS_COLUMNS)
    return 0


def _member_change(args, action: str) -> int:
    if action == "add":
        banner(args, f"Adding a replica for queue {args.name} on node {args.member_node}...")
    else:
        banner(args, f"Removing a replica of queue {args.name} on node {args.member_node}...")
    with connect(args) as s:
        res = s.quorum_members(action, args.vhost, args.name, args.member_node, timeout=member_timeout(args))
    if not res.ok:
        raise member_error(
            res, f"{action}_member of queue '{args.name}' in vhost '{args.vhost}' on node {args.member_node}"
        )
    if args.formatter == "json":
        members = (res.value or {}).get("members") or []
        print(
            json.dumps(
                {
                    "vhost": args.vhost,
                    "name": args.name,
                    "node": args.member_node,
                    "result": "ok",
                    "members": [_node(m) for m in members],
                }
            )
        )
    return 0


def cmd_add_member(args) -> int:
    return _member_change(args, "add")


def cmd_delete_member(args) -> int:
    return _member_change(args, "delete")


def grow_plan(
    records: list[dict], node: str, strategy: str = "all", vhost_pattern: str = ".*", queue_pattern: str = ".*"
) -> list[dict]:
    """The quorum queues ``grow`` adds a member on ``node`` to: those with
    none there, matching the patterns (searched, as rabbitmq-queues'), with
    ``strategy`` even: only those with an even number of members."""
    import re

    vre, qre = re.compile(vhost_pattern), re.compile(queue_pattern)
    out = []
    for r in sorted(records, key=lambda r: (r["vhost"], r["name"])):
        members = _members(r)
        if r.get("type") != "quorum" or not vre.search(r["vhost"]) or not qre.search(r["name"]):
            continue
        if any(_node(m) == node for m in members) or (strategy == "even" and len(members) % 2):
            continue
        out.append(r)
    return out


def shrink_plan(records: list[dict], node: str) -> list[dict]:
    """The quorum queues with a member on ``node`` (``shrink`` removes it
    where it is not the last one)."""
    return [
        r
        for r in sorted(records, key=lambda r: (r["vhost"], r["name"]))
        if r.get("type") == "quorum" and any(_node(m) == node for m in _members(r))
    ]


def _cluster_node(s: NodeSession, node: str) -> None:
    names = sorted(r["name"] for r in s.rows("node"))
    if node not in names:
        raise NodeUnavailable(f"node {node} is not a member of the cluster (members: {', '.join(names)})")


def _member_results(args, rows: list[dict]) -> int:
    """grow / shrink output (rabbitmq-queues': vhost, name, size, result)."""
    if args.errors_only:
        rows = [r for r in rows if r["result"] != "ok"]
    emit(args, rows, ["vhost", "name", "size", "result"])
    return 0


def cmd_grow(args) -> int:
    banner(
        args,
        f"Growing quorum queues matching {args.vhost_pattern!r} / {args.queue_pattern!r} to node "
        f"{args.member_node} ({args.strategy}) ...",
    )
    rows = []
    with connect(args) as s:
        _cluster_node(s, args.member_node)
        for r in grow_plan(s.rows("amqqueue"), args.member_node, args.strategy, args.vhost_pattern, args.queue_pattern):
            res = s.quorum_members("add", r["vhost"], r["name"], args.member_node, timeout=member_timeout(args))
            size = len((res.value or {}).get("members") or ()) if res.ok else len(_members(r))
            rows.append(
                {
                    "vhost": r["vhost"],
                    "name": r["name"],
                    "size": size,
                    "result": "ok" if res.ok else f"error: {res.error}",
                }
            )
    return _member_results(args, rows)


def cmd_shrink(args) -> int:
    banner(args, f"Shrinking quorum queues on node {args.member_node} ...")
    rows = []
    with connect(args) as s:
        for r in shrink_plan(s.rows("amqqueue"), args.member_node):
            members = _members(r)
            if len(members) < 2:
                rows.append(
                    {
                        "vhost": r["vhost"],
                        "name": r["name"],
                        "size": len(members),
                        "result": "error: last member, not removed",
                    }
                )
                continue
            res = s.quorum_members("delete", r["vhost"], r["name"], args.member_node, timeout=member_timeout(args))
            size = len((res.value or {}).get("members") or ()) if res.ok else len(members)
            rows.append(
                {
                    "vhost": r["vhost"],
                    "name": r["name"],
                    "size": size,
                    "result": "ok" if res.ok else f"error: {res.error}",
                }
            )
    return _member_results(args, rows)


# ---- parser ---------------------------------------------------------------------
# ---- users, vhosts, permissions (rabbitmqctl's forms) ---------------------------------
def cmd_add_user(args) -> int:
    if not args.username or not args.password:
        raise ClusterError("add_user: a user name and a non-empty password are needed")
    banner(args, f'Adding user "{args.username}" ...')
    with connect(args) as s:
        add_user(s, args.username, args.password, args.tags)
    return 0


def add_user(s: NodeSession, name: str, password: str, tags: list[str] | None = None) -> None:
    from mirrorq.amqp.topology import hash_password

    row = {"name": name, "password_hash": hash_password(password), "tags": list(tags or [])}
    res = s.txn(
        {
            "checks": [{"table": "user", "key": name, "absent": True}],
            "ops": [{"op": "put", "table": "user", "key": name, "record": row}],
        }
    )
    if not res.ok:
        raise ClusterError(
            f"add_user: {f'user {name!r} already exists' if 'precondition failed' in res.error else res.error}"
        )


def delete_user(s: NodeSession, name: str) -> None:
    perms = [p for p in s.rows("permission") if p["user"] == name]
    res = s.txn(
        {
            "checks": [{"table": "user", "key": name, "exists": True}],
            "ops": [{"op": "delete", "table": "user", "key": name}]
            + [{"op": "delete", "table": "permission", "key": [p["user"], p["vhost"]]} for p in perms],
        }
    )
    if not res.ok:
        if "precondition failed" in res.error:
            raise NotFound(f"delete_user: no user '{name}'")
        raise ClusterError(f"delete_user: {res.error}")


def cmd_delete_user(args) -> int:
    banner(args, f'Deleting user "{args.username}" ...')
    with connect(args) as s:
        delete_user(s, args.username)
    return 0


def add_vhost(s: NodeSession, name: str) -> bool:
    """Create vhost ``name``; False if it existed already."""
    if not name:
        raise Invalid("a vhost name must not be empty")
    res = s.txn(
        {
            "checks": [{"table": "vhost", "key": name, "absent": True}],
            "ops": [{"op": "put", "table": "vhost", "key": name, "record": {"name": name}}],
        }
    )
    if not res.ok:
        if "precondition failed" in res.error:
            return False
        raise ClusterError(f"add_vhost: {res.error}")
    return True


def cmd_add_vhost(args) -> int:
    banner(args, f'Adding vhost "{args.vhost_name}" ...')
    with connect(args) as s:
        if not add_vhost(s, args.vhost_name):
            raise ClusterError(f"add_vhost: vhost '{args.vhost_name}' already exists")
    return 0


def set_permissions(s: NodeSession, user: str, vhost: str, conf: str, write: str, read: str) -> None:
    """Set ``user``'s configure/write/read regexes in ``vhost`` (NotFound: no such user or vhost)."""
    import re

    from mirrorq.amqp.topology import DEFAULT_USER

    for what, rx in (("configure", conf), ("write", write), ("read", read)):
        if not isinstance(rx, str):
            raise Invalid(f"set_permissions: the {what} pattern must be a string, got {rx!r}")
        try:
            re.compile(rx)
        except re.error as e:
            raise Invalid(
                f"set_permissions: the {what} pattern {rx!r} is not a valid regular expression: {e}"
            ) from None
    # the built-in guest (no row yet) becomes a row first, keeping its permissions on "/"
    checks, ops = _guest_ops(s.rows("user")) if user == DEFAULT_USER else ([], [])
    checks = checks or [{"table": "user", "key": user, "exists": True}]
    if vhost != "/":
        checks.append({"table": "vhost", "key": vhost, "exists": True})
    row = {"user": user, "vhost": vhost, "configure": conf, "write": write, "read": read}
    res = s.txn(
        {"checks": checks, "ops": ops + [{"op": "put", "table": "permission", "key": [user, vhost], "record": row}]}
    )
    if not res.ok:
        if "precondition failed" in res.error:
            raise NotFound(f"set_permissions: no user '{user}' or no vhost '{vhost}'")
        raise ClusterError(f"set_permissions: {res.error}")


def clear_permissions(s: NodeSession, user: str, vhost: str) -> None:
    """Remove ``user``'s permissions in ``vhost`` (NotFound: it had none)."""
    from mirrorq.amqp.topology import DEFAULT_USER

    checks, ops = _guest_ops(s.rows("user")) if user == DEFAULT_USER else ([], [])
    if not any(op["table"] == "permission" and op["key"] == [user, vhost] for op in ops):
        checks = checks + [{"table": "permission", "key": [user, vhost], "exists": True}]
    res = s.txn({"checks": checks, "ops": ops + [{"op": "delete", "table": "permission", "key": [user, vhost]}]})
    if not res.ok:
        if "precondition failed" in res.error:
            raise NotFound(f"clear_permissions: user '{user}' has no permissions in vhost '{vhost}'")
        raise ClusterError(f"clear_permissions: {res.error}")


def cmd_set_permissions(args) -> int:
    banner(args, f'Setting permissions for user "{args.username}" in vhost "{args.vhost}" ...')
    with connect(args) as s:
        set_permissions(s, args.username, args.vhost, args.conf, args.write, args.read)
    return 0


def cmd_clear_permissions(args) -> int:
    banner(args, f'Clearing permissions for user "{args.username}" in vhost "{args.vhost}" ...')
    with connect(args) as s:
        clear_permissions(s, args.username, args.vhost)
    return 0


# ---- the built-in guest user and default vhost --------------------------------------------
def _guest_ops(users: list[dict]) -> tuple[list[dict], list[dict]]:
    """(checks, ops) that turn the built-in guest user (guest/guest, loopback
    only, all permissions on "/": see mirrorq.amqp.topology) into registry
    rows, so that it can be given permissions, tags or a password like any
    user; nothing when a guest row exists already."""
    from mirrorq.amqp.topology import DEFAULT_PASSWORD, DEFAULT_USER, DEFAULT_VHOST, hash_password

    if any(u["name"] == DEFAULT_USER for u in users):
        return [], []
    row = {"name": DEFAULT_USER, "password_hash": hash_password(DEFAULT_PASSWORD), "tags": ["administrator"]}
    perm = {"user": DEFAULT_USER, "vhost": DEFAULT_VHOST, "configure": ".*", "write": ".*", "read": ".*"}
    return (
        [{"table": "user", "key": DEFAULT_USER, "absent": True}],
        [
            {"op": "put", "table": "user", "key": DEFAULT_USER, "record": row},
            {"op": "put", "table": "permission", "key": [DEFAULT_USER, DEFAULT_VHOST], "record": perm},
        ],
    )


def user_rows(users: list[dict]) -> list[dict]:
    """Every user with its tags, the built-in guest included while it has no row."""
    from mirrorq.amqp.topology import DEFAULT_USER

    out = {u["name"]: {"user": u["name"], "tags": list(u.get("tags") or [])} for u in users}
    out.setdefault(DEFAULT_USER, {"user": DEFAULT_USER, "tags": ["administrator"]})
    return [out[k] for k in sorted(out)]


def permission_rows(users: list[dict], perms: list[dict]) -> list[dict]:
    """Every permission row, the built-in guest's on "/" included while guest has no row."""
    from mirrorq.amqp.topology import DEFAULT_USER, DEFAULT_VHOST

    out = [dict(p) for p in perms]
    if not any(u["name"] == DEFAULT_USER for u in users):
        out.append({"user": DEFAULT_USER, "vhost": DEFAULT_VHOST, "configure": ".*", "write": ".*", "read": ".*"})
    return sorted(out, key=lambda p: (p["vhost"], p["user"]))


def vhost_names(rows: list[dict]) -> list[str]:
    from mirrorq.amqp.topology import DEFAULT_VHOST

    return sorted({DEFAULT_VHOST, *(r["name"] for r in rows)})


def _pick(rows: list[dict], items: list[str]) -> list[dict]:
    return [{i: r.get(i) for i in items} for r in rows]


def _items(args, known: tuple, default: tuple) -> list[str]:
    items = list(getattr(args, "items", None) or ()) or list(default)
    bad = [i for i in items if i not in known]
    if bad:
        raise UsageError(f"Info key(s) {', '.join(bad)} are not supported; known: {', '.join(known)}")
    return items


def _listing(args, banner: str, rows: list[dict], items: list[str]) -> int:
    """A list command's output: JSON objects keyed by info item, or a banner and a table."""
    rows = _pick(rows, items)
    if args.formatter == "json":
        emit(args, rows, items)
        return 0
    print(banner)
    emit(args, [{k: _cell(v) for k, v in r.items()} for r in rows], items)
    return 0


def _check_vhost(s: NodeSession, vhost: str) -> None:
    if vhost not in vhost_names(s.rows("vhost")):
        raise ClusterError(f"Virtual host '{vhost}' does not exist")


# ---- users, vhosts, permissions: listings and changes -------------------------------------
USER_ITEMS = ("user", "tags")


def cmd_list_users(args) -> int:
    with connect(args) as s:
        rows = user_rows(s.rows("user"))
    return _listing(args, "Listing users ...", rows, list(USER_ITEMS))


VHOST_ITEMS = ("name", "description", "tags", "tracing", "cluster_state")


def vhost_rows(names: list[str], up: set[str]) -> list[dict]:
    return [
        {
            "name": n,
            "description": "Default virtual host" if n == "/" else "",
            "tags": [],
            "tracing": False,
            "cluster_state": {node: "running" for node in sorted(up)},
        }
        for n in names
    ]


def cmd_list_vhosts(args) -> int:
    items = _items(args, VHOST_ITEMS, ("name",))
    with connect(args) as s:
        names = vhost_names(s.rows("vhost"))
        up = s.nodes_up() if "cluster_state" in items else set()
    rows = vhost_rows(names, up)
    return _listing(args, "Listing vhosts ...", rows, items)


PERMISSION_ITEMS = ("user", "configure", "write", "read")


def cmd_list_permissions(args) -> int:
    with connect(args) as s:
        _check_vhost(s, args.vhost)
        rows = [p for p in permission_rows(s.rows("user"), s.rows("permission")) if p["vhost"] == args.vhost]
    return _listing(args, f'Listing permissions for vhost "{args.vhost}" ...', rows, list(PERMISSION_ITEMS))


def cmd_list_user_permissions(args) -> int:
    with connect(args) as s:
        users = s.rows("user")
        if args.username not in {u["user"] for u in user_rows(users)}:
            raise ClusterError(f"User '{args.username}' does not exist")
        rows = [p for p in permission_rows(users, s.rows("permission")) if p["user"] == args.username]
    return _listing(
        args, f'Listing permissions for user "{args.username}" ...', rows, ["vhost", "configure", "write", "read"]
    )


def change_user(s: NodeSession, name: str, what: str, change, create: dict | None = None) -> bool:
    """Rewrite user ``name``'s row with ``change(row)`` (the built-in guest
    is given a row first); a user with no row is created as ``create``
    (None: NotFound).  True if the user was created."""
    from mirrorq.amqp.topology import DEFAULT_USER

    users = s.rows("user")
    checks, ops = _guest_ops(users) if name == DEFAULT_USER else ([], [])
    row = next((u for u in users if u["name"] == name), None)
    if row is None and ops:
        row = ops[0]["record"]
    if row is None:
        if create is None:
            raise NotFound(f"{what}: User '{name}' does not exist")
        new, guard = dict(create), [{"table": "user", "key": name, "absent": True}]
    else:
        new, guard = change(dict(row)), checks or [{"table": "user", "key": name, "exists": True}]
    res = s.txn({"checks": guard, "ops": ops + [{"op": "put", "table": "user", "key": name, "record": new}]})
    if not res.ok:
        raise ClusterError(
            f"{what}: {res.error} (the user changed meanwhile; run it again)"
            if "precondition failed" in res.error
            else f"{what}: {res.error}"
        )
    return row is None


def _change_user(args, what: str, change) -> None:
    with connect(args) as s:
        change_user(s, args.username, what, change)


def cmd_change_password(args) -> int:
    from mirrorq.amqp.topology import hash_password

    if not args.password:
        raise UsageError("change_password: the new password must not be empty")
    if args.formatter != "json":
        print(f'Changing password for user "{args.username}" ...')
    _change_user(args, "change_password", lambda r: {**r, "password_hash": hash_password(args.password)})
    return 0


def cmd_set_user_tags(args) -> int:
    if args.formatter != "json":
        print(f'Setting tags for user "{args.username}" to [{", ".join(args.tags)}] ...')
    _change_user(args, "set_user_tags", lambda r: {**r, "tags": list(args.tags)})
    return 0


def delete_vhost(s: NodeSession, name: str, timeout: float) -> tuple[list, list]:
    """Delete vhost ``name`` with its permissions, policies, exchanges,
    bindings, then its queues: (queues, the queue deletes that failed)."""
    from mirrorq.amqp.topology import DEFAULT_VHOST

    if name == DEFAULT_VHOST:
        raise Invalid("deleting the default virtual host '/' is not supported by mirrorq")
    keyed = {
        "permission": lambda r: [r["user"], r["vhost"]],
        "policy": lambda r: [r["vhost"], r["name"]],
        "exchange": lambda r: [r["vhost"], r["name"]],
        "binding": lambda r: [
            r["vhost"],
            r["source"],
            r["destination_kind"],
            r["destination"],
            r["routing_key"],
            r["arguments_key"],
        ],
    }
    ops: list[dict[str, Any]] = [{"op": "delete", "table": "vhost", "key": name}]
    for table, key in keyed.items():
        ops += [{"op": "delete", "table": table, "key": key(r)} for r in s.rows(table) if r["vhost"] == name]
    res = s.txn({"checks": [{"table": "vhost", "key": name, "exists": True}], "ops": ops})
    if not res.ok:
        if "precondition failed" in res.error:
            raise NotFound(f"Virtual host '{name}' does not exist")
        raise ClusterError(f"delete_vhost: {res.error}")
    queues = [(r["vhost"], r["name"]) for r in s.rows("amqqueue") if r["vhost"] == name]
    failed = [r for r in (s.queue_ops("delete", queues, timeout=timeout) if queues else []) if not r["ok"]]
    return queues, failed


def cmd_delete_vhost(args) -> int:
    name = args.vhost_name
    if args.formatter != "json":
        print(f'Deleting vhost "{name}" ...')
    with connect(args) as s:
        queues, failed = delete_vhost(s, name, op_timeout(args))
    for r in failed:
        print(
            f"mirrorctl: warning: queue '{r['name']}' of the deleted vhost was not deleted: {r['error']}",
            file=sys.stderr,
        )
    if args.formatter == "json":
        print(json.dumps({"vhost": name, "deleted": True, "queues_deleted": len(queues) - len(failed)}))
    return 0


# ---- exchanges and bindings ----------------------------------------------------------------
EXCHANGE_ITEMS = ("name", "type", "durable", "auto_delete", "internal", "arguments", "policy")


def exchange_rows(vhost: str, exchanges: list[dict], policies: list[Policy]) -> list[dict]:
    """The exchanges of ``vhost``: the built-in ones and the declared ones (pure)."""
    from mirrorq.amqp.topology import BUILTIN_EXCHANGES
    from mirrorq.policy.matching import match

    rows: dict[str, dict[str, Any]] = {
        n: {"name": n, "type": t, "durable": True, "auto_delete": False, "internal": False, "arguments": {}}
        for n, t in BUILTIN_EXCHANGES.items()
    }
    for r in exchanges:
        if r["vhost"] == vhost:
            rows[r["name"]] = {k: r.get(k) for k in ("name", "type", "durable", "auto_delete", "internal")}
            rows[r["name"]]["arguments"] = dict(r.get("arguments") or {})
    for row in rows.values():
        p = match(policies, vhost, row["name"], "exchange") if row["name"] else None
        row["policy"] = p.name if p is not None else ""
    return [rows[n] for n in sorted(rows)]


def cmd_list_exchanges(args) -> int:
    items = _items(args, EXCHANGE_ITEMS, ("name", "type"))
    with connect(args) as s:
        _check_vhost(s, args.vhost)
        rows = exchange_rows(args.vhost, s.rows("exchange"), load_policies(s) if "policy" in items else [])
    return _listing(args, f"Listing exchanges for vhost {args.vhost} ...", rows, items)


BINDING_ITEMS = ("source_name", "source_kind", "destination_name", "destination_kind", "routing_key", "arguments")


def binding_rows(vhost: str, queues: list[dict], bindings: list[dict]) -> list[dict]:
    """The bindings of ``vhost``: the default exchange's to every queue
    first (RabbitMQ lists them), then the declared ones (pure)."""
    out = [
        {
            "source_name": "",
            "source_kind": "exchange",
            "destination_name": q["name"],
            "destination_kind": "queue",
            "routing_key": q["name"],
            "arguments": {},
        }
        for q in sorted(queues, key=lambda q: q["name"])
        if q["vhost"] == vhost
    ]
    declared = [b for b in bindings if b["vhost"] == vhost]
    for b in sorted(
        declared,
        key=lambda b: (b["source"], b["destination_kind"], b["destination"], b["routing_key"], b["arguments_key"]),
    ):
        out.append(
            {
                "source_name": b["source"],
                "source_kind": "exchange",
                "destination_name": b["destination"],
                "destination_kind": b["destination_kind"],
                "routing_key": b["routing_key"],
                "arguments": dict(b.get("arguments") or {}),
            }
        )
    return out


def cmd_list_bindings(args) -> int:
    items = _items(args, BINDING_ITEMS, BINDING_ITEMS)
    with connect(args) as s:
        _check_vhost(s, args.vhost)
        rows = binding_rows(args.vhost, s.rows("amqqueue"), s.rows("binding"))
    return _listing(args, f"Listing bindings for vhost {args.vhost}...", rows, items)


# ---- queues: purge and delete --------------------------------------------------------------
def cmd_purge_queue(args) -> int:
    if args.formatter != "json":
        print(f"Purging queue '{args.name}' in vhost '{args.vhost}' ...")
    with connect(args) as s:
        (res,) = s.queue_ops("purge", [(args.vhost, args.name)], timeout=op_timeout(args))
    if not res["ok"]:
        raise ClusterError(f"purge of queue '{args.name}' in vhost '{args.vhost}' failed: {res['error']}")
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "message_count": res["value"]}))
    return 0


def delete_queue(s: NodeSession, vhost: str, name: str, if_empty: bool, if_unused: bool, timeout: float) -> int:
    """Delete a queue (through its master) and its bindings: the messages it held."""
    from mirrorq.amqp.topology import queue_binding_deletes

    (res,) = s.queue_ops("delete", [(vhost, name)], {"if_empty": if_empty, "if_unused": if_unused}, timeout=timeout)
    if not res["ok"]:
        err = f"delete of queue '{name}' in vhost '{vhost}' failed: {res['error']}"
        raise NotFound(err) if res["error"].startswith("no queue ") else ClusterError(err)
    ops = queue_binding_deletes(s.rows("binding"), vhost, name)
    if ops:
        s.txn({"ops": ops})
    return res["value"] if isinstance(res["value"], int) else 0


def cmd_delete_queue(args) -> int:
    if args.formatter != "json":
        print(f"Deleting queue '{args.name}' on vhost '{args.vhost}' ...")
    with connect(args) as s:
        count = delete_queue(s, args.vhost, args.name, args.if_empty, args.if_unused, op_timeout(args))
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "message_count": count}))
    else:
        print(f"Queue was successfully deleted with {count} message{'' if count == 1 else 's'}")
    return 0


# ---- connections, channels, consumers: every node's AMQP front end ---------------------------
def _each_running(args):
    """(node, session) for every running node (``-n``: that one)."""
    cluster = Cluster(resolve_data_dir(args.data_dir))
    names = [args.node] if args.node else cluster.node_names()
    for n in names:
        cluster.config_path(n)
        if cluster.is_running(n):
            try:
                with open_session(cluster, n, args.timeout) as s:
                    yield n, s
            except NodeUnavailable:
                if args.node:
                    raise


def connections_of(sessions, timeout: float) -> list[dict]:
    """Every client connection of the nodes of ``sessions`` ((node, NodeSession)
    pairs): RabbitMQ's info items, with ``channels_list`` (their channels and
    consumers), ``connected_at`` in ms since the epoch."""
    out = []
    for node, s in sessions:
        ans = s.front_end("connections", timeout=timeout)
        if not ans.ok:
            raise ClusterError(f"node {node}: {ans.error}")
        now = time.time()
        for c in ans.value:
            c["connected_at"] = int((now - c.pop("connected_for", 0.0)) * 1000)
            c["channels_list"] = c.pop("channels")
            c["channels"] = len(c["channels_list"])
            out.append(c)
    return out


def all_connections(args) -> list[dict]:
    """Every client connection of the cluster (see :func:`connections_of`)."""
    return connections_of(_each_running(args), op_timeout(args))


CONNECTION_ITEMS = (
    "pid",
    "name",
    "node",
    "host",
    "port",
    "peer_host",
    "peer_port",
    "ssl",
    "state",
    "channels",
    "protocol",
    "auth_mechanism",
    "user",
    "vhost",
    "timeout",
    "frame_max",
    "channel_max",
    "client_properties",
    "connected_at",
    "ssl_protocol",
    "ssl_cipher",
    "peer_cert_subject",
    "peer_cert_issuer",
    "peer_cert_validity",
)


def cmd_list_connections(args) -> int:
    items = _items(args, CONNECTION_ITEMS, ("user", "peer_host", "peer_port", "state"))
    return _listing(args, "Listing connections ...", all_connections(args), items)


CHANNEL_ITEMS = (
    "pid",
    "connection",
    "name",
    "number",
    "user",
    "vhost",
    "transactional",
    "confirm",
    "consumer_count",
    "messages_unacknowledged",
    "messages_uncommitted",
    "acks_uncommitted",
    "messages_unconfirmed",
    "prefetch_count",
    "global_prefetch_count",
    "state",
)


def channel_rows(connections: list[dict]) -> list[dict]:
    out = []
    for c in connections:
        for ch in c["channels_list"]:
            row = {k: v for k, v in ch.items() if k != "consumers"}
            row.update(
                pid=f"{c['pid'][:-1]}.{ch['number']}>",
                connection=c["pid"],
                name=f"{c['name']} ({ch['number']})",
                user=c["user"],
                vhost=c["vhost"],
            )
            row["consumers_list"] = ch["consumers"]
            out.append(row)
    return out


def cmd_list_channels(args) -> int:
    items = _items(args, CHANNEL_ITEMS, ("pid", "user", "consumer_count", "messages_unacknowledged"))
    return _listing(args, "Listing channels ...", channel_rows(all_connections(args)), items)


CONSUMER_ITEMS = (
    "queue_name",
    "channel_pid",
    "consumer_tag",
    "ack_required",
    "prefetch_count",
    "active",
    "activity_status",
    "arguments",
)


def consumer_rows(channels: list[dict], vhost: str | None) -> list[dict]:
    """Every consumer of ``channels`` (channel_rows) in ``vhost`` (None: all),
    with its channel row as ``channel`` (not an info item)."""
    rows = []
    for ch in channels:
        if vhost is not None and ch["vhost"] != vhost:
            continue
        for c in ch["consumers_list"]:
            rows.append(
                {
                    "queue_name": c["queue"],
                    "channel_pid": ch["pid"],
                    "consumer_tag": c["consumer_tag"],
                    "ack_required": c["ack_required"],
                    "prefetch_count": c["prefetch_count"],
                    "active": True,
                    "activity_status": "up",
                    "arguments": c["arguments"],
                    "channel": ch,
                }
            )
    rows.sort(key=lambda r: (r["channel"]["vhost"], r["queue_name"], r["consumer_tag"]))
    return rows


def cmd_list_consumers(args) -> int:
    items = _items(args, CONSUMER_ITEMS, CONSUMER_ITEMS)
    rows = consumer_rows(channel_rows(all_connections(args)), args.vhost)
    return _listing(args, f"Listing consumers in vhost {args.vhost} ...", rows, items)


def cmd_close_connection(args) -> int:
    target = args.connection.strip()
    if args.formatter != "json":
        print(f"Closing connection {target}, reason: {args.explanation}...")
    errors = []
    for node, s in _each_running(args):
        if target.startswith("<") and not target.strip("<>").startswith(f"{node}."):
            continue
        ans = s.front_end("close", target, args.explanation, timeout=op_timeout(args))
        if ans.ok:
            if args.formatter == "json":
                print(json.dumps({"closed": ans.value["pid"], "name": ans.value["name"], "node": node}))
            return 0
        errors.append(ans.error)
    raise ClusterError(f"close_connection: no connection {target!r} in the cluster")


# ---- the node: status, environment, report, await_startup, ping, node_health_check ---------------
def _one_node(args) -> tuple[Cluster, str]:
    cluster = Cluster(resolve_data_dir(args.data_dir))
    if args.node:
        cluster.config_path(args.node)
        return cluster, args.node
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    if not running:
        raise NodeUnavailable(f"no node of the cluster in {cluster.data_dir} is running")
    return cluster, running[0]


def node_status(cluster: Cluster, node: str, timeout: float) -> dict:
    """What ``status`` reports of one running node (raises NodeUnavailable if it does not answer)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    if not cluster.is_running(node):
        raise NodeUnavailable(f"node {node} is not running")
    with open_session(cluster, node, timeout) as s:
        st = s.status(min(timeout, 10.0))
    cfg = cluster.config(node)
    info = cluster.pid_info(node) or {}
    pid_file = cluster.data_dir / node / "node.pid"
    try:
        product_version = version("mirrorq")
    except PackageNotFoundError:
        product_version = "unknown"
    return {
        "node": st.name,
        "pid": st.pid,
        "pgid": st.pgid,
        "incarnation": st.incarnation,
        "os": f"{platform.system()} {platform.release()}",
        "product_name": "mirrorq",
        "product_version": product_version,
        "python_version": platform.python_version(),
        "uptime": round(time.time() - pid_file.stat().st_mtime, 1) if pid_file.exists() else None,
        "data_directory": str(cluster.data_dir / node),
        "config_files": [str(cluster.config_path(node))],
        "log_files": [str(cluster.data_dir / node / "node.log")],
        "listeners": [
            {"node": node, "protocol": "amqp", "interface": cfg.host, "port": st.amqp_port, "purpose": "AMQP 0-9-1"},
        ]
        + (
            [
                {
                    "node": node,
                    "protocol": "amqp/ssl",
                    "interface": cfg.host,
                    "port": cfg.amqps_port,
                    "purpose": "AMQP 0-9-1 over TLS",
                }
            ]
            if cfg.amqps_port
            else []
        )
        + [
            {
                "node": node,
                "protocol": "clustering",
                "interface": cfg.host,
                "port": st.admin_port,
                "purpose": "inter-node and CLI tool communication",
            },
        ]
        + (
            [
                {
                    "node": node,
                    "protocol": "http",
                    "interface": cfg.host,
                    "port": cfg.management_port,
                    "purpose": "HTTP API (management, /metrics, ring page)",
                }
            ]
            if cfg.management_port
            else []
        ),
        "memory": {
            "total": {"rss": group_rss(int(info.get("pgid") or st.pgid))},
            "limit": st.alarms.get("mem_limit"),
            "vm_memory_high_watermark": st.alarms.get("vm_memory_high_watermark"),
            "alarm": st.alarms.get("mem_alarm"),
        },
        "disk_free": st.alarms.get("disk_free"),
        "disk_free_limit": st.alarms.get("disk_free_limit"),
        "disk_free_alarm": st.alarms.get("disk_free_alarm"),
        "alarms": list(st.alarms.get("alarms") or []),
        "cluster": {n: v.get("state") for n, v in sorted(st.view.items())},
        "registry": st.registry,
    }


def cmd_status(args) -> int:
    cluster, node = _one_node(args)
    st = node_status(cluster, node, args.timeout or 10.0)
    if args.formatter == "json":
        print(json.dumps(st, default=str))
        return 0
    print(f"Status of node {node} ...")
    print(
        f"Runtime\n\nOS PID: {st['pid']}\nOS: {st['os']}\nUptime (seconds): {st['uptime']}\n"
        f"Product name: {st['product_name']}\nProduct version: {st['product_version']}\n"
        f"Python: {st['python_version']}\n\nData directory: {st['data_directory']}\n"
        f"Config files: {', '.join(st['config_files'])}\nLog file(s): {', '.join(st['log_files'])}\n"
        f"\nMemory\n\nTotal resident: {st['memory']['total']['rss'] / 2**20:.1f} MiB\n"
        f"Memory high watermark setting: {st['memory']['vm_memory_high_watermark']}, "
        f"computed to: {_mib(st['memory']['limit'])}\n"
        f"\nDisk\n\nFree space of the data directory's file system: {_mib(st['disk_free'])}\n"
        f"Disk free limit: {_mib(st['disk_free_limit'])}\n"
        f"\nAlarms\n\n{alarm_lines(st['alarms'])}\n"
        f"\nRegistry (Raft): role {st['registry'].get('role')}, term {st['registry'].get('term')}, "
        f"leader {st['registry'].get('leader')}, commit index {st['registry'].get('commit_index')}\n"
        f"\nCluster view\n\n"
        + "\n".join(f"{n}: {v}" for n, v in st["cluster"].items())
        + "\n\nListeners\n\n"
        + "\n".join(
            f"Interface: {li['interface']}, port: {li['port']}, protocol: {li['protocol']}, purpose: {li['purpose']}"
            for li in st["listeners"]
        )
    )
    return 0


def _mib(n: Any) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def alarm_lines(alarms: list[dict]) -> str:
    """rabbitmqctl status' alarm lines ("(none)" when there are none)."""
    what = {alarmsmod.MEMORY: "Memory alarm", alarmsmod.DISK: "Free disk space alarm"}
    return "\n".join(f"{what.get(a['resource'], a['resource'])} on node {a['node']}" for a in alarms) or "(none)"


def set_resource_limit(s: NodeSession, resource: str, setting: Any, timeout: float) -> dict:
    """Change a node's memory watermark or disk free limit until it restarts;
    its figures after a check with the new limit."""
    from mirrorq.node.messages import ResourceLimitResult, SetResourceLimit

    res = s.client.ask(SetResourceLimit(resource, setting), timeout)
    if not isinstance(res, ResourceLimitResult):
        raise CommandTimeout(f"node {s.node} did not answer within {timeout:g}s")
    if not res.ok:
        raise Invalid(res.error)
    return res.alarms


def _limit_setting(args, resource: str) -> Any:
    """The setting rabbitmqctl's arguments name (``FRACTION`` / ``absolute SIZE``,
    ``SIZE`` / ``mem_relative X``), checked as node.yaml's; UsageError if bad."""
    words = args.limit
    memory = resource == alarmsmod.MEMORY
    keyword = "absolute" if memory else "mem_relative"
    try:
        if len(words) == 2 and words[0] == keyword:
            value: Any = float(words[1]) if keyword == "mem_relative" else words[1]
            setting: Any = {keyword: value}
        elif len(words) == 1:
            setting = float(words[0]) if memory else words[0]
        else:
            raise ValueError(
                f"expected {'FRACTION' if memory else 'SIZE'} or {keyword} "
                f"{'SIZE' if memory else 'X'}, got {' '.join(words)!r}"
            )
        (alarmsmod.parse_memory_watermark if memory else alarmsmod.parse_disk_free_limit)(setting)
    except ValueError as e:
        raise UsageError(f"{args.command}: {e}") from None
    return setting


def _set_limit_command(args, resource: str, what: str) -> int:
    setting = _limit_setting(args, resource)
    cluster, node = _one_node(args)
    banner(args, f"Setting {what} on {node} to {' '.join(args.limit)} ...")
    with open_session(cluster, node, args.timeout) as s:
        figures = set_resource_limit(s, resource, setting, args.timeout or 10.0)
    if args.formatter == "json":
        print(json.dumps({"node": node, **figures}, default=str))
    return 0


def cmd_set_vm_memory_high_watermark(args) -> int:
    return _set_limit_command(args, alarmsmod.MEMORY, "memory threshold")


def cmd_set_disk_free_limit(args) -> int:
    return _set_limit_command(args, alarmsmod.DISK, "disk free limit")


def cmd_environment(args) -> int:
    cluster, node = _one_node(args)
    env = {"mirrorq": cluster.config(node).to_dict()}
    if args.formatter == "json":
        print(json.dumps(env, default=str))
        return 0
    print(f"Application environment of node {node} ...")
    for k, v in sorted(env["mirrorq"].items()):
        print(f"  {k}: {v}")
    return 0


def cmd_report(args) -> int:
    """status, cluster status, environment, then every listing, per vhost (rabbitmqctl report)."""
    cluster, node = _one_node(args)
    report: dict[str, Any] = {
        "status": node_status(cluster, node, args.timeout or 10.0),
        "environment": {"mirrorq": cluster.config(node).to_dict()},
        "cluster_status": node_rows(cluster, cluster.node_names()),
    }
    conns = all_connections(args)
    chans = channel_rows(conns)
    report["connections"] = [{k: v for k, v in c.items() if k != "channels_list"} for c in conns]
    report["channels"] = [{k: v for k, v in ch.items() if k != "consumers_list"} for ch in chans]
    with connect(args) as s:
        users, perms = s.rows("user"), s.rows("permission")
        queues, exchanges, bindings = s.rows("amqqueue"), s.rows("exchange"), s.rows("binding")
        policies = load_policies(s)
        up = s.nodes_up()
        infos = live_infos(s, queues, up, op_timeout(args))
        report["users"] = user_rows(users)
        report["vhosts"] = {}
        for v in vhost_names(s.rows("vhost")):
            vq = sorted((q for q in queues if q["vhost"] == v), key=lambda q: q["name"])
            report["vhosts"][v] = {
                "queues": queue_rows(vq, policies, infos, up, list(QUEUE_ITEMS)),
                "exchanges": exchange_rows(v, exchanges, policies),
                "bindings": binding_rows(v, queues, bindings),
                "consumers": _pick(
                    consumer_rows(chans, v),
                    ["queue_name", "channel_pid", "consumer_tag", "ack_required", "prefetch_count"],
                ),
                "permissions": [p for p in permission_rows(users, perms) if p["vhost"] == v],
                "policies": policy_listing(policies, v),
            }
    if args.formatter == "json":
        print(json.dumps(report, default=str))
        return 0
    print(f"Reporting server status of node {node} ...\n")
    for section in ("status", "environment", "cluster_status", "users", "connections", "channels"):
        print(f"== {section} ==")
        print(json.dumps(report[section], indent=2, default=str))
    for v, sections in report["vhosts"].items():
        for section, rows in sections.items():
            print(f"== {section} of vhost {v} ==")
            print(json.dumps(rows, indent=2, default=str))
    return 0


#: await_startup's default wait (rabbitmqctl's)
AWAIT_STARTUP_TIMEOUT = 300.0


def _startup_problem(cluster: Cluster, node: str, timeout: float) -> str:
    """'' once ``node`` is fully started (agent answers, its registry knows a
    leader, its queue manager registered, its AMQP front end answers), else what is missing."""
    if not cluster.is_running(node):
        return f"node {node} is not running"
    try:
        with open_session(cluster, node, timeout) as s:
            st = s.status(min(timeout, 3.0))
            if not st.registry.get("leader"):
                return f"node {node}: its registry has no leader yet"
            if not cluster.manager_registered(node, min(timeout, 3.0)):
                return f"node {node}: its queue manager has not registered yet"
            ans = s.front_end("connections", timeout=min(timeout, 3.0))
            if not ans.ok:
                return f"node {node}: AMQP front end: {ans.error}"
    except ClusterError as e:
        return str(e)
    return ""


def cmd_await_startup(args) -> int:
    from ctl.cluster import poll

    cluster, node = _one_node(args) if args.node else (Cluster(resolve_data_dir(args.data_dir)), None)
    if node is None:
        names = cluster.node_names()
        node = next((n for n in names if cluster.is_running(n)), names[0])
    timeout = AWAIT_STARTUP_TIMEOUT if args.timeout is None else args.timeout
    last = {"why": ""}

    def started() -> bool:
        last["why"] = _startup_problem(cluster, node, 3.0)
        return not last["why"]

    if poll(started, timeout, step=0.2):
        return 0
    if not cluster.is_running(node):
        raise NodeUnavailable(f"node {node} did not start within {timeout:g}s: {last['why']}")
    raise CommandTimeout(f"node {node} did not finish starting within {timeout:g}s: {last['why']}")


def cmd_ping(args) -> int:
    cluster, node = _one_node(args) if args.node else (Cluster(resolve_data_dir(args.data_dir)), None)
    if node is None:
        names = cluster.node_names()
        node = next((n for n in names if cluster.is_running(n)), names[0])
    timeout = 60.0 if args.timeout is None else args.timeout
    if args.formatter != "json":
        print(
            f"Will ping {node}. This only checks if the node's process is running and answers. "
            f"Timeout: {int(timeout * 1000)} ms."
        )
    if not cluster.is_running(node):
        raise NodeUnavailable(f"node {node} is not running")
    with open_session(cluster, node, timeout) as s:
        s.status(timeout)
    if args.formatter == "json":
        print(json.dumps({"result": "ok", "node": node}))
    else:
        print("Ping succeeded")
    return 0


def cmd_node_health_check(args) -> int:
    cluster, node = _one_node(args)
    timeout = 70.0 if args.timeout is None else args.timeout
    if args.formatter != "json":
        print(f"Timeout: {timeout:g} seconds ...\nChecking health of node {node} ...")
    why = _startup_problem(cluster, node, timeout)
    if why:
        raise ClusterError(f"health check failed: {why}")
    if args.formatter == "json":
        print(json.dumps({"result": "ok", "node": node}))
    else:
        print("Health check passed")
    return 0


def _common() -> _Parser:
    p = _Parser(add_help=False)
    p.add_argument(
        "--data-dir", default=argparse.SUPPRESS, help="cluster data dir (else $MIRRORQ_DATA_DIR, else ~/.mirrorq)"
    )
    p.add_argument("-n", "--node", default=argparse.SUPPRESS, help="node to talk to")
    p.add_argument("--formatter", choices=["table", "json"], default=argparse.SUPPRESS)
    p.add_argument(
        "-t",
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds for the operation (queue masters: 5 by default; registry work: 30)",
    )
    return p


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 64 (EX_USAGE), as rabbitmqctl's."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(UsageError.exit_code, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(prog="mirrorctl", parents=[common], description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cl = sub.add_parser("cluster", parents=[common], help="local cluster launcher")
    clsub = cl.add_subparsers(dest="action", required=True)
    st = clsub.add_parser("start", parents=[common], help="start N nodes on loopback")
    st.add_argument("--nodes", type=int, default=None)
    st.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="first Thespian admin port")
    st.add_argument("--amqp-base-port", type=int, default=DEFAULT_AMQP_BASE_PORT, help="first AMQP port")
    st.add_argument(
        "--management-base-port",
        type=int,
        default=None,
        help="first HTTP management port (default: the AMQP port + 10000; 0: no management server)",
    )
    st.add_argument("--heartbeat-interval", type=float, default=0.2)
    st.add_argument("--heartbeat-timeout", type=float, default=1.5)
    st.add_argument("--registry-snapshot-every", type=int, default=1000)
    st.add_argument(
        "--amqp-shell",
        choices=AMQP_SHELLS,
        default=None,
        help="AMQP socket shell of the new nodes: watch (default) or asyncio",
    )
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
    p.add_argument("--management-port", type=int, default=None)
    p.set_defaults(func=cmd_add_node)
    p = sub.add_parser(
        "forget_cluster_node", parents=[common], help="remove a stopped node from the registry's Raft configuration"
    )
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
    p = sub.add_parser("clear_permissions", parents=[common], help="remove a user's permissions in a vhost")
    vhost_arg(p)
    p.add_argument("username")
    p.set_defaults(func=cmd_clear_permissions)
    p = sub.add_parser("list_queues", parents=[common], help="queues of a vhost with info items")
    vhost_arg(p)
    p.add_argument("items", nargs="*", metavar="INFO_ITEM", help=f"any of: {' '.join(QUEUE_ITEMS)}")
    p.set_defaults(func=cmd_list_queues)
    for name, func, help_ in (
        ("sync_queue", cmd_sync_queue, "synchronise a queue's unsynchronised mirrors"),
        ("cancel_sync_queue", cmd_cancel_sync_queue, "stop a queue's running synchronisation"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_)
        vhost_arg(p)
        p.add_argument("name")
        p.set_defaults(func=func)
    p = sub.add_parser("quorum_status", parents=[common], help="a quorum queue's members and their Raft state")
    vhost_arg(p)
    p.add_argument("name")
    p.set_defaults(func=cmd_quorum_status)
    for name, func, help_ in (
        ("add_member", cmd_add_member, "add a member on NODE to a quorum queue (a voter once caught up)"),
        ("delete_member", cmd_delete_member, "remove a quorum queue's member on NODE"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_)
        vhost_arg(p)
        p.add_argument("name")
        p.add_argument("member_node", metavar="NODE")
        p.set_defaults(func=func)
    p = sub.add_parser("grow", parents=[common], help="add a member on NODE to every quorum queue without one there")
    p.add_argument("member_node", metavar="NODE")
    p.add_argument(
        "strategy",
        nargs="?",
        choices=["all", "even"],
        default="all",
        help="all (default), or even: only queues with an even number of members",
    )
    p.add_argument("--vhost-pattern", default=".*")
    p.add_argument("--queue-pattern", default=".*")
    p.add_argument("--errors-only", action="store_true")
    p.set_defaults(func=cmd_grow)
    p = sub.add_parser("shrink", parents=[common], help="remove NODE's member from every quorum queue with more")
    p.add_argument("member_node", metavar="NODE")
    p.add_argument("--errors-only", action="store_true")
    p.set_defaults(func=cmd_shrink)

    # ---- rabbitmqctl's listings and operations -------------------------------------------
    def listing(name: str, func, help_: str, items: tuple, vhost: bool = True) -> _Parser:
        p = sub.add_parser(name, parents=[common], help=help_)
        if vhost:
            vhost_arg(p)
        if items:
            p.add_argument("items", nargs="*", metavar="INFO_ITEM", help=f"any of: {' '.join(items)}")
        p.set_defaults(func=func)
        return p

    listing("list_exchanges", cmd_list_exchanges, "exchanges of a vhost", EXCHANGE_ITEMS)
    listing("list_bindings", cmd_list_bindings, "bindings of a vhost", BINDING_ITEMS)
    listing("list_consumers", cmd_list_consumers, "consumers of a vhost", CONSUMER_ITEMS)
    listing("list_connections", cmd_list_connections, "client connections of every node", CONNECTION_ITEMS, vhost=False)
    listing("list_channels", cmd_list_channels, "channels of every node", CHANNEL_ITEMS, vhost=False)
    listing("list_users", cmd_list_users, "users and their tags", (), vhost=False)
    listing("list_vhosts", cmd_list_vhosts, "virtual hosts", VHOST_ITEMS, vhost=False)
    listing("list_permissions", cmd_list_permissions, "users' permissions in a vhost", ())
    p = listing(
        "list_user_permissions", cmd_list_user_permissions, "a user's permissions in every vhost", (), vhost=False
    )
    p.add_argument("username")
    p = sub.add_parser("purge_queue", parents=[common], help="remove a queue's ready messages")
    vhost_arg(p)
    p.add_argument("name")
    p.set_defaults(func=cmd_purge_queue)
    p = sub.add_parser("delete_queue", parents=[common], help="delete a queue")
    vhost_arg(p)
    p.add_argument("-e", "--if-empty", action="store_true", help="only if it has no messages")
    p.add_argument("-u", "--if-unused", action="store_true", help="only if it has no consumers")
    p.add_argument("name")
    p.set_defaults(func=cmd_delete_queue)
    p = sub.add_parser("delete_vhost", parents=[common], help="delete a virtual host and everything in it")
    p.add_argument("vhost_name")
    p.set_defaults(func=cmd_delete_vhost)
    p = sub.add_parser("change_password", parents=[common], help="set a user's password")
    p.add_argument("username")
    p.add_argument("password")
    p.set_defaults(func=cmd_change_password)
    p = sub.add_parser("set_user_tags", parents=[common], help="replace a user's tags (none: clear them)")
    p.add_argument("username")
    p.add_argument("tags", nargs="*")
    p.set_defaults(func=cmd_set_user_tags)
    p = sub.add_parser("close_connection", parents=[common], help="close a client connection (320 CONNECTION_FORCED)")
    p.add_argument("connection", help="its pid (<node.N>, see list_connections pid) or name")
    p.add_argument("explanation")
    p.set_defaults(func=cmd_close_connection)
    for name, func, help_ in (
        ("status", cmd_status, "one node's status"),
        ("environment", cmd_environment, "one node's configuration"),
        ("report", cmd_report, "everything, for a support request"),
        ("await_startup", cmd_await_startup, "wait until a node has fully started (--timeout, default 300)"),
        ("ping", cmd_ping, "check that a node is running and answers"),
        (
            "node_health_check",
            cmd_node_health_check,
            "check a node's agent, registry, queue manager and AMQP front end",
        ),
    ):
        sub.add_parser(name, parents=[common], help=help_).set_defaults(func=func)
    p = sub.add_parser(
        "set_vm_memory_high_watermark",
        parents=[common],
        help="a node's memory alarm limit until it restarts: FRACTION of RAM, or absolute SIZE",
    )
    p.add_argument("limit", nargs="+", metavar="FRACTION | absolute SIZE")
    p.set_defaults(func=cmd_set_vm_memory_high_watermark)
    p = sub.add_parser(
        "set_disk_free_limit",
        parents=[common],
        help="a node's disk alarm limit until it restarts: SIZE (50MB, 1GiB...) or mem_relative X",
    )
    p.add_argument("limit", nargs="+", metavar="SIZE | mem_relative X")
    p.set_defaults(func=cmd_set_disk_free_limit)
    p = sub.add_parser("ring", parents=[common], help="every queue's GM ring: replicas in ring order and their states")
    p.add_argument("-p", "--vhost", default=None, help="only this virtual host (default: all)")
    p.add_argument("--watch", action="store_true", help="redraw until Ctrl-C (a live view)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames with --watch")
    p.add_argument("--count", type=int, default=0, help="stop after N frames with --watch (0: never)")
    p.set_defaults(func=cmd_ring)
    p = sub.add_parser(
        "audit", parents=[common], help="check the nodes' and clients' histories with Spark (report.md + timeline.png)"
    )
    p.add_argument(
        "--history",
        action="append",
        default=[],
        metavar="FILE",
        help="a client history (JSON lines, format in mirrorq/spark/audit.py); repeatable, globs allowed",
    )
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
    for attr, default in (("data_dir", None), ("node", None), ("formatter", "table"), ("timeout", None)):
        if not hasattr(args, attr):
            setattr(args, attr, default)
    if args.timeout is not None and args.timeout <= 0:
        print(f"mirrorctl: error: --timeout must be positive, got {args.timeout:g}", file=sys.stderr)
        return UsageError.exit_code
    from mirrorq.node.client import NodeUnreachable

    try:
        return args.func(args)
    except ClusterError as e:
        print(f"mirrorctl: error: {e}", file=sys.stderr)
        return e.exit_code
    except NodeUnreachable as e:
        print(f"mirrorctl: error: {e}", file=sys.stderr)
        return NodeUnavailable.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - any other failure is EX_SOFTWARE with one line, as rabbitmqctl
        print(f"mirrorctl: error: {type(e).__name__}: {e}", file=sys.stderr)
        return ClusterError.exit_code


if __name__ == "__main__":
    sys.exit(main())
