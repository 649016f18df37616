"""Sync: a mirror that joins late catches up by log offset, while the queue serves.

This is RocketMQ's HA transfer (seeds 000/003/004) on the queue's operation
log, instead of RabbitMQ's sync that blocks the queue.

Protocol
--------
A joining mirror ``J`` is in the GM view but *unsynchronised*: it does not
hold the operations below the point where it started receiving them.

1. ``J`` sends the master ``SyncRequest(next_offset, last_offset, last_crc)``:
   where its own durable log ends (a restarted mirror keeps its log) and a
   checksum of its last record.  From then on it keeps every operation
   payload GM delivers to it (with the master's GM seq).
2. The master answers ``SyncStart``:
   * ``start``: where to stream from: ``J.next_offset`` when J's last record
     is byte-identical to the master's record at that offset (the delta);
     else, when J's log parted from the master's -- J was a master deposed
     by a partition, or a mirror of one, and holds records the queue never
     had -- the point where they parted, with ``truncate`` set to it: J
     cuts its log back to there and takes the rest (a delta too).  That
     point comes from the master *epochs* both logs hold (``EPOCH``
     records, :mod:`.backing_queue`; J sends its own in the request): the
     newest epoch both hold at the same offset, up to where the next epoch
     of either begins (:func:`parting_point`).  Else the master's
     ``first_offset`` with ``reset=True`` (J empties its store first: no
     epoch in common, a non-durable queue, or J is older than what
     compaction kept);
   * ``until``: the master's ``next_offset`` now, and ``gm_seq``: its GM
     broadcast count now.  Every operation from ``until`` on travels in a GM
     payload with seq > ``gm_seq``, which J receives (it is in the view the
     master has installed -- the master answers ``SyncRetry`` otherwise);
   * the state that is not in the log, as of that moment: publisher
     high-water marks, the consumer table, the synchronised members.  (The
     publisher seqs the master refused are in the log: compaction keeps
     every publisher's current ``REFUSED`` record, so a stream from
     ``first_offset`` carries them all, and a delta stream completes J's.)
3. The master streams the records from ``start`` up to ``until`` as raw
   log bytes: each batch is the encoded records exactly as they sit in the
   master's segment files (headers and CRC32C checksums included), read with
   one ``pread`` per segment (:meth:`SegmentLog.read_raw`) and sent as one
   ``bytes`` object: the master does nothing per record.  A batch holds at
   most ``ha-sync-batch-size`` records and about ``SYNC_BATCH_BYTES`` bytes
   (Thespian copies a message's buffer once per socket read, so a few
   hundred KiB per message beats many MiB), and names the stream position it
   covers, ``[start, next)``.  The first batch rides inside ``SyncStart``; once
   J acks it, the master keeps ``SYNC_WINDOW`` batches in flight.  J checks
   every record's framing and checksums (a bad batch raises
   :class:`~mirrorq.store.segment_log.CorruptRecord` and installs nothing), appends the
   bytes to its own log verbatim and applies each record to its queue state
   (``BackingQueue.replay_raw``: one decode, no re-encode; references to
   compacted messages are skipped) -- one fsync per batch -- and answers
   ``SyncAck(next)``.  Thespian may deliver two batches out of order: J
   installs a batch only when its ``start`` is where J's stream stands and
   keeps a batch that arrived early until the gap is filled.  Every message
   of a transfer carries J's request number ``req``, so a stale batch or ack
   of an earlier transfer is ignored.  While a transfer runs the master does
   not compact segments at or above its read position.  Meanwhile the queue
   keeps serving: new operations go through GM as usual; sync only fills the
   gap below ``until``.
4. When J's stream reaches ``until`` it applies the payloads it kept with GM
   seq > ``gm_seq`` in order, is synchronised, and sends ``SyncDone``; the
   master broadcasts ``Synced(J)`` (:mod:`.payloads`) so every replica knows (promotion
   prefers synchronised mirrors) and reports it (``sync_slave_pids``).

``ha-sync-mode``: ``automatic`` syncs at once; ``manual`` (RabbitMQ's default)
answers ``SyncWait`` until ``sync_queue``; then the master invites the
waiting mirrors (``SyncInvite``) and they request again.  While waiting, J
keeps nothing (it could not apply operations that name messages it lacks).
``cancel_sync_queue`` aborts running transfers (``SyncCancelled``; J discards
what it kept and waits again).

Failure: a transfer without an ack for ``SYNC_TIMEOUT`` is closed by the
master (housekeeping; a lost batch ends this way); J retries its request
every ``SYNC_RETRY`` while it is unsynchronised and has no transfer
progressing, sends it again when the master has not answered it within
``SYNC_ANSWER_TIMEOUT`` (the request or the ``SyncStart`` was lost: a link
reset at a heal; a new request replaces the master's transfer to J) or a
transfer stalled for ``SYNC_TIMEOUT``, and restarts with whoever is master
after a failover; from the view that drops its master until the new one is
promoted, J knows no master and ignores what the old transfer still brings
(it is void).  Nothing J applies during sync can make a
confirmed message unsafe: confirms only ever wait for the members of the view,
and an unsynchronised mirror is never promoted unless the policy says
``ha-promote-on-failure: always`` and no synchronised member survives.
A batch whose bytes fail J's checks (a damaged record on the master's disk,
or in transit) raises in J -- as any operation a mirror cannot apply: it
never installs a record it cannot trust.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c

from mirrorq.classic.payloads import Ops
from mirrorq.packing import pack

SYNC_RETRY = 0.5
SYNC_TIMEOUT = 10.0
SYNC_ANSWER_TIMEOUT = 2.0  # s: a request the master has not answered is sent again
DEFAULT_BATCH = 4096  # records (ha-sync-batch-size)
SYNC_BATCH_BYTES = 1024 * 1024  # about this many bytes per batch message
SYNC_WINDOW = 4  # batches in flight per transfer (the master answers an ack 10-30 ms late while serving)


def record_crc(rtype: int, body: Any) -> int:
    return crc32c.crc32c(pack([rtype, body]))


@dataclass(frozen=True)
class SyncRequest:
    queue: str
    member: str
    dst: Any
    next_offset: int
    last_offset: int  # -1: empty log
    last_crc: int
    req: int = 0  # the mirror's request number, echoed by every message of the transfer
    #: the master epochs its log holds, (offset, member), ascending (BackingQueue.epochs)
    epochs: tuple[tuple[int, str], ...] = ()


def parting_point(
    mine: Sequence[tuple[int, str]], theirs: Sequence[tuple[int, str]], my_next: int, their_next: int
) -> int | None:
    """Where two replicas' logs part, from their master epochs (``(offset,
    member)`` pairs, ascending, as :attr:`BackingQueue.epochs`): the
    newest epoch both hold at the same offset, ended by whichever of the
    two logs first holds a later epoch (or ends).  None if they share no
    epoch.  Below that point the logs agree: one master wrote that stretch
    of each, and each held its predecessors' log when it began."""
    index = {(int(o), m): i for i, (o, m) in enumerate(mine)}
    for k in range(len(theirs) - 1, -1, -1):
        i = index.get((int(theirs[k][0]), theirs[k][1]))
        if i is None:
            continue
        my_end = int(mine[i + 1][0]) if i + 1 < len(mine) else my_next
        their_end = int(theirs[k + 1][0]) if k + 1 < len(theirs) else their_next
        return min(my_end, their_end)
    return None


@dataclass(frozen=True)
class SyncRetry:
    queue: str
    reason: str


@dataclass(frozen=True)
class SyncWait:
    """Manual sync mode: wait for sync_queue."""

    queue: str


@dataclass(frozen=True)
class SyncInvite:
    queue: str


@dataclass(frozen=True)
class SyncBatch:
    """Encoded log records (``count`` of them, as ``SegmentLog.read_raw``
    returns them) covering stream positions ``[start, next)``."""

    queue: str
    req: int
    start: int
    next: int
    count: int
    data: bytes

    def __repr__(self) -> str:  # not the megabyte of bytes
        return (
            f"SyncBatch({self.queue!r}, req={self.req}, [{self.start}, {self.next}), {self.count} records, "
            f"{len(self.data)} bytes)"
        )


@dataclass(frozen=True)
class SyncStart:
    queue: str
    start: int
    until: int
    gm_seq: int
    reset: bool
    hwm: list[list[Any]]  # [publisher, seq] pairs (a publisher as a list: wire data)
    consumers: list[dict[str, Any]]  # the consumer table's records (channel as a list)
    synced: list[str]
    req: int = 0
    first: SyncBatch | None = None  # the first batch rides along (no batch can overtake it)
    #: >= 0: the mirror first cuts its log back to this offset (where it parted from the master's)
    truncate: int = -1


@dataclass(frozen=True)
class SyncAck:
    queue: str
    member: str
    next_offset: int  # the mirror's stream position: everything below is installed
    req: int = 0


@dataclass(frozen=True)
class SyncDone:
    queue: str
    member: str
    req: int = 0


@dataclass(frozen=True)
class SyncCancelled:
    queue: str


@dataclass
class Transfer:
    """The master's side of one transfer."""

    member: str
    dst: Any
    next: int  # where the next batch is read from
    until: int
    last_activity: float
    req: int = 0
    acked: int = 0  # the mirror's position (from its acks)
    inflight: deque[int] = field(default_factory=deque)  # ``next`` of each batch sent and not acked
    sent: int = 0  # records sent (the delta counter)
    start: int = 0  # where the transfer began (progress = (acked - start) / (until - start))


@dataclass
class Receiving:
    """The mirror's side: what it kept while the transfer runs."""

    start: SyncStart | None = None
    kept: list[tuple[str, int, Ops]] = field(default_factory=list)  # (origin, gm_seq, payload)
    received: int = 0
    position: int = 0  # stream position: every record below it is installed
    early: dict[int, SyncBatch] = field(default_factory=dict)  # start -> SyncBatch that arrived before its predecessor
