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
    a directory holding three files:

    ``log``
        append-only records ``[u32 length][u32 crc32c(payload)]
        [u32 crc32c(first 8 bytes)]`` + msgpack payload ``[index, term, kind,
        data]``.  An entry whose index is at or below the current last index
        truncates the log from there on replay (so conflict truncation is an
        append too).  Compaction rewrites the file (temp file, fsync, rename).
        Zeros are written ahead of the records (:mod:`mirrorq.preallocate`)
        so that a flush's fsync changes no file size; they are cut off on
        close.
    ``hardstate``, ``snapshot``
        one checksummed record each, replaced atomically (write temp, fsync,
        rename, fsync directory).

    On open, a *torn tail* -- fewer bytes than a header, a record running
    past the end of the file, a last record whose checksum fails, a record
    cut short with only zeros after it, or a tail of zero bytes (what is
    left of the zeros written ahead) -- is truncated away (it was never
    flushed, so never acknowledged).  Any other bad record, one with valid data after it, is
    corruption in the middle: :class:`RaftLogCorrupt` is raised, naming the
    file and the byte offset.  Commands, snapshot blobs and node names must be
    msgpack-serialisable; tuples come back as lists.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack
from crc32c import crc32c

from mirrorq import preallocate
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
    def decode(cls, raw: Any) -> "Config":
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
        return [(i, e.data) for i in range(max(lo, self.snapshot_index + 1), self.last_index + 1)
                if (e := self.entry(i)).kind == CONFIG]

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

    def close(self) -> None:
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
            raise ValueError(f"checkpoint at {snapshot.index}: must be within {self.snapshot_index + 1}..{self.last_index}")
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


_NO_CAP = 1 << 62  # a Raft log is one file: its zeros ahead have no cap but their own bound


def _frame(payload: bytes) -> bytes:
    head = struct.pack(">II", len(payload), crc32c(payload))
    return head + struct.pack(">I", crc32c(head)) + payload


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _encode_entry(e: Entry) -> bytes:
    data = e.data.encode() if e.kind == CONFIG else e.data
    return _frame(pack([e.index, e.term, e.kind, data]))


def _decode_entry(raw: Any) -> Entry:
    index, term, kind, data = raw
    if kind == CONFIG:
        data = Config.decode(data)
    return Entry(index, term, kind, data)


class FileRaftLog(_ListLog):
    """Raft state in a directory (see the module docstring for the format)."""

    LOG = "log"
    HARDSTATE = "hardstate"
    SNAPSHOT = "snapshot"

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._log_path = os.path.join(self.directory, self.LOG)
        self._term, self._vote = 0, None
        hard = self._read_single(self.HARDSTATE)
        if hard is not None:
            self._term, self._vote = hard
        snap = self._read_single(self.SNAPSHOT)
        self._snapshot = None
        if snap is not None:
            index, term, config, data = snap
            self._snapshot = Snapshot(index, term, Config.decode(config), data)
        loaded = self._read_log()
        self._entries = self._reconcile(self._snapshot, loaded)
        self._dirty = False
        if len(self._entries) != len(loaded):
            self._rewrite_log()
        self._open_log()

    # ---- checkpoints ------------------------------------------------------
    CHECKPOINT = "checkpoint."

    @property
    def checkpoints(self) -> tuple[int, ...]:
        out = []
        for name in os.listdir(self.directory):
            if name.startswith(self.CHECKPOINT) and name[len(self.CHECKPOINT):].isdigit():
                out.append(int(name[len(self.CHECKPOINT):]))
        return tuple(sorted(out))

    def save_checkpoint(self, snapshot: Snapshot) -> None:
        if not self.snapshot_index < snapshot.index <= self.last_index:
            raise ValueError(f"checkpoint at {snapshot.index}: must be within {self.snapshot_index + 1}..{self.last_index}")
        s = snapshot
        self._atomic_write(f"{self.CHECKPOINT}{s.index}", _frame(pack([s.index, s.term, s.config.encode(), s.data])))

    def drop_checkpoint(self, index: int) -> None:
        try:
            os.unlink(os.path.join(self.directory, f"{self.CHECKPOINT}{index}"))
        except FileNotFoundError:
            pass

    def promote_checkpoint(self, index: int) -> Snapshot:
        index_, term, config, data = self._read_single(f"{self.CHECKPOINT}{index}")
        snap = Snapshot(index_, term, Config.decode(config), data)
        self.install_snapshot(snap)
        return snap

    def _open_log(self) -> None:
        self._fd: int | None = os.open(self._log_path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._end = self._allocated = os.fstat(self._fd).st_size
        self._pending: list[bytes] = []  # encoded entries not yet written

    # ---- reading --------------------------------------------------------
    def _read_single(self, name: str) -> Any:
        path = os.path.join(self.directory, name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        payload, reason = self._check(blob, 0)
        if reason is not None or len(blob) != _HEADER.size + len(payload):
            raise RaftLogCorrupt(path, 0, reason or "trailing bytes after the record")
        return _unpack(payload)

    @staticmethod
    def _check(blob: bytes, off: int) -> tuple[bytes, str | None]:
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

    def _read_log(self) -> list:
        try:
            with open(self._log_path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return []
        entries: list[Entry] = []
        off = 0
        n = len(blob)
        while off < n:
            payload, reason = self._check(blob, off)
            if reason is not None:
                end_of_record = off + _HEADER.size + len(payload)
                torn = (
                    reason == "incomplete header"
                    or "past the end" in reason
                    or (reason == "payload checksum mismatch" and (end_of_record == n or not any(blob[end_of_record:])))
                    or (reason == "header checksum mismatch" and not any(blob[off + _HEADER.size:]))
                    or not any(blob[off:])
                )
                if not torn:
                    raise RaftLogCorrupt(self._log_path, off, reason)
                with open(self._log_path, "r+b") as f:
                    f.truncate(off)
                    f.flush()
                    os.fsync(f.fileno())
                break
            try:
                e = _decode_entry(_unpack(payload))
            except Exception as exc:  # checksum fine but not an entry: a bug or tampering
                raise RaftLogCorrupt(self._log_path, off, f"undecodable entry: {exc}") from None
            if entries:
                last = entries[-1].index
                if e.index > last + 1 or e.index <= last - len(entries):
                    raise RaftLogCorrupt(self._log_path, off, f"entry {e.index} does not follow {last}")
                del entries[e.index - entries[0].index :]
            entries.append(e)
            off += _HEADER.size + len(payload)
        return entries

    # ---- writing --------------------------------------------------------
    def _atomic_write(self, name: str, blob: bytes) -> None:
        path = os.path.join(self.directory, name)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _persist_hard_state(self) -> None:
        self._atomic_write(self.HARDSTATE, _frame(pack([self._term, self._vote])))

    def _persist_append(self, entries: Sequence[Entry]) -> None:
        self._pending.append(b"".join(_encode_entry(e) for e in entries))
        self._dirty = True

    def _persist_snapshot(self) -> None:
        s = self._snapshot
        self._atomic_write(self.SNAPSHOT, _frame(pack([s.index, s.term, s.config.encode(), s.data])))
        os.close(self._fd)
        self._rewrite_log()  # from the entries in memory: what was pending is in it
        self._open_log()

    def _rewrite_log(self) -> None:
        self._atomic_write(self.LOG, b"".join(_encode_entry(e) for e in self._entries))
        self._dirty = False

    def flush(self) -> None:
        fd = self.write_out()
        if fd is not None:
            os.fsync(fd)

    def write_out(self) -> int | None:
        """The first half of :meth:`flush`: hand the appends since the last
        flush to the OS without waiting for the disk.  Returns the file
        descriptor to fsync (or whose filesystem to sync: a queue host syncs
        many groups' logs at once, :mod:`mirrorq.queue_process.group_sync`)
        before anything that depends on them; None if nothing was appended."""
        if not self._dirty:
            return None
        self._end = preallocate.write_at(self._fd, b"".join(self._pending), self._end)
        self._pending.clear()
        self._allocated = preallocate.extend(self._fd, self._end, self._allocated, _NO_CAP)
        self._dirty = False
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            if self._allocated > self._end:
                os.ftruncate(self._fd, self._end)
            os.close(self._fd)
            self._fd = None
