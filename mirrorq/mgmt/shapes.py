"""mirrorctl's rows as RabbitMQ management API objects (pure functions).

The rows come from the admin layer, :mod:`mirrorq.admin.ops` (``queue_rows``, ``exchange_rows``,
``binding_rows``, ``connections_of``, ``channel_rows``, ``consumer_rows``,
``user_rows``, ``vhost_rows``, ``permission_rows``) and
:mod:`mirrorq.admin.ring` (``ring_rows``); here they only get the names and
nesting RabbitMQ's HTTP API gives them (``/api/queues`` objects have
``node``, ``slave_nodes``, ``message_stats`` with ``*_details.rate``...).
What mirrorq has beyond RabbitMQ rides along under names RabbitMQ does not
use: a queue's ``ring`` (its GM ring in forwarding order, each member's
state and sync progress), ``mirror_lag``, ``alerts``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from mirrorq.admin.ops import CONNECTION_ITEMS

#: the counters a queue master keeps (mirrorq.classic.replica ``message_stats``)
MESSAGE_STATS = ("publish", "deliver_get", "ack", "confirm")
#: queue depths that get a ``_details.rate`` too
DEPTHS = ("messages", "messages_ready", "messages_unacknowledged")

Rate = Callable[[Any, Any, bool], float]  # (key, value, is_counter) -> per second


def sync_fraction(p: dict | None) -> float | None:
    """A running sync's progress 0..1 from the master's ``sync_progress`` entry."""
    if not p:
        return None
    span = (p.get("until") or 0) - (p.get("start") or 0)
    if span <= 0:
        return 1.0
    return max(0.0, min(1.0, ((p.get("position") or 0) - (p.get("start") or 0)) / span))


def queue_json(row: dict, ring: dict, live: dict | None, vhost: str, rate: Rate) -> dict:
    """One ``/api/queues`` object.  ``row``: a queue_rows row with every
    info item; ``ring``: its ring_rows row; ``live``: its master's ``info``
    (None: the master did not answer); ``rate(key, value, counter)``."""
    key = (vhost, row["name"])
    state, *alerts = (row.get("state") or "down").split("; ")
    word, _, n = state.partition(" ")
    out: dict[str, Any] = {
        "name": row["name"],
        "vhost": vhost,
        "type": "classic",
        "durable": row["durable"],
        "auto_delete": row["auto_delete"],
        "exclusive": row["exclusive"],
        "arguments": row["arguments"],
        "node": row["pid"],
        "slave_nodes": row["slave_pids"],
        "synchronised_slave_nodes": row["synchronised_slave_pids"],
        "policy": row["policy"],
        "effective_policy_definition": row["effective_policy_definition"],
        "consumers": row["consumers"],
        "state": word,
        "alerts": alerts,
    }
    if word == "syncing":
        out["sync_messages"] = int(n) if n.isdigit() else 0
    for d in DEPTHS:
        out[d] = row[d]
        out[f"{d}_details"] = {"rate": rate(key + (d,), row[d], False)}
    live = live or {}
    for k in ("message_bytes", "message_bytes_ready", "message_bytes_unacknowledged"):
        out[k] = live.get(k)
    stats = live.get("message_stats") or {}
    out["message_stats"] = {}
    for k in MESSAGE_STATS:
        if k in stats:
            out["message_stats"][k] = stats[k]
            out["message_stats"][f"{k}_details"] = {"rate": rate(key + (k,), stats[k], True)}
    progress = live.get("sync_progress") or {}
    out["ring"] = [
        dict(m, sync=dict(progress[m["member"]], progress=sync_fraction(progress[m["member"]])))
        if m["member"] in progress
        else dict(m)
        for m in ring["ring"]
    ]
    out["mirror_lag"] = ring["mirror_lag"]
    out["sync_records_sent"] = ring["sync_records_sent"]
    return out


def exchange_json(row: dict, vhost: str) -> dict:
    return {**row, "vhost": vhost, "policy": row.get("policy") or None, "user_who_performed_action": ""}


def properties_key(routing_key: str, arguments: dict) -> str:
    """RabbitMQ's binding key in URLs: the routing key, ``~`` and a hash of the arguments when there are any."""
    if not arguments:
        return routing_key or "~"
    digest = hashlib.sha1(repr(sorted(arguments.items())).encode()).hexdigest()[:16]
    return f"{routing_key}~{digest}"


def binding_json(row: dict, vhost: str) -> dict:
    return {
        "source": row["source_name"],
        "vhost": vhost,
        "destination": row["destination_name"],
        "destination_type": row["destination_kind"],
        "routing_key": row["routing_key"],
        "arguments": row["arguments"],
        "properties_key": properties_key(row["routing_key"], row["arguments"]),
    }


#: an /api/connections object's fields: mirrorctl's connection items but the pid
CONNECTION_FIELDS = tuple(i for i in CONNECTION_ITEMS if i != "pid")


def connection_json(conn: dict) -> dict:
    out = {k: conn.get(k) for k in CONNECTION_FIELDS}
    out["type"] = "network"
    out["pid"] = conn.get("pid")
    return out


def _details(conn: dict | None) -> dict:
    conn = conn or {}
    return {"name": conn.get("name"), "peer_host": conn.get("peer_host"), "peer_port": conn.get("peer_port")}


def channel_json(ch: dict, conn: dict | None) -> dict:
    out = {k: v for k, v in ch.items() if k not in ("consumers_list", "connection")}
    out["node"] = (conn or {}).get("node")
    out["connection_details"] = _details(conn)
    return out


def consumer_json(row: dict, conn: dict | None) -> dict:
    ch = row["channel"]
    return {
        "queue": {"name": row["queue_name"], "vhost": ch["vhost"]},
        "channel_details": {
            **_details(conn),
            "name": ch["name"],
            "number": ch["number"],
            "connection_name": (conn or {}).get("name"),
            "user": ch["user"],
            "node": (conn or {}).get("node"),
        },
        "consumer_tag": row["consumer_tag"],
        "ack_required": row["ack_required"],
        "prefetch_count": row["prefetch_count"],
        "exclusive": False,
        "arguments": row["arguments"],
        "active": row["active"],
        "activity_status": row["activity_status"],
    }


def user_json(row: dict) -> dict:
    """A user_rows row ({"user", "tags"}) as RabbitMQ's (no password hash: not needed to manage users)."""
    return {"name": row["user"], "tags": list(row["tags"]), "limits": {}}


def totals(queues: list[dict]) -> dict:
    """``/api/overview``'s ``queue_totals`` and ``message_stats`` from ``/api/queues`` objects."""
    qt: dict[str, Any] = {}
    for d in DEPTHS:
        qt[d] = sum(q[d] or 0 for q in queues)
        qt[f"{d}_details"] = {"rate": round(sum(q[f"{d}_details"]["rate"] for q in queues), 2)}
    ms: dict[str, Any] = {}
    for k in MESSAGE_STATS:
        have = [q["message_stats"] for q in queues if k in q["message_stats"]]
        ms[k] = sum(m[k] for m in have)
        ms[f"{k}_details"] = {"rate": round(sum(m[f"{k}_details"]["rate"] for m in have), 2)}
    return {"queue_totals": qt, "message_stats": ms}
