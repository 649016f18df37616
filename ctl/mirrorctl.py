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
environment variable ``MIRRORQ_DATA_DIR``, else ``~/.mirrorq``; or, with
``--address HOST:ADMIN_PORT`` and ``--secret-file F`` (or
``$MIRRORQ_SECRET_FILE``), through any node of a cluster on other hosts
(mirrorq.admin.remote: everything but starting and stopping nodes).  ``-n NODE``
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

from mirrorq.admin.cluster import (
    DEFAULT_AMQP_BASE_PORT,
    DEFAULT_BASE_PORT,
    Cluster,
    ClusterError,
    CommandTimeout,
    Invalid,
    NodeUnavailable,
    UsageError,
    resolve_data_dir,
)
from mirrorq.admin.ops import (
    BINDING_ITEMS,
    CHANNEL_ITEMS,
    CONNECTION_ITEMS,
    CONSUMER_ITEMS,
    DEFAULT_QUEUE_ITEMS,
    EXCHANGE_ITEMS,
    LIVE_ITEMS,
    PERMISSION_ITEMS,
    POLICY_COLUMNS,
    QUEUE_ITEMS,
    QUORUM_STATUS_COLUMNS,
    USER_ITEMS,
    VHOST_ITEMS,
    _cell,
    _members,
    _mib,
    add_user,
    add_vhost,
    alarm_lines,
    binding_rows,
    change_user,
    channel_rows,
    clear_permissions,
    clear_policy,
    close_connection,
    connections_of,
    consumer_rows,
    delete_queue,
    delete_user,
    delete_vhost,
    exchange_rows,
    grow_plan,
    load_policies,
    make_policy,
    member_error,
    node_rows,
    node_status,
    permission_rows,
    queue_command,
    queue_rows,
    queue_snapshot,
    quorum_status_rows,
    set_permissions,
    set_policy,
    set_resource_limit,
    shrink_plan,
    user_rows,
    vhost_names,
    vhost_rows,
)
from mirrorq.admin.session import NodeSession, live_infos, node_of_member, open_session
from mirrorq.node import alarms as alarmsmod
from mirrorq.node.config import AMQP_SHELLS
from mirrorq.policy.records import PolicyValidationError
from mirrorq.policy.store import (
    definition_json,
    parse_definition,
    policy_listing,
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


def cluster_of(args) -> Cluster:
    """The cluster a command works on: through ``--address`` (a node on any
    host: :class:`~mirrorq.admin.remote.RemoteCluster`), else the local
    cluster of the data dir."""
    if args.address:
        from mirrorq.admin.remote import RemoteCluster

        return RemoteCluster(args.address, args.secret_file)
    return Cluster(resolve_data_dir(args.data_dir))


# ---- commands -------------------------------------------------------------------
def cmd_cluster_start(args) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {args.nodes}")
    if args.address:
        raise UsageError("cluster start launches a local cluster: it takes no --address")
    cluster = cluster_of(args)
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
    cluster = cluster_of(args)
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
    cluster = cluster_of(args)
    names = cluster.node_names()
    if args.node:
        cluster.config_path(args.node)
        names = [args.node]
    _node_table(args, cluster, names)
    return 0


def cmd_cluster_view(args) -> int:
    """cluster_status: every node as seen by every node (or by -n NODE)."""
    cluster = cluster_of(args)
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
    cluster = cluster_of(args)
    cluster.start_node(args.name)
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    cluster.wait_all_up(running, START_WAIT, managers=False)
    print(f"started {args.name}")
    return 0


def cmd_stop_node(args) -> int:
    cluster = cluster_of(args)
    if not cluster.stop_node(args.name):
        raise ClusterError(f"node {args.name} is not running")
    print(f"stopped {args.name}")
    return 0


def cmd_kill_node(args) -> int:
    cluster = cluster_of(args)
    if not cluster.kill_node(args.name):
        raise ClusterError(f"node {args.name} is not running")
    print(f"killed {args.name}")
    return 0


def cmd_add_node(args) -> int:
    cluster = cluster_of(args)
    name = cluster.add_node(args.name, args.admin_port, args.amqp_port, management_port=args.management_port)
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    cluster.wait_all_up(running, START_WAIT, managers=False)
    print(f"added {name} (it joins the registry through its Raft leader)")
    return 0


def cmd_forget_cluster_node(args) -> int:
    cluster = cluster_of(args)
    via = cluster.forget_node(args.name, args.node)
    print(f"forgot {args.name} (through {via})")
    return 0


# ---- policies and queues: through one node's agent and queue manager -----------------
def connect(args) -> NodeSession:
    """A session (mirrorq.admin.session) with ``-n NODE``, else with the first running
    node of the layout; its registry work has ``--timeout`` seconds."""
    return open_session(cluster_of(args), args.node, args.timeout)


def op_timeout(args) -> float:
    """Seconds a queue master has to answer (``--timeout``, default 5)."""
    return QUEUE_OP_TIMEOUT if args.timeout is None else args.timeout


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
        value = queue_command(s, args.vhost, args.name, command, op_timeout(args))
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "command": command, "result": value}, default=str))
    elif value not in (None, True, {}):
        print(value if isinstance(value, str) else json.dumps(value, default=str))
    return 0


def cmd_sync_queue(args) -> int:
    return _queue_command(args, "sync", f"Synchronising queue '{args.name}' in vhost '{args.vhost}' ...")


def cmd_cancel_sync_queue(args) -> int:
    return _queue_command(
        args, "cancel_sync", f"Stopping synchronising queue '{args.name}' in vhost '{args.vhost}' ..."
    )


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
                    "members": [node_of_member(m) for m in members],
                }
            )
        )
    return 0


def cmd_add_member(args) -> int:
    return _member_change(args, "add")


def cmd_delete_member(args) -> int:
    return _member_change(args, "delete")


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


def cmd_delete_user(args) -> int:
    banner(args, f'Deleting user "{args.username}" ...')
    with connect(args) as s:
        delete_user(s, args.username)
    return 0


def cmd_add_vhost(args) -> int:
    banner(args, f'Adding vhost "{args.vhost_name}" ...')
    with connect(args) as s:
        if not add_vhost(s, args.vhost_name):
            raise ClusterError(f"add_vhost: vhost '{args.vhost_name}' already exists")
    return 0


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


def cmd_list_users(args) -> int:
    with connect(args) as s:
        rows = user_rows(s.rows("user"))
    return _listing(args, "Listing users ...", rows, list(USER_ITEMS))


def cmd_list_vhosts(args) -> int:
    items = _items(args, VHOST_ITEMS, ("name",))
    with connect(args) as s:
        names = vhost_names(s.rows("vhost"))
        up = s.nodes_up() if "cluster_state" in items else set()
    rows = vhost_rows(names, up)
    return _listing(args, "Listing vhosts ...", rows, items)


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


def cmd_list_exchanges(args) -> int:
    items = _items(args, EXCHANGE_ITEMS, ("name", "type"))
    with connect(args) as s:
        _check_vhost(s, args.vhost)
        rows = exchange_rows(args.vhost, s.rows("exchange"), load_policies(s) if "policy" in items else [])
    return _listing(args, f"Listing exchanges for vhost {args.vhost} ...", rows, items)


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
        removed = queue_command(s, args.vhost, args.name, "purge", op_timeout(args))
    if args.formatter == "json":
        print(json.dumps({"vhost": args.vhost, "name": args.name, "message_count": removed}))
    return 0


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
    cluster = cluster_of(args)
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


def all_connections(args) -> list[dict]:
    """Every client connection of the cluster (see :func:`connections_of`)."""
    return connections_of(_each_running(args), op_timeout(args))


def cmd_list_connections(args) -> int:
    items = _items(args, CONNECTION_ITEMS, ("user", "peer_host", "peer_port", "state"))
    return _listing(args, "Listing connections ...", all_connections(args), items)


def cmd_list_channels(args) -> int:
    items = _items(args, CHANNEL_ITEMS, ("pid", "user", "consumer_count", "messages_unacknowledged"))
    return _listing(args, "Listing channels ...", channel_rows(all_connections(args)), items)


def cmd_list_consumers(args) -> int:
    items = _items(args, CONSUMER_ITEMS, CONSUMER_ITEMS)
    rows = consumer_rows(channel_rows(all_connections(args)), args.vhost)
    return _listing(args, f"Listing consumers in vhost {args.vhost} ...", rows, items)


def cmd_close_connection(args) -> int:
    target = args.connection.strip()
    if args.formatter != "json":
        print(f"Closing connection {target}, reason: {args.explanation}...")
    closed = close_connection(_each_running(args), target, args.explanation, op_timeout(args))  # NotFound: 70
    if args.formatter == "json":
        print(json.dumps({"closed": closed["pid"], "name": closed["name"], "node": closed["node"]}))
    return 0


# ---- the node: status, environment, report, await_startup, ping, node_health_check ---------------
def _one_node(args) -> tuple[Cluster, str]:
    cluster = cluster_of(args)
    if args.node:
        cluster.config_path(args.node)
        return cluster, args.node
    running = [n for n in cluster.node_names() if cluster.is_running(n)]
    if not running:
        raise NodeUnavailable(f"no node of the cluster in {cluster.data_dir} is running")
    return cluster, running[0]


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
    from mirrorq.admin.cluster import poll

    cluster, node = _one_node(args) if args.node else (cluster_of(args), None)
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
    cluster, node = _one_node(args) if args.node else (cluster_of(args), None)
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
    p.add_argument(
        "--address",
        default=argparse.SUPPRESS,
        metavar="HOST:ADMIN_PORT",
        help="reach the cluster through this node (any host) instead of a local data dir; needs the secret",
    )
    p.add_argument(
        "--secret-file",
        default=argparse.SUPPRESS,
        help="the cluster's secret (a copy of the nodes' secret_file) for --address (else $MIRRORQ_SECRET_FILE)",
    )
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
    for attr, default in (
        ("data_dir", None),
        ("node", None),
        ("formatter", "table"),
        ("timeout", None),
        ("address", None),
        ("secret_file", None),
    ):
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
