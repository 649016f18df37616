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
  and returns its deliveries once the broker cancels the consumer.
* :meth:`Client.publish_confirmed` publishes a batch pipelined (up to
  ``window`` unconfirmed) and returns only when every confirm arrived; a
  nack raises :class:`Nacked` naming it.

Not thread-safe; one client per task / per planner call.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from pamqp import commands as C
from pamqp import constants as K
from pamqp import frame as F
from pamqp import header as H
from pamqp import heartbeat as HB

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


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


@dataclass
class Delivery:
    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    properties: Any  # pamqp Basic.Properties
    body: bytes


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
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise Timeout(f"no answer from {self.host}:{self.port} in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError as e:
                self.close()
                raise AMQPClientError(f"connection to {self.host}:{self.port} lost: {e}") from None
            if not data:
                self.close()
                raise AMQPClientError(f"connection to {self.host}:{self.port} closed by the broker")
            self.buf += data

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
    def stream(self, queue: str, arguments: dict, deadline: float, no_ack: bool = True) -> list[Delivery]:
        """``basic.consume`` with ``arguments``; the deliveries until the broker cancels it."""
        self._ctag += 1
        tag = f"mirrorq.spark-{self._ctag}"
        self._send(1, C.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=no_ack, arguments=arguments))
        out: list[Delivery] = []
        cur: dict | None = None
        while True:
            ch, value = self._read_frame(deadline)
            self._check(ch, value)
            if isinstance(value, C.Basic.Deliver):
                cur = {"m": value, "h": None, "body": []}
            elif isinstance(value, H.ContentHeader) and cur is not None:
                cur["h"] = value
                if value.body_size == 0:
                    out.append(_delivery(cur))
                    cur = None
            elif isinstance(value, tuple) and value[0] == "body" and cur is not None:
                cur["body"].append(value[1])
                if sum(map(len, cur["body"])) >= cur["h"].body_size:
                    out.append(_delivery(cur))
                    cur = None
            elif isinstance(value, C.Basic.Cancel) and value.consumer_tag == tag:
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


def _delivery(cur: dict) -> Delivery:
    m, h = cur["m"], cur["h"]
    return Delivery(
        m.consumer_tag,
        m.delivery_tag,
        bool(m.redelivered),
        m.exchange or "",
        m.routing_key or "",
        h.properties,
        b"".join(cur["body"]),
    )
