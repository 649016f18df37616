"""Outbox: ordered, coalescing, flow-controlled sends between a node's actors.

Every hot-path message between mirrorq's actors (AMQP front end <-> queue
masters, GM frames between replicas, sync batches, registry traffic) goes
through an :class:`Outbox`.  It exists because of what Thespian does to
plain ``Actor.send`` under load (measured on this machine, 2 cores):

* every ``send`` is its own transmit; sends queued faster than the transport
  drains pile up, past ~950 queued the actor enters "tx-only mode" (it stops
  reading), and past ~1050 further sends are *dropped* (``SendStatus.Failed``,
  which nobody hears of);
* two sends to one target may overtake each other when one meets
  backpressure;
* many concurrent transmits to one target are several times slower than
  one transmit in flight per target, the next started from the previous
  one's completion.

Protocol
--------
*Coalescing.*  ``post(dst, msg)`` only queues.  A destination has at most
ONE :class:`Bundle` in flight; everything posted to it meanwhile waits and
leaves in post order as soon as the one in flight completes, as ONE bundle
of up to :data:`MAX_BUNDLE` messages and :data:`MAX_BUNDLE_BYTES` bytes
(the messages' estimated sizes, :func:`mirrorq.bounds.size_of`; a message
bigger than that leaves alone); the rest waits for the next one.  So a busy
link carries big bundles and an idle link sends at once: nothing ever waits
on a timer when nothing else is queued, and no bundle outgrows its
transport (:mod:`mirrorq.bounds`).  The shell transmits at the end of each turn
(``take``) and from the transport's completion callback (``sent``).

*Order and exactly-once.*  Bundles to one destination carry sequence
numbers 1, 2, 3... under the sender's ``origin`` (its address and a random
incarnation nonce).  With one in flight, they leave in order.  A bundle
whose transmit failed is sent again *unchanged* (same seq, same messages:
new posts wait for the next seq), and the receiver's :class:`Inbox` drops a
bundle whose seq it has already accepted from that origin.  So the
receiving actor sees each origin's messages once each, in post order, while
both live.

*Destinations in order of need.*  The bundles that leave together (one
``take``) go in the order their destinations' first waiting messages were
posted: an actor that answers a client and tells a peer in one turn sends
the answer first if it posted it first (the last mirror's confirms to a
front end before its GM frame back to the master).

*Bounded transport queue.*  An actor thus never has more transmits queued
than it has destinations, so Thespian's tx-only mode and its drops cannot be
reached by traffic volume.

*Replays.*  A transport may report a transmit done before the receiver has
it (a direct link does once the bytes are in the socket, so the next bundle
need not wait for the receiver's ``ACK``) and keep the bundle until the
receiver acknowledges it.  If that transport breaks first, it hands the
unacknowledged bundles back (``replay``): they are sent again unchanged,
in sequence order, before any bundle not yet sent, one in flight at a
time as always.  The receiver may already hold some of them (it drops
those, by seq) and still holds every bundle before them (they were
acknowledged), so what it accepts stays each message once, in post order.

*Failures.*  A failed transmit (the transport gave up, or the target is
dead) is retried after :data:`RETRY_DELAYS` (seconds, growing).  A target
that Thespian reports dead :data:`DEAD_ATTEMPTS` times in a row, or that
failed for :data:`GIVE_UP` seconds, is given up: its pending messages are
dropped and counted (``dropped``), the way a send to a dead actor was
always dropped; the protocols above this one (GM catch-up, publishers
resending to a new master) recover from a peer's death, not from silent
loss between live peers, which this layer removes.

Assumes: the transport reports every transmit's outcome exactly once
(Thespian's ``TransmitIntent`` callbacks do), or, for a transport that
reports a transmit done before the receiver acknowledged it (a direct link,
:mod:`mirrorq.node.link`), hands back every bundle the receiver has not
acknowledged when it breaks, in order; a transport reports a transmit done
only after every bundle before it to that destination was received or is
still held for replay; messages are picklable.
Sans-IO: no clock (``now`` is passed in), no Thespian here; the Thespian
glue is :class:`mirrorq.node.posting.PostingActor`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from mirrorq.bounds import MAX_BATCH_BYTES, size_of

#: messages per bundle at most (the rest leaves in the next one)
MAX_BUNDLE = 4000
#: estimated bytes per bundle at most, unless its one message is bigger
MAX_BUNDLE_BYTES = MAX_BATCH_BYTES
#: seconds before the 1st, 2nd, ... retry of a failed transmit (the last repeats)
RETRY_DELAYS = (0.02, 0.1, 0.3, 1.0, 2.0)
#: consecutive "dead target" reports after which a destination is given up
DEAD_ATTEMPTS = 3
#: seconds of failing transmits after which a destination is given up
GIVE_UP = 60.0


@dataclass(frozen=True, slots=True)
class Bundle:
    """Messages from one sender to one destination, in post order."""

    origin: str
    seq: int
    msgs: tuple[Any, ...]
    #: the sender's link port (:mod:`mirrorq.node.link`) when it travels
    #: through Thespian and the sender takes links; 0 otherwise
    link: int = 0

    def __repr__(self) -> str:
        # cheap: Thespian formats every message it transmits (TransmitIntent.identify),
        # and the dataclass repr of a bundle of deliveries costs more than sending it
        return f"Bundle({self.origin}#{self.seq}, {len(self.msgs)} messages)"


@dataclass(slots=True)
class _Link:
    pending: deque[Any] = field(default_factory=deque)
    #: the estimated size of each pending message, and their sum
    sizes: deque[int] = field(default_factory=deque)
    pending_bytes: int = 0
    inflight: Bundle | None = None
    next_seq: int = 1
    failures: int = 0
    dead_reports: int = 0
    failing_since: float | None = None
    retry_at: float | None = None
    #: bundles handed back by a broken transport, in seq order: they go before any new one
    replay: deque[Bundle] = field(default_factory=deque)


class Outbox:
    """The sender's half: one per actor."""

    def __init__(self, origin: str) -> None:
        if not isinstance(origin, str) or not origin:
            raise ValueError(f"outbox origin must be a non-empty string, got {origin!r}")
        self.origin = origin
        self.links: dict[str, _Link] = {}
        self.stats = {"posted": 0, "bundles": 0, "retries": 0, "replayed": 0, "dropped": 0, "given_up": 0}

    def post(self, dst: str, msg: Any) -> None:
        link = self.links.get(dst)
        if link is None:
            link = self.links[dst] = _Link()
        elif not link.pending and link.inflight is None and not link.replay:
            # idle until now: it goes after the destinations that have waited longer (take's order)
            self.links[dst] = self.links.pop(dst)
        n = size_of(msg)
        link.pending.append(msg)
        link.sizes.append(n)
        link.pending_bytes += n
        self.stats["posted"] += 1

    def take(self, now: float, only: Container[str] | None = None) -> list[tuple[str, Bundle]]:
        """Bundles to transmit now: one per destination with messages waiting,
        nothing in flight and no retry pending (of the destinations in
        ``only``, if given)."""
        out = []
        for dst, link in self.links.items():
            if only is not None and dst not in only:
                continue
            if link.inflight is None and (link.replay or link.pending) and link.retry_at is None:
                out.append((dst, self._next(link)))
        return out

    def _next(self, link: _Link) -> Bundle:
        if link.replay:
            link.inflight = link.replay.popleft()
            self.stats["replayed"] += 1
            return link.inflight
        pending, sizes = link.pending, link.sizes
        msgs = [pending.popleft()]
        total = sizes.popleft()
        while pending and len(msgs) < MAX_BUNDLE and total + sizes[0] <= MAX_BUNDLE_BYTES:
            msgs.append(pending.popleft())
            total += sizes.popleft()
        link.pending_bytes -= total
        b = Bundle(self.origin, link.next_seq, tuple(msgs))
        link.next_seq += 1
        link.inflight = b
        self.stats["bundles"] += 1
        return b

    def sent(self, dst: str, seq: int, now: float, start_next: bool = True) -> list[tuple[str, Bundle]]:
        """The transport delivered bundle ``seq`` to ``dst``; returns the next
        bundle for ``dst`` if messages wait (and ``start_next``; otherwise the
        next :meth:`take` returns it)."""
        link = self.links.get(dst)
        if link is None or link.inflight is None or link.inflight.seq != seq:
            return []
        link.inflight = None
        link.failures = link.dead_reports = 0
        link.failing_since = link.retry_at = None
        if (link.replay or link.pending) and start_next:
            return [(dst, self._next(link))]
        return []

    def replay(self, dst: str, bundles: list[Bundle]) -> None:
        """The transport to ``dst`` broke holding ``bundles`` (in seq order):
        reported sent (or the one in flight) but not acknowledged by the
        receiver.  They leave again, unchanged and in order, before anything
        new (through :meth:`take` or the next :meth:`sent`)."""
        link = self.links.get(dst)
        if link is None or not bundles:
            return
        if link.inflight is not None and any(b.seq == link.inflight.seq for b in bundles):
            link.inflight = None  # the one in flight went on the broken transport
        held = {b.seq: b for b in link.replay}
        for b in bundles:
            held.setdefault(b.seq, b)
        link.replay = deque(held[k] for k in sorted(held))

    def failed(self, dst: str, seq: int, now: float, dead: bool) -> float | None:
        """Transmit of bundle ``seq`` to ``dst`` failed (``dead``: the transport
        says the target is gone).  Returns the delay after which the shell
        should call :meth:`due`, or None when the destination was given up
        (its messages dropped and counted)."""
        link = self.links.get(dst)
        if link is None or link.inflight is None or link.inflight.seq != seq:
            return None
        link.failures += 1
        link.dead_reports = link.dead_reports + 1 if dead else 0
        if link.failing_since is None:
            link.failing_since = now
        if link.dead_reports >= DEAD_ATTEMPTS or now - link.failing_since >= GIVE_UP:
            lost = len(link.inflight.msgs) + len(link.pending) + sum(len(b.msgs) for b in link.replay)
            self.stats["dropped"] += lost
            self.stats["given_up"] += 1
            link.pending.clear()
            link.sizes.clear()
            link.pending_bytes = 0
            link.replay.clear()
            link.inflight = None
            link.failures = link.dead_reports = 0
            link.failing_since = link.retry_at = None
            return None
        delay = RETRY_DELAYS[min(link.failures, len(RETRY_DELAYS)) - 1]
        link.retry_at = now + delay
        return delay

    def due(self, now: float) -> list[tuple[str, Bundle]]:
        """Bundles whose retry time has come (sent again unchanged)."""
        out = []
        for dst, link in self.links.items():
            if link.retry_at is not None and link.retry_at <= now and link.inflight is not None:
                link.retry_at = None
                self.stats["retries"] += 1
                out.append((dst, link.inflight))
        return out

    def next_retry(self) -> float | None:
        """The earliest pending retry time, if any."""
        ts = [lk.retry_at for lk in self.links.values() if lk.retry_at is not None]
        return min(ts) if ts else None

    def pending_bytes(self, dst: str) -> int:
        """The estimated bytes waiting for ``dst`` (not in flight)."""
        link = self.links.get(dst)
        return 0 if link is None else link.pending_bytes

    def busy(self) -> int:
        """Destinations with a bundle in flight."""
        return sum(1 for lk in self.links.values() if lk.inflight is not None)

    def forget(self, dst: str) -> int:
        """Drop what waits for ``dst`` (a peer known dead); returns how many."""
        link = self.links.pop(dst, None)
        if link is None:
            return 0
        n = len(link.pending) + (len(link.inflight.msgs) if link.inflight is not None else 0)
        n += sum(len(b.msgs) for b in link.replay)
        self.stats["dropped"] += n
        return n


class Inbox:
    """The receiver's half: drops bundles it has already accepted."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.stats = {"bundles": 0, "duplicates": 0}

    def accept(self, b: Bundle) -> bool:
        """True if ``b`` is new (its messages must be handled), False for a
        retransmission of a bundle already accepted."""
        if b.seq <= self.last.get(b.origin, 0):
            self.stats["duplicates"] += 1
            return False
        self.last[b.origin] = b.seq
        self.stats["bundles"] += 1
        return True
