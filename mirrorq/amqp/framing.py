"""AMQP 0-9-1 framing: the byte stream split into frames, and frames out.

Frames are encoded and decoded with pamqp; :class:`FrameReader` only
splits the byte stream into frames (type, channel, size, payload, 0xCE) to
check sizes before decoding.  A publisher's ``basic.publish`` and
content-header frames repeat byte for byte (same exchange, routing key,
properties and size), so their decoded values are kept per connection by
the frame's bytes (:data:`DECODED_KEPT` frames of at most
:data:`DECODED_MAX_BYTES`, read only) instead of decoded again.  A
publisher whose every header differs (a message id per message) simply
never hits.

Errors (they close the connection): a frame larger than the negotiated
``frame_max`` (during the handshake: at least :data:`FRAME_MIN`) or not
ending in 0xCE is 501 FRAME_ERROR, so is a heartbeat on a channel other
than 0 and an unknown frame type; a payload pamqp cannot decode is 502
SYNTAX_ERROR.

:class:`FrameWriter` collects what goes out: method frames, and content
(method, header, body frames of at most ``frame_max``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pamqp import commands as C
from pamqp import constants as K
from pamqp import frame as F

from mirrorq.amqp.errors import amqp_error

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_MAX = 131072
FRAME_MIN = 4096
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
#: decoded basic.publish / content-header frames kept per connection, by their bytes
DECODED_KEPT = 64
#: ... each of at most this many bytes (so at most 64 KiB of keys per connection)
DECODED_MAX_BYTES = 1024

_unpack_head = struct.Struct(">BHI").unpack_from


class FrameReader:
    """The frames of a connection's byte stream (after the protocol header).

    ``limit``: the largest frame accepted (the connection sets it as the
    handshake goes); ``stopped``: set when the connection closed (what is
    still buffered is not read)."""

    def __init__(self, limit: int, stats: dict[str, int]) -> None:
        self.buf = bytearray()
        self.limit = limit
        self.stopped = False
        self.stats = stats  # the connection's: frames_in
        self.decoded: dict[bytes, Any] = {}  # frame bytes -> value (DECODED_KEPT)

    def read(self, now: float, handle: Callable[[float, int, int, Any], None]) -> None:
        """Hand every whole frame buffered to ``handle(now, type, channel,
        value)`` in order: a body frame's value is its payload, a content
        header's ``(ContentHeader, payload)``, a method frame's the method;
        heartbeats are consumed here."""
        buf = self.buf
        while not self.stopped:
            if len(buf) < 7:
                return
            ftype, channel, size = _unpack_head(buf)
            limit = self.limit
            if size + 8 > limit:
                raise amqp_error(501, f"frame of {size + 8} bytes on channel {channel} exceeds frame_max {limit}")
            if len(buf) < size + 8:
                return
            if buf[7 + size] != K.FRAME_END:
                raise amqp_error(501, f"frame on channel {channel} does not end with 0xCE (got 0x{buf[7 + size]:02x})")
            raw = bytes(buf[: size + 8])
            del buf[: size + 8]
            self.stats["frames_in"] += 1
            if ftype == K.FRAME_HEARTBEAT:
                if channel != 0:
                    raise amqp_error(501, f"heartbeat frame on channel {channel} (must be 0)")
                continue
            if ftype not in (K.FRAME_METHOD, K.FRAME_HEADER, K.FRAME_BODY):
                raise amqp_error(501, f"unknown frame type {ftype} on channel {channel}")
            if ftype == K.FRAME_BODY:
                value: Any = raw[7:-1]
            else:
                value = self.decoded.get(raw)
                if value is None:
                    value = self._decode(ftype, channel, raw)
            handle(now, ftype, channel, value)

    def _decode(self, ftype: int, channel: int, raw: bytes) -> Any:
        """A method or content-header frame's value; a publish's are kept
        by their bytes (nothing downstream changes a decoded value)."""
        value: Any  # the frame, or for a content header (the header, its payload)
        try:
            _, _, value = F.unmarshal(raw)
        except Exception as e:
            raise amqp_error(
                502,
                f"malformed {'method' if ftype == K.FRAME_METHOD else 'content header'} frame "
                f"on channel {channel}: {e}",
            ) from None
        if ftype == K.FRAME_HEADER:
            value = (value, raw[7:-1])
        elif not isinstance(value, C.Basic.Publish):
            return value
        if len(raw) > DECODED_MAX_BYTES:
            return value  # a large table: keeping it would hold the client's bytes
        decoded = self.decoded
        if len(decoded) >= DECODED_KEPT:
            decoded.clear()
        decoded[raw] = value
        return value


class FrameWriter:
    """The frames to write to the client, in order (``out``; the connection
    joins them into one write per turn)."""

    def __init__(self, frame_max: int) -> None:
        self.out: list[bytes] = []
        self.frame_max = frame_max

    def raw(self, data: bytes) -> None:
        self.out.append(data)

    def method(self, channel: int, method: Any) -> None:
        self.out.append(F.marshal(method, channel))

    def content(self, channel: int, method: Any, header_payload: bytes, body: bytes) -> None:
        """A content method, its header (``header_payload`` as encoded) and
        its body in frames of at most ``frame_max``."""
        out = self.out
        out.append(F.marshal(method, channel))
        out.append(F._marshal(K.FRAME_HEADER, channel, header_payload))
        step = self.frame_max - 8
        for i in range(0, len(body), step):
            out.append(F._marshal(K.FRAME_BODY, channel, body[i : i + step]))
