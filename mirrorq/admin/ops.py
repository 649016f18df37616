"""mirrorq's admin layer: the listings and operations behind mirrorctl and the HTTP API.

Every function here works on a :class:`~mirrorq.admin.session.NodeSession`
(one running node) or on rows already read, and returns data: rows keyed
by rabbitmqctl's info items, or the outcome of an operation.  Printing,
argument parsing and exit codes are mirrorctl's (:mod:`ctl.mirrorctl`);
renaming rows to the HTTP API's shapes is :mod:`mirrorq.mgmt.shapes`'.
So the command line and the API read and change the cluster the same way.

Errors are :mod:`mirrorq.admin.cluster`'s: ``NotFound``, ``Invalid``,
``NodeUnavailable``, ``CommandTimeout`` and any other ``ClusterError``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mirrorq.admin.cluster import (
    Cluster,
    ClusterError,
    CommandTimeout,
    Invalid,
    NodeUnavailable,
    NotFound,
    UsageError,
)
from mirrorq.admin.session import NodeSession, live_infos, node_of_member, open_session
from mirrorq.amqp.topology import client_arguments
from mirrorq.node import alarms as alarmsmod
from mirrorq.node.daemon import group_rss
from mirrorq.policy.records import Policy, PolicyValidationError
from mirrorq.policy.store import (
    clear_policy_txn,
    definition_json,
    policies_from_rows,
    set_policy_txn,
)


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


POLICY_COLUMNS = ["vhost", "name", "pattern", "apply-to", "definition", "priority"]


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
    master = node_of_member(record.get("pid"))
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
    mirrorq.store.corruption), shown after the queue's ``state``."""
    from mirrorq.store.corruption import describe

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
                row[item] = node_of_member(r.get("pid"))
            elif item == "slave_pids":
                row[item] = [node_of_member(m) for m in r.get("slave_pids") or ()]
            elif item == "synchronised_slave_pids":
                row[item] = [node_of_member(m) for m in r.get("sync_slave_pids") or ()]
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
                row[item] = node_of_member(r.get("pid"))
            elif item in ("members", "online"):
                members = [node_of_member(m) for m in _members(r)]
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
                "Node Name": node_of_member(member) if member else None,
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
        if any(node_of_member(m) == node for m in members) or (strategy == "even" and len(members) % 2):
            continue
        out.append(r)
    return out


def shrink_plan(records: list[dict], node: str) -> list[dict]:
    """The quorum queues with a member on ``node`` (``shrink`` removes it
    where it is not the last one)."""
    return [
        r
        for r in sorted(records, key=lambda r: (r["vhost"], r["name"]))
        if r.get("type") == "quorum" and any(node_of_member(m) == node for m in _members(r))
    ]


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


# ---- users, vhosts, permissions: listings and changes -------------------------------------
USER_ITEMS = ("user", "tags")


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


PERMISSION_ITEMS = ("user", "configure", "write", "read")


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


#: the queue actions RabbitMQ's API takes (``POST /api/queues/{vhost}/{name}/actions``) and mirrorctl's commands
QUEUE_ACTIONS = ("sync", "cancel_sync")


def queue_command(s: NodeSession, vhost: str, name: str, command: str, timeout: float) -> Any:
    """A queue command run by the queue's master ("purge", "sync", "cancel_sync"): its answer's value
    (purge: the messages removed; sync: {"invited", "running"}; cancel_sync: {"cancelled"})."""
    (res,) = s.queue_ops(command, [(vhost, name)], timeout=timeout)
    if not res["ok"]:
        err = f"{command} of queue '{name}' in vhost '{vhost}' failed: {res['error']}"
        raise NotFound(err) if str(res["error"]).startswith("no queue ") else ClusterError(err)
    return res["value"]


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


def close_connection(sessions, target: str, reason: str, timeout: float) -> dict:
    """Close client connection ``target`` (its pid ``<node.N>`` or its name)
    on whichever node of ``sessions`` ((node, NodeSession) pairs) holds it,
    with 320 CONNECTION_FORCED and ``reason``: ``{"pid", "name", "node"}``;
    NotFound when no node has it."""
    target = target.strip()
    for node, s in sessions:
        if target.startswith("<") and not target.strip("<>").startswith(f"{node}."):
            continue
        ans = s.front_end("close", target, reason, timeout=timeout)
        if ans.ok:
            return {**ans.value, "node": node}
    raise NotFound(f"close_connection: no connection {target!r} in the cluster")


def queue_hosts(records: list[dict]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Each node's queues (amqqueue records): ``{"masters": [(vhost, name)...],
    "mirrors": [...]}`` -- a quorum queue's leader counts as its master and
    its other members as mirrors (pure)."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for r in sorted(records, key=lambda r: (r["vhost"], r["name"])):
        key = (r["vhost"], r["name"])
        master = node_of_member(r.get("pid"))
        if master:
            out.setdefault(master, {"masters": [], "mirrors": []})["masters"].append(key)
        for m in _members(r):
            n = node_of_member(m)
            if n and n != master:
                out.setdefault(n, {"masters": [], "mirrors": []})["mirrors"].append(key)
    return out


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
    pid_file = Path(cfg.data_dir) / "node.pid"
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
        "data_directory": cfg.data_dir,
        "config_files": [str(cluster.config_path(node))],
        "log_files": [str(Path(cfg.data_dir) / "node.log")],
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
