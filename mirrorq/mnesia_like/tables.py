"""The registry's tables and their record schemas (RabbitMQ's names).

=============  =================  ===========================================
table          key                record fields
=============  =================  ===========================================
amqqueue       (vhost, name)      name, vhost, durable, auto_delete,
                                  exclusive_owner, arguments, pid, slave_pids
                                  (age order), sync_slave_pids, policy,
                                  gm_pids, state, incarnation, type
                                  ("classic"/"quorum"), members,
                                  leader_dst and bootstrap (quorum)
gm_group       name               name, version, members (ring order)
policy         (vhost, name)      vhost, name, pattern, definition, priority,
                                  apply_to
node           name               name, admin, amqp_port, state, manager
user           name               name, password_hash, tags
vhost          name               name
permission     (user, vhost)      user, vhost, configure, write, read
exchange       (vhost, name)      vhost, name, type, durable, auto_delete,
                                  internal, arguments
binding        (vhost, source,    vhost, source, destination_kind ("queue" or
               destination_kind,  "exchange"), destination, routing_key,
               destination,       arguments_key (a canonical text of the
               routing_key,       arguments: bindings that differ only in
               arguments_key)     arguments are distinct), arguments
quorum_member  (group, member)    group, member (a quorum queue member's stable
                                  name), node, dst (where it is reached now)
queue_claim    (vhost, name)      vhost, name, node, request, time: a declare
                                  placing the queue (see
                                  mirrorq.queues.manager_core)
queue_alert    (vhost, name,      vhost, name, node, event ("store_corrupt"),
               node)              file, offset, reason, quarantined_to,
                                  action, time (see
                                  mirrorq.store.corruption)
=============  =================  ===========================================

Records are plain dicts of msgpack-friendly values.  :func:`validate` checks
a record against its table: unknown table, unknown field, missing required
field, wrong type, or a key that does not match the record are each a
:class:`SchemaError` naming table, key and field.
"""

from __future__ import annotations

from typing import Any


class SchemaError(ValueError):
    pass


_STR = (str,)
_OPT_STR = (str, type(None))
_LIST = (list, tuple)
_BOOL = (bool,)
_INT = (int,)
_DICT = (dict,)

# table -> (key fields, {field: (types, required, default)})
SCHEMAS: dict[str, tuple[tuple[str, ...], dict[str, tuple[tuple[type, ...], bool, Any]]]] = {
    "amqqueue": (
        ("vhost", "name"),
        {
            "name": (_STR, True, None),
            "vhost": (_STR, True, None),
            "durable": (_BOOL, False, False),
            "auto_delete": (_BOOL, False, False),
            "exclusive_owner": (_OPT_STR, False, None),
            "arguments": (_DICT, False, {}),
            "pid": (_OPT_STR, False, None),
            "slave_pids": (_LIST, False, []),
            "sync_slave_pids": (_LIST, False, []),
            "policy": (_OPT_STR, False, None),
            "gm_pids": (_LIST, False, []),
            "state": (_STR, False, "live"),
            "incarnation": (_STR, False, ""),
            "type": (_STR, False, "classic"),  # or "quorum"
            "members": (_LIST, False, []),  # quorum: the Raft group's members (stable names)
            "leader_dst": (_OPT_STR, False, None),  # quorum: where the leader (pid) is reached now
            "bootstrap": (_LIST, False, []),  # quorum: the group's first voters (a joining member's bootstrap)
        },
    ),
    "quorum_member": (
        ("group", "member"),
        {
            "group": (_STR, True, None),
            "member": (_STR, True, None),
            "node": (_STR, True, None),
            "dst": (_STR, True, None),  # the member's address in this life of its node
        },
    ),
    "gm_group": (
        ("name",),
        {
            "name": (_STR, True, None),
            "version": (_INT, True, None),
            "members": (_LIST, True, None),
        },
    ),
    "policy": (
        ("vhost", "name"),
        {
            "vhost": (_STR, True, None),
            "name": (_STR, True, None),
            "pattern": (_STR, True, None),
            "definition": (_DICT, True, None),
            "priority": (_INT, False, 0),
            "apply_to": (_STR, False, "all"),
        },
    ),
    "node": (
        ("name",),
        {
            "name": (_STR, True, None),
            "admin": (_STR, False, ""),
            "amqp_port": (_INT, False, 0),
            "state": (_STR, False, "member"),
            "manager": (_STR, False, ""),  # the node's queue manager, host:port
        },
    ),
    "user": (
        ("name",),
        {
            "name": (_STR, True, None),
            "password_hash": (_STR, True, None),
            "tags": (_LIST, False, []),
        },
    ),
    "vhost": (("name",), {"name": (_STR, True, None)}),
    "permission": (
        ("user", "vhost"),
        {
            "user": (_STR, True, None),
            "vhost": (_STR, True, None),
            "configure": (_STR, False, ".*"),
            "write": (_STR, False, ".*"),
            "read": (_STR, False, ".*"),
        },
    ),
    "exchange": (
        ("vhost", "name"),
        {
            "vhost": (_STR, True, None),
            "name": (_STR, True, None),
            "type": (_STR, True, None),
            "durable": (_BOOL, False, True),
            "auto_delete": (_BOOL, False, False),
            "internal": (_BOOL, False, False),
            "arguments": (_DICT, False, {}),
        },
    ),
    "binding": (
        ("vhost", "source", "destination_kind", "destination", "routing_key", "arguments_key"),
        {
            "vhost": (_STR, True, None),
            "source": (_STR, True, None),
            "destination_kind": (_STR, True, None),
            "destination": (_STR, True, None),
            "routing_key": (_STR, True, None),
            "arguments_key": (_STR, True, None),
            "arguments": (_DICT, False, {}),
        },
    ),
    "queue_claim": (
        ("vhost", "name"),
        {
            "vhost": (_STR, True, None),
            "name": (_STR, True, None),
            "node": (_STR, True, None),
            "request": (_INT, True, None),
            "time": ((float, int), True, None),
        },
    ),
    "queue_alert": (
        ("vhost", "name", "node"),
        {
            "vhost": (_STR, True, None),
            "name": (_STR, True, None),
            "node": (_STR, True, None),
            "event": (_STR, True, None),
            "file": (_STR, False, ""),
            "offset": (_INT, False, 0),
            "reason": (_STR, False, ""),
            "quarantined_to": (_STR, False, ""),
            "action": (_STR, False, ""),
            "time": ((float, int), False, 0.0),
        },
    ),
}


def check_table(table: Any) -> None:
    if table not in SCHEMAS:
        raise SchemaError(f"no table {table!r} (tables: {', '.join(sorted(SCHEMAS))})")


def normalize_key(table: str, key: Any) -> tuple:
    check_table(table)
    fields = SCHEMAS[table][0]
    k = tuple(key) if isinstance(key, (list, tuple)) else (key,)
    if len(k) != len(fields) or not all(isinstance(p, str) for p in k):
        raise SchemaError(f"table {table}: key must be ({', '.join(fields)}) as strings, got {key!r}")
    return k


def key_of(table: str, record: dict) -> tuple:
    return tuple(record.get(f) for f in SCHEMAS[table][0])


def validate(table: str, key: Any, record: Any) -> dict:
    """Return the record with defaults filled in, or raise SchemaError."""
    k = normalize_key(table, key)
    if not isinstance(record, dict):
        raise SchemaError(f"table {table} key {k}: record must be a mapping, got {type(record).__name__}")
    fields = SCHEMAS[table][1]
    for f in record:
        if f not in fields:
            raise SchemaError(f"table {table} key {k}: unknown field {f!r}")
    out = {}
    for f, (types, required, default) in fields.items():
        if f not in record:
            if required:
                raise SchemaError(f"table {table} key {k}: missing field {f!r}")
            out[f] = (
                list(default)
                if isinstance(default, list)
                else (dict(default) if isinstance(default, dict) else default)
            )
            continue
        v = record[f]
        if not isinstance(v, types) or (types == _INT and isinstance(v, bool)):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            raise SchemaError(f"table {table} key {k}: field {f!r} must be {names}, got {v!r}")
        out[f] = list(v) if isinstance(v, tuple) else v
    if key_of(table, out) != k:
        raise SchemaError(f"table {table}: key {k} does not match the record's {key_of(table, out)}")
    return out
