"""A blocking AMQP 0-9-1 client with one channel, for the admin layer's get and publish.

The management API's get-messages and publish (:mod:`mirrorq.admin.messages`)
speak AMQP to their own node's listener, as the user who asked (RabbitMQ's
management plugin opens a channel as that user too): the user's
permissions, the queue semantics and the routing are the broker's own.

The conversation, as the server side of :mod:`mirrorq.amqp.connection`
expects it: protocol header, ``connection.start`` / ``start-ok`` (PLAIN),
``tune`` / ``tune-ok`` (no heartbeats: a conversation is short),
``connection.open`` on the vhost, ``channel.open`` 1; then
``basic.get`` (``get-ok`` with its content, or ``get-empty``),
``basic.reject``, a synchronous method (:meth:`BlockingClient.call`:
``exchange.declare``, ``queue.bind``...), or ``confirm.select`` once and ``basic.publish`` with
``mandatory`` (an unroutable message comes back as ``basic.return`` before
its ``basic.ack``); ``channel.close`` and ``connection.close``, each waiting
for its ``close-ok``.

Bounds: every wait -- connect, each read -- ends at the one ``deadline``
(``time.monotonic()``) given when the client is made: past it
:class:`AmqpTimeout`; a frame larger than the negotiated ``frame_max`` or
a content body larger than :data:`MAX_BODY` (the broker's cap on
``max_message_size``) ends the conversation
(:class:`AmqpError`, code 501).

Failures are :class:`AmqpError` with the AMQP reply code and text: the
server closing the channel (404 NOT_FOUND, 403 ACCESS_REFUSED, 406...) or
the connection (a login refused: 403; a vhost not allowed: 530), the
socket failing or closing (code 0).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from pamqp import body as B
from pamqp import commands as C
from pamqp import exceptions as PE
from pamqp import frame as F
from pamqp import header as H
from pamqp import heartbeat as HB

from mirrorq.amqp.framing import FRAME_MAX, PROTOCOL_HEADER
from mirrorq.bounds import MAX_MESSAGE_SIZE_LIMIT

#: the largest content body accepted (the broker's own cap on max_message_size)
MAX_BODY = MAX_MESSAGE_SIZE_LIMIT
#: bytes asked of the socket per read
READ_SIZE = 65536
CHANNEL = 1


class AmqpError(Exception):
    """The conversation failed: ``code`` is the AMQP reply code (0: the
    socket), ``text`` the server's reply text or what went wrong."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code} {text}" if code else text)
        self.code = code
        self.text = text


class AmqpTimeout(AmqpError):
    def __init__(self, what: str) -> None:
        super().__init__(0, f"no answer to {what} in time")


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


class BlockingClient:
    """One connection with one channel open; use as a context manager."""

    def __init__(
        self,
        host: str,
        port: int,
        user: str,
        password: str,
        vhost: str,
        deadline: float,
        connection_name: str = "mirrorq management",
    ) -> None:
        self.deadline = deadline
        self.buf = bytearray()
        self.frame_max = FRAME_MAX
        self.confirming = False
        self.published = 0
        self.channel_open = self.connection_open = False
        try:
            self.sock = socket.create_connection((host, port), timeout=self._left("the connect"))
        except OSError as e:
            raise AmqpError(0, f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        try:
            self._handshake(user, password, vhost, connection_name)
        except BaseException:
            self.sock.close()
            raise

    # ---- frames --------------------------------------------------------------------------
    def _left(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise AmqpTimeout(what)
        return left

    def _send(self, channel: int, *frames: Any) -> None:
        try:
            self.sock.sendall(b"".join(F.marshal(f, channel) for f in frames))
        except OSError as e:
            raise AmqpError(0, f"the connection failed: {e.strerror or e}") from None

    def _frame(self, what: str) -> tuple[int, Any]:
        """The next frame (channel, value), heartbeats skipped."""
        while True:
            if len(self.buf) >= 7:
                size = int.from_bytes(self.buf[3:7], "big")
                if size + 8 > self.frame_max:
                    raise AmqpError(501, f"a frame of {size} bytes is larger than frame_max {self.frame_max}")
                if len(self.buf) >= size + 8:
                    try:
                        n, channel, value = F.unmarshal(bytes(self.buf[: size + 8]))
                    except PE.UnmarshalingException as e:
                        raise AmqpError(502, f"a frame could not be decoded: {e}") from None
                    del self.buf[:n]
                    if isinstance(value, HB.Heartbeat):
                        continue
                    return channel, value
            self.sock.settimeout(self._left(what))
            try:
                data = self.sock.recv(READ_SIZE)
            except TimeoutError:
                raise AmqpTimeout(what) from None
            except OSError as e:
                raise AmqpError(0, f"the connection failed: {e.strerror or e}") from None
            if not data:
                raise AmqpError(0, f"the server closed the connection (waiting for {what})")
            self.buf += data

    def _expect(self, what: str, *kinds: type) -> Any:
        """The next method of one of ``kinds``; a close from the server raises AmqpError."""
        channel, value = self._frame(what)
        if isinstance(value, C.Connection.Close):
            self.connection_open = self.channel_open = False
            self._send(0, C.Connection.CloseOk())
            raise AmqpError(value.reply_code or 0, value.reply_text)
        if isinstance(value, C.Channel.Close):
            self.channel_open = False
            self._send(channel, C.Channel.CloseOk())
            raise AmqpError(value.reply_code or 0, value.reply_text)
        if not isinstance(value, kinds):
            raise AmqpError(505, f"unexpected {getattr(value, 'name', type(value).__name__)} waiting for {what}")
        return value

    def _content(self, what: str) -> tuple[C.Basic.Properties, bytes]:
        head = self._expect(what, H.ContentHeader)
        if head.body_size > MAX_BODY:
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
        try:
            self.sock.sendall(PROTOCOL_HEADER)
        except OSError as e:
            raise AmqpError(0, f"the connection failed: {e.strerror or e}") from None
        self._expect("connection.start", C.Connection.Start)
        props: dict[str, Any] = {"product": "mirrorq admin", "connection_name": connection_name}
        self._send(0, C.Connection.StartOk(client_properties=props, response=f"\0{user}\0{password}"))
        try:
            tune = self._expect("connection.tune", C.Connection.Tune)
        except AmqpError as e:
            if e.code == 0:  # RabbitMQ's way too: a refused login may just be a closed socket
                raise AmqpError(403, f"ACCESS_REFUSED - login refused for user '{user}' ({e.text})") from None
            raise
        self.frame_max = min(FRAME_MAX, tune.frame_max or FRAME_MAX)
        self._send(0, C.Connection.TuneOk(channel_max=1, frame_max=self.frame_max, heartbeat=0))
        self._send(0, C.Connection.Open(virtual_host=vhost))
        self._expect("connection.open-ok", C.Connection.OpenOk)
        self.connection_open = True
        self._send(CHANNEL, C.Channel.Open())
        self._expect("channel.open-ok", C.Channel.OpenOk)
        self.channel_open = True

    def get(self, queue: str, no_ack: bool) -> Got | None:
        """One ``basic.get``: the message, or None when the queue is empty."""
        self._send(CHANNEL, C.Basic.Get(queue=queue, no_ack=no_ack))
        ok = self._expect("basic.get", C.Basic.GetOk, C.Basic.GetEmpty)
        if isinstance(ok, C.Basic.GetEmpty):
            return None
        props, body = self._content("basic.get's content")
        return Got(ok.delivery_tag, ok.redelivered, ok.exchange, ok.routing_key, ok.message_count, props, body)

    def reject(self, delivery_tag: int, requeue: bool) -> None:
        self._send(CHANNEL, C.Basic.Reject(delivery_tag=delivery_tag, requeue=requeue))

    def publish(self, exchange: str, routing_key: str, body: bytes, properties: C.Basic.Properties) -> bool:
        """Publish with ``mandatory`` and wait for the confirm: True if the
        message was routed to a queue, False if it came back unroutable."""
        if not self.confirming:
            self._send(CHANNEL, C.Confirm.Select())
            self._expect("confirm.select-ok", C.Confirm.SelectOk)
            self.confirming = True
        step = self.frame_max - 8
        frames: list[Any] = [
            C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True),
            H.ContentHeader(0, len(body), properties),
        ]
        frames += [B.ContentBody(body[i : i + step]) for i in range(0, len(body), step)]
        self._send(CHANNEL, *frames)
        self.published += 1
        routed = True
        while True:
            answer = self._expect("the publish's confirm", C.Basic.Return, C.Basic.Ack, C.Basic.Nack)
            if isinstance(answer, C.Basic.Return):
                self._content("the returned message")
                routed = False
                continue
            if answer.delivery_tag < self.published and not answer.multiple:
                continue  # an earlier publish's
            if isinstance(answer, C.Basic.Nack):
                raise AmqpError(0, "the broker nacked the publish (rejected)")
            return routed

    def call(self, method: Any, *answers: type) -> Any:
        """A synchronous method (``exchange.declare``, ``queue.bind``...) and its answer."""
        self._send(CHANNEL, method)
        return self._expect(f"{method.name}'s answer", *answers)

    def close(self) -> None:
        """Close the channel and the connection, waiting for each close-ok
        until the deadline; the socket is closed whatever happens."""
        try:
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
            self.sock.close()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
