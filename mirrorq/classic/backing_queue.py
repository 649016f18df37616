"""The backing queue: a queue replica's messages, kept as a log of operations.

Every change to a queue is an *operation record* appended to the replica's
:class:`~mirrorq.store.segment_log.SegmentLog`; the in-memory index
(which messages are ready, in which order, which are delivered and awaiting
an ack) is only ever derived from those records.  The master runs the public
methods (``publish``, ``fetch``, ``ack``...), each of which validates, appends
one record and applies it; a mirror receives the same records and calls
:meth:`BackingQueue.apply` with the master's offsets, so master and mirrors
hold identical logs and identical state.  Sync and the Spark source read the
log by offset (``bq.log.read_from``).

Operations (record type = :class:`Op`, body = msgpack list)
-----------------------------------------------------------
``PUBLISH   [msg_id, body, properties, persistent]``  a new ready message; its
            log offset is its identity from then on.  In a queue with
            ``max_priority`` (x-max-priority), ``properties["_pr"]`` is its
            priority: ready messages go out highest priority first, each
            priority in the order below.
``DELIVER   [[offsets], ack_required]``  ready messages handed to a consumer:
            they become unacked (``ack_required``) or are gone (no-ack fetch).
``ACK       [[offsets]]``   unacked messages are gone (a deletion mark: the
            store's equivalent of CMQ's ack bitmap).
``REQUEUE   [[offsets]]``   unacked messages are ready again, back at their
            original position (FIFO order is publish-offset order), and flagged
            redelivered.
``PURGE     []``            every ready message at that point is gone; unacked
            ones stay (AMQP ``queue.purge``).
``DROP_TRANSIENT []``       every non-persistent message is gone (what the
            owner writes when a durable queue comes back after a full restart).
``DEAD_LETTER [[offsets], reason]``  unacked messages are being dead-lettered
            (rejected, expired, maxlen): no longer ready nor unacked by
            anyone, kept until an ACK says their dead-letter exchange has
            them.  A requeue of every unacked message (promotion, restart)
            leaves them alone; the new master dead-letters them again.  Each
            has a *dead-letter sequence number*: the DEAD_LETTER record's
            offset << 16 | its index in the record, the same on every
            replica and increasing in the order messages were dead-lettered.
``REFUSED   [publisher, [[lo, hi], ...]]``  the publisher seqs the master has
            refused (nacked without storing them) for that publisher, as
            sorted disjoint runs: the publisher's whole entry after the
            change, which replaces the one before (``[]`` forgets the
            publisher).  At most :data:`MAX_REFUSED_RUNS` runs: when a
            refusal would make more, the lowest runs are forgotten.  A
            publisher is a channel id ``[dst, number]``.  Names no message.
``EPOCH     [member]``  the replica ``member`` is master from this offset on
            (the first record a master writes).  Every replica keeps the
            epochs its log holds, newest :data:`MAX_EPOCHS`, as
            ``epochs``: two replicas whose logs hold the same epoch record
            at the same offset agree on every record below the next epoch
            either holds (one master wrote that stretch), which is how sync
            finds where a deposed master's log parted from the queue's
            (:mod:`.sync`).  Names no message.

Guarantees
----------
* After ``flush()`` returns, everything done before it survives a crash
  (durable queues, ``fsync=True``).  ``flush`` is the group commit: call it
  once per batch of operations (per actor message), not per operation.
* Reopening replays the log and yields *exactly* the state that was flushed:
  ready messages in FIFO order with the redelivered flag, unacked messages
  still unacked.  Replay is the same code as ``apply``, so a mirror and a
  restarted replica cannot disagree.  What happens to unacked messages after
  a restart is the owner's decision, written as an operation:
  :meth:`requeue_unacked` (and :meth:`drop_transient` for transient messages
  of a durable queue after a full cluster restart).
* Compaction deletes a segment when every message published in it is gone
  *and* it holds no operation about a message of a segment that is kept
  (otherwise deleting it would bring that message back on replay).  A
  publisher's current ``REFUSED`` record counts as live in its segment, and
  a ``REFUSED`` record refers to the segment of the one it replaced, so the
  refusals a reopened store (or a mirror synced from ``first_offset``)
  derives are exactly those of the replica that wrote them.  The
  active segment is never deleted, so offsets stay monotonic across
  compaction and restarts; ``log.first_offset`` is the lowest offset kept.
  Segments holding offsets at or above ``retain_from`` are kept too (a sync
  transfer still has to read them: the master sets it).
* Sync installs another replica's records with :meth:`replay_raw`: the
  encoded bytes are checked, applied with one decode each and appended
  verbatim (no re-encoding), with the same leniency as :meth:`replay`.
* A non-durable queue (``durable=False``) keeps the same log, in memory
  without a directory, or in a directory the owner wipes before opening
  (``fsync=False``: its bodies are paged out to the OS, never made durable,
  never recovered).  In a durable queue a
  transient message is logged like any other (mirrors and sync need its
  offset); it disappears when the owner writes ``drop_transient``.
* Performance (this machine, 2 cores, fsync on): 1000 publishes of 1 KiB and
  one flush take ~7 ms; the raw log appends and fsyncs them in ~3 ms.

Assumptions
-----------
* One owner drives the queue (one actor); not thread-safe.
* Operations given to :meth:`apply` come from a master in master order; an
  op that is invalid in the current state (ack of a message that is not
  unacked, publish of a live msg_id...) is refused with an exception and
  nothing is written: a mirror that gets one has diverged.

Failure
-------
Bad arguments raise :class:`InvalidOperation` (a ``ValueError``),
:class:`UnknownMessage` (a ``KeyError``) or ``TypeError`` naming what was
wrong; the log and state are untouched.  Disk corruption surfaces as
:class:`~mirrorq.store.segment_log.CorruptRecord` when opening or when
reading a message body.
"""

from __future__ import annotations

import bisect
import heapq
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeGuard

import msgpack

from mirrorq.fsapi import OS, FileSystem
from mirrorq.store.segment_log import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_SEGMENT_BYTES,
    HEADER_SIZE,
    Record,
    SegmentLog,
    StoreError,
)

__all__ = [
    "MAX_REFUSED_RUNS",
    "BackingQueue",
    "DuplicateMessage",
    "InvalidOperation",
    "Message",
    "Op",
    "UnknownMessage",
]


class Op(IntEnum):
    PUBLISH = 1
    DELIVER = 2
    ACK = 3
    REQUEUE = 4
    PURGE = 5
    DROP_TRANSIENT = 6
    DEAD_LETTER = 7
    REFUSED = 8
    EPOCH = 9


_OP_BY_CODE = {int(o): o for o in Op}
#: records a later fsync may cover (flush_turn): losing them to a machine crash only redelivers
_NO_SYNC_OPS = frozenset((Op.DELIVER, Op.ACK, Op.REQUEUE))
_OP_TYPES = (int, Op)
_ARITY = {
    Op.PUBLISH: 4,
    Op.DELIVER: 2,
    Op.ACK: 1,
    Op.REQUEUE: 1,
    Op.PURGE: 0,
    Op.DROP_TRANSIENT: 0,
    Op.DEAD_LETTER: 2,
    Op.REFUSED: 2,
    Op.EPOCH: 1,
}
#: messages in one DEAD_LETTER record at most (their sequence numbers are offset << 16 | index)
MAX_DEAD_LETTER_BATCH = 1 << 16
#: runs of refused seqs a publisher's REFUSED entry keeps at most (the lowest go first)
MAX_REFUSED_RUNS = 64
#: master epochs a replica remembers (the newest): enough to find where two
#: replicas' logs part after any likely run of failovers
MAX_EPOCHS = 64


class InvalidOperation(StoreError, ValueError):
    """An operation that is malformed or not valid in the queue's current state."""


class UnknownMessage(StoreError, KeyError):
    """A message reference (offset or msg_id) that names no live message."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateMessage(InvalidOperation):
    """A publish whose msg_id is already live in the queue."""


@dataclass(frozen=True, slots=True)
class Message:
    offset: int
    msg_id: str | bytes
    body: bytes
    properties: dict[str, Any]
    persistent: bool
    redelivered: bool


_READY = 0
_UNACKED = 1
_DEAD = 2  # being dead-lettered (DEAD_LETTER): gone once ACKed
_STATE_NAMES = {_READY: "ready", _UNACKED: "unacked", _DEAD: "being dead-lettered"}


class _Entry:
    __slots__ = ("msg_id", "persistent", "delivered", "state", "token", "segment", "level", "dead")

    def __init__(self, msg_id: str | bytes, persistent: bool, segment: int, level: int = 0) -> None:
        self.msg_id = msg_id
        self.persistent = persistent
        self.delivered = False
        self.state = _READY
        self.token = 0  # which ready-queue entry is current (0: the publish-order one)
        self.segment = segment
        self.level = level  # its priority level (0 unless the queue has x-max-priority)
        self.dead: tuple[int, str] | None = None  # (dead-letter seq, reason) once DEAD_LETTER named it

    def dead_mark(self) -> tuple[int, str]:
        """``(dead-letter seq, reason)`` of a message being dead-lettered."""
        if self.dead is None:
            raise StoreError(f"message {self.msg_id!r} is not being dead-lettered")
        return self.dead


#: the PUBLISH property holding a message's priority (the AMQP ``priority``)
PRIORITY_KEY = "_pr"


def priority_level(properties: dict[str, Any], max_priority: int) -> int:
    """A message's priority level in a queue with ``max_priority`` levels
    above 0: its ``priority`` clamped to ``[0, max_priority]`` (RabbitMQ:
    a message without one, or with a bad one, has priority 0; one above the
    queue's maximum counts as the maximum)."""
    if not max_priority:
        return 0
    p = properties.get(PRIORITY_KEY)
    if not isinstance(p, int) or isinstance(p, bool) or p <= 0:
        return 0
    return min(p, max_priority)


def _unpack(data: memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


#: a publisher (channel id) as a hashable key: ``(dst, number)``
PublisherKey = tuple[str | bytes | int, str | bytes | int]


def _publisher_key(value: Any, error: type[Exception] = ValueError) -> PublisherKey:
    """A publisher (channel id) as a hashable key: msgpack turns tuples into lists."""
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (str, bytes, int)) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[1])
    raise error(f"a publisher is a [dst, number] pair, got {value!r}")


def _valid_runs(runs: Any) -> list[list[int]]:
    """REFUSED runs: at most MAX_REFUSED_RUNS sorted, disjoint, non-adjacent [lo, hi], 1 <= lo <= hi."""
    if not isinstance(runs, (list, tuple)) or len(runs) > MAX_REFUSED_RUNS:
        raise InvalidOperation(f"REFUSED runs must be a list of at most {MAX_REFUSED_RUNS} [lo, hi], got {runs!r}")
    out: list[list[int]] = []
    for r in runs:
        if not (
            isinstance(r, (list, tuple))
            and len(r) == 2
            and _is_offset(r[0])
            and _is_offset(r[1])
            and 1 <= r[0] <= r[1]
            and (not out or r[0] > out[-1][1] + 1)
        ):
            raise InvalidOperation(f"REFUSED runs must be sorted disjoint [lo, hi] with 1 <= lo <= hi, got {runs!r}")
        out.append([r[0], r[1]])
    return out


def _is_offset(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


#: a PUBLISH record's body as the body cache keeps it: (msg_id, body, properties, persistent)
CachedRecord = tuple[str | bytes, bytes, dict[str, Any], bool]


class CachedBodies(dict[int, tuple[CachedRecord, int]]):
    """One queue's entries in a :class:`BodyCache`: offset -> (record, size),
    in publish order; ``bytes`` is their total size."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0


class BodyCache:
    """The bodies of messages a master published, in memory, so a delivery
    does not read the message back from the log.  One budget of
    ``max_bytes`` for every queue of a process.  An entry goes when its
    message is gone (acked, purged...) or its queue is closed.

    Over budget, the *newest* entries of the queue holding the most go (the
    new entry itself, when its queue holds the most): every queue keeps its
    head, which its consumers take next, as RabbitMQ's classic queues keep
    a queue's head in memory and page out the rest.  A backlog larger than
    the budget is then read back from the log when its consumers reach it
    (:meth:`SegmentLog.read_many`, a read per batch), while the head stays a
    hit; evicting the oldest instead would miss on every delivery as soon as
    a backlog outgrows the budget.  An eviction frees :attr:`slack` bytes
    more than the put needs, so finding the biggest queue (a scan of the
    queues with entries) is paid once per ``slack`` bytes published, not
    per message."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.slack = max_bytes // 64
        self.bytes = 0
        self.entries = 0
        self._owners: dict[int, CachedBodies] = {}  # id -> a queue's entries (non-empty ones)

    def put(self, owner: CachedBodies, offset: int, record: CachedRecord, size: int) -> None:
        if size > self.max_bytes // 16:
            return  # a huge message is read from the log when delivered
        if self.bytes + size > self.max_bytes and not self._make_room(owner, size):
            return  # the newest entry of the queue holding the most: not cached
        owner[offset] = (record, size)
        owner.bytes += size
        self.bytes += size
        self.entries += 1
        self._owners[id(owner)] = owner

    def _make_room(self, owner: CachedBodies, size: int) -> bool:
        goal = self.max_bytes - size - self.slack
        while self.bytes > goal:
            victim = max(self._owners.values(), key=lambda o: o.bytes, default=None)
            if victim is None or victim is owner or victim.bytes <= owner.bytes:
                return self.bytes + size <= self.max_bytes
            while victim and self.bytes > goal:
                _, (_, sz) = victim.popitem()  # its newest
                victim.bytes -= sz
                self.bytes -= sz
                self.entries -= 1
            if not victim:
                del self._owners[id(victim)]
        return True

    def drop(self, owner: CachedBodies, offset: int) -> None:
        v = owner.pop(offset, None)
        if v is not None:
            owner.bytes -= v[1]
            self.bytes -= v[1]
            self.entries -= 1
            if not owner:
                self._owners.pop(id(owner), None)

    def release(self, owner: CachedBodies) -> None:
        self.bytes -= owner.bytes
        self.entries -= len(owner)
        owner.clear()
        owner.bytes = 0
        self._owners.pop(id(owner), None)


#: the process's body cache (queue hosts run many queues: one budget for all)
BODY_CACHE = BodyCache(64 << 20)


class BackingQueue:
    """A queue replica's durable store and index.

    ``BackingQueue(directory, durable=True, segment_bytes=16 MiB, fsync=True)``
    opens the store in ``directory`` (creating it if needed) and recovers the
    index from the log.  ``durable=False`` keeps the log in memory when
    ``directory`` is None, else in ``directory`` (a non-durable queue's:
    see the module docstring).

    Mutations are buffered: call :meth:`flush` to make them durable (one fsync
    for everything since the last flush).

    ``fs``: the file system the log's files are on (:mod:`mirrorq.fsapi`;
    the simulator's :class:`mirrorq.simdisk.SimDisk`), the real one by default.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        durable: bool = True,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: bool = True,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        auto_compact: bool = True,
        on_append: Callable[[int, int, list[Any]], None] | None = None,
        max_priority: int = 0,
        body_cache: BodyCache | None = None,
        fs: FileSystem = OS,
    ) -> None:
        if durable and directory is None:
            raise ValueError("a durable BackingQueue needs a directory")
        if not isinstance(max_priority, int) or isinstance(max_priority, bool) or not 0 <= max_priority <= 255:
            raise ValueError(f"max_priority must be an int in [0, 255], got {max_priority!r}")
        #: priority levels above 0 (x-max-priority): ready messages go out
        #: highest level first, each level in FIFO order
        self.max_priority = max_priority
        self.durable = bool(durable)
        self._auto_compact = auto_compact
        #: called as ``on_append(offset, rtype, body)`` after every operation
        #: this replica appends (not for records recovered on open): a
        #: master's mirror layer collects them to broadcast to its mirrors.
        self.on_append = on_append
        #: bodies of messages published here (not applied: a mirror delivers
        #: nothing), while the process's budget allows (see BodyCache)
        self._bodies: BodyCache = BODY_CACHE if body_cache is None else body_cache
        self._cached = CachedBodies()
        self._msgs: dict[int, _Entry] = {}
        self._by_id: dict[str | bytes, int] = {}
        # per priority level: ready in publish order (entries may be stale), and
        # a heap of (offset, token) requeued (may be stale)
        self._fifos: list[deque[int]] = [deque() for _ in range(max_priority + 1)]
        self._returneds: list[list[tuple[int, int]]] = [[] for _ in range(max_priority + 1)]
        self._token = 0
        self._ready = 0
        self._unacked = 0
        self._dead: dict[int, int] = {}  # dead-letter seq -> offset of the messages being dead-lettered
        # publisher -> (refused seqs as sorted disjoint [lo, hi] runs, segment of its REFUSED record)
        self._refused: dict[PublisherKey, tuple[list[list[int]], int]] = {}
        #: (offset, member) of the EPOCH records in the log, ascending (MAX_EPOCHS)
        self.epochs: list[tuple[int, str]] = []
        self._live: dict[int, int] = {}  # segment base -> live messages published in it
        self._refs: dict[int, set[int]] = {}  # segment base -> other segments its records touch
        self._compact_hint = False
        self._rolls_seen = 0
        self._must_sync = False  # a record since the last fsync carries a promise (see flush_turn)
        #: compaction keeps every segment holding offsets >= this (None: no
        #: limit): a sync transfer still reading from there sets it
        self.retain_from: int | None = None
        self._log = SegmentLog(
            directory,
            segment_bytes=segment_bytes,
            fsync=fsync,
            max_pending_bytes=max_pending_bytes,
            on_record=self._replay,
            fs=fs,
        )
        self._rolls_seen = self._log.rolls

    # -------------------------------------------------------------- queries

    @property
    def log(self) -> SegmentLog:
        """The underlying log (``read_from``, ``next_offset``, ``first_offset``...)."""
        return self._log

    @property
    def message_count(self) -> int:
        """Live messages: ready + unacked."""
        return self._ready + self._unacked

    @property
    def ready_count(self) -> int:
        return self._ready

    @property
    def unacked_count(self) -> int:
        return self._unacked

    @property
    def dead_letter_count(self) -> int:
        """Messages being dead-lettered (not counted in ``message_count``)."""
        return len(self._dead)

    def dead_lettering(self) -> list[tuple[int, int, str]]:
        """``(seq, offset, reason)`` of every message being dead-lettered, in
        dead-letter sequence order."""
        return [(seq, o, self._msgs[o].dead_mark()[1]) for seq, o in sorted(self._dead.items())]

    def dead_letter_offsets(self, seqs: Iterable[int]) -> list[int]:
        """The offsets of the messages being dead-lettered with these sequence numbers (others ignored)."""
        return [self._dead[s] for s in seqs if s in self._dead]

    def was_refused(self, publisher: Any, seq: int) -> bool:
        """Whether ``seq`` of ``publisher`` is in its REFUSED entry."""
        entry = self._refused.get(_publisher_key(publisher))
        if entry is None:
            return False
        runs = entry[0]
        i = bisect.bisect_right(runs, seq, key=lambda r: r[0]) - 1  # the last run starting at or below seq
        return i >= 0 and seq <= runs[i][1]

    def refused_runs(self, publisher: Any) -> list[list[int]]:
        """The publisher's refused seqs as ``[lo, hi]`` runs (``[]``: none)."""
        entry = self._refused.get(_publisher_key(publisher))
        return [list(r) for r in entry[0]] if entry is not None else []

    def refused_publishers(self) -> list[PublisherKey]:
        """Publishers with a REFUSED entry."""
        return list(self._refused)

    def refuse(self, publisher: Any, seqs: Iterable[int]) -> int | None:
        """Record that the master refused these seqs of ``publisher``: one
        REFUSED record with the publisher's new entry (the lowest runs
        forgotten beyond :data:`MAX_REFUSED_RUNS`); returns its offset, or
        None when every seq was in the entry already (nothing written)."""
        key = _publisher_key(publisher)
        runs = self.refused_runs(key)
        new = [s for s in seqs if not any(lo <= s <= hi for lo, hi in runs)]
        for s in new:
            if not _is_offset(s) or s < 1:
                raise InvalidOperation(f"REFUSED: a publisher seq is an int >= 1, got {s!r}")
        if not new:
            return None
        merged: list[list[int]] = []
        for lo, hi in sorted(runs + [[s, s] for s in new]):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return self._submit(Op.REFUSED, [list(key), merged[-MAX_REFUSED_RUNS:]])

    def forget_refused(self, publisher: Any) -> int | None:
        """Forget the publisher's REFUSED entry (its channel is gone): one
        REFUSED record with ``[]``; None when it had none."""
        key = _publisher_key(publisher)
        if key not in self._refused:
            return None
        return self._submit(Op.REFUSED, [list(key), []])

    def __len__(self) -> int:
        """Ready messages, like RabbitMQ's ``backing_queue:len/1``."""
        return self._ready

    def is_empty(self) -> bool:
        return self._ready == 0

    def unacked_offsets(self) -> list[int]:
        return sorted(o for o, e in self._msgs.items() if e.state == _UNACKED)

    def ready_offsets(self) -> list[int]:
        """All ready offsets in delivery (FIFO) order."""
        return self._head(self._ready)

    def holds(self, msg_id: str | bytes) -> bool:
        """A live message has this msg_id."""
        return msg_id in self._by_id

    def offset_of(self, msg_id: str | bytes) -> int:
        try:
            return self._by_id[msg_id]
        except (KeyError, TypeError):
            raise UnknownMessage(f"no live message with msg_id {msg_id!r}") from None

    def peek(self, n: int = 1) -> list[Message]:
        """The next ``n`` ready messages in FIFO order, without delivering them."""
        return self._messages(self.head(n))

    def head(self, n: int = 1) -> list[int]:
        """The offsets of the next ``n`` ready messages in FIFO order (no body is read)."""
        self._check_count(n)
        return self._head(n)

    def get(self, ref: int | str | bytes) -> Message:
        """A live message by offset or msg_id."""
        return self._message(self._resolve(ref))

    # ------------------------------------------- range reads (the Spark source)

    def live_in_range(self, start: int, end: int, limit: int | None = None) -> list[int]:
        """Offsets of live messages (ready or unacked) in ``[start, end)``, in
        offset order, at most ``limit`` of them.  Reads no body; the cost is
        the live messages below ``end`` (the index keeps publish order)."""
        out: list[int] = []
        if limit is not None and limit <= 0:
            return out
        for o in self._msgs:  # insertion order is publish (= offset) order
            if o >= end:
                break
            if o >= start:
                out.append(o)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def read_range(self, offsets: Iterable[int]) -> list[Message]:
        """The live messages at ``offsets`` (from :meth:`live_in_range`),
        read from the log WITHOUT delivering them: nothing is written."""
        return [self._message(o) for o in offsets]

    def is_dead_lettering(self, offset: int) -> bool:
        e = self._msgs.get(offset)
        return e is not None and e.state == _DEAD

    def is_unacked(self, offset: int) -> bool:
        e = self._msgs.get(offset)
        return e is not None and e.state == _UNACKED

    def remove_ready(self, offsets: Iterable[int]) -> int | None:
        """Remove ready messages that were never handed out (the Spark
        source's commit): ONE ``DELIVER [offsets, false]`` record, the same
        record a no-ack fetch writes, so mirrors, sync and replay need
        nothing new.  Returns the record's offset (None if ``offsets`` is empty)."""
        offsets = list(offsets)
        if not offsets:
            return None
        return self._submit(Op.DELIVER, [offsets, False])

    # ----------------------------------------------------------- operations

    def publish(
        self, msg_id: str | bytes, body: bytes, properties: dict[str, Any] | None = None, persistent: bool = True
    ) -> int:
        """Append a ready message; returns its offset (its identity in this queue)."""
        if isinstance(body, (bytearray, memoryview)):
            body = bytes(body)
        props = {} if properties is None else properties
        offset = self._submit(Op.PUBLISH, [msg_id, body, props, persistent])
        self._bodies.put(self._cached, offset, (msg_id, body, props, persistent), len(body) + 256)
        return offset

    def fetch(self, n: int = 1, ack_required: bool = True) -> list[Message]:
        """Deliver up to ``n`` ready messages in FIFO order.

        With ``ack_required`` they become unacked; without, they are gone.
        ``redelivered`` is true for a message delivered before.
        """
        self._check_count(n)
        offsets = self._head(n)
        if not offsets:
            return []
        msgs = self._messages(offsets)
        self._append(Op.DELIVER, [offsets, bool(ack_required)])  # the ready head by construction
        return msgs

    def fetch_at(self, offsets: Iterable[int]) -> int:
        """Deliver the ready messages at ``offsets`` with an ack required,
        wherever they are in the queue (not the head): ONE ``DELIVER
        [offsets, true]`` record, the record :meth:`fetch` writes, so
        mirrors, sync and replay need nothing new.  What the queue writes to
        dead-letter a publish it refused (``x-overflow=reject-publish-dlx``).
        Returns the record's offset."""
        return self._submit(Op.DELIVER, [list(offsets), True])

    def ack(self, refs: Iterable[int | str | bytes] | int | str | bytes) -> int:
        """Acknowledge unacked messages (by offset or msg_id); returns the ACK record's offset."""
        return self._submit(Op.ACK, [self._resolve_all(refs)])

    def requeue(self, refs: Iterable[int | str | bytes] | int | str | bytes) -> int:
        """Return unacked messages to the ready queue at their original position."""
        return self._submit(Op.REQUEUE, [self._resolve_all(refs)])

    def dead_letter(self, offsets: Iterable[int], reason: str) -> list[int]:
        """Mark unacked messages as being dead-lettered for ``reason``;
        returns their dead-letter sequence numbers (in ``offsets`` order)."""
        offsets = list(offsets)
        out: list[int] = []
        for i in range(0, len(offsets), MAX_DEAD_LETTER_BATCH):
            chunk = offsets[i : i + MAX_DEAD_LETTER_BATCH]
            at = self._submit(Op.DEAD_LETTER, [chunk, reason])
            out += [at << 16 | j for j in range(len(chunk))]
        return out

    def begin_epoch(self, member: str) -> int:
        """``member`` is master from here on: an EPOCH record; its offset."""
        return self._submit(Op.EPOCH, [member])

    def requeue_unacked(self) -> int:
        """Requeue every unacked message (promotion, cold start); returns how many."""
        offsets = self.unacked_offsets()
        if offsets:
            self._submit(Op.REQUEUE, [offsets])
        return len(offsets)

    def purge(self) -> int:
        """Drop every ready message; returns how many.  Unacked messages stay."""
        n = self._ready
        if n:
            self._submit(Op.PURGE, [])
        return n

    def drop_transient(self) -> int:
        """Drop every non-persistent message (ready or unacked); returns how many."""
        n = sum(1 for e in self._msgs.values() if not e.persistent)
        if n:
            self._submit(Op.DROP_TRANSIENT, [])
        return n

    def apply(self, op: Record | tuple[int, Any], offset: int | None = None) -> int | None:
        """Apply an operation record received from the master; returns its offset.

        ``offset`` is the master's offset for it: the record is stored under
        the same offset (so later ops that name messages by offset agree).
        An ``offset`` below ``log.next_offset`` was applied already and is
        ignored (returns None), which makes redelivered ops harmless.
        """
        try:
            rtype, body = op
        except (TypeError, ValueError):
            raise InvalidOperation(f"an operation is a (type, body) pair, got {op!r}") from None
        if offset is not None:
            if not _is_offset(offset) or offset < 0:
                raise InvalidOperation(f"offset must be a non-negative int, got {offset!r}")
            if offset < self._log.next_offset:
                return None
        return self._submit(rtype, body, offset)

    def replay(self, op: Record | tuple[int, Any], offset: int) -> int | None:
        """Install a record copied from another replica's log (sync of a new mirror).

        A fresh mirror copies the master's log from its ``first_offset``;
        compaction may have removed the publish of a message that a kept
        record still names.  Such a message is gone, so -- exactly as when
        the store recovers its own log -- the reference is skipped instead of
        refused.  Everything else is checked as in :meth:`apply`, and the
        record is stored unchanged under ``offset``.  A replica whose
        ``log.next_offset`` is below the master's ``first_offset`` but which
        holds messages must be emptied (a new directory) before replaying:
        the records that removed its messages may be compacted away.
        """
        if not _is_offset(offset) or offset < 0:
            raise InvalidOperation(f"offset must be a non-negative int, got {offset!r}")
        try:
            rtype, body = op
        except (TypeError, ValueError):
            raise InvalidOperation(f"an operation is a (type, body) pair, got {op!r}") from None
        if offset < self._log.next_offset:
            return None
        return self._submit(rtype, body, offset, lenient=True)

    def replay_raw(self, data: bytes, *, source: str = "raw records") -> int:
        """Install encoded records copied verbatim from another replica's log
        (:meth:`SegmentLog.read_raw`); returns how many.

        The cheap path of sync: the log checks every record's framing,
        checksums and offsets first (a bad batch raises and installs
        nothing), then each record is decoded once, checked and applied
        exactly as :meth:`replay` does (references to compacted messages are
        skipped), and the bytes are appended unchanged -- no re-encoding.  A
        record that is not valid in the current state raises after the
        records before it were installed (as one :meth:`replay` call per
        record would).
        """
        frames = self._log.check_raw(data, source=source)
        offsets, rtypes, positions, segments = frames.offsets, frames.rtypes, frames.positions, frames.segments
        view = memoryview(frames.data)
        installed = 0
        validate, mutate, unpack = self._validate, self._mutate, _unpack
        on_append = self.on_append
        by_id, publish = self._by_id, Op.PUBLISH
        try:
            for k in range(len(offsets)):
                rtype = rtypes[k]
                body = unpack(view[positions[k] + HEADER_SIZE : positions[k + 1]])
                if (
                    rtype == 1
                    and type(body) is list
                    and len(body) == 4
                    and type(body[1]) is bytes
                    and type(body[2]) is dict
                    and type(body[3]) is bool
                    and type(body[0]) in (str, bytes)
                    and body[0] not in by_id
                ):
                    op = publish  # the common record, checked inline: what _validate would check
                else:
                    op, body = validate(rtype, body, True)
                mutate(offsets[k], op, body, segments[k], replay=True)
                installed += 1
        finally:
            self._log.append_raw(frames, installed)
            self._must_sync = True
        if on_append is not None:
            for k in range(installed):
                on_append(offsets[k], rtypes[k], unpack(view[positions[k] + HEADER_SIZE : positions[k + 1]]))
        return installed

    # ----------------------------------------------------- durability, life

    def flush(self) -> None:
        """Write and fsync everything buffered (group commit); may compact afterwards."""
        self._log.flush()
        self._must_sync = False
        if self._auto_compact and (self._compact_hint or self._log.rolls != self._rolls_seen):
            self._compact_flushed()

    def flush_turn(self, sync_later: Callable[[list[int]], None] | None = None) -> None:
        """The end-of-turn flush of a replica: write everything buffered, and
        fsync only if a record since the last fsync carries a promise --
        a PUBLISH (a publisher confirm waits for it), a PURGE, a REFUSED
        (a nack waits for it), a sync's records -- not for deliveries, acks and requeues alone (losing those
        to a machine crash means a redelivery, which at-least-once allows;
        RabbitMQ does not fsync acks either).  A process crash loses nothing
        written: the page cache keeps it.

        ``sync_later``: instead of fsyncing, hand it the file descriptors
        that need one; the caller (a queue host, syncing every replica's
        files of the turn at once) makes them durable before anything that
        depends on them leaves."""
        if self._must_sync and sync_later is None:
            self.flush()
            return
        self._log.flush(sync=False)
        if self._auto_compact and (self._compact_hint or self._log.rolls != self._rolls_seen):
            self._compact_flushed()
        if self._must_sync and sync_later is not None:  # (without sync_later it flushed above)
            self._must_sync = False
            fds = self._log.take_unsynced()
            if fds:
                sync_later(fds)

    def compact(self) -> list[int]:
        """Flush, then delete dead segments; returns the deleted segment bases."""
        self._log.flush()
        return self._compact_flushed()

    def close(self, flush: bool = True) -> None:
        """Flush and close; ``flush=False`` drops unflushed operations, as a crash would."""
        if self._log.closed:
            return
        self._bodies.release(self._cached)
        if flush:
            try:
                self.flush()
            except StoreError:
                self._log.close(flush=False)
                raise
        self._log.close(flush=False)

    def __enter__(self) -> BackingQueue:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_count(self, n: Any) -> None:
        if not _is_offset(n) or n < 0:
            raise ValueError(f"message count must be a non-negative int, got {n!r}")

    def _resolve(self, ref: Any) -> int:
        if _is_offset(ref):
            if ref not in self._msgs:
                raise UnknownMessage(f"no live message at offset {ref}")
            return ref
        if isinstance(ref, (str, bytes)):
            return self.offset_of(ref)
        raise TypeError(f"a message reference is an int offset or a str/bytes msg_id, got {ref!r}")

    def _resolve_all(self, refs: Any) -> list[int]:
        if _is_offset(refs) or isinstance(refs, (str, bytes)):
            refs = [refs]
        try:
            items = list(refs)
        except TypeError:
            raise TypeError(f"expected message references (offsets or msg_ids), got {refs!r}") from None
        return [self._resolve(r) for r in items]

    def _message(self, offset: int) -> Message:
        return self._messages((offset,))[0]

    def _messages(self, offsets: Sequence[int]) -> list[Message]:
        """Live messages at ``offsets``: bodies from the cache, the misses
        from the log in one :meth:`SegmentLog.read_many`."""
        cached = self._cached
        entries = [self._msgs[o] for o in offsets]
        misses = [o for o in offsets if o not in cached]
        read = dict(zip(misses, self._log.read_many(misses))) if misses else {}
        out = []
        for o, e in zip(offsets, entries):
            hit = cached.get(o)
            msg_id, body, props, persistent = hit[0] if hit is not None else read[o].body
            out.append(Message(o, msg_id, body, props, persistent, e.delivered))
        return out

    def _valid_fifo(self, o: int) -> bool:
        e = self._msgs.get(o)
        return e is not None and e.state == _READY and e.token == 0

    def _valid_returned(self, item: tuple[int, int]) -> bool:
        e = self._msgs.get(item[0])
        return e is not None and e.state == _READY and e.token == item[1]

    def _head(self, n: int) -> list[int]:
        """The first ``n`` ready offsets in order: the highest priority level
        first; within a level, publish order and requeued merged."""
        out: list[int] = []
        for level in range(self.max_priority, -1, -1):
            if len(out) >= n:
                break
            out += self._level_head(level, n - len(out))
        return out

    def _level_head(self, level: int, n: int) -> list[int]:
        fifo, returned = self._fifos[level], self._returneds[level]
        while fifo and not self._valid_fifo(fifo[0]):
            fifo.popleft()
        out: list[int] = []
        popped: list[tuple[int, int]] = []
        it = iter(fifo)
        f = next(it, None)
        while len(out) < n:
            while f is not None and not self._valid_fifo(f):
                f = next(it, None)
            while returned and not self._valid_returned(returned[0]):
                heapq.heappop(returned)
            h = returned[0][0] if returned else None
            if f is not None and (h is None or h >= f):
                out.append(f)
                f = next(it, None)
            elif h is not None:
                popped.append(heapq.heappop(returned))
                out.append(h)
            else:
                break  # neither holds another ready offset
        for item in popped:
            heapq.heappush(returned, item)
        return out

    def _offsets_arg(self, body: Any, op: Op, want: Any, lenient: bool) -> list[int]:
        offsets = body[0]
        if not isinstance(offsets, (list, tuple)) or not offsets:
            raise InvalidOperation(f"{op.name} needs a non-empty list of offsets, got {offsets!r}")
        for o in offsets:
            if not _is_offset(o):
                raise InvalidOperation(f"{op.name}: offset {o!r} is not an int")
            e = self._msgs.get(o)
            if e is None:
                if lenient:
                    continue
                raise UnknownMessage(f"{op.name}: no live message at offset {o}")
            if e.state not in want:
                raise InvalidOperation(f"{op.name}: message at offset {o} is {_STATE_NAMES[e.state]}")
        if len(set(offsets)) != len(offsets):
            raise InvalidOperation(f"{op.name}: offsets repeat in {list(offsets)!r}")
        return list(offsets)

    def _validate(self, rtype: Any, body: Any, lenient: bool = False) -> tuple[Op, list[Any]]:
        op = _OP_BY_CODE.get(rtype) if type(rtype) in _OP_TYPES else None  # not bool, not an enum lookup
        if op is None:
            try:
                op = Op(rtype)
            except ValueError:
                raise InvalidOperation(f"unknown operation type {rtype!r}") from None
        if not isinstance(body, (list, tuple)):
            raise InvalidOperation(f"{op.name} body must be a list, got {body!r}")
        arity = _ARITY[op]
        if len(body) != arity:
            raise InvalidOperation(f"{op.name} body must have {arity} items, got {body!r}")
        if op is Op.PUBLISH:
            msg_id, payload, props, persistent = body
            if not isinstance(msg_id, (str, bytes)):
                raise TypeError(f"msg_id must be str or bytes, got {msg_id!r}")
            if not isinstance(payload, bytes):
                raise TypeError(f"message body must be bytes, got {type(payload).__name__}")
            if not isinstance(props, dict):
                raise TypeError(f"properties must be a dict, got {props!r}")
            if not isinstance(persistent, bool):
                raise TypeError(f"persistent must be a bool, got {persistent!r}")
            if msg_id in self._by_id:
                raise DuplicateMessage(f"msg_id {msg_id!r} is already live at offset {self._by_id[msg_id]}")
            return op, [msg_id, payload, props, persistent]
        if op is Op.DELIVER:
            if not isinstance(body[1], bool):
                raise InvalidOperation(f"DELIVER ack_required must be a bool, got {body[1]!r}")
            return op, [self._offsets_arg(body, op, (_READY,), lenient), body[1]]
        if op is Op.ACK:
            return op, [self._offsets_arg(body, op, (_UNACKED, _DEAD), lenient)]
        if op is Op.REQUEUE:
            return op, [self._offsets_arg(body, op, (_UNACKED,), lenient)]
        if op is Op.DEAD_LETTER:
            if not isinstance(body[1], str) or not body[1]:
                raise InvalidOperation(f"DEAD_LETTER reason must be a non-empty str, got {body[1]!r}")
            offsets = self._offsets_arg(body, op, (_UNACKED,), lenient)
            if len(offsets) > MAX_DEAD_LETTER_BATCH:
                raise InvalidOperation(f"DEAD_LETTER names {len(offsets)} messages, at most {MAX_DEAD_LETTER_BATCH}")
            return op, [offsets, body[1]]
        if op is Op.REFUSED:
            return op, [list(_publisher_key(body[0], InvalidOperation)), _valid_runs(body[1])]
        if op is Op.EPOCH:
            if not isinstance(body[0], str) or not body[0]:
                raise InvalidOperation(f"EPOCH member must be a non-empty str, got {body[0]!r}")
            return op, [body[0]]
        return op, []

    def _submit(self, rtype: Any, body: Any, at: int | None = None, lenient: bool = False) -> int:
        op, body = self._validate(rtype, body, lenient)
        return self._append(op, body, at, lenient)

    def _append(self, op: Op, body: list[Any], at: int | None = None, lenient: bool = False) -> int:
        """Log and apply a valid operation (checked by :meth:`_validate`, or
        built here from the index, as :meth:`fetch` builds its offsets)."""
        if op not in _NO_SYNC_OPS:
            self._must_sync = True
        (offset,) = self._log.append([(int(op), body)], at=at)
        segment = self._log.segment_of(offset)
        assert segment is not None  # the record was just appended: a segment holds it
        self._mutate(offset, op, body, segment, replay=lenient)
        if self.on_append is not None:
            self.on_append(offset, int(op), body)
        return offset

    def _replay(self, offset: int, record: Record, segment: int) -> None:
        try:
            op = Op(record.rtype)
        except ValueError:
            raise StoreError(f"log record at offset {offset} has unknown operation type {record.rtype}") from None
        self._mutate(offset, op, record.body, segment, replay=True)

    def _mutate(self, offset: int, op: Op, body: list[Any], segment: int, replay: bool = False) -> None:
        """Apply a validated (or replayed) operation to the index."""
        self._live.setdefault(segment, 0)
        if op is Op.PUBLISH:
            msg_id, _payload, props, persistent = body
            level = priority_level(props, self.max_priority) if self.max_priority else 0
            self._msgs[offset] = _Entry(msg_id, persistent, segment, level)
            self._by_id[msg_id] = offset
            self._fifos[level].append(offset)
            self._ready += 1
            self._live[segment] += 1
            return
        if op is Op.PURGE:
            self._purge(segment)
            return
        if op is Op.DROP_TRANSIENT:
            for o in [o for o, e in self._msgs.items() if not e.persistent]:
                self._kill(o, segment)
            return
        if op is Op.REFUSED:
            self._set_refused(_publisher_key(body[0], StoreError), body[1], segment)
            return
        if op is Op.EPOCH:
            self.epochs.append((offset, body[0]))
            del self.epochs[:-MAX_EPOCHS]
            return
        want = (_READY,) if op is Op.DELIVER else (_UNACKED, _DEAD) if op is Op.ACK else (_UNACKED,)
        for i, o in enumerate(body[0]):
            e = self._msgs.get(o)
            if e is None or e.state not in want:
                if replay and e is None:
                    continue  # its publish was compacted away: the message is long gone
                state = "gone" if e is None else _STATE_NAMES[e.state]
                raise StoreError(
                    f"log record at offset {offset} ({op.name}) names the message at offset {o}, which is {state}"
                )
            self._touch(e, segment)
            if op is Op.DELIVER:
                e.delivered = True
                if body[1]:
                    e.state = _UNACKED
                    self._ready -= 1
                    self._unacked += 1
                else:
                    self._kill(o, segment)
            elif op is Op.ACK:
                self._kill(o, segment)
            elif op is Op.DEAD_LETTER:
                e.state = _DEAD
                e.dead = (offset << 16 | i, body[1])
                self._unacked -= 1
                self._dead[e.dead[0]] = o
            else:  # REQUEUE
                e.state = _READY
                self._unacked -= 1
                self._ready += 1
                self._token += 1
                e.token = self._token
                heapq.heappush(self._returneds[e.level], (o, self._token))

    def _set_refused(self, key: PublisherKey, runs: list[list[int]], segment: int) -> None:
        """A REFUSED record at ``segment`` replaces ``key``'s entry: it keeps
        its own segment (a live entry), and keeps the segment of the record
        it replaced from being deleted before it is itself."""
        old = self._refused.pop(key, None)
        if old is not None:
            old_segment = old[1]
            left = self._live[old_segment] - 1
            self._live[old_segment] = left
            if left == 0:
                self._compact_hint = True
            if old_segment != segment:
                self._refs.setdefault(segment, set()).add(old_segment)
        if runs:
            self._refused[key] = ([list(r) for r in runs], segment)
            self._live[segment] += 1

    def _touch(self, e: _Entry, segment: int) -> None:
        if e.segment != segment:
            self._refs.setdefault(segment, set()).add(e.segment)

    def _kill(self, o: int, segment: int) -> None:
        e = self._msgs.pop(o)
        if self._cached:
            self._bodies.drop(self._cached, o)
        self._by_id.pop(e.msg_id, None)
        if e.state == _READY:
            self._ready -= 1
        elif e.state == _UNACKED:
            self._unacked -= 1
        else:
            del self._dead[e.dead_mark()[0]]
        self._touch(e, segment)
        left = self._live[e.segment] - 1
        self._live[e.segment] = left
        if left == 0:
            self._compact_hint = True

    def _purge(self, segment: int) -> None:
        for o in self._head(self._ready):
            self._kill(o, segment)
        for fifo in self._fifos:
            fifo.clear()
        for returned in self._returneds:
            returned.clear()

    def _compact_flushed(self) -> list[int]:
        self._compact_hint = False
        self._rolls_seen = self._log.rolls
        bases = self._log.segment_bases
        kept = set(bases)
        gone: set[int] = set()
        deleted = []
        for i, base in enumerate(bases[:-1]):  # never the active segment
            if self.retain_from is not None and bases[i + 1] > self.retain_from:
                break  # a sync transfer has yet to read this segment and those after it
            if self._live.get(base, 0) or self._log.segment_has_pending(base):
                continue
            if all(r in gone or r not in kept for r in self._refs.get(base, ())):
                gone.add(base)
                deleted.append(base)
        for base in deleted:
            self._log.delete_segment(base)
            self._live.pop(base, None)
            self._refs.pop(base, None)
        return deleted
