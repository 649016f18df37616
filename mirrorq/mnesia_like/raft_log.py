"""Durable state of one Raft server: hard state, log, snapshot.

The Raft core (:mod:`mirrorq.mnesia_like.raft`) keeps nothing durable itself;
it reads and writes through a :class:`RaftLog`:

* the *hard state*: ``term`` and ``voted_for``;
* the *log*: :class:`Entry` objects with consecutive indexes
  ``snapshot_index + 1 .. last_index``;
* the *snapshot*: a :class:`Snapshot` (last included index and term, the
  cluster :class:`Config` at that index, and the application's opaque blob).

Contract (what the core relies on)
----------------------------------
* Every mutator (``set_hard_state``, ``append``, ``install_snapshot``) changes
  the in-memory view at once.  ``flush()`` is the durability barrier: once it
  returns, everything mutated before it survives a crash.  The core calls
  ``flush()`` once at the end of each entry point, before the actions it
  returns (votes, acknowledgements) are carried out -- one fsync per batch of
  records, never one per record (group fsync).
* ``append(entries)`` takes consecutive entries starting at or before
  ``last_index + 1``; entries already in the log from ``entries[0].index`` on
  are replaced (conflict truncation and append are one operation).
* ``install_snapshot(s)`` makes ``s`` the snapshot and drops the log up to
  ``s.index``; if the log does not hold ``(s.index, s.term)`` the whole log is
  dropped (it belonged to another history).  It is durable when it returns.

Implementations
---------------
:class:`MemoryRaftLog`
    keeps everything in a plain dict -- pass the simulator's ``disk`` dict,
    which survives ``Simulator.kill``; writes are durable at once there.
:class:`FileRaftLog`
    a directory of segment files, ``hardstate``, ``snapshot`` and
    checkpoints.  Its memory does not grow with the data it holds: per entry
    it keeps only where the record is and its term and kind (a few tens of
    bytes, in ``array`` objects), the CONFIG entries (tiny, so
    ``config_entries`` reads nothing), and the snapshot's index, term and
    config.

    ``log.<first index, 20 digits>`` (segments)
        append-only records ``[u32 length][u32 crc32c(payload)]
        [u32 crc32c(first 8 bytes)]`` + msgpack payload ``[index, term, kind,
        data]``, named by the index of their first record.  A segment is
        rolled -- the next record starts a new one -- once its records pass
        ``segment_bytes`` (:data:`SEGMENT_BYTES`), or at the next append
        after a compaction that left at least :data:`COMPACT_ROLL_BYTES` of
        compacted records at its head, no fewer than the rest (so that the
        next compaction deletes them whole).  An entry whose index is at or
        below the last record's truncates the log from there on replay (so
        conflict truncation is an append too).  A conflicting append drops
        the replaced records not yet written; if written ones remain, the
        replacing record is written in the segment holding the entry it
        replaces -- when that is not the last segment, the later segments
        are deleted first (newest first, then the directory fsynced, before
        the record is written).  So each segment starts with the entry
        after the previous segment's last, and replay truncates only within
        a segment.
        Zeros are written ahead of the last segment's records
        (:mod:`mirrorq.preallocate`) so that a flush's fsync changes no file
        size; they are cut off when the segment is finished and on close.
    ``hardstate``, ``snapshot``, ``checkpoint.<index>``
        one checksummed record each (a snapshot's and a checkpoint's alike:
        ``[index, term, config, data]``), replaced atomically (write temp,
        fsync, rename, fsync directory).
    ``log`` (the single-file format of old)
        renamed on open to the first segment, named by its first record.

    Reading.  ``entry``/``entries`` read a record back with ``pread``,
    check its checksums and index (else :class:`RaftLogCorrupt`, naming file
    and offset) -- unless it is in the cache of decoded entries recently
    appended or read (least recently used go first; at most ``cache_bytes``
    (:data:`ENTRY_CACHE_BYTES`) of encoded size plus
    :data:`CACHED_ENTRY_OVERHEAD` an entry; an entry larger than that is not
    cached), or appended and not yet written.  Appended records wait in
    memory for :meth:`FileRaftLog.write_out`, or are written (not fsynced)
    once more than :data:`WRITE_BUFFER_BYTES` wait.  The ``snapshot``
    property reads the snapshot file at each access unless the record is at
    most :data:`SNAPSHOT_CACHE_BYTES` (then it is kept decoded): a caller
    that keeps a large one holds its memory.  Checkpoints are a list of
    indexes in memory; ``promote_checkpoint`` reads the file (to check it and
    return it) and renames it to ``snapshot``.

    Durability.  ``write_out`` writes what waits; a segment rolled since the
    last one is finished there -- written, its zeros cut off, fsynced --
    before the next segment file is created (and the directory fsynced), so
    the descriptor it returns, the last segment's, is the only one left to
    sync.  After a crash only the last segment can have a torn tail.
    Compaction (``install_snapshot``, ``promote_checkpoint``) makes the
    snapshot file durable first, then deletes, oldest first, the whole
    segments (not the last) whose entries are all at or below the snapshot
    index; retained records are never rewritten, and those at or below it
    left in the first kept segment are skipped on open.  A snapshot from
    another history deletes every segment, newest first, and starts an
    empty one after it.  On open the log is reconciled with the snapshot as
    ``install_snapshot`` would (a crash between the two steps): whole
    segments at or below it are deleted; a log that does not hold
    ``(index, term)`` of the snapshot is dropped.

    On open, a *torn tail* of the last segment -- fewer bytes than a header,
    a record running past the end of the file, a last record whose checksum
    fails, a record cut short with only zeros after it, or a tail of zero
    bytes (what is left of the zeros written ahead) -- is truncated away (it
    was never flushed, so never acknowledged); the segment stays, even
    empty.  Any other bad record -- one with valid data after it, or one in
    any earlier segment (those were fsynced before the next one existed),
    or a segment that does not start with the entry after the previous
    one's last -- is corruption: :class:`RaftLogCorrupt` is raised, naming
    the file and the byte offset, and nothing is thrown away.  (An earlier
    segment that ends in zeros only has them cut off.)  Commands, snapshot
    blobs and node names must be msgpack-serialisable; tuples come back as
    lists.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from crc32c import crc32c

from mirrorq import preallocate
from mirrorq.fsapi import OS, FileSystem, read_file
from mirrorq.packing import pack

NOOP = 0
COMMAND = 1
CONFIG = 2
_KINDS = (NOOP, COMMAND, CONFIG)


@dataclass(frozen=True, slots=True)
class Config:
    """A cluster configuration: voters count for elections and commit;
    learners only receive the log (a joining server catches up as one)."""

    voters: tuple[str, ...]
    learners: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for group, name in ((self.voters, "voters"), (self.learners, "learners")):
            if not isinstance(group, tuple) or not all(isinstance(n, str) and n for n in group):
                raise TypeError(f"Config.{name} must be a tuple of non-empty str, got {group!r}")
        if set(self.voters) & set(self.learners):
            raise ValueError(f"Config: {sorted(set(self.voters) & set(self.learners))} both voter and learner")
        if len(set(self.voters)) != len(self.voters) or len(set(self.learners)) != len(self.learners):
            raise ValueError(f"Config has duplicate members: {self!r}")

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(sorted(self.voters + self.learners))

    def quorum(self, nodes: Iterable[str]) -> bool:
        """Whether ``nodes`` hold a majority of the voters."""
        voters = self.voters
        if not voters:
            return False
        return sum(1 for n in set(nodes) if n in voters) * 2 > len(voters)

    def encode(self) -> list:
        return [list(self.voters), list(self.learners)]

    @classmethod
    def decode(cls, raw: Any) -> Config:
        voters, learners = raw
        return cls(tuple(voters), tuple(learners))


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    term: int
    kind: int  # NOOP, COMMAND or CONFIG
    data: Any  # the command; a Config for CONFIG entries; None for NOOP


@dataclass(frozen=True, slots=True)
class Snapshot:
    index: int
    term: int
    config: Config
    data: Any  # the application's opaque state-machine blob


class RaftLogCorrupt(Exception):
    """A stored record failed its checksum (or is otherwise impossible) at a
    place that cannot be a torn tail."""

    def __init__(self, path: str, offset: int, reason: str):
        super().__init__(f"{path}: corrupt record at byte offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class RaftLog(ABC):
    """What the Raft core needs from storage (see the module docstring)."""

    @property
    @abstractmethod
    def term(self) -> int: ...

    @property
    @abstractmethod
    def voted_for(self) -> str | None: ...

    @property
    @abstractmethod
    def snapshot(self) -> Snapshot | None: ...

    @property
    @abstractmethod
    def snapshot_index(self) -> int: ...

    @property
    @abstractmethod
    def snapshot_term(self) -> int: ...

    @property
    @abstractmethod
    def last_index(self) -> int: ...

    @abstractmethod
    def term_at(self, index: int) -> int | None:
        """Term of the entry at ``index``; the snapshot's term at
        ``snapshot_index``; 0 at index 0; None if compacted away or beyond
        the end."""

    @abstractmethod
    def entry(self, index: int) -> Entry: ...

    @abstractmethod
    def entries(self, lo: int, hi: int) -> tuple[Entry, ...]:
        """Entries with ``lo <= index < hi`` (both within the log)."""

    @abstractmethod
    def set_hard_state(self, term: int, voted_for: str | None) -> None: ...

    @abstractmethod
    def append(self, entries: Sequence[Entry]) -> None: ...

    @abstractmethod
    def install_snapshot(self, snapshot: Snapshot) -> None: ...

    def config_entries(self, lo: int) -> list[tuple[int, Config]]:
        """``(index, config)`` of every CONFIG entry at or after ``lo``
        (above ``snapshot_index``), in index order.  A log that keeps entry
        data on disk answers this without reading the other entries."""
        return [
            (i, e.data)
            for i in range(max(lo, self.snapshot_index + 1), self.last_index + 1)
            if (e := self.entry(i)).kind == CONFIG
        ]

    # ---- checkpoints ------------------------------------------------------
    # A checkpoint is a snapshot kept aside: the application's state after a
    # committed index, saved now and made the snapshot later (``promote``),
    # once nothing it needs from the log at or below that index is left --
    # RabbitMQ's quorum queues keep message bodies in the log and may only
    # drop a prefix no live message points into.
    @property
    @abstractmethod
    def checkpoints(self) -> tuple[int, ...]:
        """The indexes of the checkpoints kept, ascending."""

    @abstractmethod
    def save_checkpoint(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot`` as a checkpoint (its index above
        ``snapshot_index``, at most ``last_index``); durable when it returns.
        One at the same index is replaced."""

    @abstractmethod
    def drop_checkpoint(self, index: int) -> None:
        """Forget the checkpoint at ``index`` (none there: nothing)."""

    @abstractmethod
    def promote_checkpoint(self, index: int) -> Snapshot:
        """Make the checkpoint at ``index`` the snapshot, exactly as
        ``install_snapshot`` of it would (the log up to ``index`` dropped),
        and return it; durable when it returns."""

    @abstractmethod
    def flush(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - a log with no files has nothing to close
        pass


class _ListLog(RaftLog):
    """Shared in-memory view; subclasses add persistence hooks."""

    _entries: list
    _term: int
    _vote: str | None
    _snapshot: Snapshot | None

    @property
    def term(self) -> int:
        return self._term

    @property
    def voted_for(self) -> str | None:
        return self._vote

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    @property
    def snapshot_index(self) -> int:
        return self._snapshot.index if self._snapshot is not None else 0

    @property
    def snapshot_term(self) -> int:
        return self._snapshot.term if self._snapshot is not None else 0

    @property
    def last_index(self) -> int:
        return self.snapshot_index + len(self._entries)

    def term_at(self, index: int) -> int | None:
        base = self.snapshot_index
        if index == base:
            return self.snapshot_term
        k = index - base - 1
        if 0 <= k < len(self._entries):
            return self._entries[k].term
        return None

    def entry(self, index: int) -> Entry:
        k = index - self.snapshot_index - 1
        if not 0 <= k < len(self._entries):
            raise IndexError(f"no log entry {index} (log holds {self.snapshot_index + 1}..{self.last_index})")
        return self._entries[k]

    def entries(self, lo: int, hi: int) -> tuple[Entry, ...]:
        base = self.snapshot_index
        if lo <= base or hi - 1 > self.last_index or lo > hi:
            raise IndexError(f"entries [{lo}, {hi}) not within log {base + 1}..{self.last_index}")
        return tuple(self._entries[lo - base - 1 : hi - base - 1])

    def set_hard_state(self, term: int, voted_for: str | None) -> None:
        if not isinstance(term, int) or term < self._term:
            raise ValueError(f"term must be an int >= current term {self._term}, got {term!r}")
        if voted_for is not None and not isinstance(voted_for, str):
            raise TypeError(f"voted_for must be str or None, got {voted_for!r}")
        if (term, voted_for) == (self._term, self._vote):
            return
        self._term, self._vote = term, voted_for
        self._persist_hard_state()

    def append(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        first = entries[0].index
        base = self.snapshot_index
        if first <= base or first > self.last_index + 1:
            raise ValueError(f"append at index {first}: must be within {base + 1}..{self.last_index + 1}")
        for k, e in enumerate(entries):
            if not isinstance(e, Entry) or e.index != first + k or e.kind not in _KINDS:
                raise ValueError(f"append: entry {k} is {e!r}, expected an Entry with index {first + k}")
        del self._entries[first - base - 1 :]
        self._entries.extend(entries)
        self._persist_append(entries)

    def install_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.index < self.snapshot_index:
            raise ValueError(f"snapshot at {snapshot.index} is older than the current one at {self.snapshot_index}")
        if self.term_at(snapshot.index) == snapshot.term:
            keep = self._entries[snapshot.index - self.snapshot_index :]
        else:
            keep = []
        self._entries[:] = keep
        self._snapshot = snapshot
        for c in self.checkpoints:
            if c <= snapshot.index:
                self.drop_checkpoint(c)
        self._persist_snapshot()

    @staticmethod
    def _reconcile(snapshot: Snapshot | None, entries: list) -> list:
        """Entries consistent with ``snapshot`` (see install_snapshot)."""
        if snapshot is None or not entries:
            return entries
        first = entries[0].index
        s = snapshot.index
        if first > s + 1:
            return []
        if first == s + 1:
            return entries
        k = s - first
        if k < len(entries) and entries[k].term == snapshot.term:
            return entries[k + 1 :]
        return []

    @abstractmethod
    def _persist_hard_state(self) -> None: ...

    @abstractmethod
    def _persist_append(self, entries: Sequence[Entry]) -> None: ...

    @abstractmethod
    def _persist_snapshot(self) -> None: ...


class MemoryRaftLog(_ListLog):
    """Keeps the Raft state in ``disk[key]`` (a dict: the simulator's disk).
    Writes change the in-memory view at once and reach ``disk`` at
    :meth:`flush`, as a file's writes reach the platter at fsync: a core
    killed before its driver carried out ``Persist`` loses them."""

    def __init__(self, disk: dict, key: str = "raft"):
        if not isinstance(disk, dict):
            raise TypeError(f"MemoryRaftLog needs a dict, got {type(disk).__name__}")
        self._store = disk.setdefault(key, {"term": 0, "vote": None, "snapshot": None, "entries": []})
        self._checkpoints: dict[int, Snapshot] = self._store.setdefault("checkpoints", {})
        self._term = self._store["term"]
        self._vote = self._store["vote"]
        self._snapshot = self._store["snapshot"]
        self._entries = list(self._store["entries"])
        self._dirty = False

    @property
    def checkpoints(self) -> tuple[int, ...]:
        return tuple(sorted(self._checkpoints))

    def save_checkpoint(self, snapshot: Snapshot) -> None:
        if not self.snapshot_index < snapshot.index <= self.last_index:
            raise ValueError(
                f"checkpoint at {snapshot.index}: must be within {self.snapshot_index + 1}..{self.last_index}"
            )
        self._checkpoints[snapshot.index] = snapshot  # the disk dict: durable at once

    def drop_checkpoint(self, index: int) -> None:
        self._checkpoints.pop(index, None)

    def promote_checkpoint(self, index: int) -> Snapshot:
        snap = self._checkpoints[index]
        self.install_snapshot(snap)
        self.flush()
        return snap

    def _persist_hard_state(self) -> None:
        self._dirty = True

    def _persist_append(self, entries: Sequence[Entry]) -> None:
        self._dirty = True

    def _persist_snapshot(self) -> None:
        self._dirty = True

    def flush(self) -> None:
        if self._dirty:
            self._store.update(term=self._term, vote=self._vote, snapshot=self._snapshot, entries=list(self._entries))
            self._dirty = False

    def close(self) -> None:
        self.flush()  # a graceful close keeps everything, as the file log's does


_HEADER = struct.Struct(">III")


_NO_CAP = 1 << 62  # a segment's zeros ahead have no cap but their own bound (cut off when it is rolled)

#: A segment is rolled (a new one started) once its records pass this size.
SEGMENT_BYTES = 64 * 1024 * 1024
#: Decoded entries kept in memory (recently appended or read), bounded by
#: their encoded size plus :data:`CACHED_ENTRY_OVERHEAD` each; an entry
#: larger than this is never cached.
ENTRY_CACHE_BYTES = 4 * 1024 * 1024
#: What a cached entry costs beyond its encoded size, counted against
#: :data:`ENTRY_CACHE_BYTES`: the Entry, its decoded containers and the
#: cache's own node (some 600-700 bytes for a small command), so that many
#: small entries do not hold many times the bound.
CACHED_ENTRY_OVERHEAD = 640
#: Encoded records appended and not yet handed to the OS: past this, they are
#: written (not fsynced) at once, ahead of :meth:`FileRaftLog.write_out`.
WRITE_BUFFER_BYTES = 4 * 1024 * 1024
#: A snapshot whose record is at most this big is also kept decoded.
SNAPSHOT_CACHE_BYTES = 1024 * 1024
#: Bytes read at a time when scanning a segment on open, and at most per
#: ``pread`` of a run of entries (a single larger record is read whole).
READ_CHUNK_BYTES = 1024 * 1024
#: Read-only descriptors of older segments kept open (least recently used go).
READ_FDS = 4
#: A compaction that leaves at least this many bytes of records at or below
#: the snapshot at the head of the last segment -- and no fewer than the
#: records above it -- rolls that segment at the next append, so that a later
#: compaction deletes it whole and an open does not scan what is compacted.
COMPACT_ROLL_BYTES = 64 * 1024


def _frame(payload: bytes) -> bytes:
    head = struct.pack(">II", len(payload), crc32c(payload))
    return head + struct.pack(">I", crc32c(head)) + payload


def _unpack(raw: Any) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _encode_entry(e: Entry) -> bytes:
    data = e.data.encode() if e.kind == CONFIG else e.data
    return _frame(pack([e.index, e.term, e.kind, data]))


def _decode_entry(raw: Any) -> Entry:
    index, term, kind, data = raw
    if kind == CONFIG:
        data = Config.decode(data)
    return Entry(index, term, kind, data)


def _encode_snapshot(s: Snapshot) -> bytes:
    return _frame(pack([s.index, s.term, s.config.encode(), s.data]))


def _check(blob: bytes | memoryview, off: int) -> tuple[Any, str | None]:
    """The payload of the record at ``off`` of ``blob`` and why it is bad
    (None: good)."""
    if len(blob) - off < _HEADER.size:
        return b"", "incomplete header"
    length, crc, hcrc = _HEADER.unpack_from(blob, off)
    if crc32c(blob[off : off + 8]) != hcrc:
        return b"", "header checksum mismatch"
    start = off + _HEADER.size
    if start + length > len(blob):
        return b"", f"record of {length} bytes runs past the end of the file"
    payload = blob[start : start + length]
    if crc32c(payload) != crc:
        return payload, "payload checksum mismatch"
    return payload, None


def _pread(pread: Callable[[int, int, int], bytes], fd: int, n: int, off: int) -> bytes:
    """Up to ``n`` bytes at ``off`` (fewer only at the end of the file)."""
    data = pread(fd, n, off)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = pread(fd, n - got, off + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class _Scan:
    """Reads a file front to back through a buffer of about
    :data:`READ_CHUNK_BYTES` (a larger record is read whole)."""

    def __init__(self, fd: int, size: int, pread: Callable[[int, int, int], bytes]):
        self.fd, self.size, self.pread = fd, size, pread
        self.buf, self.at = b"", 0
        self.view = memoryview(self.buf)

    def _fill(self, off: int, n: int) -> None:
        self.buf = _pread(self.pread, self.fd, min(max(n, READ_CHUNK_BYTES), self.size - off), off)
        self.view = memoryview(self.buf)
        self.at = off

    def read(self, off: int, n: int) -> bytes:
        end = min(off + n, self.size)
        if not (self.at <= off and end <= self.at + len(self.buf)):
            self._fill(off, end - off)
        return self.buf[off - self.at : end - self.at]

    def record(self, off: int) -> tuple[Any, str | None, int]:
        """``(payload, reason, end)`` of the record at ``off``, as :func:`_check`
        (the payload a memoryview)."""
        rel = off - self.at
        if rel < 0 or rel + _HEADER.size > len(self.buf):
            self._fill(off, _HEADER.size)
            rel = 0
            if len(self.buf) < _HEADER.size:
                return b"", "incomplete header", off
        length, crc, hcrc = _HEADER.unpack_from(self.buf, rel)
        if crc32c(self.view[rel : rel + 8]) != hcrc:
            return b"", "header checksum mismatch", off
        end = off + _HEADER.size + length
        if end > self.size:
            return b"", f"record of {length} bytes runs past the end of the file", off
        if end - self.at > len(self.buf):
            self._fill(off, end - off)
            rel = 0
        payload = self.view[rel + _HEADER.size : rel + _HEADER.size + length]
        if crc32c(payload) != crc:
            return payload, "payload checksum mismatch", end
        return payload, None, end

    def zeros(self, off: int) -> bool:
        """Whether the file holds only zeros from ``off`` to its end."""
        while off < self.size:
            chunk = self.read(off, READ_CHUNK_BYTES)
            if not chunk or chunk.count(0) != len(chunk):
                return not chunk
            off += len(chunk)
        return True


class _Segment:
    """One segment file: ``first`` is the index of its first record (its name).
    ``fd`` is open (read-write) while the segment is written: the last one,
    and a rolled one until the write-out that finishes it; ``exists`` is False
    until the write-out that creates it.  ``written`` bytes are in the file,
    ``pending`` follow them (``end`` = both), ``allocated`` is the file's
    length with the zeros written ahead."""

    __slots__ = ("first", "path", "fd", "exists", "written", "end", "allocated", "pending")

    def __init__(self, first: int, path: str):
        self.first, self.path = first, path
        self.fd: int | None = None
        self.exists = False
        self.written = self.end = self.allocated = 0
        self.pending = bytearray()


class FileRaftLog(RaftLog):
    """Raft state in a directory (see the module docstring for the format).

    ``segment_bytes`` and ``cache_bytes`` default to :data:`SEGMENT_BYTES`
    and :data:`ENTRY_CACHE_BYTES`.  ``fs``: the file system the directory is
    on (:mod:`mirrorq.fsapi`), the real one by default; the simulator hands
    in a :class:`mirrorq.simdisk.SimDisk`."""

    LOG = "log"  # the single-file format of old: renamed to the first segment on open
    SEGMENT = "log."
    HARDSTATE = "hardstate"
    SNAPSHOT = "snapshot"
    CHECKPOINT = "checkpoint."

    def __init__(
        self,
        directory: str | os.PathLike,
        segment_bytes: int = SEGMENT_BYTES,
        cache_bytes: int = ENTRY_CACHE_BYTES,
        *,
        fs: FileSystem = OS,
    ):
        if not isinstance(segment_bytes, int) or segment_bytes < 1:
            raise ValueError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        self.directory = os.fspath(directory)
        self._fs = fs
        self.segment_bytes = segment_bytes
        self.cache_bytes = cache_bytes
        self._fs.makedirs(self.directory, exist_ok=True)
        self._closed = False
        self._term, self._vote = 0, None
        hard = self._read_single(self.HARDSTATE)
        if hard is not None:
            self._term, self._vote = hard
        # the snapshot: (index, term, config) in memory, its data in the file
        self._snap_meta: tuple[int, int, Config] | None = None
        self._snap_cache: Snapshot | None = None
        payload = self._read_payload(self.SNAPSHOT)
        if payload is not None:
            self._snap_meta = self._snapshot_meta(self._path(self.SNAPSHOT), payload)
            if len(payload) + _HEADER.size <= SNAPSHOT_CACHE_BYTES:
                self._snap_cache = self._decode_snapshot(self._path(self.SNAPSHOT), payload)
        # the log: per entry ``_base + k`` its term, kind, and where its record is
        self._base = 1
        self._terms = array("Q")
        self._kinds = bytearray()
        self._offs = array("Q")
        self._lens = array("I")
        self._configs: list[tuple[int, Config]] = []  # (index, config) of the CONFIG entries
        self._segs: list[_Segment] = []
        self._firsts: list[int] = []  # each segment's first index, for bisect
        self._cache: OrderedDict[int, tuple[Entry, int]] = OrderedDict()  # index -> (entry, encoded size)
        self._cache_used = 0
        self._unwritten: dict[int, Entry] = {}  # entries whose records are pending
        self._pending_bytes = 0
        self._readers: OrderedDict[str, int] = OrderedDict()  # path -> read-only fd, at most READ_FDS
        self._dirty = False
        self._roll_next = False  # start a segment at the next append (COMPACT_ROLL_BYTES)
        ours = (self.HARDSTATE, self.SNAPSHOT, self.LOG)
        for name in self._fs.listdir(self.directory):  # the directory may hold others' files too
            if name.endswith(".tmp") and (name[:-4] in ours or name.startswith(self.CHECKPOINT)):
                self._fs.unlink(self._path(name))  # an atomic write a crash interrupted
        self._load_log()
        self._checkpoints: list[int] = []
        for name in self._fs.listdir(self.directory):
            if name.startswith(self.CHECKPOINT) and name[len(self.CHECKPOINT) :].isdigit():
                index = int(name[len(self.CHECKPOINT) :])
                if index <= self.snapshot_index:
                    self._fs.unlink(self._path(name))  # a crash came between a snapshot and this drop
                else:
                    self._checkpoints.append(index)
        self._checkpoints.sort()

    # ---- the in-memory view ---------------------------------------------
    @property
    def term(self) -> int:
        return self._term

    @property
    def voted_for(self) -> str | None:
        return self._vote

    @property
    def snapshot(self) -> Snapshot | None:
        """Read from the file at each access unless it is small
        (:data:`SNAPSHOT_CACHE_BYTES`): a caller that keeps it holds its
        memory."""
        if self._snap_meta is None:
            return None
        if self._snap_cache is not None:
            return self._snap_cache
        path = self._path(self.SNAPSHOT)
        payload = self._read_payload(self.SNAPSHOT)
        if payload is None:
            raise RaftLogCorrupt(path, 0, "the snapshot file is gone")
        return self._decode_snapshot(path, payload)

    @property
    def snapshot_index(self) -> int:
        return self._snap_meta[0] if self._snap_meta is not None else 0

    @property
    def snapshot_term(self) -> int:
        return self._snap_meta[1] if self._snap_meta is not None else 0

    @property
    def last_index(self) -> int:
        return self._base - 1 + len(self._terms)

    def term_at(self, index: int) -> int | None:
        k = index - self._base
        if 0 <= k < len(self._terms):
            return self._terms[k]
        if k == -1:
            return self.snapshot_term
        return None

    def entry(self, index: int) -> Entry:
        k = index - self._base
        if not 0 <= k < len(self._terms):
            raise IndexError(f"no log entry {index} (log holds {self._base}..{self.last_index})")
        e = self._unwritten.get(index)
        if e is not None:
            return e
        hit = self._cache.get(index)
        if hit is not None:
            self._cache.move_to_end(index)
            return hit[0]
        seg = self._segment_of(index)
        off, n = self._offs[k], self._lens[k]
        e = self._decode_record(seg.path, off, index, k, _pread(self._fs.pread, self._read_fd(seg), n, off))
        self._cache_put(index, e, n)
        return e

    def entries(self, lo: int, hi: int) -> tuple[Entry, ...]:
        base = self._base
        if lo < base or hi - 1 > self.last_index or lo > hi:
            raise IndexError(f"entries [{lo}, {hi}) not within log {base}..{self.last_index}")
        out: list = [None] * (hi - lo)
        missing: list[int] = []
        for i in range(lo, hi):
            e = self._unwritten.get(i)
            if e is None:
                hit = self._cache.get(i)
                if hit is None:
                    missing.append(i)
                    continue
                self._cache.move_to_end(i)
                e = hit[0]
            out[i - lo] = e
        # read what is missing in runs: one pread per run of adjacent records of one segment
        offs, lens = self._offs, self._lens
        j = 0
        while j < len(missing):
            i0 = missing[j]
            seg = self._segment_of(i0)
            k0 = i0 - base
            start = end = offs[k0]
            n = 1
            while j + n < len(missing):
                i = missing[j + n]
                k = i - base
                if (
                    i != i0 + n
                    or offs[k] != end + lens[k - 1]
                    or offs[k] + lens[k] - start > READ_CHUNK_BYTES
                    or self._segment_of(i) is not seg
                ):
                    break
                end = offs[k]
                n += 1
            last_k = k0 + n - 1
            blob = _pread(self._fs.pread, self._read_fd(seg), offs[last_k] + lens[last_k] - start, start)
            for m in range(n):
                k = k0 + m
                rel = offs[k] - start
                e = self._decode_record(seg.path, offs[k], i0 + m, k, blob[rel : rel + lens[k]])
                self._cache_put(i0 + m, e, lens[k])
                out[i0 + m - lo] = e
            j += n
        return tuple(out)

    def config_entries(self, lo: int) -> list[tuple[int, Config]]:
        lo = max(lo, self._base)
        return [(i, c) for i, c in self._configs if i >= lo]

    # ---- mutators ---------------------------------------------------------
    def set_hard_state(self, term: int, voted_for: str | None) -> None:
        if not isinstance(term, int) or term < self._term:
            raise ValueError(f"term must be an int >= current term {self._term}, got {term!r}")
        if voted_for is not None and not isinstance(voted_for, str):
            raise TypeError(f"voted_for must be str or None, got {voted_for!r}")
        if (term, voted_for) == (self._term, self._vote):
            return
        self._term, self._vote = term, voted_for
        self._atomic_write(self.HARDSTATE, _frame(pack([self._term, self._vote])))

    def append(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        first = entries[0].index
        if first < self._base or first > self.last_index + 1:
            raise ValueError(f"append at index {first}: must be within {self._base}..{self.last_index + 1}")
        for k, e in enumerate(entries):
            if not isinstance(e, Entry) or e.index != first + k or e.kind not in _KINDS:
                raise ValueError(f"append: entry {k} is {e!r}, expected an Entry with index {first + k}")
        recs = [_encode_entry(e) for e in entries]  # one that cannot be encoded changes nothing
        # a record that replaces written ones must follow them in their segment (see the docstring)
        stay = first <= self.last_index and self._truncate(first)
        for e, rec in zip(entries, recs):
            seg = self._segs[-1]
            if stay:
                stay = False
            elif seg.end >= self.segment_bytes or (self._roll_next and seg.end):
                self._roll_next = False
                seg = _Segment(e.index, self._segment_path(e.index))
                self._segs.append(seg)
                self._firsts.append(e.index)
            self._terms.append(e.term)
            self._kinds.append(e.kind)
            self._offs.append(seg.end)
            self._lens.append(len(rec))
            seg.pending += rec
            seg.end += len(rec)
            self._pending_bytes += len(rec)
            self._unwritten[e.index] = e
            if e.kind == CONFIG:
                self._configs.append((e.index, e.data))
            self._cache_put(e.index, e, len(rec))
        self._dirty = True
        if self._pending_bytes > WRITE_BUFFER_BYTES:
            self._write_pending()

    def _truncate(self, index: int) -> bool:
        """Forget the entries from ``index`` on (in memory; records not yet
        written are dropped, later segments deleted).  True if written records
        of ``index`` or later may stay, so its replacement must follow them in
        their segment (replay truncates there)."""
        for i in [i for i in self._unwritten if i >= index]:
            del self._unwritten[i]
        for i in [i for i in self._cache if i >= index]:
            self._cache_used -= self._cache.pop(i)[1]
        while self._configs and self._configs[-1][0] >= index:
            self._configs.pop()
        n = bisect_right(self._firsts, index) - 1
        seg = self._segs[n]
        if n + 1 < len(self._segs):
            # later segments go, newest first, durably before anything is written to ``seg``
            unlinked = False
            for later in reversed(self._segs[n + 1 :]):
                self._pending_bytes -= len(later.pending)
                unlinked |= self._discard(later)
            del self._segs[n + 1 :], self._firsts[n + 1 :]
            if unlinked:
                self._fsync_dir()
            if seg.fd is None and seg.exists:  # a finished segment is written again
                self._close_reader(seg.path)
                seg.fd = self._fs.open(seg.path, os.O_RDWR)
                seg.written = seg.end = seg.allocated = self._fs.fstat(seg.fd).st_size
        k = index - self._base
        off = self._offs[k]
        del self._terms[k:], self._kinds[k:], self._offs[k:], self._lens[k:]
        if off > seg.written:
            # not written, and neither is the entry before it (pending records are live entries,
            # in order): it simply goes, and its replacement follows entry ``index - 1``
            self._pending_bytes -= seg.end - off
            del seg.pending[off - seg.written :]
            seg.end = off
            return False
        # what is pending is all after ``index`` (live records are in offset order) and goes; the
        # records written last may be (older) entries at or after ``index``: its replacement truncates
        self._pending_bytes -= len(seg.pending)
        seg.pending = bytearray()
        seg.end = seg.written
        return True

    def install_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.index < self.snapshot_index:
            raise ValueError(f"snapshot at {snapshot.index} is older than the current one at {self.snapshot_index}")
        keep = self.term_at(snapshot.index) == snapshot.term
        blob = _encode_snapshot(snapshot)
        self._atomic_write(self.SNAPSHOT, blob)
        self._snapshot_installed(snapshot, len(blob), keep)

    def _snapshot_installed(self, s: Snapshot, size: int, keep: bool) -> None:
        """``s`` (``size`` bytes) is the durable snapshot now: the log follows."""
        self._snap_meta = (s.index, s.term, s.config)
        self._snap_cache = s if size <= SNAPSHOT_CACHE_BYTES else None
        for c in [c for c in self._checkpoints if c <= s.index]:
            self.drop_checkpoint(c)
        if keep:
            self._drop_prefix(s.index)
        else:
            self._drop_all(s.index)

    def _drop_prefix(self, index: int) -> None:
        """Forget the entries up to ``index``; delete the segments (not the
        last) that hold no later entry, oldest first."""
        n = index + 1 - self._base
        if n > 0:
            del self._terms[:n], self._kinds[:n], self._offs[:n], self._lens[:n]
            self._base = index + 1
            for i in [i for i in self._unwritten if i <= index]:
                del self._unwritten[i]
            for i in [i for i in self._cache if i <= index]:
                self._cache_used -= self._cache.pop(i)[1]
            self._configs = [(i, c) for i, c in self._configs if i > index]
        drop = 0
        while drop + 1 < len(self._segs) and self._firsts[drop + 1] <= index + 1:
            drop += 1
        if drop:
            unlinked = False
            for seg in self._segs[:drop]:
                self._pending_bytes -= len(seg.pending)
                unlinked |= self._discard(seg)
            del self._segs[:drop], self._firsts[:drop]
            if unlinked:
                self._fsync_dir()
        last = self._segs[-1]
        live = max(self._base, last.first)  # the first entry above ``index`` in the last segment
        dead = self._offs[live - self._base] if live <= self.last_index else last.end
        if dead >= max(COMPACT_ROLL_BYTES, last.end - dead):
            self._roll_next = True

    def _drop_all(self, index: int) -> None:
        """Forget every entry: delete every segment (newest first, so a crash
        leaves a prefix of the old log, which reconciliation drops) and
        start an empty one after ``index``."""
        for seg in reversed(self._segs):
            self._discard(seg)
        self._segs, self._firsts = [], []
        del self._terms[:], self._kinds[:], self._offs[:], self._lens[:]
        self._base = index + 1
        self._unwritten.clear()
        self._cache.clear()
        self._cache_used = 0
        self._configs = []
        self._pending_bytes = 0
        self._roll_next = False
        self._start_segment(index + 1)

    # ---- checkpoints ------------------------------------------------------
    @property
    def checkpoints(self) -> tuple[int, ...]:
        return tuple(self._checkpoints)

    def save_checkpoint(self, snapshot: Snapshot) -> None:
        if not self.snapshot_index < snapshot.index <= self.last_index:
            raise ValueError(
                f"checkpoint at {snapshot.index}: must be within {self.snapshot_index + 1}..{self.last_index}"
            )
        self._atomic_write(f"{self.CHECKPOINT}{snapshot.index}", _encode_snapshot(snapshot))
        k = bisect_left(self._checkpoints, snapshot.index)
        if k == len(self._checkpoints) or self._checkpoints[k] != snapshot.index:
            self._checkpoints.insert(k, snapshot.index)

    def drop_checkpoint(self, index: int) -> None:
        k = bisect_left(self._checkpoints, index)
        if k < len(self._checkpoints) and self._checkpoints[k] == index:
            del self._checkpoints[k]
        try:
            self._fs.unlink(self._path(f"{self.CHECKPOINT}{index}"))
        except FileNotFoundError:
            pass

    def promote_checkpoint(self, index: int) -> Snapshot:
        if index not in self._checkpoints:
            raise KeyError(index)
        name = f"{self.CHECKPOINT}{index}"
        path = self._path(name)
        payload = self._read_payload(name)
        if payload is None:
            raise KeyError(index)
        snap = self._decode_snapshot(path, payload)
        if snap.index != index:
            raise RaftLogCorrupt(path, 0, f"checkpoint file holds a snapshot at {snap.index}")
        if index < self.snapshot_index:
            raise ValueError(f"checkpoint at {index} is older than the snapshot at {self.snapshot_index}")
        keep = self.term_at(index) == snap.term
        self._fs.replace(path, self._path(self.SNAPSHOT))  # the same record format: no re-encoding
        self._fsync_dir()
        self._checkpoints.remove(index)
        self._snapshot_installed(snap, len(payload) + _HEADER.size, keep)
        return snap

    # ---- durability -------------------------------------------------------
    def flush(self) -> None:
        fd = self.write_out()
        if fd is not None:
            self._fs.fsync(fd)

    def write_out(self) -> int | None:
        """The first half of :meth:`flush`: hand the appends since the last
        flush to the OS without waiting for the disk.  Returns the file
        descriptor to fsync (or whose filesystem to sync: a queue host syncs
        many groups' logs at once, :mod:`mirrorq.store.group_sync`)
        before anything that depends on them; None if nothing was appended.
        Segments finished on the way (rolled) are fsynced here, before the
        next is created: the returned descriptor is the last segment's."""
        if not self._dirty:
            return None
        self._write_pending()
        self._dirty = False
        return self._segs[-1].fd

    def _write_pending(self) -> None:
        segs = self._segs
        n = len(segs) - 1
        while n > 0 and (segs[n - 1].fd is not None or not segs[n - 1].exists):
            n -= 1  # rolled and not yet finished
        for seg in segs[n:-1]:
            self._write_segment(seg)
            fd = seg.fd
            assert fd is not None  # a rolled segment holds records: open until finished here
            if seg.allocated > seg.end:
                self._fs.ftruncate(fd, seg.end)  # a finished segment ends at its last record
            seg.allocated = seg.end
            self._fs.fsync(fd)  # durable before the next segment exists
            self._fs.close(fd)
            seg.fd = None
        last = segs[-1]
        self._write_segment(last)
        if last.fd is not None:
            last.allocated = preallocate.extend(last.fd, last.end, last.allocated, _NO_CAP, self._fs.pwrite)
        self._unwritten.clear()
        self._pending_bytes = 0

    def _write_segment(self, seg: _Segment) -> None:
        if not seg.pending:
            return
        if not seg.exists:
            self._create(seg)
        fd = seg.fd
        assert fd is not None  # a segment with records pending is open (_create opened a new one)
        preallocate.write_at(fd, memoryview(seg.pending), seg.written, self._fs.pwrite)
        seg.written = seg.end
        seg.pending = bytearray()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        for seg in self._segs:
            if seg.fd is not None:
                if seg.allocated > seg.end:
                    self._fs.ftruncate(seg.fd, seg.end)
                    seg.allocated = seg.end
                self._fs.close(seg.fd)
                seg.fd = None
        for path in list(self._readers):
            self._close_reader(path)
        self._closed = True

    # ---- cache and reading ---------------------------------------------------
    def _cache_put(self, index: int, e: Entry, size: int) -> None:
        size += CACHED_ENTRY_OVERHEAD
        if size > self.cache_bytes:
            return
        old = self._cache.pop(index, None)
        if old is not None:
            self._cache_used -= old[1]
        self._cache[index] = (e, size)
        self._cache_used += size
        while self._cache_used > self.cache_bytes:
            self._cache_used -= self._cache.popitem(last=False)[1][1]

    def _segment_of(self, index: int) -> _Segment:
        return self._segs[bisect_right(self._firsts, index) - 1]

    def _read_fd(self, seg: _Segment) -> int:
        if seg.fd is not None:
            return seg.fd
        fd = self._readers.get(seg.path)
        if fd is not None:
            self._readers.move_to_end(seg.path)
            return fd
        fd = self._readers[seg.path] = self._fs.open(seg.path, os.O_RDONLY)
        while len(self._readers) > READ_FDS:
            self._fs.close(self._readers.popitem(last=False)[1])
        return fd

    def _close_reader(self, path: str) -> None:
        fd = self._readers.pop(path, None)
        if fd is not None:
            self._fs.close(fd)

    def _decode_record(self, path: str, off: int, index: int, k: int, raw: bytes) -> Entry:
        payload, reason = _check(raw, 0)
        if reason is None and len(raw) != _HEADER.size + len(payload):
            reason = "record length differs from the index"
        if reason is not None:
            raise RaftLogCorrupt(path, off, reason)
        try:
            e = _decode_entry(_unpack(payload))
        except Exception as exc:
            raise RaftLogCorrupt(path, off, f"undecodable entry: {exc}") from None
        if e.index != index or e.term != self._terms[k] or e.kind != self._kinds[k]:
            raise RaftLogCorrupt(
                path,
                off,
                f"holds entry {e.index} (term {e.term}, kind {e.kind}), expected "
                f"{index} (term {self._terms[k]}, kind {self._kinds[k]})",
            )
        return e

    # ---- files ----------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _segment_path(self, first: int) -> str:
        return self._path(f"{self.SEGMENT}{first:020d}")

    def _create(self, seg: _Segment) -> None:
        seg.fd = self._fs.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        seg.exists = True
        self._fsync_dir()

    def _start_segment(self, first: int) -> None:
        """An empty last segment, created now."""
        seg = _Segment(first, self._segment_path(first))
        self._create(seg)
        self._segs.append(seg)
        self._firsts.append(first)

    def _discard(self, seg: _Segment) -> bool:
        """Close and delete ``seg``'s file; True if there was one."""
        self._close_reader(seg.path)
        if seg.fd is not None:
            self._fs.close(seg.fd)
            seg.fd = None
        seg.pending = bytearray()
        if seg.exists:
            seg.exists = False
            self._fs.unlink(seg.path)
            return True
        return False

    def _read_payload(self, name: str) -> bytes | None:
        path = self._path(name)
        try:
            blob = read_file(self._fs, path)
        except FileNotFoundError:
            return None
        payload, reason = _check(blob, 0)
        if reason is not None or len(blob) != _HEADER.size + len(payload):
            raise RaftLogCorrupt(path, 0, reason or "trailing bytes after the record")
        return payload

    def _read_single(self, name: str) -> Any:
        payload = self._read_payload(name)
        return None if payload is None else _unpack(payload)

    @staticmethod
    def _decode_snapshot(path: str, payload: bytes) -> Snapshot:
        try:
            index, term, config, data = _unpack(payload)
            return Snapshot(index, term, Config.decode(config), data)
        except Exception as exc:
            raise RaftLogCorrupt(path, 0, f"undecodable snapshot: {exc}") from None

    @staticmethod
    def _snapshot_meta(path: str, payload: bytes) -> tuple[int, int, Config]:
        """Index, term and config of a snapshot record, its data skipped."""
        try:
            u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
            u.feed(payload)
            if u.read_array_header() != 4:
                raise ValueError("not a 4-item array")
            return u.unpack(), u.unpack(), Config.decode(u.unpack())
        except Exception as exc:
            raise RaftLogCorrupt(path, 0, f"undecodable snapshot: {exc}") from None

    def _atomic_write(self, name: str, blob: bytes) -> None:
        path = self._path(name)
        tmp = path + ".tmp"
        fs = self._fs
        fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            preallocate.write_at(fd, blob, 0, fs.pwrite)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = self._fs.open(self.directory, os.O_RDONLY)
        try:
            self._fs.fsync(fd)
        finally:
            self._fs.close(fd)

    # ---- open -------------------------------------------------------------
    def _segment_files(self) -> list[tuple[int, str]]:
        out = []
        for name in self._fs.listdir(self.directory):
            if name.startswith(self.SEGMENT) and name[len(self.SEGMENT) :].isdigit():
                out.append((int(name[len(self.SEGMENT) :]), self._path(name)))
        return sorted(out)

    def _migrate_single_file(self) -> None:
        """The old format's one ``log`` file becomes the first segment, named
        by its first record (a rename: atomic)."""
        old = self._path(self.LOG)
        if not self._fs.exists(old):
            return
        if self._segment_files():
            raise RaftLogCorrupt(old, 0, "an old single-file log beside segment files")
        first = self.snapshot_index + 1
        fd = self._fs.open(old, os.O_RDONLY)
        try:
            head = _pread(self._fs.pread, fd, _HEADER.size, 0)
            if len(head) == _HEADER.size:
                payload, reason = _check(head + _pread(self._fs.pread, fd, _HEADER.unpack(head)[0], _HEADER.size), 0)
                if reason is None:
                    try:
                        first = int(_unpack(payload)[0])
                    except Exception:
                        pass  # replay says what is wrong with it
        finally:
            self._fs.close(fd)
        self._fs.rename(old, self._segment_path(first))
        self._fsync_dir()

    def _load_log(self) -> None:
        self._migrate_single_file()
        files = self._segment_files()
        terms, kinds, offs, lens, configs = self._terms, self._kinds, self._offs, self._lens, self._configs
        rbase = 0  # index of terms[0] (0: no record yet)
        for n, (first, path) in enumerate(files):
            last = rbase - 1 + len(terms) if rbase else None
            is_last = n == len(files) - 1
            seg = _Segment(first, path)
            seg.exists = True
            fd = self._fs.open(path, os.O_RDONLY)
            try:
                size = self._fs.fstat(fd).st_size
                scan = _Scan(fd, size, self._fs.pread)
                off = 0
                seen = False
                while off < size:
                    payload, reason, end = scan.record(off)
                    if reason is not None:
                        zeros = scan.zeros(off)
                        torn = is_last and (
                            reason == "incomplete header"
                            or "past the end" in reason
                            or (reason == "payload checksum mismatch" and (end == size or scan.zeros(end)))
                            or (reason == "header checksum mismatch" and scan.zeros(off + _HEADER.size))
                        )
                        if not (torn or zeros):
                            raise RaftLogCorrupt(path, off, reason)
                        wfd = self._fs.open(path, os.O_RDWR)
                        try:
                            self._fs.ftruncate(wfd, off)
                            self._fs.fsync(wfd)
                        finally:
                            self._fs.close(wfd)
                        size = off
                        break
                    try:
                        index, term, kind, data = _unpack(payload)
                        if kind not in _KINDS:
                            raise ValueError(f"kind {kind!r}")
                        if kind == CONFIG:
                            data = Config.decode(data)
                    except Exception as exc:  # checksum fine but not an entry: a bug or tampering
                        raise RaftLogCorrupt(path, off, f"undecodable entry: {exc}") from None
                    if not seen:
                        if index != first:
                            raise RaftLogCorrupt(path, off, f"segment {first} starts with entry {index}")
                        if last is not None and index != last + 1:
                            raise RaftLogCorrupt(path, off, f"entry {index} does not follow {last}")
                        if not rbase:
                            rbase = index
                        seen = True
                    else:
                        assert last is not None  # the index of this segment's previous record
                        if index > last + 1 or index < first:
                            raise RaftLogCorrupt(path, off, f"entry {index} does not follow {last}")
                        elif index <= last:  # conflict truncation
                            k = index - rbase
                            del terms[k:], kinds[k:], offs[k:], lens[k:]
                            while configs and configs[-1][0] >= index:
                                configs.pop()
                    terms.append(term)
                    kinds.append(kind)
                    offs.append(off)
                    lens.append(end - off)
                    if kind == CONFIG:
                        configs.append((index, data))
                    last = index
                    off = end
            finally:
                self._fs.close(fd)
            if not seen:
                if not is_last:
                    raise RaftLogCorrupt(path, 0, "empty segment before the last")
                if last is not None and first != last + 1:
                    raise RaftLogCorrupt(path, 0, f"segment {first} does not follow entry {last}")
            seg.written = seg.end = seg.allocated = size
            self._segs.append(seg)
            self._firsts.append(first)
        # reconcile with the snapshot (a crash may have come between it and the segments' deletion)
        s, s_term = self.snapshot_index, self.snapshot_term
        if not rbase:
            drop_all = not (len(self._segs) == 1 and self._segs[0].first == s + 1)
        elif rbase > s + 1:
            if s == 0:
                raise RaftLogCorrupt(self._segs[0].path, 0, f"log starts at entry {rbase} and there is no snapshot")
            drop_all = True
        else:
            k = s - rbase
            drop_all = k >= 0 and (k >= len(terms) or terms[k] != s_term)
        if drop_all:
            self._drop_all(s)
            return
        self._base = rbase or s + 1
        self._drop_prefix(s)
        seg = self._segs[-1]
        seg.fd = self._fs.open(seg.path, os.O_RDWR)
