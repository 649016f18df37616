"""A blocking AMQP 0-9-1 client on pamqp, one channel, a deadline on every wait.

Two users inside mirrorq speak AMQP as clients, and both need what pika's
blocking adapter does not give: a bound on *every* wait (pika's
``basic_consume`` waits for consume-ok for ever, and a request in flight to
a master that dies is never answered), frames checked against what was
negotiated, and pipelined publishing with confirms.

* The admin layer (:mod:`mirrorq.admin.messages`): the management API's
  get-messages, publish, exchanges and bindings run as an AMQP
  conversation with the node's own listener as the user who asked
  (:meth:`BlockingClient.get`, :meth:`~BlockingClient.reject`,
  :meth:`~BlockingClient.publish`, :meth:`~BlockingClient.call`).
* The Spark source and sink (:mod:`mirrorq.spark.broker`): range reads and
  commits through one ``basic.consume`` with the extension arguments of
  :mod:`mirrorq.amqp.stream`, answered by deliveries and a server cancel
  (:meth:`BlockingClient.stream`), and batches published with confirms
  (:meth:`BlockingClient.publish_confirmed`).

The conversation: protocol header, ``connection.start`` / ``start-ok``
(PLAIN; capability ``consumer_cancel_notify``), ``tune`` / ``tune-ok`` (no
heartbeats: the client never idles long), ``connection.open`` on the vhost,
``channel.open`` 1; at the end ``channel.close`` and ``connection.close``,
each waiting for its close-ok (:data:`CLOSE_WAIT` at most).

Bounds: every wait ends at the client's ``deadline`` (``time.monotonic()``),
given when it is made and renewed by the calls that take one: past it
:class:`AmqpTimeout`, and the connection is unusable (closed).  A frame
larger than the negotiated ``frame_max`` or a content body larger than
:data:`MAX_BODY` (the broker's cap on ``max_message_size``) ends the
conversation (:class:`AmqpError`, code 501).

Failures are :class:`AmqpError` with the AMQP reply code and text: the
broker closing the channel (:class:`ChannelError`: 404 NOT_FOUND, 403
ACCESS_REFUSED, 406...) or the connection (:class:`ConnectionClosed`: a
login refused, 403; a vhost not allowed, 530), a nack of a confirmed
publish (:class:`Nacked`), or the socket failing or closing (code 0).

Codec: every frame and field is pamqp's.  A range read's frames
(``basic.deliver``, content headers, bodies) are taken apart by
:func:`decode_deliver` and :func:`decode_properties` with pamqp's field
decoders, without building pamqp's method and property objects, which is
most of their cost.

Not thread-safe: one client per task, per planner call, per HTTP request.
"""

from __future__ import annotations

import datetime as dt
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from pamqp import body as B
from pamqp import commands as C
from pamqp import constants as K
from pamqp import decode as D
from pamqp import exceptions as PE
from pamqp import frame as F
from pamqp import header as H

from mirrorq.amqp.framing import FRAME_MAX, PROTOCOL_HEADER
from mirrorq.bounds import MAX_MESSAGE_SIZE_LIMIT

#: the largest content body accepted (the broker's own cap on max_message_size)
MAX_BODY = MAX_MESSAGE_SIZE_LIMIT
#: bytes asked of the socket per read
READ_SIZE = 1 << 20
#: seconds a close waits for each close-ok (whatever is left of the deadline, at most)
CLOSE_WAIT = 1.0
#: publishes written to the socket at once by :meth:`BlockingClient.publish_confirmed`
PUBLISH_CHUNK = 500
CHANNEL = 1

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_DELIVER = b"\x00\x3c\x00\x3c"  # basic.deliver: class 60, method 60


class AmqpError(Exception):
    """The conversation failed: ``code`` is the AMQP reply code (0: the
    socket, a deadline, or this client), ``text`` the broker's reply text or
    what went wrong."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code} {text}" if code else text)
        self.code = code
        self.text = text


class AmqpTimeout(AmqpError):
    def __init__(self, what: str) -> None:
        super().__init__(0, f"no answer to {what} in time")


class ChannelError(AmqpError):
    """The broker closed the channel (``channel.close``): its reply code and text."""


class ConnectionClosed(ChannelError):
    """The broker closed the connection (``connection.close``)."""


class Nacked(AmqpError):
    """The broker nacked publishes sent with confirms."""

    def __init__(self, text: str) -> None:
        super().__init__(0, text)


@dataclass(frozen=True)
class Got:
    """A ``basic.get-ok`` with its content."""

    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    message_count: int
    properties: C.Basic.Properties
    body: bytes


@dataclass(slots=True)
class Properties:
    """A delivered message's basic properties (pamqp's ``Basic.Properties`` attribute names)."""

    content_type: str | None = None
    content_encoding: str | None = None
    headers: dict[str, Any] | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: dt.datetime | None = None
    message_type: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    cluster_id: str | None = None


@dataclass(slots=True)
class Delivery:
    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    properties: Properties
    body: bytes


# the basic class's properties in flag order (bit 15 first) and pamqp's decoder of each
_PROPERTY_DECODERS = (
    ("content_type", D.short_str),
    ("content_encoding", D.short_str),
    ("headers", D.field_table),
    ("delivery_mode", D.octet),
    ("priority", D.octet),
    ("correlation_id", D.short_str),
    ("reply_to", D.short_str),
    ("expiration", D.short_str),
    ("message_id", D.short_str),
    ("timestamp", D.timestamp),
    ("message_type", D.short_str),
    ("user_id", D.short_str),
    ("app_id", D.short_str),
    ("cluster_id", D.short_str),
)


def decode_deliver(payload: bytes) -> tuple[str, int, bool, str, str]:
    """A ``basic.deliver`` method frame's payload (class and method ids
    first): consumer tag, delivery tag, redelivered, exchange, routing key."""
    i = 4
    n, tag = D.short_str(payload[i:])
    i += n
    n, dtag = D.long_long_int(payload[i:])
    i += n
    _n, redelivered = D.bit(payload[i:], 0)  # a bit consumes nothing by itself: its octet does
    i += 1
    n, exchange = D.short_str(payload[i:])
    i += n
    _n, rkey = D.short_str(payload[i:])
    return tag, dtag, redelivered, exchange, rkey


def decode_properties(payload: bytes) -> tuple[int, Properties]:
    """A content header frame's payload: (body size, properties)."""
    _n, body_size = D.long_long_int(payload[4:12])
    _n, flags = D.short_uint(payload[12:14])
    i = 14
    while payload[i - 1] & 1:  # a continued flag word (0-9-1's basic class never sets one)
        i += 2
    p = Properties()
    bit = 1 << 15
    for name, decoder in _PROPERTY_DECODERS:
        if flags & bit:
            n, v = decoder(payload[i:])
            i += n
            setattr(p, name, v)
        bit >>= 1
    return body_size, p


class BlockingClient:
    """One connection with channel 1 open; use as a context manager."""

    def __init__(
        self,
        host: str,
        port: int,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        deadline: float | None = None,
        *,
        connection_name: str = "mirrorq",
        frame_max: int = FRAME_MAX,
    ) -> None:
        self.host, self.port = host, port
        self.deadline = deadline if deadline is not None else time.monotonic() + 10.0
        self.buf = bytearray()
        self.frame_max = frame_max
        self.confirming = False
        self.next_tag = 1  # the delivery tag of the next publish (with confirms)
        self.channel_open = self.connection_open = False
        self.closed = False
        self.failed = False  # the socket failed or a wait ran out: no graceful close
        self._ctag = 0
        try:
            self.sock = socket.create_connection((host, port), timeout=self._left("the connect"))
        except OSError as e:
            self.closed = True
            raise AmqpError(0, f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake(user, password, vhost, connection_name)
        except BaseException:
            self.failed = True
            self.close()
            raise

    # ---- frames --------------------------------------------------------------------------
    def _left(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.failed = True
            raise AmqpTimeout(what)
        return left

    def _send(self, channel: int, *frames: Any) -> None:
        self._write(b"".join(F.marshal(f, channel) for f in frames))

    def _write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            self.failed = True
            raise AmqpError(0, f"the connection to {self.host}:{self.port} failed: {e.strerror or e}") from None

    def _fill(self, what: str) -> None:
        """Read what the socket has (at most :data:`READ_SIZE`) into the buffer, waiting until the deadline."""
        self.sock.settimeout(self._left(what))
        try:
            data = self.sock.recv(READ_SIZE)
        except TimeoutError:
            self.failed = True
            raise AmqpTimeout(what) from None
        except OSError as e:
            self.failed = True
            raise AmqpError(0, f"the connection to {self.host}:{self.port} failed: {e.strerror or e}") from None
        if not data:
            self.failed = True
            raise AmqpError(0, f"the server closed the connection (waiting for {what})")
        self.buf += data

    def _raw(self, what: str) -> tuple[int, int, bytes]:
        """The next frame as (type, channel, payload), heartbeats skipped."""
        while True:
            buf = self.buf
            if len(buf) >= 7:
                kind, channel, size = _HEAD.unpack_from(buf, 0)
                if size + 8 > self.frame_max:
                    self.failed = True
                    raise AmqpError(501, f"a frame of {size} bytes is larger than frame_max {self.frame_max}")
                if len(buf) >= size + 8:
                    payload = bytes(buf[7 : 7 + size])
                    del buf[: size + 8]
                    if kind != K.FRAME_HEARTBEAT:
                        return kind, channel, payload
                    continue
            self._fill(what)

    def _decode(self, kind: int, channel: int, payload: bytes) -> Any:
        try:
            return F.unmarshal(_HEAD.pack(kind, channel, len(payload)) + payload + bytes([K.FRAME_END]))[2]
        except PE.UnmarshalingException as e:
            self.failed = True
            raise AmqpError(502, f"a frame could not be decoded: {e}") from None

    def _fast(self, decoder: Any, payload: bytes) -> Any:
        try:
            return decoder(payload)
        except (ValueError, IndexError) as e:
            self.failed = True
            raise AmqpError(502, f"a frame could not be decoded: {e}") from None

    def _frame(self, what: str) -> tuple[int, Any]:
        """The next frame as (channel, pamqp value); a close from the broker raises."""
        kind, channel, payload = self._raw(what)
        value = self._decode(kind, channel, payload)
        self._refused(channel, value)
        return channel, value

    def _refused(self, channel: int, value: Any) -> None:
        """A close from the broker is answered (close-ok) and raised."""
        if isinstance(value, C.Connection.Close):
            self.connection_open = self.channel_open = False
            self._send(0, C.Connection.CloseOk())
            raise ConnectionClosed(value.reply_code or 0, value.reply_text)
        if isinstance(value, C.Channel.Close):
            self.channel_open = False
            self._send(channel, C.Channel.CloseOk())
            raise ChannelError(value.reply_code or 0, value.reply_text)

    def _expect(self, what: str, *kinds: type) -> Any:
        """The next frame, which must be one of ``kinds``."""
        _channel, value = self._frame(what)
        if not isinstance(value, kinds):
            raise AmqpError(505, f"unexpected {getattr(value, 'name', type(value).__name__)} waiting for {what}")
        return value

    def _content(self, what: str) -> tuple[C.Basic.Properties, bytes]:
        head = self._expect(what, H.ContentHeader)
        if head.body_size > MAX_BODY:
            self.failed = True
            raise AmqpError(501, f"a message body of {head.body_size} bytes is larger than {MAX_BODY}")
        parts: list[bytes] = []
        got = 0
        while got < head.body_size:
            part = self._expect(what, B.ContentBody)
            parts.append(part.value)
            got += len(part.value)
        return head.properties, b"".join(parts)

    # ---- the conversation ------------------------------------------------------------------
    def _handshake(self, user: str, password: str, vhost: str, connection_name: str) -> None:
        self._write(PROTOCOL_HEADER)
        self._expect("connection.start", C.Connection.Start)
        props: dict[str, Any] = {
            "product": "mirrorq",
            "connection_name": connection_name,
            "capabilities": {"consumer_cancel_notify": True},
        }
        self._send(0, C.Connection.StartOk(client_properties=props, response=f"\0{user}\0{password}"))
        try:
            tune = self._expect("connection.tune", C.Connection.Tune)
        except AmqpError as e:
            if e.code == 0 and not isinstance(e, AmqpTimeout):
                # RabbitMQ's way too: a refused login may just be a closed socket
                raise ConnectionClosed(403, f"ACCESS_REFUSED - login refused for user '{user}' ({e.text})") from None
            raise
        self.frame_max = min(self.frame_max, tune.frame_max or self.frame_max)
        self._send(0, C.Connection.TuneOk(channel_max=1, frame_max=self.frame_max, heartbeat=0))
        self._send(0, C.Connection.Open(virtual_host=vhost))
        self._expect("connection.open-ok", C.Connection.OpenOk)
        self.connection_open = True
        self._send(CHANNEL, C.Channel.Open())
        self._expect("channel.open-ok", C.Channel.OpenOk)
        self.channel_open = True

    def _renew(self, deadline: float | None) -> None:
        if deadline is not None:
            self.deadline = deadline

    def get(self, queue: str, no_ack: bool, deadline: float | None = None) -> Got | None:
        """One ``basic.get``: the message, or None when the queue is empty."""
        self._renew(deadline)
        self._send(CHANNEL, C.Basic.Get(queue=queue, no_ack=no_ack))
        ok = self._expect("basic.get", C.Basic.GetOk, C.Basic.GetEmpty)
        if isinstance(ok, C.Basic.GetEmpty):
            return None
        props, body = self._content("basic.get's content")
        return Got(ok.delivery_tag, ok.redelivered, ok.exchange, ok.routing_key, ok.message_count, props, body)

    def reject(self, delivery_tag: int, requeue: bool) -> None:
        self._send(CHANNEL, C.Basic.Reject(delivery_tag=delivery_tag, requeue=requeue))

    def _confirm_select(self) -> None:
        if not self.confirming:
            self._send(CHANNEL, C.Confirm.Select())
            self._expect("confirm.select-ok", C.Confirm.SelectOk)
            self.confirming = True

    def _publish_frames(self, exchange: str, routing_key: str, body: bytes, props: Any, mandatory: bool) -> bytes:
        step = self.frame_max - 8
        frames = [
            F.marshal(C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory), CHANNEL),
            F.marshal(H.ContentHeader(0, len(body), props), CHANNEL),
        ]
        frames += [F.marshal(B.ContentBody(body[i : i + step]), CHANNEL) for i in range(0, len(body), step)]
        return b"".join(frames)

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: C.Basic.Properties,
        deadline: float | None = None,
    ) -> bool:
        """Publish with ``mandatory`` and wait for the confirm: True if the
        message was routed to a queue, False if it came back unroutable."""
        self._renew(deadline)
        self._confirm_select()
        self._write(self._publish_frames(exchange, routing_key, body, properties, True))
        tag = self.next_tag
        self.next_tag += 1
        routed = True
        while True:
            answer = self._expect("the publish's confirm", C.Basic.Return, C.Basic.Ack, C.Basic.Nack)
            if isinstance(answer, C.Basic.Return):
                self._content("the returned message")
                routed = False
                continue
            if answer.delivery_tag < tag and not answer.multiple:
                continue  # an earlier publish's
            if isinstance(answer, C.Basic.Nack):
                raise Nacked("the broker nacked the publish (rejected)")
            return routed

    def publish_confirmed(
        self, exchange: str, routing_key: str, messages: list, deadline: float, window: int = 2000
    ) -> int:
        """Publish ``messages`` (``(body, pamqp Basic.Properties)``) with
        confirms, at most ``window`` unconfirmed; returns once all are
        confirmed, raises :class:`Nacked` on any nack (AMQP names no reason:
        the index of the first nacked message is in the text)."""
        self._renew(deadline)
        self._confirm_select()
        first = self.next_tag
        last = first + len(messages) - 1
        confirmed = first - 1
        nacked: list[int] = []
        sent = 0
        while confirmed < last:
            if sent < len(messages) and (first + sent) - confirmed <= window:
                chunk: list[bytes] = []
                while sent < len(messages) and (first + sent) - confirmed <= window and len(chunk) < PUBLISH_CHUNK:
                    body, props = messages[sent]
                    chunk.append(self._publish_frames(exchange, routing_key, body, props, False))
                    sent += 1
                self._write(b"".join(chunk))
                self.next_tag = first + sent
                continue
            _channel, value = self._frame("publish confirms")
            if isinstance(value, (C.Basic.Ack, C.Basic.Nack)):
                upto = value.delivery_tag
                if isinstance(value, C.Basic.Nack):
                    lo = confirmed + 1 if value.multiple else value.delivery_tag
                    nacked.extend(range(lo, upto + 1))
                confirmed = max(confirmed, upto)
        if nacked:
            raise Nacked(f"{len(nacked)} of {len(messages)} publishes nacked (first: message {nacked[0] - first})")
        return len(messages)

    def call(self, method: Any, *answers: type, deadline: float | None = None) -> Any:
        """A synchronous method (``exchange.declare``, ``queue.bind``...) and its answer."""
        self._renew(deadline)
        self._send(CHANNEL, method)
        return self._expect(f"{method.name}'s answer", *answers)

    def stream(self, queue: str, arguments: dict, deadline: float, no_ack: bool = True) -> list[Delivery]:
        """``basic.consume`` with ``arguments`` (:mod:`mirrorq.amqp.stream`'s
        range reads and controls): the deliveries until the broker cancels it."""
        self._renew(deadline)
        self._ctag += 1
        tag = f"mirrorq.stream-{self._ctag}"
        self._send(CHANNEL, C.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=no_ack, arguments=arguments))
        out: list[Delivery] = []
        deliver: tuple[str, int, bool, str, str] | None = None
        props = Properties()
        size = got = 0
        parts: list[bytes] = []
        while True:
            kind, channel, payload = self._raw("a range read")
            if kind == K.FRAME_BODY:
                if deliver is not None:
                    parts.append(payload)
                    got += len(payload)
                    if got >= size:
                        out.append(Delivery(*deliver, props, parts[0] if len(parts) == 1 else b"".join(parts)))
                        deliver = None
                continue
            if kind == K.FRAME_HEADER:
                if deliver is not None:
                    size, props = self._fast(decode_properties, payload)
                    if size > MAX_BODY:
                        self.failed = True
                        raise AmqpError(501, f"a message body of {size} bytes is larger than {MAX_BODY}")
                    parts, got = [], 0
                    if size == 0:
                        out.append(Delivery(*deliver, props, b""))
                        deliver = None
                continue
            if kind == K.FRAME_METHOD and payload[:4] == _DELIVER:
                deliver = self._fast(decode_deliver, payload)
                continue
            value = self._decode(kind, channel, payload)
            self._refused(channel, value)
            if isinstance(value, C.Basic.Cancel) and value.consumer_tag == tag:
                return out

    def close(self) -> None:
        """Close the channel and the connection, waiting for each close-ok
        (:data:`CLOSE_WAIT` at most, nothing after a failure); the socket is
        closed whatever happens."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.failed:
                self.deadline = min(self.deadline, time.monotonic() + CLOSE_WAIT)
                if self.channel_open:
                    self._send(CHANNEL, C.Channel.Close(reply_code=200, reply_text="done", class_id=0, method_id=0))
                    self._expect("channel.close-ok", C.Channel.CloseOk)
                    self.channel_open = False
                if self.connection_open:
                    self._send(0, C.Connection.Close(reply_code=200, reply_text="done", class_id=0, method_id=0))
                    self._expect("connection.close-ok", C.Connection.CloseOk)
                    self.connection_open = False
        except AmqpError:
            pass
        finally:
            try:
                self.sock.close()
            except OSError:
                pass

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
