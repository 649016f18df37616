"""The AMQP 0-9-1 connection state machine, sans-IO (bytes in, actions out).

One :class:`Connection` per client TCP connection.  The shell
(:mod:`mirrorq.amqp.listener`) feeds it what the socket read
(:meth:`Connection.data_received`), what queue masters answered
(:meth:`Connection.receive`), registry and declare outcomes
(:meth:`Connection.registry_result`, :meth:`Connection.declare_result`),
queue-record changes (:meth:`Connection.queue_moved`) and timers
(:meth:`Connection.timer`); it returns :mod:`mirrorq.sansio` actions:
``Emit(Write(bytes))`` for the socket, ``Emit(CloseTransport(reason))``,
``Send(master_dst, message)`` to queue masters (the wire messages of
:mod:`mirrorq.queues.messages`), ``Emit(RegistryRequest)`` /
``Emit(DeclareRequest)`` for the node's registry and queue manager, and
``SetTimer`` / ``CancelTimer`` (heartbeats, handshake and close deadlines).
The byte stream is split into frames, and frames encoded, by
:mod:`mirrorq.amqp.framing` (which keeps a publisher's repeated frames
decoded); the errors are :mod:`mirrorq.amqp.errors`; the connection's
and channels' states, and which frames each takes, are the transition
tables of :mod:`mirrorq.amqp.states`.

Protocol (RabbitMQ's behaviour, as clients expect it)
-----------------------------------------------------
* Handshake: protocol header (anything else gets our header back and the
  socket closed), ``connection.start`` (SASL ``PLAIN`` and ``AMQPLAIN``),
  ``start-ok`` checked against the registry's ``user`` table (guest/guest
  by default, from loopback only), ``tune`` / ``tune-ok`` (``frame_max``
  4096..:data:`FRAME_MAX`, ``channel_max`` <= :data:`CHANNEL_MAX`,
  heartbeat as the client asks), ``open`` (the vhost must exist and the
  user must have a permission row for it).  A handshake that does not end
  within :data:`HANDSHAKE_TIMEOUT` closes the socket.
* Heartbeats: with an interval ``h`` we send a heartbeat when we have sent
  nothing for ``h/2`` and close the socket when the client has sent nothing
  for ``2h``.
* Each AMQP channel keeps one :class:`~mirrorq.queues.channel.QueueChannel`
  per queue it touches (channel id ``(dst, uid)``, ``uid`` unique per
  channel *incarnation*, so a reopened channel number never inherits a
  publisher sequence).  Publishes parsed from one read are handed to each
  queue's master as ONE message per queue (batch per hop).
* Synchronous methods (declare, bind, get, ...) are answered in order: while
  one waits for the registry, a queue manager or a master, later frames of
  that channel wait behind it.
* Features, each in a module of its own working through a small
  interface of this class (a ``Protocol``): publishing -- content
  assembly, routing, publisher confirms, ``max_message_size`` --
  :mod:`mirrorq.amqp.publish`; consumers, deliveries, settlements,
  prefetch, ``channel.flow`` -- :mod:`mirrorq.amqp.consume`;
  transactions -- :mod:`mirrorq.amqp.tx`; range reads, commits and
  publisher refs -- :mod:`mirrorq.amqp.stream`.  This class keeps the
  connection's and channels' state machines, dispatches each frame
  (:data:`_HANDLERS`), and does exchanges, queues and bindings itself.
  What a queue's master says reaches the feature it is for:
  confirms, deliveries, answers to the request waiting, cancels.  A
  server-initiated ``basic.cancel`` tells consumers their queue was
  deleted or failed over (``x-cancel-on-ha-failover``).

Errors: every protocol error closes the channel (403, 404, 405, 406) or the
connection (501-506, 530, 540, 541; the spec's hard errors) with
``"<NAME> - <text naming the cause>"`` and the class/method that caused it.
Framing errors (501, 502: :mod:`mirrorq.amqp.framing`) close the
connection; nothing a client sends raises out of this class (an unexpected exception becomes a
541 connection close).  After a close is sent, only close / close-ok are
heeded; the socket is closed when close-ok arrives or after
:data:`CLOSE_TIMEOUT`.

* If the queue's record disappears while a request waits on its master
  (consume, get, purge...), the request fails with 404 (its master is
  gone and will not answer).
* Credit, both ways, so that no buffer between a client and its queues
  grows with the load.  Publishes: the shell reads a client's socket only
  while the publishes it sent on to masters and that are not confirmed yet
  stay under :data:`MAX_UNCONFIRMED` messages and
  :data:`MAX_UNCONFIRMED_BYTES` of bodies (``wants_read``; a master
  confirms once its mirrors hold the message, so a slow mirror slows the
  publisher through TCP); each queue channel has at most two ``Publish``
  batches in flight (:mod:`mirrorq.queues.channel`).  What was read
  before a channel or connection closes goes to its queues all the same.
  Deliveries: a master sends a consumer at most
  ``amqqueue.LINK_CREDIT_BYTES`` of bodies that this connection has not
  credited back; the connection credits what it *wrote to the client*
  (``grant_credit``, in the next ``Settle``), and the front end asks for
  that only while the shell holds at most :data:`CLIENT_BACKLOG` bytes the
  client's socket has not taken -- so a client that stops reading stops
  its queues, whatever its prefetch (none, or no-ack).

* Lost contact with a master.  The node's transport may give up on a
  queue host (a partition resets every connection to it, or the host died)
  and drop what was posted to it -- publishes, acks, consumes -- and a
  master that loses contact with this node drops this node's channels
  (their consumers go, their unacked messages are requeued).  Either breaks
  the channel's conversation with that master for good, so
  :meth:`Connection.link_lost` (the transport gave up on the master's host,
  or the master's node went down) gives every queue channel with something
  outstanding at that master (unconfirmed publishes, consumers, unacked
  deliveries; an unanswered get or command has its own
  :data:`MASTER_ANSWER_TIMEOUT`) :data:`LINK_GRACE` seconds for a new
  master to take over (a failover: everything outstanding is sent to it
  again, see :mod:`mirrorq.queues.channel`).  If the master is still
  the same then (this node was cut off from it), the connection is closed
  with 320 CONNECTION_FORCED naming the queue, as RabbitMQ's nodes close
  their clients' connections on a partition: the client reconnects, and a
  publisher learns that its unconfirmed publishes are in doubt instead of
  waiting for ever.

* Resource alarms (:mod:`mirrorq.node.alarms`), as RabbitMQ's reader:
  while an alarm is in effect anywhere in the cluster
  (:meth:`Connection.resource_alarm`), a connection that publishes is
  *blocked*: one that has published before is blocked at once, one that
  has not is *blocking* (it goes on) until its first ``basic.publish``.  A
  blocked connection is not read (:meth:`Connection.wants_read` is False:
  TCP back-pressure stops the publisher; the frames already read are
  handled), its client's missed heartbeats are not held against it, and a
  client that announced the ``connection.blocked`` capability gets
  ``connection.blocked`` with the reason ("low on memory", "low on disk",
  both joined by " & "), once per blocking.  When every alarm has cleared
  it is read again and such a client gets ``connection.unblocked``.
  Deliveries to a blocked connection go on; a connection that only
  consumes is never blocked.  ``list_connections`` shows the state
  (``running``, ``blocking``, ``blocked``).

Not supported (refused with 540): ``basic.recover`` with ``requeue=false``
(as RabbitMQ), ``immediate=true``, ``prefetch_size`` != 0.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pamqp import commands as C
from pamqp import constants as K
from pamqp.common import FieldTable

from mirrorq.amqp import consume, publish, tx
from mirrorq.amqp.channel import Channel
from mirrorq.amqp.consume import on_delivery
from mirrorq.amqp.errors import (
    HARD_ERRORS,
    REPLY_NAMES,
    AMQPException,
    NotKnownHere,
    amqp_error,
    strip_name,
    unknown_exchange,
    unknown_queue,
)
from mirrorq.amqp.framing import FRAME_MAX, FRAME_MIN, HEARTBEAT_FRAME, PROTOCOL_HEADER, FrameReader, FrameWriter
from mirrorq.amqp.publish import content_frame
from mirrorq.amqp.publish import flush as flush_publishes
from mirrorq.amqp.states import (
    CHANNEL_FRAME_REFUSAL,
    CHANNEL_REFUSALS,
    CHANNEL_TRANSITIONS,
    CONNECTION_REFUSALS,
    CONNECTION_TRANSITIONS,
    CONTENT_EXPECTS,
    ChanEvent,
    ChanMode,
    ChanState,
    ConnEvent,
    ConnState,
    ContentState,
    Throttle,
)
from mirrorq.amqp.topology import (
    DEFAULT_VHOST,
    EXCHANGE_TYPES,
    INTERNAL_MARK,
    Topology,
    _plain,
    arguments_key,
    queue_inequivalence,
    with_internal_arguments,
)
from mirrorq.amqp.topology import value_text as _txt
from mirrorq.bounds import DEFAULT_MAX_MESSAGE_SIZE, check_max_message_size
from mirrorq.queues import channel as qch
from mirrorq.queues import messages as qm
from mirrorq.queues import semantics
from mirrorq.sansio import CancelTimer, Emit, SetTimer

CHANNEL_MAX = 2047
HEARTBEAT = 60
HANDSHAKE_TIMEOUT = 10.0
CLOSE_TIMEOUT = 3.0
MAX_UNCONFIRMED = 20000  # per connection; above it the shell stops reading the socket
#: per connection, their bodies; the same (bench/overload.py: 94% of the rate
#: of 4x as much credit, a quarter more than 8 MiB; bench/README.md)
MAX_UNCONFIRMED_BYTES = 32 << 20
#: link credit goes back to the masters once this much was delivered ...
GRANT_BYTES = 2 << 20
#: ... and the shell holds at most this much not yet written to the client
CLIENT_BACKLOG = 1 << 20

#: a request waiting on a queue's master (declare's message count, purge, delete, get, consume-ok) fails
#: with 541 after this long: the master died and none took over (the queue is down), nothing answers
MASTER_ANSWER_TIMEOUT = 20.0
#: after losing contact with a queue's master, how long a new master has to take over before the connection is closed
LINK_GRACE = 10.0
PRODUCT = "mirrorq"

# The states as module globals: what the per-frame code compares with
# (looking an Enum member up on its class costs as much as handling a frame's header).
_AWAIT_HEADER, _START_SENT, _TUNE_SENT, _AWAIT_OPEN = (
    ConnState.AWAIT_HEADER,
    ConnState.START_SENT,
    ConnState.TUNE_SENT,
    ConnState.AWAIT_OPEN,
)
_OPEN, _CLOSING, _CLOSED = ConnState.OPEN, ConnState.CLOSING, ConnState.CLOSED
_CH_OPEN, _CH_CLOSING, _CH_CLOSED = ChanState.OPEN, ChanState.CLOSING, ChanState.CLOSED
_PLAIN, _CONFIRM, _TX = ChanMode.PLAIN, ChanMode.CONFIRM, ChanMode.TX
_RUNNING, _BLOCKING, _BLOCKED = Throttle.RUNNING, Throttle.BLOCKING, Throttle.BLOCKED
_CONTENT_IDLE, _METHOD_FRAME = ContentState.IDLE, CONTENT_EXPECTS[ContentState.IDLE]
# the per-frame and per-delivery code's classes, as module globals too
_PUBLISH = C.Basic.Publish
_DELIVERY, _CONFIRMS = qch.Delivery, (qch.Confirmed, qch.Nacked)
#: connection-class methods -> their events (any other method on channel 0: ConnEvent.METHOD)
#: channel-class methods -> their events (any other method or frame: ChanEvent.METHOD)
_CHANNEL_EVENTS: dict[type, ChanEvent] = {
    C.Channel.Open: ChanEvent.OPEN,
    C.Channel.Close: ChanEvent.CLOSE,
    C.Channel.CloseOk: ChanEvent.CLOSE_OK,
}
_CONNECTION_EVENTS: dict[type, ConnEvent] = {
    C.Connection.StartOk: ConnEvent.START_OK,
    C.Connection.TuneOk: ConnEvent.TUNE_OK,
    C.Connection.Open: ConnEvent.OPEN,
    C.Connection.Close: ConnEvent.CLOSE,
    C.Connection.CloseOk: ConnEvent.CLOSE_OK,
    C.Connection.Blocked: ConnEvent.BLOCKED,
    C.Connection.Unblocked: ConnEvent.BLOCKED,
    C.Connection.UpdateSecret: ConnEvent.UPDATE_SECRET,
}

_NAME_OK = re.compile(r"[^A-Za-z0-9_.:-]")


# ---- events for the shell ------------------------------------------------------------
@dataclass(frozen=True)
class Write:
    data: bytes


@dataclass(frozen=True)
class CloseTransport:
    """Close the socket after the bytes written before.  ``linger``: we
    answered the client's connection.close with close-ok, so the client
    closes the socket (AMQP 0-9-1: the receiver of close-ok releases the
    connection; RabbitMQ waits for it): keep the socket open, discarding
    what arrives, until the client closes it or the shell's linger time
    passes, instead of closing it under the client's feet."""

    reason: str
    linger: bool = False


@dataclass(frozen=True)
class RegistryRequest:
    """Run ``txn`` on the registry; answer with ``registry_result(tag, ...)``."""

    tag: int
    txn: dict


@dataclass(frozen=True)
class RefreshRequest:
    """Re-read ``tables`` with a linearizable registry read (the local
    topology may lag behind a declare or bind committed through another
    node); answer with ``registry_result(tag, ...)``."""

    tag: int
    tables: tuple


@dataclass(frozen=True)
class ProtocolError:
    """The connection (``channel`` 0) or a channel was closed with an AMQP
    error: what the shell writes to the node's log (RabbitMQ logs every
    refused login, missing vhost, precondition failure...)."""

    code: int
    name: str
    text: str
    channel: int
    class_id: int
    method_id: int
    user: str
    vhost: str


@dataclass(frozen=True)
class DeclareRequest:
    """Ask the node's queue manager to declare a queue; answer with
    ``declare_result(tag, ...)``.  ``nodes`` () means the manager's default."""

    tag: int
    spec: dict
    nodes: tuple = ()


def master_dst(record: dict) -> str | None:
    """Where a queue's master is reached, from its ``amqqueue`` row: a
    quorum queue's leader at ``leader_dst`` (its ``pid`` is an epoch of a
    stable name), a classic master at its member name."""
    if record.get("type") == "quorum":
        return record.get("leader_dst") if record.get("pid") else None
    pid = record.get("pid")
    return dst_of_member(pid) if pid else None


def dst_of_member(member: str) -> str:
    """A queue master's GM member name (node/host:port/uid) -> its ``dst``:
    the name itself (a post to it reaches the replica through its queue
    host, see :class:`mirrorq.node.posting.ToReplica`)."""
    if member.count("/") != 2:
        raise ValueError(f"{member!r} is not a queue replica's name (node/host:port/uid)")
    return member


def _sasl_plain(response: Any) -> tuple[str, str] | None:
    raw = response.encode("latin-1", "replace") if isinstance(response, str) else bytes(response or b"")
    parts = raw.split(b"\x00")
    if len(parts) != 3:
        return None
    try:
        return parts[1].decode(), parts[2].decode()
    except UnicodeDecodeError:
        return None


def _sasl_amqplain(response: Any) -> tuple[str, str] | None:
    from pamqp import decode

    raw = response.encode("latin-1", "replace") if isinstance(response, str) else bytes(response or b"")
    try:
        _, table = decode.field_table(struct.pack(">I", len(raw)) + raw)
        return str(table["LOGIN"]), str(table["PASSWORD"])
    except Exception:
        return None


class Connection:
    def __init__(
        self,
        topology: Topology,
        *,
        dst: str,
        conn_id: str,
        uid_base: int,
        peer_host: str = "127.0.0.1",
        node: str = "",
        frame_max: int = FRAME_MAX,
        channel_max: int = CHANNEL_MAX,
        heartbeat: int = HEARTBEAT,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        self.topo = topology
        self.max_message_size = check_max_message_size(max_message_size)
        self.dst = dst
        self.conn_id = conn_id
        self.safe_id = _NAME_OK.sub("_", conn_id)
        self.uid_base = uid_base
        self.uid_next = 0
        self.node = node
        self.loopback = peer_host in ("127.0.0.1", "::1", "localhost") or peer_host.startswith("127.")
        self.server_frame_max, self.server_channel_max, self.server_heartbeat = frame_max, channel_max, heartbeat
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = 0
        self.state = ConnState.AWAIT_HEADER  # see mirrorq.amqp.states: CONNECTION_TRANSITIONS
        self.user = ""
        self.vhost = DEFAULT_VHOST
        self.chans: dict[int, Channel] = {}
        self.by_uid: dict[int, Channel] = {}
        self.exclusive_queues: set[str] = set()
        self.next_tag = 0
        self.requests: dict[int, Callable] = {}
        self.link_watch: set[tuple] = set()  # ("link", channel uid, queue, master) timers armed
        self.refreshed_at = float("-inf")
        self.last_read = 0.0
        self.last_write = 0.0
        self.client_properties: dict = {}
        self.cancel_notify = False  # the client announced capability consumer_cancel_notify
        self.auth_mechanism = ""
        self.unconfirmed = 0  # publishes sent to masters and not confirmed (MAX_UNCONFIRMED)
        self.unconfirmed_bytes = 0  # their bodies (MAX_UNCONFIRMED_BYTES)
        self.ungranted = 0  # delivered bodies written to the client, link credit not given back yet
        self.writer = FrameWriter(frame_max)
        self.acts: list = []
        self.closed_reason = ""
        self.alarm = ""  # the connection.blocked reason while a resource alarm is in effect
        self.throttle = Throttle.RUNNING
        self.published = False  # a basic.publish was read on this connection
        self.blocked_sent = False  # connection.blocked went out: connection.unblocked is owed
        self.stats = {"frames_in": 0, "publishes": 0, "deliveries": 0, "errors": 0}
        self.reader = FrameReader(max(frame_max, FRAME_MIN), self.stats)

    # ================================================================ entry points
    def start(self, now: float) -> list:
        self.last_read = self.last_write = now
        return [SetTimer("handshake", HANDSHAKE_TIMEOUT)]

    def wants_credit(self) -> bool:
        """Enough delivered bytes were written to the client for link credit
        to go back to the masters (:meth:`grant_credit`), once the shell's
        own buffer toward the client is short (:data:`CLIENT_BACKLOG`)."""
        return self.ungranted >= GRANT_BYTES

    def grant_credit(self, now: float) -> list:
        """Give the masters back the link credit of every delivery written
        to the client so far: one ``credit`` per consumer in the channel's
        next Settle to that master (``amqqueue.LINK_CREDIT_BYTES``)."""
        if not self.ungranted or self.state is _CLOSED:
            return []
        self.ungranted = 0
        for ch in self.chans.values():
            consume.grant(self, now, ch)
        return self._flush(now)

    def wants_read(self) -> bool:
        """False while too many publishes, or too many bytes of them, wait
        for their masters' confirms (credit: the shell stops reading this
        socket, and TCP slows the publisher), or while a resource alarm
        blocks the connection."""
        return (
            self.state is not _CLOSED
            and self.unconfirmed < MAX_UNCONFIRMED
            and self.unconfirmed_bytes < MAX_UNCONFIRMED_BYTES
            and self.throttle is not _BLOCKED
        )

    def mid_message(self) -> bool:
        """The client is in the middle of sending something: part of a frame
        is buffered, or a channel has a content method whose header or body
        has not all come (a client may write one message in several
        segments: pika writes method, header and body frames one by one)."""
        if self.state is _CLOSED:
            return False
        return bool(self.reader.buf) or any(ch.pub.content is not None for ch in self.chans.values())

    def data_received(self, now: float, data: bytes) -> list:
        if self.state is _CLOSED:
            return []
        self.last_read = now
        self.reader.buf += data
        try:
            self._parse(now)
        except AMQPException as e:
            self._connection_error(now, e)
        except Exception as e:  # never let client bytes raise out of the core
            self._connection_error(now, amqp_error(541, f"internal error handling a frame: {type(e).__name__}: {e}"))
        return self._flush(now)

    def connection_lost(self, now: float) -> list:
        """The socket went away: release everything the connection held."""
        if self.state is not _CLOSED:
            self._teardown(now)
            self._enter(_CLOSED)
        out = self._flush(now)
        return [a for a in out if not (isinstance(a, Emit) and isinstance(a.event, (Write, CloseTransport)))]

    def resource_alarm(self, now: float, reason: str) -> list:
        """The cluster's resource alarms changed: ``reason`` is the
        connection.blocked reason while any is in effect, "" once all have
        cleared (see the module docstring)."""
        if self.state is _CLOSED:
            return []
        self.alarm = reason
        if reason:
            if self.throttle is _RUNNING:
                self.throttle = _BLOCKING
                if self.published:
                    self._block()
        elif self.throttle is not _RUNNING:
            if self.blocked_sent and self.state is _OPEN:
                self.writer.method(0, C.Connection.Unblocked())
            self.throttle, self.blocked_sent = _RUNNING, False
            self.last_read = now  # what the client sent meanwhile (heartbeats) was not read
        return self._flush(now)

    def _block(self) -> None:
        self.throttle = _BLOCKED
        caps = self.client_properties.get("capabilities")
        if isinstance(caps, dict) and caps.get("connection.blocked") is True and self.state is _OPEN:
            self.writer.method(0, C.Connection.Blocked(self.alarm[:255]))
            self.blocked_sent = True

    def close_forced(self, now: float, reason: str) -> list:
        """An operator closes this connection (``mirrorctl close_connection``):
        connection.close 320 CONNECTION_FORCED with ``reason``, as RabbitMQ."""
        if self.state is _CLOSING or self.state is _CLOSED:
            return []
        if self.state is not _OPEN:
            self._close_transport(now, f"closed by an operator: {reason}")
        else:
            self._connection_error(now, amqp_error(320, reason))
        return self._flush(now)

    def info(self) -> dict:
        """What ``list_connections`` / ``list_channels`` / ``list_consumers``
        show of this connection (RabbitMQ's info item names)."""
        chans = []
        for ch in sorted(self.chans.values(), key=lambda c: c.number):
            chans.append(
                {
                    "number": ch.number,
                    "confirm": ch.mode is _CONFIRM,
                    "transactional": ch.mode is _TX,
                    "consumer_count": len(ch.cons.consumers),
                    "messages_unacknowledged": len(ch.dlv.unacked),
                    "messages_unconfirmed": len(ch.pub.pending),
                    "messages_uncommitted": len(ch.tx.publishes),
                    "acks_uncommitted": len(ch.tx.settled),
                    "prefetch_count": ch.cons.prefetch,
                    "global_prefetch_count": ch.cons.global_prefetch,
                    "state": ch.state.value,
                    "consumers": [
                        {
                            "queue": q,
                            "consumer_tag": tag,
                            "ack_required": not no_ack,
                            "prefetch_count": ch.cons.limit.get(tag, 0),
                            "arguments": dict(ch.cons.arguments.get(tag) or {}),
                        }
                        for tag, (q, no_ack) in sorted(ch.cons.consumers.items())
                    ],
                }
            )
        return {
            "state": (self.throttle if self.state is _OPEN else self.state).value,
            "user": self.user,
            "vhost": self.vhost,
            "frame_max": self.frame_max,
            "channel_max": self.channel_max,
            "timeout": self.heartbeat,
            "client_properties": _plain(self.client_properties),
            "auth_mechanism": self.auth_mechanism,
            "channels": chans,
        }

    def timer(self, now: float, key: Any) -> list:
        if self.state is _CLOSED:
            return []
        if key == "handshake":
            if self.state is not _OPEN and self.state is not _CLOSING:
                self._close_transport(now, "handshake timed out")
        elif key == "close-wait":
            if self.state is _CLOSING:
                self._close_transport(now, "no connection.close-ok in time")
        elif isinstance(key, tuple) and key[0] == "answer":
            _, uid, queue, rid = key
            waiting = self.by_uid.get(uid)
            if waiting is not None and (queue, rid) in waiting.callbacks:
                late = qch.CommandDone(
                    rid,
                    False,
                    None,
                    f"INTERNAL_ERROR - queue '{queue}' in vhost '{self.vhost}': "
                    f"its master did not answer within {MASTER_ANSWER_TIMEOUT:.0f}s",
                    541,
                )
                self._guarded(now, lambda: self._callback(now, waiting, (queue, rid), late))
        elif isinstance(key, tuple) and key[0] == "gone":
            ch = self.by_uid.get(key[1])
            if ch is not None and self.chans.get(ch.number) is ch and ch.state is not _CH_CLOSING:
                self._cancels_when_gone(ch, key[2])  # the registry never said: tell the client all the same
        elif isinstance(key, tuple) and key[0] == "link":
            self.link_watch.discard(key)
            _, uid, queue, master = key
            ch = self.by_uid.get(uid)
            qc = ch.queues.get(queue) if ch is not None else None
            if (
                self.state is _OPEN
                and ch is not None
                and qc is not None
                and qc.master == master
                and self._outstanding(ch, qc)
            ):
                self._connection_error(
                    now,
                    amqp_error(
                        320,
                        (
                            f"lost contact with the master of queue '{queue}' in vhost '{self.vhost}' "
                            f"(on node {master.split('/', 1)[0]}) and no new master took over "
                            f"within {LINK_GRACE:.0f}s; "
                            f"what this connection had outstanding there is in doubt"
                        ),
                    ),
                )
        elif key == "heartbeat" and self.heartbeat:
            if now - self.last_read > 2 * self.heartbeat and self.throttle is not _BLOCKED:
                self._close_transport(now, f"missed heartbeats from client, timeout: {self.heartbeat}s")
            else:
                if now - self.last_write >= self.heartbeat / 2:
                    self.writer.raw(HEARTBEAT_FRAME)
                self.acts.append(SetTimer("heartbeat", self.heartbeat / 2))
        return self._flush(now)

    def receive(self, now: float, src: Any, msg: Any) -> list:
        """A message from a queue master (or a NewMaster / NotMaster note)."""
        if self.state is _CLOSED:
            return []
        try:
            if isinstance(msg, (qm.NewMaster, qm.NotMaster)):
                for ch in list(self.chans.values()):
                    qc = ch.queues.get(msg.queue)
                    if qc is not None:
                        self._queue_events(now, ch, qc, qc.receive(now, src, msg))
                        consume.drop_void(ch, qc)
            else:
                cid = getattr(msg, "channel", None) or getattr(msg, "publisher", None)
                target = self.by_uid.get(qm.channel_id(cid)[1]) if cid is not None else None
                qc = target.queues.get(msg.queue) if target is not None else None
                if target is not None and qc is not None:
                    self._queue_events(now, target, qc, qc.receive(now, src, msg))
        except AMQPException as e:
            self._connection_error(now, e)
        return self._flush(now)

    def link_lost(self, now: float, *, host: str | None = None, node: str | None = None) -> list:
        """The node's transport gave up on the queue host at ``host``
        (``"host:port"``: what was posted to it may be lost), or node ``node``
        went down: every queue channel whose master lives there and has
        something outstanding with it waits :data:`LINK_GRACE` seconds for a
        new master (see the module docstring)."""
        if self.state is not _OPEN:
            return []
        for ch in self.chans.values():
            for qc in ch.queues.values():
                master = qc.master
                if master is None or master.count("/") != 2:
                    continue
                m_node, m_host, _ = master.split("/")
                if host != m_host and node != m_node:
                    continue
                key = ("link", ch.uid, qc.queue, master)
                if key not in self.link_watch and self._outstanding(ch, qc):
                    self.link_watch.add(key)
                    self.acts.append(SetTimer(key, LINK_GRACE))
        return self._flush(now)

    @staticmethod
    def _outstanding(ch: Channel, qc: qch.QueueChannel) -> bool:
        """Does ``qc``'s channel wait on its master for anything (or does the
        master hold anything for it)?"""
        # (an unanswered get or command ends with MASTER_ANSWER_TIMEOUT on its own)
        return bool(qc.unconfirmed or qc.consumers or consume.unacked_at(ch, qc))

    def queue_moved(self, now: float, vhost: str, name: str, record: dict | None, old: dict | None = None) -> list:
        """The registry's ``amqqueue`` row of a queue changed (``old``: the
        row before, when known)."""
        if vhost != self.vhost or self.state is _CLOSED:
            return []
        if record is None:
            # the queue is gone: requests waiting on its master will not be answered
            for ch in list(self.chans.values()):
                for key in [k for k in ch.callbacks if k[0] == name]:
                    gone = qch.CommandDone(
                        key[1], False, None, f"NOT_FOUND - queue '{name}' in vhost '{vhost}' was deleted", 404
                    )
                    self._guarded(now, lambda ch=ch, key=key, gone=gone: self._callback(now, ch, key, gone))
            self._guarded(now, lambda: self._queue_replaced(now, name, deleted=old or {}))
            return self._flush(now)
        self._guarded(now, lambda: self._queue_replaced(now, name, record=record))
        pid = record.get("pid")
        if pid:
            for ch in list(self.chans.values()):
                qc = ch.queues.get(name)
                dst = master_dst(record)
                if qc is not None and pid != qc.master and dst is not None:
                    self._queue_events(now, ch, qc, qc.new_master(now, pid, dst))
                    consume.drop_void(ch, qc)
        return self._flush(now)

    def registry_result(self, now: float, tag: int, ok: bool, error: str = "") -> list:
        fn = self.requests.pop(tag, None)
        if fn is not None and self.state is not _CLOSED:
            self._guarded(now, lambda: fn(now, ok, error))
        return self._flush(now)

    def declare_result(self, now: float, tag: int, ok: bool, record: dict | None, error: str = "") -> list:
        fn = self.requests.pop(tag, None)
        if fn is not None and self.state is not _CLOSED:
            self._guarded(now, lambda: fn(now, ok, record or {}, error))
        return self._flush(now)

    # ================================================================ output
    def _flush(self, now: float) -> list:
        for ch in list(self.chans.values()):
            flush_publishes(self, now, ch)
            for qc in ch.queues.values():
                self.acts += qc.flush(now)  # every ack / nack / reject of this read: one Settle per master
        acts, self.acts = self.acts, []
        out = self.writer.out
        if out:
            data = b"".join(out)
            self.writer.out = []
            self.last_write = now
            acts.insert(0, Emit(Write(data)))
        # a close transport goes after the bytes that explain it
        closes = [a for a in acts if isinstance(a, Emit) and isinstance(a.event, CloseTransport)]
        if closes:
            acts = [a for a in acts if a not in closes] + closes[:1]
        return acts

    def _close_transport(self, now: float, reason: str, linger: bool = False) -> None:
        if self.state is not _CLOSED:
            self._teardown(now)
        self._enter(_CLOSED)
        self.closed_reason = reason
        self.acts.append(Emit(CloseTransport(reason, linger)))

    def _enter(self, state: ConnState) -> None:
        """Enter ``state`` (the caller checked the transition in
        :data:`~mirrorq.amqp.states.CONNECTION_TRANSITIONS`)."""
        self.state = state
        reader = self.reader
        if state is _CLOSED:
            reader.stopped = True
        reader.limit = self.frame_max if state is _OPEN or state is _CLOSING else max(self.frame_max, FRAME_MIN)

    def _guarded(self, now: float, fn: Callable) -> None:
        try:
            fn()
        except AMQPException as e:
            self._connection_error(now, e)
        except Exception as e:
            self._connection_error(now, amqp_error(541, f"internal error: {type(e).__name__}: {e}"))

    # ================================================================ framing
    def _parse(self, now: float) -> None:
        if self.state is _AWAIT_HEADER:
            buf = self.reader.buf
            if len(buf) < 8:
                if buf and not PROTOCOL_HEADER.startswith(bytes(buf[:8])):
                    self._bad_header(now)
                return
            if bytes(buf[:8]) != PROTOCOL_HEADER:
                return self._bad_header(now)
            del buf[:8]
            self._enter(CONNECTION_TRANSITIONS[_AWAIT_HEADER, ConnEvent.HEADER])
            props: FieldTable = {
                "product": PRODUCT,
                "version": "0.1.0",
                "platform": "Python",
                "cluster_name": self.node or PRODUCT,
                "capabilities": {
                    "publisher_confirms": True,
                    "exchange_exchange_bindings": True,
                    "basic.nack": True,
                    "consumer_cancel_notify": True,
                    "connection.blocked": True,
                    "authentication_failure_close": True,
                    "per_consumer_qos": True,
                },
            }
            self.writer.method(0, C.Connection.Start(0, 9, props, "PLAIN AMQPLAIN", "en_US"))
        self.reader.read(now, self._frame)

    def _bad_header(self, now: float) -> None:
        self.writer.raw(PROTOCOL_HEADER)
        self._close_transport(now, f"bad protocol header {bytes(self.reader.buf[:8])!r}")

    def _frame(self, now: float, ftype: int, channel: int, value: Any) -> None:
        if channel == 0:
            if ftype != K.FRAME_METHOD:
                raise amqp_error(
                    505, f"{'content header' if ftype == K.FRAME_HEADER else 'content body'} frame on channel 0"
                )
            return self._connection_method(now, value)
        if self.state is not _OPEN:  # the one state whose row has CHANNEL_FRAME
            refusal = CONNECTION_REFUSALS[self.state]
            if refusal is None:
                return  # closing: dropped
            raise amqp_error(refusal[0], CHANNEL_FRAME_REFUSAL.format(channel=channel))
        if ftype == K.FRAME_METHOD and isinstance(value, C.Basic.Publish):
            self.published = True
            if self.throttle is _BLOCKING:
                self._block()
        ch = self.chans.get(channel)
        if ch is None or ch.state is not _CH_OPEN:  # (an open channel's frames: _channel_frame)
            return self._closed_channel_frame(channel, ch, ftype, value)
        if ch.waiting:
            ch.deferred.append((ftype, value))
            return
        self._channel_frame(now, ch, ftype, value)

    def _closed_channel_frame(self, channel: int, ch: Channel | None, ftype: int, value: Any) -> None:
        """A frame on a channel that is not open: ``ch`` None (never opened,
        or closed) or closing."""
        method = value if ftype == K.FRAME_METHOD else None
        ev = _CHANNEL_EVENTS.get(type(method), ChanEvent.METHOD)
        nxt = self._channel_step(channel, _CH_CLOSED if ch is None else ch.state, ev, method)
        if ch is None:
            if nxt is None:
                return
            if channel > self.channel_max:
                raise amqp_error(530, f"channel number {channel} exceeds channel_max {self.channel_max}", value)
            self.uid_next += 1
            ch = Channel(channel, self.uid_base + self.uid_next)
            ch.state = nxt
            self.chans[channel] = ch
            self.by_uid[ch.uid] = ch
            self.writer.method(channel, C.Channel.OpenOk())
        elif nxt is _CH_CLOSED:  # the close-ok of our close
            self._drop_chan(ch)
        elif ev is ChanEvent.CLOSE:  # crossing ours
            self.writer.method(channel, C.Channel.CloseOk())

    @staticmethod
    def _channel_step(channel: int, state: ChanState, ev: ChanEvent, method: Any) -> ChanState | None:
        """The channel's next state (:data:`~mirrorq.amqp.states.CHANNEL_TRANSITIONS`);
        None: the event is ignored; an event refused raises its error."""
        nxt = CHANNEL_TRANSITIONS.get((state, ev))
        if nxt is not None:
            return nxt
        refusal = CHANNEL_REFUSALS[state, ev]
        if refusal is not None:
            raise amqp_error(refusal[0], refusal[1].format(channel=channel), method)
        return None

    def _channel_frame(self, now: float, ch: Channel, ftype: int, value: Any, refreshed: bool = False) -> None:
        try:
            c = ch.pub.content
            if c is not None:  # a publish's header or body (states.CONTENT_EXPECTS)
                return content_frame(self, now, ch, c, ftype, value)
            if ftype != _METHOD_FRAME:
                raise publish.refused(_CONTENT_IDLE, ftype, ch.number, value)
            self._channel_method(now, ch, value)
        except NotKnownHere as e:
            if refreshed and e.on_second_miss is not None:
                e.on_second_miss(now)
            elif refreshed:
                self._channel_error(now, ch, e)
            else:
                self._refresh_then_retry(ch, ftype, value, e.tables)
        except AMQPException as e:
            if e.code in HARD_ERRORS:
                raise
            self._channel_error(now, ch, e)

    def _refresh_then_retry(self, ch: Channel, ftype: int, value: Any, tables: tuple) -> None:
        """A queue or exchange this node does not know (yet): RabbitMQ's
        declare is visible cluster-wide once declare-ok is sent, so re-read
        ``tables`` through the registry leader and run the method again;
        the channel's later frames wait (order is kept)."""

        def retry(now: float) -> None:
            ch.waiting = False
            self._channel_frame(now, ch, ftype, value, refreshed=True)
            if not ch.waiting:
                self.resume(now, ch)

        self.refresh(ch, tables, retry)

    def refresh(self, ch: Channel, tables: tuple, then: Callable[[float], None]) -> None:
        """Re-read ``tables`` through the registry leader (this node's copy
        may lag behind a commit made through another node), then ``then(now)``
        if the channel is still open; its later frames wait meanwhile."""
        rtag = self._tag()
        ch.waiting = True

        def refreshed(now: float, ok: bool, error: str) -> None:
            self.refreshed_at = now
            if ch.state is _CH_CLOSING or self.chans.get(ch.number) is not ch:
                return
            then(now)

        self.requests[rtag] = refreshed
        self.acts.append(Emit(RefreshRequest(rtag, tables)))

    def resume(self, now: float, ch: Channel) -> None:
        """A synchronous method finished: run the frames that waited behind it."""
        ch.waiting = False
        while ch.deferred and not ch.waiting and ch.state is not _CH_CLOSING and self.state is _OPEN:
            ftype, value = ch.deferred.pop(0)
            self._channel_frame(now, ch, ftype, value)

    # ================================================================ connection class
    def _connection_method(self, now: float, m: Any) -> None:
        st = self.state
        ev = _CONNECTION_EVENTS.get(type(m), ConnEvent.METHOD)
        nxt = CONNECTION_TRANSITIONS.get((st, ev))
        if nxt is None:
            refusal = CONNECTION_REFUSALS[st]
            if refusal is None:
                return  # closing: only close / close-ok are heeded
            code, text = refusal
            raise amqp_error(code, text.format(method=m.name, state=st), m)
        if ev is ConnEvent.CLOSE:
            if st is not _CLOSING:
                self.writer.method(0, C.Connection.CloseOk())
            self._close_transport(now, f"client closed: {m.reply_code} {m.reply_text}", linger=st is not _CLOSING)
        elif ev is ConnEvent.CLOSE_OK:
            self._close_transport(now, "closed")
        elif ev is ConnEvent.START_OK:
            self._start_ok(m, nxt)
        elif ev is ConnEvent.TUNE_OK:
            self._tune_ok(m, nxt)
        elif ev is ConnEvent.OPEN:
            self._open(m, nxt)
        elif ev is ConnEvent.UPDATE_SECRET:
            # a token refresh: the internal users' credentials do not expire,
            # so, as RabbitMQ's internal backend, the session goes on unchanged
            self.writer.method(0, C.Connection.UpdateSecretOk())
        # ConnEvent.BLOCKED: a client's connection.blocked / unblocked changes nothing here

    def _start_ok(self, m: Any, nxt: ConnState) -> None:
        self.client_properties = dict(m.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.cancel_notify = isinstance(caps, dict) and caps.get("consumer_cancel_notify") is True
        mech = m.mechanism
        self.auth_mechanism = mech
        creds = (
            _sasl_plain(m.response) if mech == "PLAIN" else _sasl_amqplain(m.response) if mech == "AMQPLAIN" else None
        )
        if mech not in ("PLAIN", "AMQPLAIN"):
            raise amqp_error(403, f"unsupported authentication mechanism '{mech}' (PLAIN, AMQPLAIN)", m)
        if creds is None:
            raise amqp_error(403, f"malformed {mech} response", m)
        why = self.topo.authenticate(creds[0], creds[1], self.loopback)
        if why is not None:
            raise amqp_error(403, f"Login was refused using authentication mechanism {mech}: {why}", m)
        self.user = creds[0]
        self._enter(nxt)
        self.writer.method(0, C.Connection.Tune(self.server_channel_max, self.server_frame_max, self.server_heartbeat))

    def _tune_ok(self, m: Any, nxt: ConnState) -> None:
        fm = m.frame_max or self.server_frame_max
        if fm < FRAME_MIN or fm > self.server_frame_max:
            raise amqp_error(530, f"frame_max {m.frame_max} outside {FRAME_MIN}..{self.server_frame_max}", m)
        cm = m.channel_max or self.server_channel_max
        if cm > self.server_channel_max:
            raise amqp_error(530, f"channel_max {m.channel_max} above the server's {self.server_channel_max}", m)
        self.frame_max, self.channel_max = fm, cm
        self.writer.frame_max = fm
        self.heartbeat = int(m.heartbeat or 0)
        if self.heartbeat:
            self.acts.append(SetTimer("heartbeat", self.heartbeat / 2))
        self._enter(nxt)

    def _open(self, m: Any, nxt: ConnState) -> None:
        vhost = m.virtual_host or DEFAULT_VHOST
        if not self.topo.vhost_exists(vhost):
            raise amqp_error(530, f"vhost '{vhost}' not found", m)
        if self.topo.permission(self.user, vhost) is None:
            raise amqp_error(530, f"access to vhost '{vhost}' refused for user '{self.user}'", m)
        self.vhost = vhost
        self._enter(nxt)
        self.acts.append(CancelTimer("handshake"))
        self.writer.method(0, C.Connection.OpenOk())

    def _report(self, e: AMQPException, channel: int) -> None:
        self.acts.append(
            Emit(
                ProtocolError(
                    e.code,
                    REPLY_NAMES.get(e.code, "ERROR"),
                    e.text,
                    channel,
                    e.class_id,
                    e.method_id,
                    self.user,
                    self.vhost,
                )
            )
        )

    def _connection_error(self, now: float, e: AMQPException) -> None:
        self.stats["errors"] += 1
        nxt = CONNECTION_TRANSITIONS.get((self.state, ConnEvent.ERROR))
        if nxt is None:
            return  # closing or closed already
        self._report(e, 0)
        if nxt is _CLOSED:  # before the protocol header: no connection.close
            self._close_transport(now, e.reply_text)
            return
        self.writer.method(0, C.Connection.Close(e.code, e.reply_text[:255], e.class_id, e.method_id))
        self._teardown(now)
        self._enter(nxt)
        self.closed_reason = e.reply_text
        self.reader.buf.clear()
        self.acts.append(SetTimer("close-wait", CLOSE_TIMEOUT))

    def _teardown(self, now: float) -> None:
        """Close every channel (masters requeue their unacked messages) and
        delete the exclusive queues this connection declared."""
        for ch in list(self.chans.values()):
            self._release_chan(now, ch)
        self.chans.clear()
        self.by_uid.clear()
        self.requests.clear()
        for name in sorted(self.exclusive_queues):
            self._delete_exclusive(now, name)
        self.exclusive_queues.clear()

    def _delete_exclusive(self, now: float, name: str) -> None:
        key = (self.vhost, name)
        rec = self.topo.queue(*key)
        self.topo.exclusive.pop(key, None)
        if rec is None:
            return
        if rec.get("pid"):
            qc = qch.QueueChannel((self.dst, self.uid_base), name, master_dst(rec), rec["pid"])
            _, acts = qc.command(now, "delete")
            self.acts += acts
        self.acts.append(Emit(RegistryRequest(self._tag(), self._delete_queue_txn(name))))
        self._forget_queue(name)

    # ================================================================ channels
    def _drop_chan(self, ch: Channel) -> None:
        ch.state = _CH_CLOSED
        self.chans.pop(ch.number, None)
        self.by_uid.pop(ch.uid, None)

    def _release_chan(self, now: float, ch: Channel) -> None:
        flush_publishes(self, now, ch)
        consume.give_back_held(self, now, ch)
        for qc in ch.queues.values():
            self.unconfirmed -= len(qc.unconfirmed)
            self.unconfirmed_bytes -= qc.unconfirmed_bytes
            if qc.master_dst is not None:
                self.acts += qc.close(now)
        ch.queues.clear()
        tx.drop(ch)
        ch.callbacks.clear()
        ch.deferred.clear()
        publish.drop(ch)
        consume.drop(ch)

    def _channel_error(self, now: float, ch: Channel, e: AMQPException) -> None:
        nxt = CHANNEL_TRANSITIONS.get((ch.state, ChanEvent.ERROR))
        if nxt is None:
            return  # closing or closed already
        self.stats["errors"] += 1
        self._report(e, ch.number)
        self._release_chan(now, ch)
        ch.state = nxt
        ch.waiting = False
        self.writer.method(ch.number, C.Channel.Close(e.code, e.reply_text[:255], e.class_id, e.method_id))

    def queue_channel(self, ch: Channel, name: str) -> qch.QueueChannel:
        qc = ch.queues.get(name)
        if qc is None:
            rec = self.topo.queue(self.vhost, name)
            pid = (rec or {}).get("pid")
            qc = qch.QueueChannel((self.dst, ch.uid), name, master_dst(rec or {}), pid)
            ch.queues[name] = qc
            ch.incarnations[name] = (rec or {}).get("incarnation")
        return qc

    def _queue_gone(self, now: float, ch: Channel, qc: qch.QueueChannel) -> None:
        """``qc``'s queue was deleted (a queue of that name declared later is
        another queue: a fresh QueueChannel, publish sequence from 1, talks
        to it).  What it had not confirmed is confirmed, as RabbitMQ
        confirms publishes routed to a queue deleted meanwhile; its
        consumers still here are ended (the client hears it as the master's
        cancels: :meth:`_cancel_when_gone`)."""
        name = qc.queue
        if ch.queues.get(name) is not qc or publish.buffered(ch, name):
            return
        if qc.unconfirmed:
            self._queue_events(now, ch, qc, [Emit(qc.confirm_all())])
        ended = consume.forget_queue(self, now, ch, name)
        if ended:
            ch.cancels_when_gone.setdefault(name, []).extend(ended)
        del ch.queues[name]
        ch.incarnations.pop(name, None)
        publish.forget_queue(ch, name)

    def _queue_replaced(
        self, now: float, name: str, *, deleted: dict | None = None, record: dict | None = None, told: bool = True
    ) -> None:
        """Queue ``name``'s row ``deleted`` was deleted, or ``record`` is its
        row now: this connection's QueueChannels of the deleted incarnation,
        or of another one than ``record``'s, are done with (an unknown
        incarnation counts as the deleted one).  ``told``: the registry
        has the change (the consumers of the queue gone may hear of it)."""
        gone = (deleted or {}).get("incarnation")
        new = (record or {}).get("incarnation")
        for ch in list(self.chans.values()):
            mine = ch.incarnations.get(name)
            if record is None:
                ended = gone is None or mine is None or mine == gone
            else:
                ended = mine is not None and new is not None and mine != new
            if not ended:
                continue
            qc = ch.queues.get(name)
            if qc is not None:
                self._queue_gone(now, ch, qc)
            if told and name not in ch.deleting:
                self._cancels_when_gone(ch, name)

    def _cancel_when_gone(self, ch: Channel, qc: qch.QueueChannel, tag: str) -> None:
        """Consumer ``tag`` ended because its queue is being deleted: the
        client hears it (server ``basic.cancel``) once the queue is gone
        from the registry, and after delete-ok on the channel deleting it
        -- as from RabbitMQ, where the queue no longer exists when its
        consumers are told (a client re-declaring it at once, as aio-pika's
        robust channel does, gets a new queue, not the one going)."""
        name = qc.queue
        row = self.topo.queue(self.vhost, name)
        mine = ch.incarnations.get(name)
        same = row is not None and (mine is None or row.get("incarnation") in (None, mine))
        if name not in ch.deleting and not same:
            self.server_cancel(ch, tag)
            return
        ch.cancels_when_gone.setdefault(name, []).append(tag)
        self.acts.append(SetTimer(("gone", ch.uid, name), MASTER_ANSWER_TIMEOUT))

    def _cancels_when_gone(self, ch: Channel, name: str) -> None:
        tags = ch.cancels_when_gone.pop(name, None)
        if tags:
            self.acts.append(CancelTimer(("gone", ch.uid, name)))
            for tag in tags:
                self.server_cancel(ch, tag)

    def _tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def _wait_registry(
        self,
        now: float,
        ch: Channel,
        txn: dict,
        on_ok: Callable,
        method: Any,
        on_refused: Callable[[str], AMQPException | None] | None = None,
    ) -> None:
        tag = self._tag()
        ch.waiting = True

        def done(now: float, ok: bool, error: str) -> None:
            if ch.state is _CH_CLOSING or self.chans.get(ch.number) is not ch:
                return
            if not ok:
                e = on_refused(error) if on_refused is not None else None
                self._channel_frame_error(
                    now, ch, e or amqp_error(541, f"registry refused {method.name}: {error}", method)
                )
                return
            on_ok()
            self.resume(now, ch)

        self.requests[tag] = done
        self.acts.append(Emit(RegistryRequest(tag, txn)))

    def _channel_frame_error(self, now: float, ch: Channel, e: AMQPException) -> None:
        if e.code in HARD_ERRORS:
            self._connection_error(now, e)
        else:
            self._channel_error(now, ch, e)

    def command(self, now: float, ch: Channel, queue: str, command: str, on_done: Callable, **args: Any) -> None:
        """Run queue command ``command`` on ``queue``'s master for channel
        ``ch`` (its later frames wait); ``on_done(CommandDone)`` gets the
        answer (raising an :class:`AMQPException` closes the channel)."""
        qc = self.queue_channel(ch, queue)
        if qc.master_dst is None:
            raise unknown_queue(f"queue '{queue}' in vhost '{self.vhost}' has no master yet", None)
        rid, acts = qc.command(now, command, **args)
        self.acts += acts
        ch.waiting = True
        self.await_master(ch, queue, rid, on_done)

    def await_master(self, ch: Channel, queue: str, rid: int, fn: Callable) -> None:
        """``fn`` gets the master's answer to request ``rid`` -- or a 541
        after :data:`MASTER_ANSWER_TIMEOUT`: no request waits for ever."""
        ch.callbacks[(queue, rid)] = fn
        self.acts.append(SetTimer(("answer", ch.uid, queue, rid), MASTER_ANSWER_TIMEOUT))

    def readable_queues(self) -> list[dict]:
        return [
            r
            for (vhost, name), r in sorted(self.topo.queues.items())
            if vhost == self.vhost and self.topo.allowed(self.user, vhost, "read", name)
        ]

    def check(self, what: str, kind: str, name: str, method: Any) -> None:
        if not self.topo.allowed(self.user, self.vhost, what, name):
            raise amqp_error(
                403, f"{what} access to {kind} '{name}' in vhost '{self.vhost}' refused for user '{self.user}'", method
            )

    def queue_for(self, ch: Channel, name: str, method: Any, *, owner_check: bool = True) -> dict:
        name = name or ch.last_queue
        if not name:
            raise amqp_error(404, "no queue named and no queue declared on this channel yet", method)
        rec = self.topo.queue(self.vhost, name)
        if rec is None:
            raise unknown_queue(f"no queue '{name}' in vhost '{self.vhost}'", method)
        if owner_check:
            self._check_exclusive(name, rec, method)
        return rec

    def _check_exclusive(self, name: str, rec: dict, method: Any) -> None:
        owner = rec.get("exclusive_owner")
        local = self.topo.exclusive.get((self.vhost, name))
        if (owner and owner != self.dst) or (local is not None and local != self.conn_id):
            raise amqp_error(
                405,
                f"cannot obtain exclusive access to locked queue '{name}' in vhost '{self.vhost}'. "
                "It could be originally declared on another connection or the exclusive property "
                "value does not match that of the original declaration.",
                method,
            )

    # ---- channel methods ------------------------------------------------------------------
    def _channel_method(self, now: float, ch: Channel, m: Any) -> None:
        if isinstance(m, _PUBLISH):
            return publish.start(self, now, ch, m)
        flush_publishes(self, now, ch)
        name = m.name
        handler = _HANDLERS.get(name)
        if handler is None:
            raise amqp_error(
                503 if name.startswith(("Connection.", "Channel.Open")) else 540,
                f"method {name} is not allowed on a channel here",
                m,
            )
        handler(self, now, ch, m)

    def _channel_close(self, now: float, ch: Channel, m: Any) -> None:
        self._channel_step(ch.number, ch.state, ChanEvent.CLOSE, m)
        self._release_chan(now, ch)
        self._drop_chan(ch)
        self.writer.method(ch.number, C.Channel.CloseOk())

    def _channel_close_ok(self, now: float, ch: Channel, m: Any) -> None:
        self._channel_step(ch.number, ch.state, ChanEvent.CLOSE_OK, m)  # refused: no close was sent

    def _channel_open(self, now: float, ch: Channel, m: Any) -> None:
        self._channel_step(ch.number, ch.state, ChanEvent.OPEN, m)  # refused: open already

    # ---- exchanges ---------------------------------------------------------------------------
    def _exchange_declare(self, now: float, ch: Channel, m: Any) -> None:
        name = m.exchange
        ex = self.topo.exchange(self.vhost, name)
        if m.passive:
            if ex is None:
                raise unknown_exchange(f"no exchange '{name}' in vhost '{self.vhost}'", m)
            if not m.nowait:
                self.writer.method(ch.number, C.Exchange.DeclareOk())
            return
        if m.exchange_type not in EXCHANGE_TYPES:
            raise amqp_error(
                503,
                f"invalid exchange type '{m.exchange_type}' for exchange '{name}' in vhost '{self.vhost}' "
                f"(types: {', '.join(EXCHANGE_TYPES)})",
                m,
            )
        if name == "" or name.startswith("amq."):
            if ex is not None and name != "" and ex["type"] == m.exchange_type and bool(m.durable):
                if not m.nowait:
                    self.writer.method(ch.number, C.Exchange.DeclareOk())
                return
            raise amqp_error(
                403,
                f"exchange name '{name}' contains reserved prefix 'amq.*'"
                if name
                else "operation not permitted on the default exchange",
                m,
            )
        self.check("configure", "exchange", name, m)
        if ex is not None:
            for field, want in (
                ("type", m.exchange_type),
                ("durable", bool(m.durable)),
                ("auto_delete", bool(m.auto_delete)),
                ("internal", bool(m.internal)),
            ):
                if ex[field] != want:
                    raise amqp_error(
                        406,
                        f"inequivalent arg '{field}' for exchange '{name}' in vhost '{self.vhost}': "
                        f"received '{_txt(want)}' but current is '{_txt(ex[field])}'",
                        m,
                    )
            if not m.nowait:
                self.writer.method(ch.number, C.Exchange.DeclareOk())
            return
        rec = {
            "vhost": self.vhost,
            "name": name,
            "type": m.exchange_type,
            "durable": bool(m.durable),
            "auto_delete": bool(m.auto_delete),
            "internal": bool(m.internal),
            "arguments": _plain(dict(m.arguments or {})),
        }
        txn = {"ops": [{"op": "put", "table": "exchange", "key": [self.vhost, name], "record": rec}]}

        def ok() -> None:
            self.topo.put("exchange", rec)
            if not m.nowait:
                self.writer.method(ch.number, C.Exchange.DeclareOk())

        self._wait_registry(now, ch, txn, ok, m)

    def _exchange_delete(self, now: float, ch: Channel, m: Any) -> None:
        name = m.exchange
        if name == "" or name.startswith("amq."):
            raise amqp_error(
                403, f"operation not permitted on the {'default' if not name else 'built-in'} exchange '{name}'", m
            )
        self.check("configure", "exchange", name, m)
        if self.topo.exchange(self.vhost, name) is None:
            if not m.nowait:
                self.writer.method(ch.number, C.Exchange.DeleteOk())
            return
        bindings = self.topo.bindings_of_exchange(self.vhost, name)
        if m.if_unused and any(b["source"] == name for b in bindings):
            raise amqp_error(406, f"exchange '{name}' in vhost '{self.vhost}' in use", m)
        ops = [{"op": "delete", "table": "exchange", "key": [self.vhost, name]}]
        ops += [{"op": "delete", "table": "binding", "key": _binding_key(b)} for b in bindings]

        def ok() -> None:
            self.topo.delete("exchange", (self.vhost, name))
            for b in bindings:
                self.topo.delete("binding", tuple(_binding_key(b)))
            if not m.nowait:
                self.writer.method(ch.number, C.Exchange.DeleteOk())

        self._wait_registry(now, ch, {"ops": ops}, ok, m)

    def _bind(
        self, now: float, ch: Channel, m: Any, *, kind: str, source: str, dest: str, unbind: bool, ok_method: Any
    ) -> None:
        if source == "" or (kind == "exchange" and dest == ""):
            raise amqp_error(403, "operation not permitted on the default exchange", m)
        nowait = bool(getattr(m, "nowait", False))
        if unbind:
            self._unbind_missing(ch, m, kind, source, dest, nowait, ok_method)
        if self.topo.exchange(self.vhost, source) is None:
            raise unknown_exchange(f"no exchange '{source}' in vhost '{self.vhost}'", m)
        if kind == "queue":
            self.queue_for(ch, dest, m)
        elif self.topo.exchange(self.vhost, dest) is None:
            raise unknown_exchange(f"no exchange '{dest}' in vhost '{self.vhost}'", m)
        self.check("write", kind, dest, m)
        self.check("read", "exchange", source, m)
        args = _plain(dict(m.arguments or {}))
        rec: dict[str, Any] = {
            "vhost": self.vhost,
            "source": source,
            "destination_kind": kind,
            "destination": dest,
            "routing_key": m.routing_key or "",
            "arguments_key": arguments_key(args),
            "arguments": args,
        }
        key = _binding_key(rec)
        checks: list = []
        op: dict[str, Any]
        if unbind:
            op = {"op": "delete", "table": "binding", "key": key}
        else:
            op = {"op": "put", "table": "binding", "key": key, "record": rec}
            if kind == "queue":
                # never bind a queue deleted meanwhile (its deleter removed its
                # bindings; one added after that would outlive it)
                checks.append({"table": "amqqueue", "key": [self.vhost, dest], "exists": True})

        def ok() -> None:
            if unbind:
                self.topo.delete("binding", tuple(key))
            else:
                self.topo.put("binding", rec)
            if not nowait:
                self.writer.method(ch.number, ok_method)

        def refused(error: str) -> AMQPException | None:
            if "precondition failed" in error:
                return amqp_error(404, f"no queue '{dest}' in vhost '{self.vhost}'", m)
            return None

        txn = {"checks": checks, "ops": [op]} if checks else {"ops": [op]}
        self._wait_registry(now, ch, txn, ok, m, refused)

    def _unbind_missing(
        self, ch: Channel, m: Any, kind: str, source: str, dest: str, nowait: bool, ok_method: Any
    ) -> None:
        """An unbind whose source exchange or destination does not exist
        has nothing to remove: once a re-read of the registry confirms it is
        missing, it is answered unbind-ok, as RabbitMQ's binding removal
        treats a missing source or destination (permissions are checked
        all the same)."""
        missing = []
        if self.topo.exchange(self.vhost, source) is None:
            missing.append(("exchange", source))
        if kind == "exchange" and self.topo.exchange(self.vhost, dest) is None:
            missing.append(("exchange", dest))
        elif kind == "queue" and dest and self.topo.queue(self.vhost, dest) is None:
            missing.append(("queue", dest))
        if not missing:
            return
        self.check("write", kind, dest, m)
        self.check("read", "exchange", source, m)

        def nothing_to_unbind(now: float) -> None:
            if not nowait:
                self.writer.method(ch.number, ok_method)

        tables = tuple(sorted({"amqqueue" if k == "queue" else "exchange" for k, _ in missing}))
        k, n = missing[0]
        raise NotKnownHere(404, f"no {k} '{n}' in vhost '{self.vhost}'", m, tables, nothing_to_unbind)

    def _exchange_bind(self, now: float, ch: Channel, m: Any) -> None:
        self._bind(
            now,
            ch,
            m,
            kind="exchange",
            source=m.source,
            dest=m.destination,
            unbind=False,
            ok_method=C.Exchange.BindOk(),
        )

    def _exchange_unbind(self, now: float, ch: Channel, m: Any) -> None:
        self._bind(
            now,
            ch,
            m,
            kind="exchange",
            source=m.source,
            dest=m.destination,
            unbind=True,
            ok_method=C.Exchange.UnbindOk(),
        )

    def _queue_bind(self, now: float, ch: Channel, m: Any) -> None:
        self._bind(
            now,
            ch,
            m,
            kind="queue",
            source=m.exchange,
            dest=m.queue or ch.last_queue,
            unbind=False,
            ok_method=C.Queue.BindOk(),
        )

    def _queue_unbind(self, now: float, ch: Channel, m: Any) -> None:
        self._bind(
            now,
            ch,
            m,
            kind="queue",
            source=m.exchange,
            dest=m.queue or ch.last_queue,
            unbind=True,
            ok_method=C.Queue.UnbindOk(),
        )

    # ---- queues -----------------------------------------------------------------------------
    def _queue_declare(self, now: float, ch: Channel, m: Any) -> None:
        name = m.queue
        if not name:
            if m.passive:
                raise amqp_error(404, "passive declare of a queue with no name", m)
            self.uid_next += 1
            name = f"amq.gen-{self.safe_id}-{self.uid_next}"
        elif name.startswith("amq.") and not m.passive:
            raise amqp_error(403, f"queue name '{name}' contains reserved prefix 'amq.*'", m)
        rec = self.topo.queue(self.vhost, name)
        if m.passive:
            if rec is None:
                raise unknown_queue(f"no queue '{name}' in vhost '{self.vhost}'", m)
            self._check_exclusive(name, rec, m)
            return self._declare_ok(now, ch, m, name, rec)
        try:
            args = semantics.validate_queue_arguments(name, dict(m.arguments or {}))
            if args.get("x-queue-type") == "quorum":
                semantics.validate_quorum_declare(
                    name, args, durable=bool(m.durable), exclusive=bool(m.exclusive), auto_delete=bool(m.auto_delete)
                )
        except semantics.AMQPError as e:
            raise amqp_error(e.reply_code, e.text, m) from None
        except (TypeError, ValueError) as e:
            raise amqp_error(406, f"invalid arguments for queue '{name}': {e}", m) from None
        if INTERNAL_MARK in args:
            raise amqp_error(406, f"invalid arg '{INTERNAL_MARK}' for queue '{name}': reserved for the broker", m)
        self.check("configure", "queue", name, m)
        args = _plain(args)
        if rec is not None:
            self._check_exclusive(name, rec, m)
            why = queue_inequivalence(rec, bool(m.durable), bool(m.auto_delete), args)
            if why:
                raise amqp_error(406, why, m)
            return self._declare_ok(now, ch, m, name, rec)
        pinned = bool(m.exclusive and self.node)
        if pinned and "x-ha-policy" not in args:
            # an exclusive queue lives on its connection's node: placement
            # arguments the client did not give, marked as the broker's own
            args = with_internal_arguments(args, {"x-ha-policy": "nodes", "x-ha-policy-params": [self.node]})
        spec = {
            "name": name,
            "vhost": self.vhost,
            "durable": bool(m.durable),
            "auto_delete": bool(m.auto_delete),
            "exclusive_owner": self.dst if m.exclusive else None,
            "arguments": args,
        }
        tag = self._tag()
        ch.waiting = True

        def done(now: float, ok: bool, record: dict, error: str) -> None:
            if ch.state is _CH_CLOSING or self.chans.get(ch.number) is not ch:
                return
            if not ok:
                self._channel_frame_error(now, ch, amqp_error(541, f"declaring queue '{name}' failed: {error}", m))
                return
            self.topo.put("amqqueue", record)
            self._queue_replaced(now, name, record=record)
            if m.exclusive:
                self.topo.exclusive[(self.vhost, name)] = self.conn_id
                self.exclusive_queues.add(name)
            ch.last_queue = name
            if not m.nowait:
                self.writer.method(ch.number, C.Queue.DeclareOk(name, 0, 0))
            self.resume(now, ch)

        self.requests[tag] = done
        self.acts.append(Emit(DeclareRequest(tag, spec, (self.node,) if pinned else ())))

    def _declare_ok(self, now: float, ch: Channel, m: Any, name: str, rec: dict) -> None:
        ch.last_queue = name
        if m.nowait:
            return
        if not rec.get("pid"):
            self.writer.method(ch.number, C.Queue.DeclareOk(name, 0, 0))
            return

        def done(ev: qch.CommandDone) -> None:
            v = ev.value if ev.ok and isinstance(ev.value, dict) else {}
            self.writer.method(
                ch.number, C.Queue.DeclareOk(name, int(v.get("messages_ready", 0)), int(v.get("consumers", 0)))
            )

        self.command(now, ch, name, "info", done)

    def _queue_purge(self, now: float, ch: Channel, m: Any) -> None:
        rec = self.queue_for(ch, m.queue, m)
        self.check("read", "queue", rec["name"], m)

        def done(ev: qch.CommandDone) -> None:
            if not ev.ok:
                raise amqp_error(ev.code or 541, strip_name(ev.error), m)
            if not m.nowait:
                self.writer.method(ch.number, C.Queue.PurgeOk(int(ev.value or 0)))

        self.command(now, ch, rec["name"], "purge", done)

    def _queue_delete(self, now: float, ch: Channel, m: Any) -> None:
        name = m.queue or ch.last_queue
        rec = self.topo.queue(self.vhost, name)
        if rec is None:
            if not m.nowait:
                self.writer.method(ch.number, C.Queue.DeleteOk(0))
            return
        self._check_exclusive(name, rec, m)
        self.check("configure", "queue", name, m)

        def done(ev: qch.CommandDone) -> None:
            if not ev.ok and ev.code != 404:
                ch.deleting.discard(name)
                self._cancels_when_gone(ch, name)
                raise amqp_error(ev.code or 541, strip_name(ev.error), m)
            count = int(ev.value or 0) if ev.ok else 0  # gone meanwhile: deleting it again is fine
            self._queue_replaced(now, name, deleted=rec, told=False)
            txn = self._delete_queue_txn(name)
            self._forget_queue(name)
            self.exclusive_queues.discard(name)
            self.topo.exclusive.pop((self.vhost, name), None)

            def ok() -> None:
                ch.deleting.discard(name)
                if not m.nowait:
                    self.writer.method(ch.number, C.Queue.DeleteOk(count))
                for c in list(self.chans.values()):  # the registry has it now
                    if name not in c.deleting:
                        self._cancels_when_gone(c, name)

            self._wait_registry(now, ch, txn, ok, m)

        # this channel's own consumers of the queue hear basic.cancel after
        # delete-ok, as from RabbitMQ (its channel answers the delete before
        # it handles the queue's end)
        ch.deleting.add(name)
        self.command(now, ch, name, "delete", done, if_unused=bool(m.if_unused), if_empty=bool(m.if_empty))

    def server_cancel(self, ch: Channel, tag: str) -> None:
        """Tell the client the broker ended consumer ``tag`` (a server
        ``basic.cancel``) -- only to clients that announced capability
        ``consumer_cancel_notify``, as RabbitMQ; the others just see no
        more deliveries."""
        if self.cancel_notify:
            self.writer.method(ch.number, C.Basic.Cancel(tag, True))

    def _delete_queue_txn(self, name: str) -> dict:
        ops = [{"op": "delete", "table": "amqqueue", "key": [self.vhost, name]}]
        ops += [
            {"op": "delete", "table": "binding", "key": _binding_key(b)}
            for b in self.topo.bindings_of_queue(self.vhost, name)
        ]
        return {"ops": ops}

    def _forget_queue(self, name: str) -> None:
        for b in self.topo.bindings_of_queue(self.vhost, name):
            self.topo.delete("binding", tuple(_binding_key(b)))
        self.topo.delete("amqqueue", (self.vhost, name))

    # ---- what queue masters said ---------------------------------------------------------------
    def _queue_events(self, now: float, ch: Channel, qc: qch.QueueChannel, actions: list) -> None:
        """What ``qc``'s master said, as its queue channel made it events:
        confirms to :mod:`~mirrorq.amqp.publish`, deliveries to
        :mod:`~mirrorq.amqp.consume`, answers to the request waiting."""
        confirms = False
        release = False
        for a in actions:
            if not isinstance(a, Emit):
                self.acts.append(a)
                continue
            ev = a.event
            if isinstance(ev, _DELIVERY):
                if on_delivery(self, now, ch, qc, ev):
                    release = True
            elif isinstance(ev, _CONFIRMS):
                if publish.confirmed(self, ch, qc.queue, ev):
                    confirms = True
            elif isinstance(ev, qch.GetResult):
                self._callback(now, ch, (qc.queue, ev.request_id), ev)
            elif isinstance(ev, qch.CommandDone):
                if ev.request_id == -1 and not ev.ok:
                    # a refused cancel/settle (they carry no request id)
                    if ev.code == 404:
                        # the queue was deleted meanwhile: nothing is left to settle or cancel there
                        # (a delivery given back after its consumer's cancel auto-deleted the queue)
                        continue
                    e = amqp_error(ev.code or 541, strip_name(ev.error))
                    self._channel_frame_error(now, ch, e)
                    return
                key = (qc.queue, ev.request_id)
                if key in ch.callbacks:
                    self._callback(now, ch, key, ev)
                elif not ev.ok:
                    refusal = consume.refused_later(self, now, ch, key, ev)  # a consume's (or nothing waiting)
                    if refusal is not None:
                        self._channel_frame_error(now, ch, refusal)
                        return
            elif isinstance(ev, qch.Cancelled):
                if consume.forget(self, now, ch, ev.consumer_tag) is not None:
                    if ev.reason == "queue-deleted":
                        self._cancel_when_gone(ch, qc, ev.consumer_tag)
                    else:
                        self.server_cancel(ch, ev.consumer_tag)
            # qch.Refused: the registry row tells us the new master (queue_moved)
        if confirms and ch.mode is _CONFIRM:
            publish.emit_confirms(self, ch)
        if confirms and ch.tx.commit is not None:
            tx.progress(self, now, ch)
        if release:
            consume.release(self, now, ch)

    def _callback(self, now: float, ch: Channel, key: tuple, ev: Any) -> None:
        fn = ch.callbacks.pop(key, None)
        if fn is not None:
            self.acts.append(CancelTimer(("answer", ch.uid, key[0], key[1])))
        if fn is None or ch.state is _CH_CLOSING:
            return
        ch.waiting = False  # the method waiting on this answer has it; fn may start another wait
        try:
            fn(ev)
        except AMQPException as e:
            self._channel_frame_error(now, ch, e)
            return
        if self.chans.get(ch.number) is ch and ch.state is not _CH_CLOSING and not ch.waiting:
            self.resume(now, ch)


def _binding_key(b: dict) -> list:
    return [b["vhost"], b["source"], b["destination_kind"], b["destination"], b["routing_key"], b["arguments_key"]]


_HANDLERS: dict[str, Callable] = {
    "Channel.Close": Connection._channel_close,
    "Channel.CloseOk": Connection._channel_close_ok,
    "Channel.Flow": consume.flow,
    "Channel.Open": Connection._channel_open,
    "Exchange.Declare": Connection._exchange_declare,
    "Exchange.Delete": Connection._exchange_delete,
    "Exchange.Bind": Connection._exchange_bind,
    "Exchange.Unbind": Connection._exchange_unbind,
    "Queue.Declare": Connection._queue_declare,
    "Queue.Bind": Connection._queue_bind,
    "Queue.Unbind": Connection._queue_unbind,
    "Queue.Purge": Connection._queue_purge,
    "Queue.Delete": Connection._queue_delete,
    "Basic.Qos": consume.qos,
    "Basic.Consume": consume.consume,
    "Basic.Cancel": consume.cancel,
    "Basic.Get": consume.get,
    "Basic.Ack": consume.ack,
    "Basic.Nack": consume.nack,
    "Basic.Reject": consume.reject,
    "Basic.Recover": consume.recover,
    "Basic.RecoverAsync": consume.recover,
    "Confirm.Select": publish.confirm_select,
    "Tx.Select": tx.select,
    "Tx.Commit": tx.commit,
    "Tx.Rollback": tx.rollback,
}
