"""What every AMQP socket shell does between its client sockets and the node's actors.

Both shells (:mod:`mirrorq.amqp.listener`, a Thespian actor watching its
sockets, and :mod:`mirrorq.amqp.aio_shell`, an asyncio process behind
:mod:`mirrorq.amqp.bridge`) own sockets and a way to reach actors; all the
rest is here, once: one :class:`~mirrorq.amqp.connection.Connection` core per
client, performing the cores' actions, routing the masters' replies, the
registry request queue, queue declares, the topology cache and the
connections' timers.  No sockets, no clock, no Thespian calls (it imports the queue
manager's message classes, whose module imports Thespian): the shell passes
``now`` in and implements :class:`FrontEndHost`.

Guarantees:

* a master's reply reaches the connection whose channel uid it carries
  (``uid_base = key << 32``, ``key`` the connection's random channel key:
  channel ids are never reused, see :mod:`mirrorq.queues.messages`);
  ``NewMaster`` / ``NotMaster`` go to every connection (each ignores queues
  it does not use);
* registry requests (reads, transactions) carry request ids
  (:class:`~mirrorq.node.registry_client.RegistryClient`), any number
  outstanding.  A failed initial table read is retried; a client's
  transaction whose outcome is unknown (leader change, no answer) is sent
  again for up to :data:`TXN_RETRY_FOR` seconds before the client hears of it;
* queue declares are matched to their answers by queue name (the oldest
  pending declare when the answer names none);
* a lost link reaches every connection: the shell's :class:`LinkLost`
  (its transport gave up on an actor) and the agent's ``NodeEvent`` "down"
  (the front end subscribes at start) become
  :meth:`~mirrorq.amqp.connection.Connection.link_lost`;
* a master's :class:`~mirrorq.queues.messages.FrontEndProbe` is
  answered with the channel keys of every live connection
  (``FrontEndChannels``): the master drops its channels under other keys,
  closed while it could not hear of it (a partition, a paused node);
* while the node is paused in a minority (:meth:`FrontEnd.pause`: the
  agent's ``NodeEvent`` "paused", or the shell reading the majority lease),
  every client connection is closed with 320 CONNECTION_FORCED naming the
  minority, and so is each new one once its handshake is done;
* while a resource alarm is in effect anywhere in the cluster (the
  agent's :class:`~mirrorq.node.messages.ResourceAlarms`, subscribed to at
  start and answered at once with the alarms in effect), every connection,
  and each new one, hears the ``connection.blocked`` reason
  (:meth:`~mirrorq.amqp.connection.Connection.resource_alarm`): its
  publishers stop being read (``wants_read``) until every alarm has cleared;
* the node's masters' dead-lettered messages (:class:`~mirrorq.queues.messages.DeadLetter`)
  go to the :class:`~mirrorq.amqp.dead_letter.DeadLetterRouter`, which has a
  channel key of its own; replies for its channels, every ``NewMaster`` /
  ``NotMaster`` and every queue-record change reach it too;
* the :class:`~mirrorq.amqp.topology.Topology` cache is loaded at start and
  kept by the registry's change notifications; a change of a queue's
  ``pid`` (a promotion) reaches every connection; a snapshot reset reloads
  every table.

* a connection opened on the TLS listener (``open(..., ssl=True)``) is
  listed with ``ssl`` true, its own port in its name, and, once the shell
  hands them over (:meth:`FrontEnd.tls_established`), RabbitMQ's TLS items
  (:data:`TLS_ITEMS`: protocol, cipher, the client certificate's subject,
  issuer and validity); TLS itself is the shells' business
  (:mod:`mirrorq.amqp.tls`).

Assumes: the agent answers registry requests in the order it got them, and
the shell delivers actor messages to :meth:`FrontEnd.message` in the order
they arrived.  Fails: a connection whose core raises is closed by the core
(541); a transport the shell reports lost releases what its connection held
(channels are closed at their masters, which requeue unacked messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mirrorq.amqp import connection as cn
from mirrorq.amqp.dead_letter import DeadLetterRouter
from mirrorq.amqp.states import ConnState, Throttle
from mirrorq.amqp.topology import TABLES, Topology
from mirrorq.bounds import DEFAULT_MAX_MESSAGE_SIZE, check_max_message_size
from mirrorq.node.alarms import blocked_reason
from mirrorq.node.messages import (
    AlarmSubscribe,
    NodeEvent,
    RegistryChanges,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    ResourceAlarms,
    Subscribe,
)
from mirrorq.node.registry_client import RegistryClient
from mirrorq.queues import messages as qm
from mirrorq.queues.control import FrontEndAt
from mirrorq.queues.manager import DeclareQueue, DeclareResult
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

#: messages from queue masters to the front end
REPLIES = (qm.Confirm, qm.Deliveries, qm.GetEmpty, qm.ConsumerCancelled, qm.CommandResult, qm.NotMaster, qm.NewMaster)
#: everything :meth:`FrontEnd.message` understands


@dataclass(frozen=True)
class LinkLost:
    """From the shell: its transport gave up on the actor at ``dst``
    (``"host:port"``); what was posted to it may be lost."""

    dst: str


FRONTEND_MESSAGES = REPLIES + (
    RegistryChanges,
    RegistryRows,
    RegistryResult,
    DeclareResult,
    NodeEvent,
    LinkLost,
    qm.DeadLetter,
    qm.FrontEndProbe,
    ResourceAlarms,
)
#: the connection number under which the dead-letter router's channel key is kept
ROUTER_NO = 0
#: timer granularity (seconds): heartbeats and handshake deadlines are coarse
TICK = 0.1
REGISTRY_TIMEOUT = 10.0  # a registry request the agent has not answered by then is given up (read: asked again)
#: a client's registry transaction whose outcome is unknown (a leader change, no answer) is sent again for this long
TXN_RETRY_FOR = 30.0


@dataclass
class FrontEndQuery:
    """From a tool (mirrorctl), answered with :class:`FrontEndAnswer`:
    ``what`` = ``"connections"`` (every connection of this node with its
    channels and consumers, :meth:`FrontEnd.connections`) or ``"close"``
    (close the connection whose ``pid`` or ``name`` is ``target`` with
    320 CONNECTION_FORCED and ``reason``)."""

    what: str
    target: str = ""
    reason: str = ""


@dataclass
class FrontEndAnswer:
    ok: bool
    value: Any = None
    error: str = ""


class FrontEndHost(Protocol):
    """What a shell does for the front end."""

    def fe_write(self, no: int, data: bytes) -> bool:
        """Write to client ``no``'s socket; False if the socket failed (the
        shell has then called :meth:`FrontEnd.lost`)."""

    def fe_close(self, no: int, reason: str, linger: bool = False) -> None:
        """Close client ``no``'s socket once what was written is flushed
        (``linger``: once the client closed it, or the shell's linger time
        passed; see :class:`~mirrorq.amqp.connection.CloseTransport`).
        Nothing read from it reaches the front end any more."""

    def fe_send(self, dst: str, msg: Any) -> None:
        """Send ``msg`` to the actor at ``dst`` (``"host:port"``)."""

    def fe_backlog(self, no: int) -> int:
        """Bytes written for client ``no`` that its socket has not taken yet.
        The shell calls :meth:`FrontEnd.drained` when they fall to
        :data:`~mirrorq.amqp.connection.CLIENT_BACKLOG` or below."""

    def fe_agent(self, msg: Any) -> None:
        """Send ``msg`` to the node agent (its answer comes back to :meth:`FrontEnd.message`)."""

    def fe_manager(self, msg: Any) -> None:
        """Send ``msg`` to the node's queue manager."""

    def fe_tick_soon(self) -> None:
        """Call :meth:`FrontEnd.tick` about :data:`TICK` seconds from now
        (once, however often this is called before it fires)."""

    def fe_log(self, event: str, level: str, fields: dict) -> None:
        """Write one structured record to the node's log."""


#: RabbitMQ's TLS connection info items (None on a plain connection; see mirrorq.amqp.tls.peer_info)
TLS_ITEMS = ("ssl_protocol", "ssl_cipher", "peer_cert_subject", "peer_cert_issuer", "peer_cert_validity")


class _Conn:
    __slots__ = ("no", "conn", "timers", "peer_host", "peer_port", "opened_at", "key", "port", "ssl", "tls")

    def __init__(
        self,
        no: int,
        conn: cn.Connection,
        peer_host: str = "",
        peer_port: int = 0,
        opened_at: float = 0.0,
        key: int = 0,
        port: int = 0,
        ssl: bool = False,
    ) -> None:
        self.no, self.conn, self.key = no, conn, key
        self.timers: dict = {}
        self.peer_host, self.peer_port, self.opened_at = peer_host, peer_port, opened_at
        self.port, self.ssl = port, ssl
        self.tls: dict = {}


class FrontEnd:
    def __init__(
        self,
        host: FrontEndHost,
        *,
        node: str,
        dst: str,
        amqp_host: str = "127.0.0.1",
        amqp_port: int = 0,
        channel_key: Any = qm.channel_key,
        max_message_size: int | None = None,
    ) -> None:
        """``dst``: where the masters' replies for these connections go (the
        address of the actor that hands them to :meth:`message`);
        ``amqp_host``/``amqp_port``: the listening address (connection names);
        ``channel_key(taken)``: a connection's channel key (random; a
        simulator passes a seeded one); ``max_message_size``: the largest
        message body a connection accepts (None: the default,
        :mod:`mirrorq.bounds`)."""
        if not isinstance(dst, str) or ":" not in dst:
            raise ValueError(f"front end dst must be 'host:port' text, got {dst!r}")
        self.host, self.node, self.dst = host, node, dst
        self.max_message_size = check_max_message_size(
            DEFAULT_MAX_MESSAGE_SIZE if max_message_size is None else max_message_size
        )
        self.amqp_host, self.amqp_port = amqp_host, amqp_port
        self.topo = Topology()
        self.conns: dict[int, _Conn] = {}
        self.next_no = 0
        self.channel_key = channel_key
        self.by_key: dict[int, int] = {}  # channel key -> connection number
        router_key = channel_key(self.by_key)
        self.by_key[router_key] = ROUTER_NO
        self.dead_letters = DeadLetterRouter(self.topo, dst, router_key)
        self.registry = RegistryClient("frontend", REGISTRY_TIMEOUT)
        self.refreshes: dict[int, list] = {}  # refresh id -> [tables left, ok, error]
        self.next_refresh = 0
        self.now = 0.0  # the time of the last call that had one (requests made outside a call)
        self.declares: list = []  # (connection no, tag, (vhost, name))
        self.stats = {"accepted": 0, "closed": 0, "read_bytes": 0, "sends": 0, "forced_paused": 0}
        #: why the node does not serve clients (pause_minority), or "" while it does
        self.paused = ""
        #: the connection.blocked reason while a resource alarm is in effect in the cluster, else ""
        self.alarm = ""

    # ---- start and status ----------------------------------------------------------------
    def start(self) -> None:
        """Subscribe to the registry's tables and read them, and to node events."""
        self.host.fe_agent(Subscribe())
        self.host.fe_agent(AlarmSubscribe())
        self.host.fe_agent(RegistrySubscribe(TABLES))
        self.host.fe_manager(FrontEndAt(self.dst))  # the node's masters dead-letter through us
        for t in TABLES:
            self._registry(self.now, ("get", t))

    def status(self) -> dict:
        return {
            "connections": len(self.conns),
            **self.stats,
            "tables": sorted(self.topo.loaded),
            "alarm": self.alarm,
            "blocked": sum(c.conn.throttle is Throttle.BLOCKED for c in self.conns.values()),
        }

    # ---- client transports ----------------------------------------------------------------
    def open(
        self, now: float, peer_host: str, peer_port: int = 0, *, port: int | None = None, ssl: bool = False
    ) -> int:
        """A client connected (to ``port``, default the AMQP port; ``ssl``: on
        the TLS listener): returns its connection number."""
        self.next_no += 1
        no = self.next_no
        key = self.channel_key(self.by_key)
        self.by_key[key] = no
        conn = cn.Connection(
            self.topo,
            dst=self.dst,
            conn_id=f"{self.node}.{no}",
            uid_base=key << 32,
            peer_host=peer_host,
            node=self.node,
            max_message_size=self.max_message_size,
        )
        c = _Conn(no, conn, peer_host, peer_port, now, key, self.amqp_port if port is None else port, ssl)
        self.conns[no] = c
        self.stats["accepted"] += 1
        self._do(now, c, conn.start(now))
        if self.alarm:
            self._do(now, c, conn.resource_alarm(now, self.alarm))
        return no

    def data(self, now: float, no: int, data: bytes) -> None:
        c = self.conns.get(no)
        if c is not None:
            self.stats["read_bytes"] += len(data)
            self._do(now, c, c.conn.data_received(now, data))
            if self.paused and self.conns.get(no) is c and c.conn.state is ConnState.OPEN:
                self._force(now, c)

    # ---- pause_minority ----------------------------------------------------------------------
    def pause(self, now: float, reason: str) -> None:
        """The node is in a minority: every client connection is closed with
        320 CONNECTION_FORCED and ``reason`` (a client reconnects to a node of
        the majority), and every connection opened until :meth:`resume` is
        closed the same way once its handshake is done, so its client reads
        the reason instead of a dropped socket."""
        first = not self.paused
        self.paused = reason or "the node is paused (pause_minority)"
        if first:
            self.host.fe_log("clients_paused", "warning", {"reason": self.paused, "connections": len(self.conns)})
        for c in list(self.conns.values()):
            if c.conn.state is ConnState.OPEN:
                self._force(now, c)

    def follow_lease(self, now: float, paused: bool) -> None:
        """The node's majority lease (:mod:`mirrorq.node.lease`) as the shell
        read it before handling anything of this turn: pause or resume to
        match it."""
        if paused != bool(self.paused):
            if self.paused:
                self.resume(now)
            else:
                self.pause(
                    now,
                    f"node {self.node} is in a minority and paused (pause_minority): "
                    f"it does not reach a majority of its cluster",
                )

    def resume(self, now: float) -> None:
        if self.paused:
            self.paused = ""
            self.host.fe_log("clients_resumed", "info", {})

    # ---- resource alarms -------------------------------------------------------------------
    def resource_alarms(self, now: float, msg: ResourceAlarms) -> None:
        """The cluster's resource alarms are now ``msg.alarms``: every connection hears the reason."""
        reason = blocked_reason(r for _, r in msg.alarms)
        if reason == self.alarm:
            return
        self.alarm = reason
        self.host.fe_log(
            "resource_alarm" if reason else "resource_alarm_cleared",
            "warning" if reason else "info",
            {"alarms": [list(a) for a in msg.alarms], "connections": len(self.conns)},
        )
        for c in list(self.conns.values()):
            self._do(now, c, c.conn.resource_alarm(now, reason))

    def _force(self, now: float, c: _Conn) -> None:
        self.stats["forced_paused"] += 1
        self._do(now, c, c.conn.close_forced(now, self.paused))

    def mid_message(self, no: int) -> bool:
        """Client ``no`` has sent part of a frame or of a message's frames."""
        c = self.conns.get(no)
        return c is not None and c.conn.mid_message()

    def tls_established(self, no: int, info: dict) -> None:
        """Client ``no``'s TLS handshake completed: ``info`` holds its
        :data:`TLS_ITEMS` (reported by :meth:`connections`)."""
        c = self.conns.get(no)
        if c is not None:
            c.tls = {k: info.get(k) for k in TLS_ITEMS}

    def wants_read(self, no: int) -> bool:
        c = self.conns.get(no)
        return c is not None and c.conn.wants_read()

    def lost(self, now: float, no: int) -> None:
        """Client ``no``'s socket is gone (the shell closes it itself)."""
        c = self.conns.pop(no, None)
        if c is not None:
            self.by_key.pop(c.key, None)
            self.stats["closed"] += 1
            self._do(now, c, c.conn.connection_lost(now), dropping=True)

    # ---- the core's actions --------------------------------------------------------------
    def _do(self, now: float, c: _Conn, actions: list, dropping: bool = False) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.stats["sends"] += 1
                self.host.fe_send(a.dst, a.msg)
            elif isinstance(a, Emit):
                ev = a.event
                if isinstance(ev, cn.Write):
                    if not dropping and not self.host.fe_write(c.no, ev.data):
                        dropping = True
                elif isinstance(ev, cn.CloseTransport):
                    if not dropping:
                        dropping = True
                        self.lost(now, c.no)
                        self.host.fe_close(c.no, ev.reason, ev.linger)
                elif isinstance(ev, cn.RegistryRequest):
                    self._registry(now, ("txn", ev.txn, c.no, ev.tag, now))
                elif isinstance(ev, cn.RefreshRequest):
                    self.next_refresh += 1
                    self.refreshes[self.next_refresh] = [len(ev.tables), True, ""]
                    for t in ev.tables:
                        self._registry(now, ("rget", t, c.no, ev.tag, self.next_refresh))
                elif isinstance(ev, cn.ProtocolError):
                    self._log_error(c, ev)
                elif isinstance(ev, cn.DeclareRequest):
                    self.declares.append((c.no, ev.tag, (ev.spec["vhost"], ev.spec["name"])))
                    self.host.fe_manager(DeclareQueue(dict(ev.spec), tuple(ev.nodes)))
            elif isinstance(a, SetTimer):
                c.timers[a.key] = now + a.delay
                self.host.fe_tick_soon()
            elif isinstance(a, CancelTimer):
                c.timers.pop(a.key, None)
        if not dropping and c.conn.wants_credit() and self.host.fe_backlog(c.no) <= cn.CLIENT_BACKLOG:
            self._do(now, c, c.conn.grant_credit(now))

    def drained(self, now: float, no: int) -> None:
        """Client ``no``'s socket took what was waiting for it, down to
        :data:`~mirrorq.amqp.connection.CLIENT_BACKLOG`: the link credit of
        what it was sent goes back to the masters."""
        c = self.conns.get(no)
        if c is not None and c.conn.wants_credit():
            self._do(now, c, c.conn.grant_credit(now))

    def _name(self, c: _Conn) -> str:
        """RabbitMQ's connection name: ``peer host:port -> our host:port``."""
        return f"{c.peer_host}:{c.peer_port} -> {self.amqp_host}:{c.port}"

    def _log_error(self, c: _Conn, ev: cn.ProtocolError) -> None:
        fields = {
            "connection": c.conn.conn_id,
            "name": self._name(c),
            "channel": ev.channel,
            "code": ev.code,
            "reply": ev.name,
            "text": ev.text,
            "class_id": ev.class_id,
            "method_id": ev.method_id,
            "user": ev.user,
            "vhost": ev.vhost,
        }
        self.host.fe_log("amqp_connection_error" if ev.channel == 0 else "amqp_channel_error", "warning", fields)

    # ---- what tools ask ----------------------------------------------------------------------
    def query(self, now: float, q: FrontEndQuery) -> FrontEndAnswer:
        if q.what == "connections":
            return FrontEndAnswer(True, self.connections(now))
        if q.what == "close":
            target = q.target.strip("<>")
            c = next((c for c in self.conns.values() if target in (c.conn.conn_id, self._name(c))), None)
            if c is None:
                return FrontEndAnswer(False, error=f"no connection {q.target!r} on node {self.node}")
            self.host.fe_log(
                "amqp_connection_closed_by_operator",
                "info",
                {"connection": c.conn.conn_id, "name": self._name(c), "reason": q.reason},
            )
            self._do(now, c, c.conn.close_forced(now, q.reason))
            return FrontEndAnswer(True, {"pid": f"<{c.conn.conn_id}>", "name": self._name(c)})
        return FrontEndAnswer(False, error=f"unknown front end query {q.what!r}")

    def connections(self, now: float) -> list[dict]:
        """Every client connection of this node: RabbitMQ's connection info
        items, with ``channels`` (each with its ``consumers``); ``ssl`` is
        true for a connection to the TLS listener, with the :data:`TLS_ITEMS`."""
        out = []
        for c in sorted(self.conns.values(), key=lambda c: c.no):
            info = c.conn.info()
            out.append(
                {
                    "pid": f"<{c.conn.conn_id}>",
                    "name": self._name(c),
                    "node": self.node,
                    "host": self.amqp_host,
                    "port": c.port,
                    "peer_host": c.peer_host,
                    "peer_port": c.peer_port,
                    "protocol": "AMQP 0-9-1",
                    "ssl": c.ssl,
                    **{k: c.tls.get(k) for k in TLS_ITEMS},
                    "connected_for": round(max(0.0, now - c.opened_at), 3),
                    **info,
                }
            )
        return out

    def tick(self, now: float) -> None:
        """Fire the connections' due timers; asks for another tick while any is pending."""
        for c in list(self.conns.values()):
            for key, at in sorted(c.timers.items(), key=lambda kv: kv[1]):
                if at <= now and c.timers.get(key) == at and self.conns.get(c.no) is c:
                    del c.timers[key]
                    self._do(now, c, c.conn.timer(now, key))
        for ctx in self.registry.expired(now):
            self._registry_lost(now, ctx)
        if any(c.timers for c in self.conns.values()) or len(self.registry):
            self.host.fe_tick_soon()

    # ---- messages from actors ---------------------------------------------------------------
    def message(self, now: float, src: Any, msg: Any) -> bool:
        """An actor's message for the front end; False if it is not one."""
        if isinstance(msg, REPLIES):
            self._reply(now, src, msg)
        elif isinstance(msg, qm.DeadLetter):
            self._router(self.dead_letters.dead_letter(now, msg))
        elif isinstance(msg, RegistryChanges):
            self._changes(now, msg)
        elif isinstance(msg, (RegistryRows, RegistryResult)):
            self._registry_answer(now, msg)
        elif isinstance(msg, DeclareResult):
            self._declared(now, msg)
        elif isinstance(msg, NodeEvent):
            if msg.kind == "down":
                for c in list(self.conns.values()):
                    self._do(now, c, c.conn.link_lost(now, node=msg.node))
            elif msg.kind == "paused":
                self.pause(now, msg.reason)
            elif msg.kind == "resumed":
                self.resume(now)
        elif isinstance(msg, qm.FrontEndProbe):
            # a master asks which of its channels here live: the keys of every live connection
            self.host.fe_send(msg.master, qm.FrontEndChannels(self.dst, frozenset(self.by_key)))
        elif isinstance(msg, LinkLost):
            for c in list(self.conns.values()):
                self._do(now, c, c.conn.link_lost(now, host=msg.dst))
        elif isinstance(msg, ResourceAlarms):
            self.resource_alarms(now, msg)
        else:
            return False
        return True

    def _reply(self, now: float, src: Any, msg: Any) -> None:
        if isinstance(msg, (qm.NewMaster, qm.NotMaster)):
            for c in list(self.conns.values()):
                self._do(now, c, c.conn.receive(now, src, msg))
            self._router(self.dead_letters.receive(now, src, msg))
            return
        cid = getattr(msg, "channel", None) or getattr(msg, "publisher", None)
        try:
            uid = qm.channel_id(cid)[1]
        except ValueError:
            return
        no = self.by_key.get(uid >> 32) if isinstance(uid, int) else None
        if no == ROUTER_NO:
            self._router(self.dead_letters.receive(now, src, msg))
            return
        target = self.conns.get(no) if no is not None else None
        if target is not None:
            self._do(now, target, target.conn.receive(now, src, msg))

    def _router(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.stats["sends"] += 1
                self.host.fe_send(a.dst, a.msg)

    # ---- registry: requests with ids, any number outstanding (RegistryClient) -----------------
    def _registry(self, now: float, req: tuple) -> None:
        self.now = max(self.now, now)
        msg: RegistryGet | RegistryTxn
        if req[0] == "get":
            msg = self.registry.get(now, req[1], None, req)
        elif req[0] == "rget":
            msg = self.registry.get(now, req[1], None, req, linearizable=True)
        else:
            msg = self.registry.txn(now, req[1], req)
        self.host.fe_agent(msg)
        self.host.fe_tick_soon()  # the tick gives up requests the agent never answers

    def _registry_lost(self, now: float, req: tuple) -> None:
        """The agent never answered ``req`` (REGISTRY_TIMEOUT): a table read
        is asked again, a transaction or refresh fails (the client may retry)."""
        if req[0] == "get":
            self._registry(now, req)
        else:
            self._registry_done(now, req, False, "the registry did not answer; retry")

    def _retried(self, now: float, req: tuple, error: str) -> bool:
        """Send a client's transaction again when its outcome is unknown (the
        registry's answer says "retry": a leader change, no leader, no
        answer) -- the front end's transactions are puts and deletes (with
        existence checks that their own success does not change), so a
        repeat is harmless -- for up to TXN_RETRY_FOR seconds; the client
        never sees a leader change."""
        if req[0] != "txn" or "retry" not in error or now - req[4] > TXN_RETRY_FOR or req[2] not in self.conns:
            return False
        self.stats["txn_retries"] = self.stats.get("txn_retries", 0) + 1
        self._registry(now, req)
        return True

    def _registry_answer(self, now: float, msg: Any) -> None:
        self.now = max(self.now, now)
        req = self.registry.answer(msg)
        if req is None:
            return  # not an answer to us (or to a request given up)
        if req[0] in ("get", "rget") and msg.ok:
            self.topo.load(req[1], msg.rows)
            if req[1] == "amqqueue":
                self._masters_changed(now, [(r["vhost"], r["name"], None, r) for r in msg.rows])
        if req[0] == "get":
            if not msg.ok:
                self._registry(now, req)  # retry (the registry may not be ready yet)
            return
        self._registry_done(now, req, msg.ok, msg.error)

    def _registry_done(self, now: float, req: tuple, ok: bool, error: str) -> None:
        if not ok and self._retried(now, req, error):
            return
        if req[0] == "rget":
            r = self.refreshes.get(req[4])
            if r is None:
                return
            r[0] -= 1
            if not ok and r[1]:
                r[1], r[2] = False, error
            if r[0] > 0:
                return  # the connection hears once every table of its refresh is in
            del self.refreshes[req[4]]
            ok, error = r[1], r[2]
        c = self.conns.get(req[2])
        if c is not None:
            self._do(now, c, c.conn.registry_result(now, req[3], ok, error))

    def _changes(self, now: float, msg: RegistryChanges) -> None:
        if msg.changes is None:
            for t in TABLES:
                self._registry(now, ("get", t))
            return
        self._masters_changed(now, self.topo.apply(msg.changes))

    def _masters_changed(self, now: float, moved: list) -> None:
        for vhost, name, old, new in moved:
            self._router(self.dead_letters.queue_moved(now, vhost, name, new))
            if new is not None and (old or {}).get("pid") == new.get("pid") and old is not None:
                continue
            for c in list(self.conns.values()):
                self._do(now, c, c.conn.queue_moved(now, vhost, name, new, old))

    def _declared(self, now: float, msg: DeclareResult) -> None:
        if not self.declares:
            return
        idx = 0
        if msg.ok and msg.record:
            key = (msg.record.get("vhost"), msg.record.get("name"))
            idx = next((i for i, d in enumerate(self.declares) if d[2] == key), 0)
        else:
            idx = next((i for i, d in enumerate(self.declares) if f"'{d[2][1]}'" in (msg.error or "")), 0)
        no, tag, _ = self.declares.pop(idx)
        c = self.conns.get(no)
        if c is not None:
            self._do(now, c, c.conn.declare_result(now, tag, msg.ok, msg.record, msg.error))
