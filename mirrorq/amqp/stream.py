"""Range reads, commits and publisher refs over AMQP 0-9-1 (RabbitMQ-flavoured extensions).

A mirrored queue's log gives every message an *offset* (its PUBLISH
record's offset, the same on the master and on every mirror: mirrors apply
and sync install records at the master's offsets, and promotion only lets
a mirror write once every survivor holds the same prefix).  These
extensions let a client read a queue by offset without removing anything,
and remove everything below an offset later -- what the Spark source
(:mod:`mirrorq.spark`) is built on.  They follow RabbitMQ streams, which
read with ``basic.consume(arguments={"x-stream-offset": N})`` and put an
``x-stream-offset`` header on each delivery.

Range read
    ``basic.consume(queue, no_ack=True, arguments={"x-stream-offset": S,
    "x-stream-end-offset": E, "x-stream-max-messages": M})``: the broker
    answers ``consume-ok``, delivers the live messages at offsets in ``[S,
    E)`` in offset order -- at most ``M`` (default 10000) and about 4 MiB
    of bodies -- each with header ``x-stream-offset`` = its offset, and then
    cancels the consumer (a server ``basic.cancel``; clients that do not
    announce ``consumer_cancel_notify`` simply see no more deliveries).  A
    client that got fewer than the range holds reads on from its last
    offset + 1.  Nothing is removed or marked delivered; ``redelivered``
    says whether the message was ever delivered to an ordinary consumer.
    ``E`` defaults to the log's end when the read is served.
Control
    ``basic.consume(queue, arguments={"x-stream-control": OP, ...})``: the
    broker answers ``consume-ok``, then ONE delivery whose body is a JSON
    object (content-type ``application/json``, header ``x-stream-control``
    = OP), then a server ``basic.cancel``.  ``OP``:

    ``"bounds"``  ``{"first_offset", "next_offset", "messages",
                  "consumers"}``; with ``x-stream-offset`` S (and
                  ``x-stream-max-messages`` M, ``x-stream-end-offset`` U)
                  also ``"end"``: where a range of at most M live messages
                  from S (below U) ends, exclusive, and ``"count"``: how
                  many live messages it holds.
    ``"commit"``  with ``x-stream-commit-offset`` N: every message at an
                  offset below N is removed (replicated through GM like an
                  ack; the answer ``{"committed_below": N, "removed": k}``
                  is sent only once every replica of the view holds it, so
                  an answered commit survives a failover).  Idempotent.

    ``"queues"``  answered by the node the client is connected to, whatever
                  queue the consume names (it may be ""): ``{"queues":
                  [names]}``, the vhost's queues that can be range-read
                  (classic queues; quorum queues cannot) and that the user
                  may read, from the node's copy of the registry, sorted;
                  with ``x-stream-queue-pattern`` P only the names that P (a
                  Python regular expression) matches whole.

    A range reader must be the queue's only consumer: a read or commit
    while the queue has consumers (or messages unacked by one) is refused,
    and for 30 s after a read or commit ``basic.consume`` / ``basic.get``
    by anyone else are refused (403 ACCESS_REFUSED naming the conflict).
Publisher refs (idempotent publishing)
    A publish whose headers carry ``x-publisher-ref`` (text) and
    ``x-publishing-id`` (1, 2, 3... per ref; RabbitMQ streams' names for
    de-duplication) is enqueued only if its id is the ref's next: a lower
    id is a replay and is confirmed (basic.ack) without being enqueued; a
    higher one is nacked (a gap).  So a publisher that replays the same
    numbered messages -- from any connection, after any failure -- puts
    each into the queue once.

Errors close the channel with 406 PRECONDITION_FAILED (a range beyond the
log's end, a start after the end, a commit beyond the log, bad arguments,
a missing ``no_ack``), 403 ACCESS_REFUSED (another consumer) or 404, and a
text naming the queue and what was wrong.

This module is the front end's part: consuming
(:mod:`mirrorq.amqp.consume`, with the connection as its
:class:`StreamHost`) hands a ``basic.consume`` that
:func:`is_stream_consume` to :func:`consume`, and publishing
(:mod:`mirrorq.amqp.publish`) takes a publish's publisher ref from
:func:`publisher_ref`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol

from pamqp import commands as C
from pamqp import decode, encode
from pamqp import header as H

from mirrorq.amqp.channel import Channel
from mirrorq.amqp.errors import amqp_error, strip_name
from mirrorq.amqp.framing import FrameWriter
from mirrorq.amqp.properties import EXCHANGE, HEADER, ROUTING_KEY

ARG_OFFSET = "x-stream-offset"
ARG_END = "x-stream-end-offset"
ARG_MAX = "x-stream-max-messages"
ARG_CONTROL = "x-stream-control"
ARG_COMMIT = "x-stream-commit-offset"
ARG_PATTERN = "x-stream-queue-pattern"
HDR_OFFSET = "x-stream-offset"
HDR_PUBLISHER_REF = "x-publisher-ref"
HDR_PUBLISHING_ID = "x-publishing-id"

DEFAULT_MAX_MESSAGES = 10000
MAX_MAX_MESSAGES = 100000
MAX_READ_BYTES = 4 << 20
CONTROLS = ("bounds", "commit")


class StreamHost(Protocol):
    """What :func:`consume` needs of the connection."""

    safe_id: str  # the connection's name, as consumer tags carry it
    writer: FrameWriter  # frames to the client
    stats: dict[str, int]  # "deliveries"

    def command(self, now: float, ch: Channel, queue: str, command: str, on_done: Callable, **args: Any) -> None:
        """Run a queue command on ``queue``'s master; ``on_done(CommandDone)``."""
        ...

    def server_cancel(self, ch: Channel, tag: str) -> None:
        """A server ``basic.cancel`` of consumer ``tag`` (to clients that take it)."""
        ...


def is_stream_consume(arguments: Any) -> bool:
    return isinstance(arguments, dict) and (ARG_OFFSET in arguments or ARG_CONTROL in arguments)


def _text_arg(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def is_queue_listing(arguments: Any) -> bool:
    return isinstance(arguments, dict) and _text_arg(arguments.get(ARG_CONTROL)) == "queues"


def list_queues(conn: StreamHost, ch: Channel, m: Any, records: list[dict]) -> None:
    """The ``"queues"`` control: consume-ok, one JSON delivery naming the
    range-readable queues among ``records`` (matching the pattern, if
    given), a server cancel."""
    args = dict(m.arguments or {})
    pattern = _text_arg(args.get(ARG_PATTERN))
    rx = None
    if pattern is not None:
        if not isinstance(pattern, str):
            raise amqp_error(406, f"invalid arg '{ARG_PATTERN}': expected a regular expression, got {pattern!r}", m)
        try:
            rx = re.compile(pattern)
        except re.error as e:
            why = f"invalid arg '{ARG_PATTERN}': {pattern!r} is not a regular expression: {e}"
            raise amqp_error(406, why, m) from None
    names = [
        r["name"] for r in records if r.get("type") != "quorum" and (rx is None or rx.fullmatch(r["name"]) is not None)
    ]
    tag = m.consumer_tag or ch.new_consumer_tag(conn.safe_id)
    if tag in ch.cons.consumers:
        raise amqp_error(530, f"attempt to reuse consumer tag '{tag}'", m)
    if not m.nowait:
        conn.writer.method(ch.number, C.Basic.ConsumeOk(tag))
    body = json.dumps({"queues": names}).encode()
    props = C.Basic.Properties(content_type="application/json", headers={ARG_CONTROL: "queues"})
    _deliver(conn, ch, tag, H.ContentHeader(0, len(body), props).marshal(), body, "", m.queue or "", False)
    conn.server_cancel(ch, tag)


def publisher_ref(headers: Any) -> list | None:
    """``[ref, id]`` from a publish's headers, or None."""
    if not isinstance(headers, dict) or HDR_PUBLISHER_REF not in headers:
        return None
    ref = headers.get(HDR_PUBLISHER_REF)
    if isinstance(ref, bytes):
        ref = ref.decode("utf-8", "replace")
    pid = headers.get(HDR_PUBLISHING_ID)
    return [str(ref), pid if isinstance(pid, int) and not isinstance(pid, bool) else -1]


def _int_arg(args: dict, key: str, m: Any, err: Any, default: Any = None) -> Any:
    v = args.get(key, default)
    if v is default:
        return v
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise err(406, f"invalid arg '{key}': expected a non-negative integer, got {v!r}", m)
    return v


def consume(conn: StreamHost, now: float, ch: Channel, m: Any, name: str) -> None:
    """``basic.consume`` with ``x-stream-offset`` or ``x-stream-control`` on queue ``name``."""
    args = dict(m.arguments or {})
    tag = m.consumer_tag
    if not tag:
        tag = ch.new_consumer_tag(conn.safe_id)
    if tag in ch.cons.consumers:
        raise amqp_error(530, f"attempt to reuse consumer tag '{tag}'", m)
    control = args.get(ARG_CONTROL)
    if control is not None:
        if isinstance(control, bytes):
            control = control.decode("utf-8", "replace")
        if control not in CONTROLS:
            raise amqp_error(
                406, f"invalid arg '{ARG_CONTROL}': expected one of {', '.join(CONTROLS)}, got {control!r}", m
            )
        if control == "commit":
            end = _int_arg(args, ARG_COMMIT, m, amqp_error)
            if end is None:
                raise amqp_error(
                    406,
                    f"x-stream-control 'commit' on queue '{name}' needs '{ARG_COMMIT}' (commit below which offset)",
                    m,
                )
            command, cargs = "stream_commit", {"end": end}
        else:
            mx = _int_arg(args, ARG_MAX, m, amqp_error)
            command, cargs = (
                "stream_bounds",
                {
                    "start": _int_arg(args, ARG_OFFSET, m, amqp_error),
                    "max_messages": mx,
                    "until": _int_arg(args, ARG_END, m, amqp_error),
                },
            )
    else:
        if not m.no_ack:
            raise amqp_error(
                406,
                f"a range read ('{ARG_OFFSET}') of queue '{name}' removes nothing, so it takes no acks: "
                f"consume with no_ack=true and remove with x-stream-control 'commit'",
                m,
            )
        start = _int_arg(args, ARG_OFFSET, m, amqp_error)
        end = _int_arg(args, ARG_END, m, amqp_error)
        mx = _int_arg(args, ARG_MAX, m, amqp_error, DEFAULT_MAX_MESSAGES) or DEFAULT_MAX_MESSAGES
        if mx > MAX_MAX_MESSAGES:
            raise amqp_error(406, f"invalid arg '{ARG_MAX}': at most {MAX_MAX_MESSAGES}, got {mx}", m)
        command, cargs = "stream_read", {"start": start, "end": end, "max_messages": mx, "max_bytes": MAX_READ_BYTES}

    ch.cons.consumers[tag] = (name, True)
    nowait = bool(m.nowait)

    def done(ev: Any) -> None:
        if ch.cons.consumers.get(tag) != (name, True):
            return  # cancelled meanwhile
        del ch.cons.consumers[tag]
        if not ev.ok:
            raise amqp_error(ev.code or 541, strip_name(ev.error), m)
        if not nowait:
            conn.writer.method(ch.number, C.Basic.ConsumeOk(tag))
        if control is not None:
            body = json.dumps(ev.value, sort_keys=True).encode()
            props = C.Basic.Properties(content_type="application/json", headers={ARG_CONTROL: control})
            _deliver(conn, ch, tag, H.ContentHeader(0, len(body), props).marshal(), body, "", name, False)
        else:
            for offset, body, props, redelivered in ev.value["items"]:
                _deliver(
                    conn,
                    ch,
                    tag,
                    with_header((props or {}).get(HEADER), len(body), HDR_OFFSET, offset),
                    body,
                    (props or {}).get(EXCHANGE, ""),
                    (props or {}).get(ROUTING_KEY, ""),
                    redelivered,
                )
        conn.server_cancel(ch, tag)

    conn.command(now, ch, name, command, done, **cargs)


def _deliver(
    conn: StreamHost, ch: Channel, tag: str, header: bytes, body: bytes, exchange: str, rkey: str, redelivered: bool
) -> None:
    dtag = ch.dlv.next_tag
    ch.dlv.next_tag += 1
    conn.stats["deliveries"] += 1
    conn.writer.content(ch.number, C.Basic.Deliver(tag, dtag, bool(redelivered), exchange, rkey), header, body)


def with_header(raw: Any, size: int, key: str, value: Any) -> bytes:
    """The publisher's content header (``raw``; a plain one if None) with
    header ``key`` set to ``value`` (``x-stream-offset``, ``x-delivery-count``)."""
    if isinstance(raw, (bytes, bytearray)) and isinstance(value, int) and not isinstance(value, bool):
        spliced = _splice_header(bytes(raw), size, key, value)
        if spliced is not None:
            return spliced
    hdr = H.ContentHeader(0, size, C.Basic.Properties())
    if isinstance(raw, (bytes, bytearray)):
        hdr.unmarshal(bytes(raw))
    headers = dict(hdr.properties.headers or {})
    headers[key] = value
    hdr.properties.headers = headers
    hdr.body_size = size
    return hdr.marshal()


_FLAG_CONTENT_TYPE, _FLAG_CONTENT_ENCODING, _FLAG_HEADERS = 1 << 15, 1 << 14, 1 << 13


def _splice_header(raw: bytes, size: int, key: str, value: int) -> bytes | None:
    """:func:`with_header` without decoding the properties: the entry is
    appended to the header table in place (the same bytes as decoding and
    re-encoding give; every field read and written by pamqp's field codecs).
    None when that is not plainly right -- the table may hold ``key``
    already, or the flags continue -- and the caller takes the decoding
    path."""
    if len(raw) < 14:
        return None
    _n, flags = decode.short_uint(raw[12:14])
    if flags & 1:
        return None
    i = 14
    for bit in (_FLAG_CONTENT_TYPE, _FLAG_CONTENT_ENCODING):
        if flags & bit:
            n, _text = decode.short_str(raw[i:])
            i += n
    entry = encode.short_string(key) + encode.table_integer(value)
    head = raw[:4] + encode.long_long_int(size)
    if flags & _FLAG_HEADERS:
        _n, length = decode.long_uint(raw[i : i + 4])
        table = raw[i + 4 : i + 4 + length]
        if key.encode() in table:
            return None
        return head + raw[12:i] + encode.long_uint(length + len(entry)) + table + entry + raw[i + 4 + length :]
    return head + encode.short_uint(flags | _FLAG_HEADERS) + raw[14:i] + encode.long_uint(len(entry)) + entry + raw[i:]
