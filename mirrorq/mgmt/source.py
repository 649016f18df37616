"""The management server's data: what mirrorctl reads and does, as API objects.

:class:`NodeSource` keeps a :class:`mirrorq.admin.session.NodeSession` with its own
node (admin port from the config) and, when a listing needs every node's
front end (connections, channels, consumers) or a peer's status (nodes),
one with each peer (admin address from the registry's ``node`` table).
Every read and operation is the admin layer's (:mod:`mirrorq.admin.ops`, mirrorctl's too:
``queue_snapshot``/``queue_rows``, ``exchange_rows``, ``set_permissions``,
``delete_vhost``...); :mod:`.shapes` renames the rows.  So the API and the
command line cannot drift apart.

All of it blocks (Thespian asks): the HTTP handlers call it through
``asyncio.to_thread``.  A Thespian external handle is one conversation at a
time, so one lock serializes the calls; a call that failed on the node's
side (timeout, node unreachable) drops the session it used, so a late answer
to it can never be taken for the next call's.

Errors are mirrorctl's: :class:`~mirrorq.admin.cluster.NotFound` (404),
:class:`~mirrorq.admin.cluster.Invalid` (400), :class:`~mirrorq.admin.cluster.NodeUnavailable`
and :class:`~mirrorq.admin.cluster.CommandTimeout` (503), any other
:class:`~mirrorq.admin.cluster.ClusterError` (500) -- see :mod:`.api`.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from typing import Any

from mirrorq.admin import messages
from mirrorq.admin import ops as ctl
from mirrorq.admin.cluster import ClusterError, Invalid, NotFound
from mirrorq.admin.ring import ring_rows
from mirrorq.admin.session import NodeSession, live_infos, node_of_member
from mirrorq.mgmt import shapes
from mirrorq.mgmt.rates import Rates
from mirrorq.node.config import parse_address
from mirrorq.node.daemon import group_fds, group_rss, read_pid_file
from mirrorq.policy.store import policy_listing

#: seconds a registry read or transaction may take (retried across leader changes within it)
REGISTRY_TIMEOUT = 10.0
#: seconds queue masters and front ends have to answer
OP_TIMEOUT = 5.0
#: seconds a conversation as the asking user with the node's AMQP listener (get, publish,
#: exchanges, bindings) may take: answered before the console's pages give up (20 s)
MESSAGE_TIMEOUT = 15.0
ADMIN_TAG = "administrator"
#: RabbitMQ's /api/nodes items of the resource alarms (mirrorq.node.alarms.Alarms.status)
NODE_ALARM_ITEMS = ("mem_limit", "mem_alarm", "disk_free", "disk_free_limit", "disk_free_alarm")


def _one(objects: list[dict], name: str, missing: str) -> dict:
    """The object named ``name``, else NotFound(``missing``)."""
    for o in objects:
        if o["name"] == name:
            return o
    raise NotFound(missing)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class NodeSource:
    def __init__(
        self,
        cfg: dict,
        warn: Callable[[str], None] | None = None,
        op_timeout: float = OP_TIMEOUT,
        timeout: float = REGISTRY_TIMEOUT,
    ) -> None:
        self.cfg = cfg
        self.node = cfg["name"]
        self.host = cfg.get("host") or "127.0.0.1"
        self.op_timeout, self.timeout = op_timeout, timeout
        self.warn = warn
        self.lock = threading.RLock()
        self.sessions: dict[str, NodeSession] = {}
        self.rates = Rates()

    # ---- sessions -----------------------------------------------------------------------
    def _session(self, node: str | None = None) -> NodeSession:
        node = node or self.node
        s = self.sessions.get(node)
        if s is None:
            if node == self.node:
                host, port = self.host, int(self.cfg["admin_port"])
            else:
                row = next((r for r in self._session().rows("node") if r["name"] == node), None)
                if row is None or not row.get("admin"):
                    raise NotFound(f"no node {node!r} in the registry")
                host, port = parse_address(row["admin"])
            s = self.sessions[node] = NodeSession(node, port, self.cfg.get("amqp_shell") or "watch", self.timeout, host)
        return s

    def _drop(self, node: str) -> None:
        s = self.sessions.pop(node, None)
        if s is not None:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - closing a broken handle
                pass

    def run(self, fn: Callable[[NodeSession], Any], node: str | None = None) -> Any:
        """``fn(session)`` under the lock; a failure other than NotFound/Invalid drops the session."""
        node = node or self.node
        with self.lock:
            try:
                return fn(self._session(node))
            except (NotFound, Invalid):
                raise
            except BaseException:
                self._drop(node)
                raise

    def close(self) -> None:
        with self.lock:
            for n in list(self.sessions):
                self._drop(n)

    def _peer_sessions(self, s: NodeSession) -> list[tuple[str, NodeSession]]:
        """(node, session) of every node this one sees up (itself first); one that cannot be reached is left out."""
        out = [(self.node, s)]
        for n, v in sorted(s.status().view.items()):
            if n == self.node or v.get("state") != "up":
                continue
            try:
                out.append((n, self._session(n)))
            except ClusterError:
                self._drop(n)
        return out

    def _vhosts(self, s: NodeSession, vhost: str | None) -> list[str]:
        names = ctl.vhost_names(s.rows("vhost"))
        if vhost is None:
            return names
        if vhost not in names:
            raise NotFound(f"no vhost '{vhost}'")
        return [vhost]

    # ---- auth ---------------------------------------------------------------------------
    def authenticate(self, user: str, password: str, peer: str) -> tuple[int, str]:
        """(0, "") for an administrator, (401, why) for a failed login, (403, why) without the tag."""
        from mirrorq.amqp.topology import Topology

        users = self.run(lambda s: s.rows("user"))
        topo = Topology()
        topo.load("user", users)
        why = topo.authenticate(user, password, _loopback(peer))
        if why:
            return 401, why
        tags: list[str] = next((r["tags"] for r in ctl.user_rows(users) if r["user"] == user), [])
        if ADMIN_TAG not in tags:
            return 403, f"user '{user}' is not an administrator (tags: {', '.join(tags) or 'none'})"
        return 0, ""

    # ---- queues -------------------------------------------------------------------------
    def queues(self, vhost: str | None = None) -> list[dict]:
        def fn(s: NodeSession) -> list[dict]:
            if vhost is not None:
                self._vhosts(s, vhost)
            snap = ctl.queue_snapshot(s, vhost, self.op_timeout, warn=self.warn)
            records, infos = snap["records"], snap["infos"]
            rows = ctl.queue_rows(records, snap["policies"], infos, snap["up"], list(ctl.QUEUE_ITEMS), snap["alerts"])
            rings = ring_rows(records, infos, snap["up"])
            out = []
            for rec, row, ring in zip(records, rows, rings):
                assert (ring["vhost"], ring["name"]) == (rec["vhost"], rec["name"])
                info = infos.get((rec["vhost"], rec["name"])) or {}
                live = info.get("value") if info.get("ok") else None
                out.append(shapes.queue_json(row, ring, live, rec["vhost"], self.rates.sample))
            return out

        return self.run(fn)

    def queue(self, vhost: str, name: str) -> dict:
        return _one(self.queues(vhost), name, f"no queue '{name}' in vhost '{vhost}'")

    def put_queue(self, vhost: str, name: str, body: dict) -> bool:
        """Declare a queue through the node's queue manager (as the AMQP front end
        does); True if created, False if an equivalent one exists."""
        from mirrorq.amqp.topology import INTERNAL_MARK, _plain, queue_inequivalence
        from mirrorq.queues import semantics

        durable, auto_delete = body.get("durable", True), body.get("auto_delete", False)
        for k, v in (("durable", durable), ("auto_delete", auto_delete)):
            if not isinstance(v, bool):
                raise Invalid(f"'{k}' must be true or false, got {v!r}")
        if not name or name.startswith("amq."):
            raise Invalid(f"queue name '{name}' is not allowed (empty, or the reserved prefix 'amq.')")
        try:
            args = semantics.validate_queue_arguments(name, body.get("arguments") or {})
        except semantics.AMQPError as e:
            raise Invalid(f"invalid arguments for queue '{name}': {e.text}") from None
        except (TypeError, ValueError) as e:
            raise Invalid(f"invalid arguments for queue '{name}': {e}") from None
        if INTERNAL_MARK in args:
            raise Invalid(f"invalid arg '{INTERNAL_MARK}' for queue '{name}': reserved for the broker")
        args = _plain(args)

        def fn(s: NodeSession) -> bool:
            self._vhosts(s, vhost)
            rec = next((r for r in s.rows("amqqueue") if (r["vhost"], r["name"]) == (vhost, name)), None)
            if rec is not None:
                why = queue_inequivalence(rec, durable, auto_delete, args)
                if why:
                    raise Invalid(why)
                return False
            spec = {
                "name": name,
                "vhost": vhost,
                "durable": durable,
                "auto_delete": auto_delete,
                "exclusive_owner": None,
                "arguments": args,
            }
            res = s.declare(spec, timeout=self.timeout)
            if not res.ok:
                raise ClusterError(f"declaring queue '{name}' in vhost '{vhost}' failed: {res.error}")
            return True

        return self.run(fn)

    def delete_queue(self, vhost: str, name: str, if_empty: bool = False, if_unused: bool = False) -> int:
        def fn(s: NodeSession) -> int:
            if not any((r["vhost"], r["name"]) == (vhost, name) for r in s.rows("amqqueue")):
                raise NotFound(f"no queue '{name}' in vhost '{vhost}'")
            return ctl.delete_queue(s, vhost, name, if_empty, if_unused, self.op_timeout)

        return self.run(fn)

    def _queue_command(self, vhost: str, name: str, command: str) -> Any:
        def fn(s: NodeSession) -> Any:
            if not any((r["vhost"], r["name"]) == (vhost, name) for r in s.rows("amqqueue")):
                raise NotFound(f"no queue '{name}' in vhost '{vhost}'")
            return ctl.queue_command(s, vhost, name, command, self.op_timeout)

        return self.run(fn)

    def purge_queue(self, vhost: str, name: str) -> int:
        """Remove the queue's ready messages (its master does, as mirrorctl purge_queue); how many."""
        removed = self._queue_command(vhost, name, "purge")
        return removed if isinstance(removed, int) else 0

    def queue_action(self, vhost: str, name: str, action: str) -> Any:
        """One of ``ctl.QUEUE_ACTIONS``: ``sync`` or ``cancel_sync`` the queue's mirrors
        (mirrorctl sync_queue, cancel_sync_queue); the master's answer."""
        return self._queue_command(vhost, name, action)

    # ---- get messages, publish: an AMQP conversation as the asking user ----------------------
    def _amqp_address(self) -> tuple[str, int]:
        return self.host, int(self.cfg["amqp_port"])

    def get_messages(self, vhost: str, name: str, body: dict, user: str, password: str) -> list[dict]:
        """RabbitMQ's get (:mod:`mirrorq.admin.messages`): 400 for a bad body,
        404 for no vhost or queue, then the messages got as ``user``."""
        req = messages.parse_get(body)

        def exists(s: NodeSession) -> None:
            self._vhosts(s, vhost)
            if not any((r["vhost"], r["name"]) == (vhost, name) for r in s.rows("amqqueue")):
                raise NotFound(f"no queue '{name}' in vhost '{vhost}'")

        self.run(exists)
        return messages.get_messages(self._amqp_address(), user, password, vhost, name, req, MESSAGE_TIMEOUT)

    def publish(self, vhost: str, exchange: str, body: dict, user: str, password: str) -> dict:
        """RabbitMQ's publish: ``{"routed": bool}``; 400 for a bad body, 404 for no vhost or exchange."""
        req = messages.parse_publish(body)
        real = "" if exchange == "amq.default" else exchange

        def exists(s: NodeSession) -> None:
            vhosts = self._vhosts(s, vhost)
            rows = ctl.exchange_rows(vhosts[0], s.rows("exchange"), [])
            if not any(r["name"] == real for r in rows):
                raise NotFound(f"no exchange '{exchange}' in vhost '{vhost}'")

        self.run(exists)
        routed = messages.publish_message(self._amqp_address(), user, password, vhost, exchange, req, MESSAGE_TIMEOUT)
        return {"routed": routed}

    # ---- exchanges, bindings ----------------------------------------------------------------
    def exchanges(self, vhost: str | None = None) -> list[dict]:
        def fn(s: NodeSession) -> list[dict]:
            vhosts = self._vhosts(s, vhost)
            rows, policies = s.rows("exchange"), ctl.load_policies(s, self.warn)
            return [shapes.exchange_json(r, v) for v in vhosts for r in ctl.exchange_rows(v, rows, policies)]

        return self.run(fn)

    def bindings(self, vhost: str | None = None) -> list[dict]:
        def fn(s: NodeSession) -> list[dict]:
            vhosts = self._vhosts(s, vhost)
            queues, bindings = s.rows("amqqueue"), s.rows("binding")
            return [shapes.binding_json(r, v) for v in vhosts for r in ctl.binding_rows(v, queues, bindings)]

        return self.run(fn)

    def exchange(self, vhost: str, name: str) -> dict:
        """One exchange (``amq.default``: the default one, named "")."""
        real = "" if name == "amq.default" else name
        found = [x for x in self.exchanges(vhost) if x["name"] == real]
        if not found:
            raise NotFound(f"no exchange '{name}' in vhost '{vhost}'")
        return found[0]

    def _as_user(self, vhost: str, check: Callable[[NodeSession], None]) -> tuple[str, int]:
        """The AMQP address to run an operation at as a user, after ``check`` (404s) and the vhost's."""

        def fn(s: NodeSession) -> None:
            self._vhosts(s, vhost)
            check(s)

        self.run(fn)
        return self._amqp_address()

    def put_exchange(self, vhost: str, name: str, body: dict, user: str, password: str) -> bool:
        """Declare exchange ``name`` as ``user`` (RabbitMQ's PUT): True if created."""
        spec = messages.parse_exchange(body)
        if not name or name == "amq.default":
            raise Invalid("the default exchange cannot be declared (name it)")
        existed: list[bool] = []
        addr = self._as_user(
            vhost,
            lambda s: existed.append(any(r["name"] == name for r in ctl.exchange_rows(vhost, s.rows("exchange"), []))),
        )
        messages.declare_exchange(addr, user, password, vhost, name, spec, MESSAGE_TIMEOUT)
        return not existed[0]

    def delete_exchange(self, vhost: str, name: str, if_unused: bool, user: str, password: str) -> None:
        def check(s: NodeSession) -> None:
            if not any(r["name"] == name for r in ctl.exchange_rows(vhost, s.rows("exchange"), [])) or not name:
                raise NotFound(f"no exchange '{name}' in vhost '{vhost}'")

        addr = self._as_user(vhost, check)
        messages.delete_exchange(addr, user, password, vhost, name, if_unused, MESSAGE_TIMEOUT)

    def bindings_of(
        self, vhost: str, source: str | None = None, kind: str | None = None, destination: str | None = None
    ) -> list[dict]:
        """The bindings of ``vhost`` from exchange ``source`` to ``destination``
        (a ``kind``: "queue" or "exchange"); None: any.  An exchange or queue
        named that does not exist: NotFound."""

        def fn(s: NodeSession) -> list[dict]:
            self._vhosts(s, vhost)
            queues = s.rows("amqqueue")
            names = {r["name"] for r in ctl.exchange_rows(vhost, s.rows("exchange"), [])}
            src = "" if source == "amq.default" else source
            if src is not None and src not in names:
                raise NotFound(f"no exchange '{source}' in vhost '{vhost}'")
            if kind == "queue" and destination is not None:
                if not any((q["vhost"], q["name"]) == (vhost, destination) for q in queues):
                    raise NotFound(f"no queue '{destination}' in vhost '{vhost}'")
            if kind == "exchange" and destination is not None and destination not in names:
                raise NotFound(f"no exchange '{destination}' in vhost '{vhost}'")
            rows = [shapes.binding_json(r, vhost) for r in ctl.binding_rows(vhost, queues, s.rows("binding"))]
            return [
                b
                for b in rows
                if src in (None, b["source"])
                and kind in (None, b["destination_type"])
                and destination in (None, b["destination"])
            ]

        return self.run(fn)

    def add_binding(
        self, vhost: str, source: str, kind: str, destination: str, body: dict, user: str, password: str
    ) -> str:
        """Bind as ``user`` (RabbitMQ's POST to /api/bindings/...): the new binding's properties key."""
        spec = messages.parse_binding(body)
        self.bindings_of(vhost, source, kind, destination)  # 404s
        src = "" if source == "amq.default" else source
        if not src:
            raise Invalid("the default exchange's bindings are implicit: they cannot be added or removed")
        messages.bind(self._amqp_address(), user, password, vhost, src, kind, destination, spec, MESSAGE_TIMEOUT)
        return shapes.properties_key(spec.routing_key, spec.arguments)

    def delete_binding(
        self, vhost: str, source: str, kind: str, destination: str, props: str, user: str, password: str
    ) -> None:
        found = [b for b in self.bindings_of(vhost, source, kind, destination) if b["properties_key"] == props]
        if not found:
            raise NotFound(f"no binding '{props}' from '{source}' to {kind} '{destination}' in vhost '{vhost}'")
        if not found[0]["source"]:
            raise Invalid("the default exchange's bindings are implicit: they cannot be added or removed")
        spec = messages.BindingSpec(found[0]["routing_key"], found[0]["arguments"])
        messages.bind(
            self._amqp_address(),
            user,
            password,
            vhost,
            found[0]["source"],
            kind,
            destination,
            spec,
            MESSAGE_TIMEOUT,
            unbind=True,
        )

    # ---- connections, channels, consumers: every node's front end -------------------------------
    def _connections(self) -> list[dict]:
        return self.run(lambda s: ctl.connections_of(self._peer_sessions(s), self.op_timeout))

    def connections(self) -> list[dict]:
        return [shapes.connection_json(c) for c in self._connections()]

    def connection(self, name: str) -> dict:
        return _one(self.connections(), name, f"no connection '{name}'")

    def close_connection(self, name: str, reason: str) -> dict:
        """Close connection ``name`` with 320 CONNECTION_FORCED and ``reason``
        (RabbitMQ's DELETE /api/connections/{name} with X-Reason)."""
        return self.run(lambda s: ctl.close_connection(self._peer_sessions(s), name, reason, self.op_timeout))

    def connection_channels(self, name: str) -> list[dict]:
        self.connection(name)
        return [ch for ch in self.channels() if ch["connection_details"]["name"] == name]

    def channel(self, name: str) -> dict:
        return _one(self.channels(), name, f"no channel '{name}'")

    def channels(self) -> list[dict]:
        conns = self._connections()
        by_pid = {c["pid"]: c for c in conns}
        return [shapes.channel_json(ch, by_pid.get(ch["connection"])) for ch in ctl.channel_rows(conns)]

    def consumers(self, vhost: str | None = None) -> list[dict]:
        if vhost is not None:
            self.run(lambda s: self._vhosts(s, vhost))
        conns = self._connections()
        by_pid = {c["pid"]: c for c in conns}
        return [
            shapes.consumer_json(r, by_pid.get(r["channel"]["connection"]))
            for r in ctl.consumer_rows(ctl.channel_rows(conns), vhost)
        ]

    # ---- policies ---------------------------------------------------------------------------
    def policies(self, vhost: str | None = None) -> list[dict]:
        def fn(s: NodeSession) -> list[dict]:
            if vhost is not None:
                self._vhosts(s, vhost)
            return policy_listing(ctl.load_policies(s, self.warn), vhost)

        return self.run(fn)

    def policy(self, vhost: str, name: str) -> dict:
        return _one(self.policies(vhost), name, f"no policy '{name}' in vhost '{vhost}'")

    def put_policy(self, vhost: str, name: str, body: dict) -> bool:
        for k in ("pattern", "definition"):
            if k not in body:
                raise Invalid(f"a policy needs '{k}'")
        if not isinstance(body["definition"], dict):
            raise Invalid(f"'definition' must be a JSON object, got {body['definition']!r}")
        policy = ctl.make_policy(
            vhost, name, body["pattern"], body["definition"], body.get("priority", 0), body.get("apply-to", "all")
        )

        def fn(s: NodeSession) -> bool:
            self._vhosts(s, vhost)
            existed = any(r["vhost"] == vhost and r["name"] == name for r in s.rows("policy"))
            ctl.set_policy(s, policy)
            return not existed

        return self.run(fn)

    def delete_policy(self, vhost: str, name: str) -> None:
        self.run(lambda s: ctl.clear_policy(s, vhost, name))

    # ---- users, vhosts, permissions ---------------------------------------------------------------
    def users(self) -> list[dict]:
        return [shapes.user_json(r) for r in self.run(lambda s: ctl.user_rows(s.rows("user")))]

    def user(self, name: str) -> dict:
        return _one(self.users(), name, f"no user '{name}'")

    def put_user(self, name: str, body: dict) -> bool:
        from mirrorq.amqp.topology import hash_password

        password, password_hash, tags = body.get("password"), body.get("password_hash"), body.get("tags")
        if password is not None and (not isinstance(password, str) or not password):
            raise Invalid("'password' must be a non-empty string")
        if password_hash is not None and (
            not isinstance(password_hash, str) or (password_hash and password_hash.count("$") != 2)
        ):
            raise Invalid(
                "'password_hash' must be mirrorq's 'sha256$<salt hex>$<digest hex>' (or '': no password login)"
            )
        if isinstance(tags, str):  # RabbitMQ's comma-separated form
            tags = [t.strip() for t in tags.split(",") if t.strip()]
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise Invalid(f"'tags' must be a list of strings or a comma-separated string, got {tags!r}")
        new_hash = hash_password(password) if password is not None else password_hash

        def change(row: dict) -> dict:
            if new_hash is not None:
                row["password_hash"] = new_hash
            if tags is not None:
                row["tags"] = tags
            return row

        create = None
        if new_hash is not None:
            create = {"name": name, "password_hash": new_hash, "tags": tags or []}

        def fn(s: NodeSession) -> bool:
            try:
                return ctl.change_user(s, name, "put user", change, create)
            except NotFound:
                raise Invalid(f"a new user needs 'password' or 'password_hash' (user '{name}')") from None

        return self.run(fn)

    def delete_user(self, name: str) -> None:
        self.run(lambda s: ctl.delete_user(s, name))

    def vhosts(self) -> list[dict]:
        return self.run(lambda s: ctl.vhost_rows(ctl.vhost_names(s.rows("vhost")), s.nodes_up()))

    def vhost(self, name: str) -> dict:
        return _one(self.vhosts(), name, f"no vhost '{name}'")

    def put_vhost(self, name: str) -> bool:
        from mirrorq.amqp.topology import DEFAULT_VHOST

        if name == DEFAULT_VHOST:
            return False
        return self.run(lambda s: ctl.add_vhost(s, name))

    def delete_vhost(self, name: str) -> dict:
        queues, failed = self.run(lambda s: ctl.delete_vhost(s, name, self.op_timeout))
        return {"queues": len(queues), "failed": [f"{r['name']}: {r['error']}" for r in failed]}

    def permissions(self, vhost: str | None = None, user: str | None = None) -> list[dict]:
        def fn(s: NodeSession) -> list[dict]:
            if vhost is not None:
                self._vhosts(s, vhost)
            rows = ctl.permission_rows(s.rows("user"), s.rows("permission"))
            return [p for p in rows if vhost in (None, p["vhost"]) and user in (None, p["user"])]

        return self.run(fn)

    def permission(self, vhost: str, user: str) -> dict:
        rows = self.permissions(vhost, user)
        if not rows:
            raise NotFound(f"user '{user}' has no permissions in vhost '{vhost}'")
        return rows[0]

    def put_permission(self, vhost: str, user: str, body: dict) -> bool:
        for k in ("configure", "write", "read"):
            if k not in body:
                raise Invalid(f"permissions need 'configure', 'write' and 'read' (missing '{k}')")

        def fn(s: NodeSession) -> bool:
            existed = any(
                p["vhost"] == vhost and p["user"] == user
                for p in ctl.permission_rows(s.rows("user"), s.rows("permission"))
            )
            ctl.set_permissions(s, user, vhost, body["configure"], body["write"], body["read"])
            return not existed

        return self.run(fn)

    def delete_permission(self, vhost: str, user: str) -> None:
        self.run(lambda s: ctl.clear_permissions(s, user, vhost))

    # ---- nodes, overview ---------------------------------------------------------------------------
    def _node_json(self, name: str, st: Any, view: dict, admin: str, hosts: dict) -> dict:
        running = name == self.node or view.get("state") == "up"
        held = hosts.get(name) or {"masters": [], "mirrors": []}
        out: dict[str, Any] = {
            "name": name,
            "type": "disc",
            "running": running,
            "partitions": [],
            "being_drained": False,
            "mem_used": None,
            "uptime": None,
            "os_pid": None,
            "admin": admin,
            "incarnation": view.get("incarnation"),
            "registry": None,
            "partition": None,
            "alarms": [],
            "queue_masters": len(held["masters"]),
            "queue_mirrors": len(held["mirrors"]),
        }
        if st is None:
            return out
        host = parse_address(admin)[0] if admin else self.host
        local = _loopback(host) or host == self.host
        if local:  # its processes are on this machine: measure them
            out["mem_used"] = group_rss(st.pgid) or None
            out.update(group_fds(st.pgid))
        out["os_pid"] = str(st.pid)
        out["amqp_port"] = st.amqp_port
        out["incarnation"] = st.incarnation
        out["registry"] = {k: st.registry.get(k) for k in ("role", "term", "leader", "commit_index", "applied_index")}
        out["partition"] = ctl.partition_state(st)
        out["alarms"] = ctl.node_alarms(st)
        out.update({k: st.alarms.get(k) for k in NODE_ALARM_ITEMS})
        if out["mem_used"] is None:
            out["mem_used"] = st.alarms.get("mem_used")
        data_dir = (self.cfg.get("data_dir") or ".") if name == self.node else (st.config or {}).get("data_dir")
        info = read_pid_file(data_dir) if local and data_dir else None
        if info and info.get("started"):
            out["uptime"] = int((time.time() - info["started"]) * 1000)
        return out

    def _nodes(self, s: NodeSession) -> tuple[list[dict], dict]:
        st = s.status()
        admins = {r["name"]: r.get("admin", "") for r in s.rows("node")}
        hosts = ctl.queue_hosts(s.rows("amqqueue"))
        out = []
        for name in sorted(set(admins) | set(st.view) | {self.node}):
            view = st.view.get(name, {})
            peer = st if name == self.node else None
            if peer is None and view.get("state") == "up":
                try:
                    peer = self._session(name).status()
                except ClusterError:
                    self._drop(name)
            out.append(self._node_json(name, peer, view, admins.get(name, ""), hosts))
        return out, hosts

    def nodes(self) -> list[dict]:
        return self.run(lambda s: self._nodes(s)[0])

    def node_info(self, name: str) -> dict:
        """One node (``/api/nodes/{name}``), with the queues it holds the
        master of (``master_queues``) and mirrors of (``mirror_queues``),
        each ``{"vhost", "name"}``."""
        nodes, hosts = self.run(self._nodes)
        out = dict(_one(nodes, name, f"no node '{name}'"))
        held = hosts.get(name) or {"masters": [], "mirrors": []}
        out["master_queues"] = [{"vhost": v, "name": n} for v, n in held["masters"]]
        out["mirror_queues"] = [{"vhost": v, "name": n} for v, n in held["mirrors"]]
        return out

    def overview(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        queues = self.queues()
        conns = self._connections()
        chans = ctl.channel_rows(conns)
        n_exchanges = len(self.exchanges())
        try:
            product_version = version("mirrorq")
        except PackageNotFoundError:
            product_version = "unknown"
        cfg = self.cfg
        return {
            "management_version": product_version,
            "product_name": "mirrorq",
            "product_version": product_version,
            "cluster_name": ",".join(cfg.get("cluster_nodes") or [self.node]),
            "node": self.node,
            "object_totals": {
                "connections": len(conns),
                "channels": len(chans),
                "exchanges": n_exchanges,
                "queues": len(queues),
                "consumers": sum(c.get("consumer_count") or 0 for c in chans),
            },
            **shapes.totals(queues),
            "listeners": [
                {"node": self.node, "protocol": "amqp", "ip_address": self.host, "port": cfg.get("amqp_port")},
                *(
                    [
                        {
                            "node": self.node,
                            "protocol": "amqp/ssl",
                            "ip_address": self.host,
                            "port": cfg.get("amqps_port"),
                        }
                    ]
                    if cfg.get("amqps_port")
                    else []
                ),
                {"node": self.node, "protocol": "clustering", "ip_address": self.host, "port": cfg.get("admin_port")},
                {"node": self.node, "protocol": "http", "ip_address": self.host, "port": cfg.get("management_port")},
            ],
        }

    # ---- health checks -------------------------------------------------------------------------
    def alarms(self, local: bool = False) -> list[dict]:
        """The resource alarms in effect in the cluster as this node sees it
        (``local``: only this node's own), each ``{"node", "resource"}``."""
        alarms = self.run(lambda s: list(s.status().alarms.get("alarms") or []))
        return [a for a in alarms if a.get("node") == self.node] if local else alarms

    # ---- /metrics ------------------------------------------------------------------------------
    def metrics_snapshot(self) -> dict:
        """What /metrics reports: this node's view, registry and memory, and
        every queue whose master is on this node (as RabbitMQ's per-node
        endpoint: scrape every node for the whole cluster)."""
        from mirrorq.queues.control import group_name

        def fn(s: NodeSession) -> dict:
            st = s.status()
            up = {n for n, v in st.view.items() if v.get("state") == "up"} | {self.node}
            mine = sorted(
                (r for r in s.rows("amqqueue") if node_of_member(r.get("pid")) == self.node),
                key=lambda r: (r["vhost"], r["name"]),
            )
            infos = live_infos(s, mine, up, self.op_timeout)
            groups = {g["name"]: g for g in s.rows("gm_group")}
            queues = []
            for r in mine:
                info = infos.get((r["vhost"], r["name"])) or {}
                queues.append(
                    {
                        "vhost": r["vhost"],
                        "name": r["name"],
                        "record": r,
                        "info": info.get("value") if info.get("ok") else None,
                        "group": groups.get(group_name(r["vhost"], r["name"])),
                    }
                )
            return {
                "node": self.node,
                "view": st.view,
                "registry": st.registry,
                "rss": group_rss(st.pgid),
                "queues": queues,
                "alarms": st.alarms,
            }

        return self.run(fn)
