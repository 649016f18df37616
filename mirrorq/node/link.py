"""Link: a direct, authenticated TCP stream between two mirrorq actors that
carries their :class:`~mirrorq.outbox.Bundle` s instead of Thespian's transport.

Why
---
A Thespian message between two processes costs ~0.3 ms of CPU on each side
on this machine (a round trip of two actors ping-ponging through Thespian:
0.33 ms; the same two actors ping-ponging over a socket each watches with
``ThespianWatch``: 0.066 ms).  On the hot path (front end <-> queue masters,
GM frames and sync between queue hosts) that transport is most of a hop.
A link keeps Thespian as the control plane, the way to find a peer and the
fallback, and moves the bundles themselves onto a plain socket.

Protocol
--------
*Frames.*  ``length (4 bytes, big endian) | type (1 byte) | payload``, the
length counting type and payload, at most :data:`MAX_FRAME` bytes: the
largest message one mirrorq process may send another
(:data:`mirrorq.bounds.MAX_WIRE_BYTES`; the outbox keeps bundles to a few
MiB, a bundle of one message to that message's size).

*Finding a peer.*  An actor that sends a bundle through Thespian names its
link port in it (``Bundle.link``).  The receiver, if it has no link to that
actor, connects to the sender's host at that port.  Only the receiver of
traffic connects, so a one-way stream (a GM ring's edge) gets a link too.

*Handshake (mutual).*  The acceptor speaks first: ``GREET`` (a fresh
16-byte nonce and its own name, ``host:port`` of its Thespian address).
The connector answers ``HELLO``: an HMAC-SHA256 under the cluster secret
over that nonce and both names, its own fresh nonce and its name.  The
acceptor checks the MAC and answers ``WELCOME``: its MAC over the
connector's nonce and both names.  The acceptor's side is *up* once it
checked ``HELLO``, the connector's once it checked ``WELCOME``; either may
then send bundles.  Neither side unpickles anything before its peer proved
the secret; a wrong MAC, an unknown frame type, an oversized frame or a
``BUNDLE`` before the handshake closes the link.
Two actors may end up with two links (each connected to the other): each
sends on the one that came up first and accepts bundles from both.

*Bundles and acks.*  ``BUNDLE`` carries one pickled bundle; ``ACK`` carries
the sequence number of the last bundle its sender has read, acknowledging
it and every bundle before it on that link (cumulative).  The sender keeps
each bundle it sent until an ``ACK`` covers it.  The receiver owes an
``ACK`` once it has read a bundle and pays it when it next sends on the
link (the ``ACK`` rides in front of its own bundle, so two actors talking
both ways never wake each other for acks alone), or, when it has nothing to
send, once it owes :data:`ACK_EVERY` bundles or :data:`ACK_BYTES` bytes, or
when the shell's short ack timer fires.  So a bundle costs its receiver one
wakeup and its sender none.

Guarantees (with :mod:`mirrorq.outbox`)
---------------------------------------
* *Order and exactly-once per pair are the outbox's*: the shell reports a
  transmit done as soon as its bytes are in the socket (while the link
  holds fewer than :data:`MAX_UNACKED` bundles and :data:`MAX_UNACKED_BYTES`
  bytes; otherwise once acks make room), so the outbox's next bundle
  follows at once on the same in-order stream.  A link that breaks hands
  every bundle it holds unacknowledged back to the outbox, which sends them
  again, unchanged and in order, before anything newer; the receiver's
  ``Inbox`` drops the ones it had read.
* *No silent loss between live peers*: a link that breaks (EOF, error, a
  protocol violation) or whose oldest unacknowledged bundle waited longer
  than the transmit period is closed and its bundles replayed, through
  Thespian; a new link forms from the next bundle Thespian carries.
* *Nothing unauthenticated is unpickled*, as on Thespian's wire
  (:mod:`mirrorq.node.wire`): only frames that follow a checked ``HELLO``.

Assumes: both ends hold the cluster secret; the transport below is TCP
(in-order, reliable while the connection lives).  Fails: a peer that stops
reading (a paused process, a dropping partition) holds its bundles until
the transmit period ends, as a Thespian transmit did; an ``ACK`` for a
bundle never sent on the link is a protocol violation.

Sans-IO: :class:`Link` turns bytes read into events and events into bytes
to write; no sockets, no clock.  The shell is
:class:`mirrorq.node.posting.PostingActor`.
"""

from __future__ import annotations

import hmac
import pickle
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

from mirrorq.bounds import MAX_WIRE_BYTES

#: frame types
GREET, HELLO, WELCOME, BUNDLE, ACK = 1, 2, 3, 4, 5
_TYPES = (GREET, HELLO, WELCOME, BUNDLE, ACK)
#: a frame longer than this closes the link; a bundle that would need one travels through Thespian
MAX_FRAME = MAX_WIRE_BYTES
NONCE_LEN = 16
MAC_LEN = 32
#: a receiver owing this many bundles (or bytes) acknowledges without waiting to send
#: (half of MAX_UNACKED: the sender never waits for room while acks are on their way)
ACK_EVERY = 32
ACK_BYTES = 1 << 20
#: a sender holding this many unacknowledged bundles (or bytes) waits for acks
#: before it reports its next transmit done
MAX_UNACKED = 64
MAX_UNACKED_BYTES = 16 << 20
_HEAD = struct.Struct("!IB")
_SEQ = struct.Struct("!Q")


class LinkError(Exception):
    """The peer broke the protocol: the link must be closed."""


def frame(kind: int, payload: bytes) -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise LinkError(f"frame of {len(payload)} bytes is over the link's limit of {MAX_FRAME}")
    return _HEAD.pack(len(payload) + 1, kind) + payload


def link_mac(key: bytes, role: bytes, nonce: bytes, connector: str, acceptor: str) -> bytes:
    """The MAC one side proves the secret with (``role``: who proves it)."""
    msg = b"mirrorq-link\0" + role + b"\0" + nonce + connector.encode() + b"\0" + acceptor.encode()
    return hmac.digest(key, msg, "sha256")


def _proved(keys: list[bytes], mac: bytes, role: bytes, nonce: bytes, connector: str, acceptor: str) -> bool:
    return any(hmac.compare_digest(link_mac(k, role, nonce, connector, acceptor), mac) for k in keys)


@dataclass
class Received:
    """What one :meth:`Link.receive` produced."""

    up: bool = False  # the link came up with this data
    bundles: list | None = None  # bundles read, in order
    acked: int = 0  # bundles the peer's acks released from :attr:`Link.unacked`


class Link:
    """One connection's protocol state (either end)."""

    def __init__(self, me: str, keys: list[bytes], *, connector: bool, nonce: bytes) -> None:
        if not keys:
            raise ValueError("a link needs the cluster secret")
        if len(nonce) != NONCE_LEN:
            raise ValueError("a link needs a fresh 16-byte nonce")
        self.me = me
        self.keys = keys
        self.connector = connector
        self.peer: str | None = None
        self.up = False
        self.closed = False
        self._buf = bytearray()
        self.out = bytearray()
        self._nonce = nonce
        #: bundles sent and not yet acknowledged, oldest first: ``(bundle, frame bytes, stamp)``
        self.unacked: deque[tuple[Any, int, float]] = deque()
        self.unacked_bytes = 0
        self._sent_seq = 0  # the highest seq sent on this link
        self._ack_seq: int | None = None  # the last bundle read, while its ACK is owed
        self.owed = 0  # bundles read since the last ACK written
        self.owed_bytes = 0
        if not connector:
            self.out += frame(GREET, nonce + me.encode())

    # ---- sending -------------------------------------------------------------------------
    def send_bundle(self, bundle, stamp: float = 0.0) -> None:
        """Queue ``bundle`` (any ACK owed rides in front of it); it is held
        in :attr:`unacked`, with ``stamp`` (the shell's clock), until acked."""
        if not self.up:
            raise LinkError("bundle on a link that is not up")
        data = frame(BUNDLE, pickle.dumps(bundle, protocol=pickle.HIGHEST_PROTOCOL))
        self.write_ack()
        self.out += data
        self.unacked.append((bundle, len(data), stamp))
        self._sent_seq = max(self._sent_seq, bundle.seq)
        self.unacked_bytes += len(data)

    def write_ack(self) -> bool:
        """Queue the ACK owed, if any (True if one was queued)."""
        if self._ack_seq is None:
            return False
        self.out += frame(ACK, _SEQ.pack(self._ack_seq))
        self._ack_seq = None
        self.owed = self.owed_bytes = 0
        return True

    def ack_due(self) -> bool:
        """The receiver owes enough to acknowledge without waiting to send."""
        return self.owed >= ACK_EVERY or self.owed_bytes >= ACK_BYTES

    def room(self) -> bool:
        """Fewer unacknowledged bundles (and bytes) held than the limits."""
        return len(self.unacked) < MAX_UNACKED and self.unacked_bytes < MAX_UNACKED_BYTES

    def take(self) -> bytes:
        """Bytes to write (the caller writes what it can and hands the rest
        back with :meth:`unsent`)."""
        data = bytes(self.out)
        self.out.clear()
        return data

    def unsent(self, rest: bytes) -> None:
        self.out[:0] = rest

    # ---- receiving ------------------------------------------------------------------------
    def receive(self, data: bytes) -> Received:
        """Feed bytes read; raises :class:`LinkError` on a protocol violation."""
        r = Received()
        self._buf += data
        buf = self._buf
        pos = 0
        try:
            while len(buf) - pos >= _HEAD.size:
                n, kind = _HEAD.unpack_from(buf, pos)
                if n < 1 or n > MAX_FRAME:
                    raise LinkError(f"frame length {n} out of range")
                if kind not in _TYPES:
                    raise LinkError(f"unknown frame type {kind}")
                end = pos + 4 + n
                if len(buf) < end:
                    break
                payload = bytes(buf[pos + _HEAD.size : end])
                pos = end
                self._frame(kind, payload, r)
        finally:
            del buf[:pos]
        return r

    def _frame(self, kind: int, payload: bytes, r: Received) -> None:
        if kind == GREET:
            if not self.connector or self.peer is not None or len(payload) <= NONCE_LEN:
                raise LinkError("unexpected GREET")
            nonce, acceptor = payload[:NONCE_LEN], payload[NONCE_LEN:].decode()
            self.peer = acceptor
            mac = link_mac(self.keys[-1], b"connector", nonce, self.me, acceptor)
            self.out += frame(HELLO, mac + self._nonce + self.me.encode())
        elif kind == HELLO:
            if self.connector or self.peer is not None or len(payload) <= MAC_LEN + NONCE_LEN:
                raise LinkError("unexpected HELLO")
            mac, nonce = payload[:MAC_LEN], payload[MAC_LEN : MAC_LEN + NONCE_LEN]
            connector = payload[MAC_LEN + NONCE_LEN :].decode()
            if not _proved(self.keys, mac, b"connector", self._nonce, connector, self.me):
                raise LinkError(f"HELLO from {connector!r} without the cluster secret's MAC")
            self.peer = connector
            self.out += frame(WELCOME, link_mac(self.keys[-1], b"acceptor", nonce, connector, self.me))
            self.up = r.up = True
        elif kind == WELCOME:
            if not self.connector or self.peer is None or self.up:
                raise LinkError("unexpected WELCOME")
            if not _proved(self.keys, payload, b"acceptor", self._nonce, self.me, self.peer):
                raise LinkError(f"WELCOME from {self.peer!r} without the cluster secret's MAC")
            self.up = r.up = True
        elif not self.up:
            raise LinkError("data before the handshake")
        elif kind == BUNDLE:
            b = pickle.loads(payload)
            if r.bundles is None:
                r.bundles = []
            r.bundles.append(b)
            self._ack_seq = b.seq
            self.owed += 1
            self.owed_bytes += len(payload)
        else:  # ACK
            if len(payload) != _SEQ.size:
                raise LinkError("malformed ACK")
            seq = _SEQ.unpack(payload)[0]
            if seq > self._sent_seq:
                raise LinkError(f"ACK for bundle {seq}, never sent on this link")
            while self.unacked and self.unacked[0][0].seq <= seq:
                _b, n, _t = self.unacked.popleft()
                self.unacked_bytes -= n
                r.acked += 1
