"""Exchanges, bindings, queues, users and permissions as one node's front end sees them.

:class:`Topology` is a local, read-mostly cache of the registry tables
``exchange``, ``binding``, ``amqqueue``, ``user``, ``vhost`` and
``permission``: loaded with :meth:`Topology.load` (a full table read) and
kept current with :meth:`Topology.apply` (the registry's change
notifications).  Routing (:meth:`Topology.route`) and authorisation run on it
without asking anyone, so a publish costs no registry round trip.

Guarantees: routing follows RabbitMQ's exchange types -- ``direct``
(routing key equals binding key), ``fanout`` (every binding), ``topic``
(dot-separated words; ``*`` matches one word, ``#`` zero or more) and
``headers`` (``x-match`` ``all`` (default) or ``any``; ``x-``-prefixed
binding arguments are not matched) -- and the default exchange ``""``
routes to the queue named by the routing key.  Exchange-to-exchange
bindings are followed, each exchange at most once per publish (so cycles
terminate).  Every vhost has the built-in exchanges ``""``, ``amq.direct``,
``amq.fanout``, ``amq.topic``, ``amq.headers`` and ``amq.match``.

Assumes: the cache may lag the registry by one change notification; a
writer updates its own cache at once (read-your-writes on the node that
wrote).  Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from typing import Any

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")
BUILTIN_EXCHANGES = {
    "": "direct",
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}
TABLES = ("exchange", "binding", "amqqueue", "user", "vhost", "permission")
DEFAULT_USER = "guest"
DEFAULT_PASSWORD = "guest"
DEFAULT_VHOST = "/"


# ---- passwords ---------------------------------------------------------------------
def hash_password(password: str, salt: bytes | None = None) -> str:
    """``sha256$<salt hex>$<digest hex>`` of a salted SHA-256, like RabbitMQ's
    rabbit_password_hashing_sha256 (not reversible; compare with
    :func:`check_password`)."""
    if not isinstance(password, str):
        raise TypeError(f"a password is a string, got {type(password).__name__}")
    salt = os.urandom(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).hexdigest()
    return f"sha256${salt.hex()}${digest}"


def check_password(password: str, password_hash: str) -> bool:
    try:
        algo, salt_hex, digest = password_hash.split("$")
        salt = bytes.fromhex(salt_hex)
    except (ValueError, AttributeError):
        return False
    return algo == "sha256" and hashlib.sha256(salt + password.encode()).hexdigest() == digest


# ---- arguments the broker adds to a queue ------------------------------------------------
#: names the arguments of a queue record that the broker added itself (an
#: exclusive queue's placement on its connection's node): they steer
#: placement but are never shown to clients, nor compared by queue.declare's
#: equivalence check (RabbitMQ compares what clients declared)
INTERNAL_MARK = "x-mirrorq-internal"


def with_internal_arguments(arguments: dict, added: dict) -> dict:
    """``arguments`` plus the broker's own ``added`` ones, marked as such."""
    marked = sorted(set(internal_argument_names(arguments)) | set(added))
    return {**arguments, **added, INTERNAL_MARK: marked}


def internal_argument_names(arguments: dict | None) -> list[str]:
    """The names of the broker-added arguments among ``arguments`` (the mark included)."""
    if not arguments or INTERNAL_MARK not in arguments:
        return []
    names = arguments[INTERNAL_MARK]
    return [INTERNAL_MARK, *(str(n) for n in names)] if isinstance(names, (list, tuple)) else [INTERNAL_MARK]


def client_arguments(arguments: dict | None) -> dict:
    """A queue record's arguments as its clients declared them (without the broker's own)."""
    hidden = set(internal_argument_names(arguments))
    return {k: v for k, v in (arguments or {}).items() if k not in hidden}


def value_text(v: Any) -> str:
    """A value as RabbitMQ's refusals print it (true/false, none)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else str(v)


def queue_inequivalence(rec: dict, durable: bool, auto_delete: bool, arguments: dict) -> str | None:
    """queue.declare's equivalence check of an existing queue record against
    a declare's ``durable``, ``auto_delete`` and (validated) x-arguments:
    None if equivalent, else the 406 PRECONDITION_FAILED text (RabbitMQ's).
    The AMQP front end and the management API's PUT both ask it."""
    name, vhost = rec["name"], rec["vhost"]
    for field, want in (("durable", bool(durable)), ("auto_delete", bool(auto_delete))):
        if bool(rec.get(field)) != want:
            return (
                f"inequivalent arg '{field}' for queue '{name}' in vhost '{vhost}': "
                f"received '{value_text(want)}' but current is '{value_text(rec.get(field))}'"
            )
    have = client_arguments(rec.get("arguments"))
    for k in sorted(set(have) | set(arguments)):
        if k.startswith("x-") and have.get(k) != arguments.get(k):
            return (
                f"inequivalent arg '{k}' for queue '{name}' in vhost '{vhost}': "
                f"received {value_text(arguments.get(k))} but current is {value_text(have.get(k))}"
            )
    return None


def arguments_key(arguments: dict | None) -> str:
    """A canonical text for binding arguments (part of a binding's key)."""
    if not arguments:
        return ""
    return json.dumps(_plain(arguments), sort_keys=True, separators=(",", ":"))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def topic_matches(pattern: str, key: str) -> bool:
    """RabbitMQ's topic rule on dot-separated words (an empty text is zero
    words): ``*`` matches exactly one word, ``#`` zero or more."""
    p = pattern.split(".") if pattern else []
    k = key.split(".") if key else []
    # reach[j]: the pattern prefix seen so far can match k[:j]
    reach = [True] + [False] * len(k)
    for w in p:
        if w == "#":
            nxt = reach[:]
            for j in range(1, len(k) + 1):
                nxt[j] = nxt[j] or nxt[j - 1]
        else:
            nxt = [False] * (len(k) + 1)
            for j in range(1, len(k) + 1):
                nxt[j] = reach[j - 1] and (w == "*" or w == k[j - 1])
        reach = nxt
        if not any(reach):
            return False
    return reach[len(k)]


def _headers_match(binding_args: dict, headers: dict | None) -> bool:
    headers = headers or {}
    mode = binding_args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode("utf-8", "replace")
    wanted = {k: v for k, v in binding_args.items() if not str(k).startswith("x-")}
    if not wanted:
        return mode != "any"
    hits = [k in headers and (v is None or headers[k] == v) for k, v in wanted.items()]
    return any(hits) if mode == "any" else all(hits)


def deleted_queues(changes: Iterable, node: str) -> list[tuple[str, str]]:
    """``(vhost, name)`` of the queues whose ``amqqueue`` row the registry
    ``changes`` ``(table, key, old, new)`` delete and whose master (the old
    row's ``pid``, a member name ``node/host:port/uid``) ran on ``node``:
    the node whose queue master deleted the queue cleans up after it."""
    out = []
    for table, key, old, new in changes:
        if table != "amqqueue" or new is not None or not old:
            continue
        pid = old.get("pid")
        if isinstance(pid, str) and pid.split("/", 1)[0] == node:
            out.append((key[0], key[1]))
    return out


def queue_binding_deletes(rows: Iterable[dict], vhost: str, queue: str) -> list[dict]:
    """Registry ops deleting every binding among ``rows`` (the ``binding``
    table) whose destination is queue ``queue`` in ``vhost``."""
    return [
        {
            "op": "delete",
            "table": "binding",
            "key": [
                r["vhost"],
                r["source"],
                r["destination_kind"],
                r["destination"],
                r["routing_key"],
                r["arguments_key"],
            ],
        }
        for r in rows
        if r.get("vhost") == vhost and r.get("destination_kind") == "queue" and r.get("destination") == queue
    ]


class Topology:
    def __init__(self) -> None:
        self.exchanges: dict[tuple, dict] = {}
        self.bindings: dict[tuple, dict[tuple, dict]] = {}  # (vhost, source) -> {key: record}
        self.queues: dict[tuple, dict] = {}
        self.users: dict[str, dict] = {}
        self.vhosts: dict[str, dict] = {}
        self.permissions: dict[tuple, dict] = {}
        self.exclusive: dict[tuple, Any] = {}  # (vhost, queue) -> local connection id owning it
        self.loaded: set[str] = set()

    # ---- keeping it current --------------------------------------------------------
    def load(self, table: str, rows: Iterable[dict]) -> None:
        """Replace ``table`` with a full read of it."""
        if table == "exchange":
            self.exchanges = {}
        elif table == "binding":
            self.bindings = {}
        elif table == "amqqueue":
            self.queues = {}
        elif table == "user":
            self.users = {}
        elif table == "vhost":
            self.vhosts = {}
        elif table == "permission":
            self.permissions = {}
        else:
            raise ValueError(f"topology: no table {table!r} (tables: {', '.join(TABLES)})")
        for r in rows:
            self.put(table, r)
        self.loaded.add(table)

    def apply(self, changes: Iterable) -> list[tuple]:
        """Apply registry changes ``(table, key, old, new)``; returns the
        ``amqqueue`` changes as ``(vhost, name, old, new)`` (the front end
        follows masters through them)."""
        moved = []
        for table, key, old, new in changes:
            if table not in TABLES:
                continue
            if new is None:
                self.delete(table, tuple(key))
            else:
                self.put(table, new)
            if table == "amqqueue":
                moved.append((key[0], key[1], old, new))
        return moved

    def put(self, table: str, r: dict) -> None:
        if table == "exchange":
            self.exchanges[(r["vhost"], r["name"])] = r
        elif table == "binding":
            k = (r["vhost"], r["source"], r["destination_kind"], r["destination"], r["routing_key"], r["arguments_key"])
            self.bindings.setdefault((r["vhost"], r["source"]), {})[k] = r
        elif table == "amqqueue":
            self.queues[(r["vhost"], r["name"])] = r
        elif table == "user":
            self.users[r["name"]] = r
        elif table == "vhost":
            self.vhosts[r["name"]] = r
        elif table == "permission":
            self.permissions[(r["user"], r["vhost"])] = r

    def delete(self, table: str, key: tuple) -> None:
        if table == "exchange":
            self.exchanges.pop(key, None)
        elif table == "binding":
            d = self.bindings.get((key[0], key[1]))
            if d is not None:
                d.pop(key, None)
                if not d:
                    del self.bindings[(key[0], key[1])]
        elif table == "amqqueue":
            self.queues.pop(key, None)
        elif table == "user":
            self.users.pop(key[0], None)
        elif table == "vhost":
            self.vhosts.pop(key[0], None)
        elif table == "permission":
            self.permissions.pop(key, None)

    # ---- lookups -------------------------------------------------------------------------
    def exchange(self, vhost: str, name: str) -> dict | None:
        if name in BUILTIN_EXCHANGES:
            return {
                "vhost": vhost,
                "name": name,
                "type": BUILTIN_EXCHANGES[name],
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            }
        return self.exchanges.get((vhost, name))

    def queue(self, vhost: str, name: str) -> dict | None:
        return self.queues.get((vhost, name))

    def vhost_exists(self, vhost: str) -> bool:
        return vhost == DEFAULT_VHOST or vhost in self.vhosts

    def bindings_of_queue(self, vhost: str, queue: str) -> list[dict]:
        return [
            r
            for (v, _), d in self.bindings.items()
            if v == vhost
            for r in d.values()
            if r["destination_kind"] == "queue" and r["destination"] == queue
        ]

    def bindings_of_exchange(self, vhost: str, name: str) -> list[dict]:
        out = list(self.bindings.get((vhost, name), {}).values())
        out += [
            r
            for (v, _), d in self.bindings.items()
            if v == vhost
            for r in d.values()
            if r["destination_kind"] == "exchange" and r["destination"] == name and r["source"] != name
        ]
        return out

    def route(self, vhost: str, exchange: str, routing_key: str, headers: dict | None = None) -> list[str]:
        """Queue names a publish to ``exchange`` reaches (sorted, no repeats)."""
        found: set[str] = set()
        seen: set[str] = set()
        todo = [exchange]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name == "":
                if (vhost, routing_key) in self.queues:
                    found.add(routing_key)
                continue
            ex = self.exchange(vhost, name)
            if ex is None:
                continue
            kind = ex["type"]
            for b in self.bindings.get((vhost, name), {}).values():
                if kind == "fanout":
                    ok = True
                elif kind == "direct":
                    ok = b["routing_key"] == routing_key
                elif kind == "topic":
                    ok = topic_matches(b["routing_key"], routing_key)
                elif kind == "headers":
                    ok = _headers_match(b.get("arguments") or {}, headers)
                else:
                    ok = False
                if not ok:
                    continue
                if b["destination_kind"] == "queue":
                    if (vhost, b["destination"]) in self.queues:
                        found.add(b["destination"])
                else:
                    todo.append(b["destination"])
        return sorted(found)

    # ---- authentication and authorisation ---------------------------------------------
    def authenticate(self, user: str, password: str, loopback: bool) -> str | None:
        """None if ``user``/``password`` may log in, else why not.  Without a
        ``user`` row, guest/guest is the default user (from loopback only,
        as RabbitMQ's ``loopback_users``)."""
        row = self.users.get(user)
        if row is None:
            if user == DEFAULT_USER and password == DEFAULT_PASSWORD and not self.users.get(DEFAULT_USER):
                return None if loopback else "user 'guest' can only connect via localhost"
            return f"user '{user}' - invalid credentials"
        if not check_password(password, row.get("password_hash", "")):
            return f"user '{user}' - invalid credentials"
        if user == DEFAULT_USER and not loopback:
            return "user 'guest' can only connect via localhost"
        return None

    def permission(self, user: str, vhost: str) -> dict | None:
        p = self.permissions.get((user, vhost))
        if p is None and user == DEFAULT_USER and vhost == DEFAULT_VHOST and DEFAULT_USER not in self.users:
            return {"user": user, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
        return p

    def allowed(self, user: str, vhost: str, what: str, resource: str) -> bool:
        """``what`` is configure / write / read; resource an exchange or queue
        name (the default exchange is ``amq.default``); an empty regex
        allows nothing."""
        p = self.permission(user, vhost)
        if p is None:
            return False
        rx = p.get(what, "")
        if rx == "":
            return False
        if resource == "":
            resource = "amq.default"
        try:
            return re.search(rx, resource) is not None  # RabbitMQ's rule: the regex matches anywhere
        except re.error:
            return False
