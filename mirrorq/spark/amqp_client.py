"""A small blocking AMQP 0-9-1 client (pamqp frames) with a deadline on every call.

The Spark source and sink speak the extensions of :mod:`mirrorq.amqp.stream`
(range reads, commits, publisher refs), which any AMQP client can use -- the
README shows them with pika.  Inside Spark tasks we need what pika's
blocking adapter does not give: a deadline on *every* wait (pika's
``basic_consume`` waits for consume-ok forever, and a request in flight to
a master that dies is never answered), and pipelined publishing with
confirms.  So this module is a thin client of its own:

* :class:`Client` connects (PLAIN), opens channel 1, and every method takes
  a ``deadline`` (``time.monotonic()`` value): past it :class:`Timeout` is
  raised and the connection is unusable (close it, reconnect elsewhere).
* Broker refusals raise :class:`ChannelError` / :class:`ConnectionError_`
  with the reply code and the broker's text.
* :meth:`Client.stream` runs one ``basic.consume`` with extension arguments
  and returns its deliveries once the broker cancels the consumer.  Its
  frames are decoded here, not by pamqp's generic unmarshalling: a
  ``basic.deliver`` and a content header (:func:`decode_properties`, the
  basic class's property list) are what a range read is made of, and
  decoding them directly is several times faster; every other frame goes
  through pamqp.
* :meth:`Client.publish_confirmed` publishes a batch pipelined (up to
  ``window`` unconfirmed) and returns only when every confirm arrived; a
  nack raises :class:`Nacked` naming it.

Not thread-safe; one client per task / per planner call.
"""

from __future__ import annotations

import datetime as dt
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from pamqp import commands as C
from pamqp import constants as K
from pamqp import decode as D
from pamqp import frame as F
from pamqp import header as H
from pamqp import heartbeat as HB

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
RECV_BYTES = 1 << 20  # one socket read


class AMQPClientError(Exception):
    pass


class Timeout(AMQPClientError):
    pass


class ChannelError(AMQPClientError):
    """A channel.close (or connection.close) from the broker: its reply code
    (None only if the close carried none: pamqp's type) and text."""

    def __init__(self, code: int | None, text: str):
        super().__init__(f"{code} {text}")
        self.code, self.text = code, text


class ConnectionError_(ChannelError):
    pass


class Nacked(AMQPClientError):
    pass


@dataclass(slots=True)
class Properties:
    """A message's basic properties (pamqp's ``Basic.Properties`` attribute names)."""

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


_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_DELIVER = b"\x00\x3c\x00\x3c"  # basic.deliver: class 60, method 60
# the basic class's properties in flag order (bit 15 first): name, type
_PROPERTY_LIST = (
    ("content_type", "s"),
    ("content_encoding", "s"),
    ("headers", "t"),
    ("delivery_mode", "o"),
    ("priority", "o"),
    ("correlation_id", "s"),
    ("reply_to", "s"),
    ("expiration", "s"),
    ("message_id", "s"),
    ("timestamp", "T"),
    ("message_type", "s"),
    ("user_id", "s"),
    ("app_id", "s"),
    ("cluster_id", "s"),
)


def _shortstr(b: bytes, i: int) -> tuple[str, int]:
    n = b[i]
    return b[i + 1 : i + 1 + n].decode("utf-8", "replace"), i + 1 + n


def decode_deliver(payload: bytes) -> tuple[str, int, bool, str, str]:
    """A ``basic.deliver`` method payload (after class and method ids):
    consumer tag, delivery tag, redelivered, exchange, routing key."""
    tag, i = _shortstr(payload, 4)
    dtag = _U64.unpack_from(payload, i)[0]
    redelivered = bool(payload[i + 8] & 1)
    exchange, i = _shortstr(payload, i + 9)
    rkey, i = _shortstr(payload, i)
    return tag, dtag, redelivered, exchange, rkey


def decode_properties(payload: bytes) -> tuple[int, Properties]:
    """A content header payload: (body size, properties)."""
    body_size = _U64.unpack_from(payload, 4)[0]
    flags = _U16.unpack_from(payload, 12)[0]
    i = 14
    while _U16.unpack_from(payload, i - 2)[0] & 1:  # a continued flag word (unused by 0-9-1's basic class)
        i += 2
    p = Properties()
    bit = 1 << 15
    for name, kind in _PROPERTY_LIST:
        if flags & bit:
            v: Any
            if kind == "s":
                v, i = _shortstr(payload, i)
            elif kind == "o":
                v, i = payload[i], i + 1
            elif kind == "T":
                secs = _U64.unpack_from(payload, i)[0]
                v, i = dt.datetime.fromtimestamp(secs / 1000.0 if secs > 0xFFFFFFFF else secs, dt.UTC), i + 8
            else:
                n, v = D.field_table(payload[i:])
                i += n
            setattr(p, name, v)
        bit >>= 1
    return body_size, p


class Client:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        deadline: float | None = None,
        frame_max: int = 131072,
    ):
        self.host, self.port = host, port
        deadline = deadline if deadline is not None else time.monotonic() + 10
        self.sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.frame_max = frame_max
        self.closed = False
        self.confirming = False
        self.next_tag = 1
        self._ctag = 0
        try:
            self.sock.sendall(PROTOCOL_HEADER)
            self._expect(0, C.Connection.Start, deadline)
            self._send(
                0,
                C.Connection.StartOk(
                    {"product": "mirrorq.spark", "capabilities": {"consumer_cancel_notify": True}},
                    "PLAIN",
                    f"\0{user}\0{password}",
                    "en_US",
                ),
            )
            tune = self._expect(0, C.Connection.Tune, deadline)
            self.frame_max = min(frame_max, tune.frame_max or frame_max)
            self._send(0, C.Connection.TuneOk(tune.channel_max, self.frame_max, 0))
            self._send(0, C.Connection.Open(vhost))
            self._expect(0, C.Connection.OpenOk, deadline)
            self._send(1, C.Channel.Open())
            self._expect(1, C.Channel.OpenOk, deadline)
        except BaseException:
            self.close()
            raise

    # ---- plumbing ------------------------------------------------------------------
    def _send(self, channel: int, method: Any) -> None:
        self.sock.sendall(F.marshal(method, channel))

    def _read_frame(self, deadline: float) -> tuple[int, Any]:
        while True:
            if len(self.buf) >= 7:
                size = struct.unpack_from(">I", self.buf, 3)[0]
                if len(self.buf) >= size + 8:
                    raw = bytes(self.buf[: size + 8])
                    del self.buf[: size + 8]
                    if raw[0] == K.FRAME_BODY:
                        return raw[1] << 8 | raw[2], ("body", raw[7:-1])
                    _, channel, value = F.unmarshal(raw)
                    if isinstance(value, HB.Heartbeat):
                        continue
                    return channel, value
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        """Read what the socket has (at most ``RECV_BYTES``) into the buffer, waiting until ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise Timeout(f"no answer from {self.host}:{self.port} in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(RECV_BYTES)
            except TimeoutError:
                continue
            except OSError as e:
                self.close()
                raise AMQPClientError(f"connection to {self.host}:{self.port} lost: {e}") from None
            if not data:
                self.close()
                raise AMQPClientError(f"connection to {self.host}:{self.port} closed by the broker")
            self.buf += data
            return

    def _check(self, channel: int, value: Any) -> None:
        if isinstance(value, C.Channel.Close):
            self._send(1, C.Channel.CloseOk())
            raise ChannelError(value.reply_code, value.reply_text)
        if isinstance(value, C.Connection.Close):
            try:
                self._send(0, C.Connection.CloseOk())
            finally:
                self.close()
            raise ConnectionError_(value.reply_code, value.reply_text)

    def _expect(self, channel: int, kind: type, deadline: float) -> Any:
        while True:
            ch, value = self._read_frame(deadline)
            self._check(ch, value)
            if isinstance(value, kind):
                return value

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- extensions: one consume, answered by deliveries and a server cancel -------------
    def _read_raw(self, deadline: float) -> tuple[int, int, bytes]:
        """The next frame as (type, channel, payload); heartbeats skipped."""
        while True:
            buf = self.buf
            if len(buf) >= 7:
                kind, channel, size = _HEAD.unpack_from(buf, 0)
                if len(buf) >= size + 8:
                    payload = bytes(buf[7 : 7 + size])
                    del buf[: size + 8]
                    if kind == K.FRAME_HEARTBEAT:
                        continue
                    return kind, channel, payload
            self._fill(deadline)

    def stream(self, queue: str, arguments: dict, deadline: float, no_ack: bool = True) -> list[Delivery]:
        """``basic.consume`` with ``arguments``; the deliveries until the broker cancels it."""
        self._ctag += 1
        tag = f"mirrorq.spark-{self._ctag}"
        self._send(1, C.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=no_ack, arguments=arguments))
        out: list[Delivery] = []
        deliver: tuple[str, int, bool, str, str] | None = None
        props = Properties()
        size = 0
        parts: list[bytes] = []
        got = 0
        while True:
            kind, ch, payload = self._read_raw(deadline)
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
                    size, props = decode_properties(payload)
                    parts, got = [], 0
                    if size == 0:
                        out.append(Delivery(*deliver, props, b""))
                        deliver = None
                continue
            if kind == K.FRAME_METHOD and payload[:4] == _DELIVER:
                deliver = decode_deliver(payload)
                continue
            value = F.unmarshal(_HEAD.pack(kind, ch, len(payload)) + payload + b"\xce")[2]
            self._check(ch, value)
            if isinstance(value, C.Basic.Cancel) and value.consumer_tag == tag:
                return out

    def publish_confirmed(
        self, exchange: str, routing_key: str, messages: list, deadline: float, window: int = 2000
    ) -> int:
        """Publish ``messages`` (``(body, pamqp Basic.Properties)``) with
        confirms; returns when all are confirmed, raises :class:`Nacked` on
        any nack (naming the broker's reason is not in AMQP: the index is)."""
        if not self.confirming:
            self._send(1, C.Confirm.Select())
            self._expect(1, C.Confirm.SelectOk, deadline)
            self.confirming = True
        first = self.next_tag
        last = first + len(messages) - 1
        confirmed = first - 1
        nacked: list[int] = []
        sent = 0
        step = self.frame_max - 8
        while confirmed < last:
            if sent < len(messages) and (first + sent) - confirmed <= window:
                chunk: list[bytes] = []
                while sent < len(messages) and (first + sent) - confirmed <= window and len(chunk) < 500:
                    body, props = messages[sent]
                    chunk.append(F.marshal(C.Basic.Publish(exchange=exchange, routing_key=routing_key), 1))
                    chunk.append(F._marshal(K.FRAME_HEADER, 1, H.ContentHeader(0, len(body), props).marshal()))
                    for i in range(0, len(body), step):
                        chunk.append(F._marshal(K.FRAME_BODY, 1, body[i : i + step]))
                    sent += 1
                self.sock.sendall(b"".join(chunk))
                self.next_tag = first + sent
                continue
            ch, value = self._read_frame(deadline)
            self._check(ch, value)
            if isinstance(value, (C.Basic.Ack, C.Basic.Nack)):
                upto = value.delivery_tag if value.multiple else value.delivery_tag
                if isinstance(value, C.Basic.Nack):
                    lo = confirmed + 1 if value.multiple else value.delivery_tag
                    nacked.extend(range(lo, upto + 1))
                confirmed = max(confirmed, upto)
        if nacked:
            raise Nacked(f"{len(nacked)} of {len(messages)} publishes nacked (first: message {nacked[0] - first})")
        return len(messages)
