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
     is byte-identical to the master's record at that offset (the delta),
     else the master's ``first_offset`` with ``reset=True`` (J empties its
     store first: its log diverged, e.g. it held operations of a master that
     died and were never confirmed, or it is older than what compaction kept);
   * ``until``: the master's ``next_offset`` now, and ``gm_seq``: its GM
     broadcast count now.  Every operation from ``until`` on travels in a GM
     payload with seq > ``gm_seq``, which J receives (it is in the view the
     master has installed -- the master answers ``SyncRetry`` otherwise);
   * the state that is not in the log, as of that moment: publisher
     high-water marks, the consumer table, the synchronised members.
3. The master streams batches of at most ``ha-sync-batch-size`` records
   from ``start`` (the first inside ``SyncStart``, the others as ``SyncBatch``,
   each sent only after the previous one is acked, so Thespian's occasional
   reordering cannot put a batch before its start); J replays them (``BackingQueue.replay``: references
   to compacted messages are skipped) and answers ``SyncAck(next_offset)``;
   the master sends the next batch from there (flow control: one batch in
   flight).  Meanwhile the queue keeps serving: new operations go through GM
   as usual; sync only fills the gap below ``until``.
4. When J's log reaches ``until`` it applies the payloads it kept with GM
   seq > ``gm_seq`` in order, is synchronised, and sends ``SyncDone``; the
   master broadcasts ``["synced", J]`` so every replica knows (promotion
   prefers synchronised mirrors) and reports it (``sync_slave_pids``).

``ha-sync-mode``: ``automatic`` syncs at once; ``manual`` (RabbitMQ's default)
answers ``SyncWait`` until ``sync_queue``; then the master invites the
waiting mirrors (``SyncInvite``) and they request again.  While waiting, J
keeps nothing (it could not apply operations that name messages it lacks).
``cancel_sync_queue`` aborts running transfers (``SyncCancelled``; J discards
what it kept and waits again).

Failure: a transfer without an ack for ``SYNC_TIMEOUT`` is closed by the
master (housekeeping); J retries its request every ``SYNC_RETRY`` while it is
unsynchronised and has no transfer progressing, and restarts with whoever is
master after a failover.  Nothing J applies during sync can make a
confirmed message unsafe: confirms only ever wait for the members of the view,
and an unsynchronised mirror is never promoted unless the policy says
``ha-promote-on-failure: always`` and no synchronised member survives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import crc32c
import msgpack

SYNC_RETRY = 0.5
SYNC_TIMEOUT = 10.0
DEFAULT_BATCH = 4096


def record_crc(rtype: int, body: Any) -> int:
    return crc32c.crc32c(msgpack.packb([rtype, body], use_bin_type=True))


@dataclass(frozen=True)
class SyncRequest:
    queue: str
    member: str
    dst: Any
    next_offset: int
    last_offset: int  # -1: empty log
    last_crc: int


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
class SyncStart:
    queue: str
    start: int
    until: int
    gm_seq: int
    reset: bool
    hwm: list
    consumers: list
    synced: list
    records: list = field(default_factory=list)  # the first batch rides along (no batch can overtake it)


@dataclass(frozen=True)
class SyncBatch:
    queue: str
    records: list  # [offset, rtype, body]


@dataclass(frozen=True)
class SyncAck:
    queue: str
    member: str
    next_offset: int


@dataclass(frozen=True)
class SyncDone:
    queue: str
    member: str


@dataclass(frozen=True)
class SyncCancelled:
    queue: str


@dataclass
class Transfer:
    """The master's side of one transfer."""

    member: str
    dst: Any
    next: int
    until: int
    last_activity: float
    sent: int = 0  # records sent (the delta counter)


@dataclass
class Receiving:
    """The mirror's side: what it kept while the transfer runs."""

    start: SyncStart | None = None
    kept: list = field(default_factory=list)  # (gm_seq, payload)
    received: int = 0
