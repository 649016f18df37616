"""An append-only segment log: the durable half of a queue replica's store.

One log per queue replica.  It knows nothing about queues: it stores typed,
msgpack-encoded records, numbers them, checksums them, makes them durable in
batches and reads them back.  :mod:`mirrorq.classic.backing_queue` gives
the records their meaning.

Format
------
A log is a directory of segment files named by the offset they start at
(``00000000000000000000.seg``, 20 digits).  A segment file starts with the
8-byte magic ``MQSEGv1\\n`` and continues with records, each::

    hcrc    u32  CRC32C of the next 17 header bytes (length..bcrc)
    length  u32  body length in bytes
    rtype   u8   record type, 1..255 (the caller's vocabulary)
    offset  u64  log offset of the record
    bcrc    u32  CRC32C of the body
    body    msgpack bytes

all little-endian.  The header has its own checksum so that a flipped length
byte is recognised as corruption, not mistaken for a record that runs past
the end of the file.  After the records the last segment may hold zeros
(preallocation, below) up to the end of the file; a closed log's files, and
every segment but the last, end at their last record.

Guarantees
----------
* **Offsets** are a monotonic 64-bit sequence: every record gets one greater
  than all before it, and an offset that was ever durable (see ``flushed_offset``)
  is never handed out again, across restarts and compaction (deleting old
  segments never lowers ``next_offset``).  Offsets may have gaps: a mirror
  appends with ``at=`` to keep its master's numbering, and compaction removes
  whole segments.
* **Group commit.**  :meth:`SegmentLog.append` only encodes and buffers;
  :meth:`SegmentLog.flush` writes the whole buffer and calls ``fsync`` once.
  A segment is rolled when the next record would push it past
  ``segment_bytes``; a flush that crosses a roll fsyncs the old segment, then
  the new one, then the directory (three fsyncs instead of one, once per
  segment).  Older segments are fsync'd before newer ones are created --
  by ``flush(sync=False)`` too, which leaves only the last segment unsynced
  -- so after a crash only the last segment can have a torn tail.
* **Deletion** (:meth:`delete_segment`, :meth:`truncate`) is durable when
  it returns (the directory is fsynced): a crash never brings back a
  segment the owner deleted.
* **Preallocation** (:mod:`mirrorq.preallocate`).  A flush whose records run
  past the end of the active segment's file also writes zeros after them
  (never past ``segment_bytes``), so the flushes that follow overwrite
  blocks the file already has and their fsync changes no file size.  A
  rolled segment's zeros are cut off before the next segment is written,
  and the active segment's when the log closes.
* **Reads** (:meth:`read_from`, :meth:`read_at`) verify both checksums.  By
  default they only return flushed records, so a reader (sync, the Spark
  source) never sees a record that a crash could still take back.
* **Raw copy** (sync): :meth:`read_raw` returns the encoded bytes of a run of
  whole records (headers and checksums included) with one ``pread`` per
  segment and no per-record work; :meth:`append_raw` appends such bytes to
  another log verbatim after checking every record's framing, both
  checksums and that offsets increase from ``next_offset`` on -- a bad batch
  raises (:class:`CorruptRecord` for framing and checksums, ``ValueError`` for
  offsets) and appends nothing.  Records are placed in this log's own
  segments (rolled as for :meth:`append`), so the copy is byte-identical per
  record, not per file.
* **Truncation** (:meth:`truncate`, sync of a deposed master's store):
  every record from an offset on goes -- later segments deleted, the one
  holding the offset cut at that record, durably -- and the log goes on from
  that offset; the records below it are not touched.
* **Recovery** on open scans every segment and checks every checksum.  In the
  last segment, a torn tail -- a partial header, a body running past the end of
  the file, a bad checksum on the very last record, or a zero-filled tail --
  is truncated with a warning on the ``mirrorq.backing_queue`` logger and the
  log continues after the last good record; "the end" is where the zeros
  after the records begin, so a record cut short inside the preallocated
  zeros is a torn tail too.  Zeros alone after the last good record are
  preallocation, not a tear: kept in the last segment (no warning), cut off
  (logged at info) in an older one that a crash caught between a roll and
  the trim; a last segment of nothing but zeros starts again from its
  magic, with a warning.  Anything else -- a bad checksum
  with more data after it, offsets going backwards, a torn record in a segment
  that is not the last -- raises :class:`CorruptRecord` naming the file and
  byte offset.  Nothing is ever skipped silently.

Assumptions
-----------
* One process owns a directory at a time (enforced with ``flock`` on
  ``LOCK``).  The log is not thread-safe: one actor drives it.
* The file system keeps data that was fsync'd; unflushed data may be lost or
  zero-filled after a crash.  With ``fsync=False`` (non-durable queues,
  whose directory is wiped before it is opened; tests, benchmarks),
  durability is whatever the OS gives.
* ``directory=None`` gives an in-memory log with the same behaviour and no
  disk at all (tests).  ``fs=`` (:mod:`mirrorq.fsapi`) is the file system
  the directory is on: the real one (``os``) by default; the simulator
  hands in a :class:`mirrorq.simdisk.SimDisk`, whose crash keeps only what
  was fsynced (and, of the rest, a prefix with a torn last write).

Failure
-------
An ``OSError`` while flushing leaves the buffer in an unknown state on disk;
the log then refuses every further operation with :class:`LogFailed` (the
owner must reopen it, which recovers from what reached the disk: a record
cut short is a torn tail).  A full disk (``ENOSPC``, ``EDQUOT``) is
:class:`DiskFull`, a ``LogFailed`` whose message says so, with the log's
directory and the space left on its file system.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import re
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import msgpack

from mirrorq import preallocate
from mirrorq.fsapi import OS, FileSystem, read_file
from mirrorq.packing import pack

logger = logging.getLogger("mirrorq.backing_queue")

MAGIC = b"MQSEGv1\n"
MAGIC_LEN = len(MAGIC)
_HCRC = struct.Struct("<I")
_HTAIL = struct.Struct("<IBQI")  # length, rtype, offset, bcrc
HEADER_SIZE = _HCRC.size + _HTAIL.size  # 21
MAX_RECORD_BYTES = 64 * 1024 * 1024
MAX_OFFSET = 2**64 - 1
DEFAULT_SEGMENT_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_PENDING_BYTES = 8 * 1024 * 1024
_READ_CHUNK = 1024 * 1024
#: read_many: records further apart than this are read separately ...
READ_GAP = 64 * 1024
#: ... and one read spans at most this many bytes
READ_SPAN = 4 * 1024 * 1024
_FD_CACHE = 16
_SEGMENT_RE = re.compile(r"^(\d{20})\.seg$")
_MEMORY = "<memory>"

_crc = crc32c.crc32c


class Record(NamedTuple):
    """One log record: a type code (1..255) and a msgpack-able body."""

    rtype: int
    body: Any


class StoreError(Exception):
    """Base class of the store's errors."""


class CorruptRecord(StoreError):
    """A record that cannot be trusted, with the file and byte offset where it starts."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt record in {path} at byte offset {offset}: {reason}")


@dataclass(frozen=True, slots=True)
class RawRecords:
    """What :meth:`SegmentLog.read_raw` returns: ``count`` whole encoded
    records in ``data``, and ``next_offset``: where a reader continues (one
    past the last record returned, or the read's limit once nothing is left
    below it)."""

    data: bytes
    count: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class RawFrames:
    """Checked encoded records (:meth:`SegmentLog.check_raw`), ready for
    :meth:`SegmentLog.append_raw`.  ``positions`` has ``count + 1`` entries
    (each record's start in ``data``, then the end); ``segments`` is the base
    of the segment each record will land in; ``state`` is the log's state
    the plan was made against."""

    data: bytes
    offsets: list[int]
    rtypes: list[int]
    positions: list[int]
    segments: list[int]
    state: tuple[int, int, int, int]

    @property
    def count(self) -> int:
        return len(self.offsets)

    def body(self, k: int) -> memoryview:
        """The msgpack body of record ``k`` (a view into ``data``)."""
        return memoryview(self.data)[self.positions[k] + HEADER_SIZE : self.positions[k + 1]]


class LogClosed(StoreError):
    """The log was closed."""


class LogFailed(StoreError):
    """A previous write or fsync failed; the log must be reopened."""


class DiskFull(LogFailed):
    """A write or fsync failed for lack of space; the log must be reopened."""


def _failure(fs: FileSystem, directory: str, what: str, exc: OSError) -> LogFailed:
    """The error a failed flush or fsync of the log in ``directory`` raises."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return LogFailed(f"{what} {directory} failed: {exc}")
    try:
        st = fs.statvfs(directory)
        left = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        left = "free space unknown"
    return DiskFull(
        f"{what} {directory} failed: no space left on its device ({left}; {exc.strerror}); "
        "the log must be reopened, which keeps every record that reached the disk"
    )


def segment_name(base: int) -> str:
    return f"{base:020d}.seg"


def _unpack(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode_record(offset: int, rtype: int, body: Any) -> bytes:
    """The on-disk bytes of one record (header + msgpack body)."""
    if not isinstance(rtype, int) or isinstance(rtype, bool) or not 1 <= rtype <= 255:
        raise ValueError(f"record type must be an int in 1..255, got {rtype!r}")
    try:
        payload = pack(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"record body of type {rtype} is not msgpack-serialisable: {exc}") from exc
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"record body is {len(payload)} bytes, more than the {MAX_RECORD_BYTES} allowed")
    tail = _HTAIL.pack(len(payload), rtype, offset, _crc(payload))
    return _HCRC.pack(_crc(tail)) + tail + payload


def _decode_pending(data: bytes) -> Record:
    # Decoded from the encoded bytes, so a pending record reads back exactly
    # as it will once flushed (lists not tuples, a copy not the caller's dict).
    return Record(data[8], _unpack(memoryview(data)[HEADER_SIZE:]))


def _fsync_dir(fs: FileSystem, path: str) -> None:
    fd = fs.open(path, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def _pread_all(pread: Callable[[int, int, int], bytes], fd: int, size: int, pos: int, path: str) -> bytes:
    chunks = []
    while size > 0:
        data = pread(fd, size, pos)
        if not data:
            raise CorruptRecord(path, pos, f"file ends {size} bytes early")
        chunks.append(data)
        size -= len(data)
        pos += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Segment:
    __slots__ = (
        "base",
        "path",
        "offsets",
        "positions",
        "size",
        "allocated",
        "pending",
        "pending_size",
        "fd",
        "buf",
        "on_disk",
    )

    def __init__(self, base: int, path: str) -> None:
        self.base = base
        self.path = path
        self.offsets = array("Q")  # offsets of the records, ascending
        self.positions = array("Q")  # byte position of each record
        self.size = 0  # bytes written to the file (or buf)
        self.allocated = 0  # the file's length: size, or more with the zeros preallocated after it
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.fd: int | None = None
        self.buf: bytearray | None = None
        self.on_disk = True

    @property
    def end(self) -> int:
        return self.size + self.pending_size

    @property
    def memory(self) -> bytearray:
        """The bytes of a segment of an in-memory log (``buf``)."""
        if self.buf is None:
            raise StoreError(f"segment {self.base} ({self.path}) is not held in memory")
        return self.buf


class SegmentLog:
    """An append-only, checksummed, segmented log of typed records.

    ``SegmentLog(directory, segment_bytes=16 MiB, fsync=True)`` opens (and
    recovers) or creates the log in ``directory``; ``directory=None`` keeps
    it in memory.  ``on_record(offset, record, segment_base)`` is called for
    every good record during the recovery scan, in offset order, so an owner
    rebuilds its index in the same pass that verifies the checksums.

    ``max_pending_bytes``: when the unflushed buffer grows past this, the log
    flushes by itself so the buffer stays bounded.  ``fs``: the file system
    its files are on (:mod:`mirrorq.fsapi`), the real one by default.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: bool = True,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        on_record: Callable[[int, Record, int], None] | None = None,
        fs: FileSystem = OS,
    ) -> None:
        if not isinstance(segment_bytes, int) or segment_bytes < MAGIC_LEN + HEADER_SIZE + 1:
            raise ValueError(f"segment_bytes must be an int >= {MAGIC_LEN + HEADER_SIZE + 1}, got {segment_bytes!r}")
        if not isinstance(max_pending_bytes, int) or max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be a positive int, got {max_pending_bytes!r}")
        self._memory = directory is None
        self._fs = fs
        self._dir = _MEMORY if directory is None else os.fspath(directory)
        self._segment_bytes = segment_bytes
        self._fsync = bool(fsync)
        self._unsynced: set[int] = set()  # segment bases written without fsync (flush(sync=False))
        self._max_pending = max_pending_bytes
        self._segments: list[_Segment] = []
        self._bases: list[int] = []
        self._next = 0
        self._flushed_next = 0
        self._pending_records: dict[int, bytes] = {}  # offset -> encoded record, until flushed
        self._pending_bytes = 0
        self._dirty: list[_Segment] = []
        self._rolled: list[_Segment] = []  # rolled past, their preallocated zeros not yet trimmed
        self._fds: OrderedDict[int, _Segment] = OrderedDict()
        self._lock_fd: int | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self.rolls = 0  # segments created since open (owners use it to decide when to compact)
        if self._memory:
            seg = _Segment(0, _MEMORY)
            seg.buf = bytearray(MAGIC)
            seg.size = MAGIC_LEN
            self._add_segment(seg)
            return
        fs.makedirs(self._dir, exist_ok=True)
        self._lock()
        try:
            self._recover(on_record)
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ open

    def _lock(self) -> None:
        fd = self._fs.open(os.path.join(self._dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._fs.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fs.close(fd)
            raise StoreError(f"log directory {self._dir} is already open (LOCK held)") from None
        self._lock_fd = fd

    def _recover(self, on_record: Callable[[int, Record, int], None] | None) -> None:
        bases = []
        for name in self._fs.listdir(self._dir):
            m = _SEGMENT_RE.match(name)
            if m:
                bases.append(int(m.group(1)))
            elif name.endswith(".seg"):
                raise StoreError(f"unexpected file {os.path.join(self._dir, name)}: segment names are 20 digits + .seg")
        bases.sort()
        if not bases:
            seg = _Segment(0, os.path.join(self._dir, segment_name(0)))
            seg.fd = self._fs.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            preallocate.write_at(seg.fd, MAGIC, 0, self._fs.pwrite)
            seg.size = seg.allocated = MAGIC_LEN
            if self._fsync:
                self._fs.fsync(seg.fd)
                _fsync_dir(self._fs, self._dir)
            self._add_segment(seg)
            return
        prev = -1
        for i, base in enumerate(bases):
            last = i == len(bases) - 1
            seg = _Segment(base, os.path.join(self._dir, segment_name(base)))
            if base <= prev:
                raise CorruptRecord(
                    seg.path, 0, f"segment starts at offset {base} but an earlier segment holds offset {prev}"
                )
            self._add_segment(seg)
            prev = self._scan(seg, None if last else bases[i + 1], prev, on_record)
        self._next = max(prev + 1, self._segments[-1].base)
        self._flushed_next = self._next
        active = self._segments[-1]
        active.fd = self._fs.open(active.path, os.O_RDWR)
        self._fds[active.base] = active

    def _scan(
        self, seg: _Segment, next_base: int | None, prev: int, on_record: Callable[[int, Record, int], None] | None
    ) -> int:
        """Verify one segment, fill its index, feed ``on_record``; returns the last offset seen.

        ``next_base`` is the next segment's first offset, None for the last segment
        (the only one whose tail may be torn).
        """
        last = next_base is None
        data = read_file(self._fs, seg.path)
        n = len(data)
        if n < MAGIC_LEN or data[:MAGIC_LEN] != MAGIC:
            if last and data.count(0) == n:  # created and preallocated, its first page lost in a crash
                self._truncate_tail(seg, 0, "segment holds nothing but zeros")
                return prev
            head = data.rstrip(b"\0")  # (the magic holds no zero byte)
            if last and len(head) < MAGIC_LEN and MAGIC.startswith(head):  # its first write torn in the magic
                self._truncate_tail(seg, 0, "segment header incomplete")
                return prev
            raise CorruptRecord(seg.path, 0, "bad segment magic (not a mirrorq segment, or damaged)")
        view = memoryview(data)
        pos = MAGIC_LEN
        allocated = n
        while pos < n:
            torn = False
            problem = None
            if n - pos < HEADER_SIZE:
                problem, torn = f"partial record header ({n - pos} of {HEADER_SIZE} bytes)", True
            else:
                (hcrc,) = _HCRC.unpack_from(data, pos)
                length, rtype, off, bcrc = _HTAIL.unpack_from(data, pos + 4)
                end = pos + HEADER_SIZE + length
                if _crc(view[pos + 4 : pos + HEADER_SIZE]) != hcrc:
                    problem = "header CRC32C mismatch"
                    # a header cut short: zeros (preallocated, or pages a crash lost) from within it to the end
                    torn = end == n or data.count(0, pos + HEADER_SIZE) == n - pos - HEADER_SIZE
                elif end > n:
                    problem, torn = f"record body of {length} bytes runs past the end of the file ({n} bytes)", True
                elif _crc(view[pos + HEADER_SIZE : end]) != bcrc:
                    problem = "body CRC32C mismatch"
                    torn = end == n or data.count(0, end) == n - end
                elif rtype == 0:
                    problem = "record type 0"
                elif off <= prev or off < seg.base:
                    problem = f"offset {off} does not follow offset {max(prev, seg.base - 1)}"
            if problem is not None:
                if data.count(0, pos) == n - pos:  # the zeros preallocated after the records
                    break
                if last and torn:
                    self._truncate_tail(seg, pos, problem)
                    allocated = seg.allocated
                    break
                raise CorruptRecord(seg.path, pos, problem)
            if next_base is not None and off >= next_base:
                raise CorruptRecord(seg.path, pos, f"offset {off} belongs to the next segment")
            seg.offsets.append(off)
            seg.positions.append(pos)
            if on_record is not None:
                try:
                    body = _unpack(view[pos + HEADER_SIZE : end])
                except Exception as exc:  # msgpack raises several types
                    raise CorruptRecord(seg.path, pos, f"body does not decode as msgpack: {exc}") from exc
                on_record(off, Record(rtype, body), seg.base)
            prev = off
            pos = end
        seg.size = pos
        seg.allocated = allocated
        if allocated > pos and not last:
            self._trim_zeros(seg)
        return prev

    def _trim_zeros(self, seg: _Segment) -> None:
        """A segment that is not the last, found with zeros after its records
        (a crash before its preallocation was trimmed): trim them."""
        logger.info("trimming %d zero bytes preallocated after the records of %s", seg.allocated - seg.size, seg.path)
        self._cut(seg, seg.size)

    def _truncate_tail(self, seg: _Segment, pos: int, reason: str) -> None:
        size = self._fs.getsize(seg.path)
        logger.warning(
            "torn tail in %s at byte offset %d (%s): truncating %d bytes; the log continues after the last good record",
            seg.path,
            pos,
            reason,
            size - pos,
        )
        self._cut(seg, pos, MAGIC if pos == 0 else b"")
        seg.size = max(pos, MAGIC_LEN)

    def _cut(self, seg: _Segment, pos: int, then: bytes = b"") -> None:
        """Truncate ``seg``'s file at ``pos`` (then write ``then`` there) and sync it."""
        fs = self._fs
        fd = fs.open(seg.path, os.O_RDWR)
        try:
            fs.ftruncate(fd, pos)
            preallocate.write_at(fd, then, pos, fs.pwrite)
            if self._fsync:
                fs.fsync(fd)
        finally:
            fs.close(fd)
        seg.allocated = pos + len(then)

    def _add_segment(self, seg: _Segment) -> None:
        self._segments.append(seg)
        self._bases.append(seg.base)

    # ------------------------------------------------------------ properties

    @property
    def directory(self) -> str | None:
        return None if self._memory else self._dir

    @property
    def next_offset(self) -> int:
        """The offset the next appended record gets (includes unflushed records)."""
        return self._next

    @property
    def flushed_offset(self) -> int:
        """Every record with an offset below this is flushed (durable if ``fsync``)."""
        return self._flushed_next

    @property
    def first_offset(self) -> int:
        """Offset of the oldest record still stored, or ``next_offset`` if none is."""
        for seg in self._segments:
            if seg.offsets:
                return seg.offsets[0]
        return self._next

    @property
    def segment_bases(self) -> list[int]:
        """First offsets (file names) of the stored segments, ascending; the last is active."""
        return list(self._bases)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def __len__(self) -> int:
        """Number of records stored (flushed or not)."""
        return sum(len(s.offsets) for s in self._segments)

    def segment_of(self, offset: int) -> int | None:
        """Base of the segment whose offset range covers ``offset`` (None if before the first)."""
        i = bisect.bisect_right(self._bases, offset) - 1
        return self._bases[i] if i >= 0 else None

    def segment_has_pending(self, base: int) -> bool:
        seg = self._segment(base)
        return seg.pending_size > 0

    def _segment(self, base: int) -> _Segment:
        i = bisect.bisect_left(self._bases, base)
        if i == len(self._bases) or self._bases[i] != base:
            raise KeyError(f"no segment starting at offset {base} in {self._dir}")
        return self._segments[i]

    def _check_usable(self) -> None:
        if self._closed:
            raise LogClosed(f"log {self._dir} is closed")
        if self._failed is not None:
            raise LogFailed(f"log {self._dir} failed earlier ({self._failed!r}); reopen it")

    # ---------------------------------------------------------------- append

    def append(self, records: Iterable[Record | tuple[int, Any]], *, at: int | None = None) -> list[int]:
        """Encode and buffer ``records``; return their offsets.  Nothing is written until :meth:`flush`.

        ``at`` gives the first record an explicit offset (>= ``next_offset``),
        so a mirror keeps its master's numbering; later records follow on.
        The batch is validated as a whole first: a bad record appends nothing.
        """
        self._check_usable()
        start = self._next
        if at is not None:
            if not isinstance(at, int) or isinstance(at, bool):
                raise TypeError(f"at must be an int offset, got {at!r}")
            if at < self._next:
                raise ValueError(f"cannot append at offset {at}: offsets below next_offset {self._next} are taken")
            start = at
        encoded = []
        off = start
        for rec in records:
            try:
                rtype, body = rec
            except (TypeError, ValueError):
                raise TypeError(f"a record is a (rtype, body) pair, got {rec!r}") from None
            if off > MAX_OFFSET:
                raise OverflowError("log offsets exhausted (2**64)")
            encoded.append((off, rtype, body, encode_record(off, rtype, body)))
            off += 1
        offsets = []
        active = self._segments[-1]
        for off, _rtype, _body, data in encoded:
            if active.offsets and active.end + len(data) > self._segment_bytes:
                active = self._roll(off)
            if not active.pending:
                self._dirty.append(active)
            active.offsets.append(off)
            active.positions.append(active.end)
            active.pending.append(data)
            active.pending_size += len(data)
            self._pending_bytes += len(data)
            self._pending_records[off] = data
            offsets.append(off)
        if offsets:
            self._next = offsets[-1] + 1
        if self._pending_bytes >= self._max_pending:
            self.flush()
        return offsets

    def _roll(self, base: int) -> _Segment:
        if not self._memory:
            self._rolled.append(self._segments[-1])
        seg = _Segment(base, _MEMORY if self._memory else os.path.join(self._dir, segment_name(base)))
        seg.on_disk = False
        if self._memory:
            seg.buf = bytearray()
        seg.pending.append(MAGIC)
        seg.pending_size = MAGIC_LEN
        self._pending_bytes += MAGIC_LEN
        self._dirty.append(seg)
        self._add_segment(seg)
        self.rolls += 1
        return seg

    def _plan_state(self) -> tuple[int, int, int, int]:
        active = self._segments[-1]
        return (self._next, active.base, active.end, len(active.offsets))

    def check_raw(self, data: bytes | bytearray | memoryview, *, source: str = "raw records") -> RawFrames:
        """Check encoded records (as :meth:`read_raw` returns them) for appending here.

        Every record must be whole, carry good header and body checksums and a
        non-zero type; offsets must increase, the first at or above
        ``next_offset``.  Raises :class:`CorruptRecord` (naming ``source`` and
        the byte position in ``data``) or ``ValueError``; changes nothing.
        The result says which segment each record will land in, for
        :meth:`append_raw`.
        """
        self._check_usable()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"raw records must be bytes, got {type(data).__name__}")
        data = bytes(data)
        view = memoryview(data)
        n = len(data)
        offsets: list[int] = []
        rtypes: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        active = self._segments[-1]
        base, end, has = active.base, active.end, bool(active.offsets)
        limit = self._segment_bytes
        prev = self._next - 1
        pos = 0
        unpack_h, unpack_t = _HCRC.unpack_from, _HTAIL.unpack_from
        while pos < n:
            if n - pos < HEADER_SIZE:
                raise CorruptRecord(source, pos, f"partial record header ({n - pos} of {HEADER_SIZE} bytes)")
            (hcrc,) = unpack_h(data, pos)
            if _crc(view[pos + 4 : pos + HEADER_SIZE]) != hcrc:
                raise CorruptRecord(source, pos, "header CRC32C mismatch")
            length, rtype, off, bcrc = unpack_t(data, pos + 4)
            rec_end = pos + HEADER_SIZE + length
            if length > MAX_RECORD_BYTES:
                raise CorruptRecord(
                    source, pos, f"record body of {length} bytes is over the {MAX_RECORD_BYTES} allowed"
                )
            if rec_end > n:
                raise CorruptRecord(
                    source, pos, f"record body of {length} bytes runs past the end of the data ({n} bytes)"
                )
            if _crc(view[pos + HEADER_SIZE : rec_end]) != bcrc:
                raise CorruptRecord(source, pos, "body CRC32C mismatch")
            if rtype == 0:
                raise CorruptRecord(source, pos, "record type 0")
            if off <= prev:
                if not offsets:
                    raise ValueError(
                        f"cannot append at offset {off}: offsets below next_offset {self._next} are taken "
                        f"({source}, byte {pos})"
                    )
                raise ValueError(f"offset {off} does not follow offset {prev} ({source}, byte {pos})")
            size = rec_end - pos
            if has and end + size > limit:
                base, end, has = off, MAGIC_LEN, False
            end += size
            has = True
            offsets.append(off)
            rtypes.append(rtype)
            positions.append(pos)
            segments.append(base)
            prev = off
            pos = rec_end
        positions.append(pos)
        return RawFrames(data, offsets, rtypes, positions, segments, self._plan_state())

    def append_raw(self, records: RawFrames | bytes | bytearray | memoryview, count: int | None = None) -> RawFrames:
        """Append encoded records verbatim (buffered, like :meth:`append`).

        ``records``: bytes (checked here with :meth:`check_raw`: a bad batch
        raises and appends nothing) or the :class:`RawFrames` of a
        ``check_raw`` made on this log since its last change; ``count``
        appends only the first ``count`` of them.  Returns the frames.
        """
        frames = records if isinstance(records, RawFrames) else self.check_raw(records)
        self._check_usable()
        total = frames.count
        if count is None:
            count = total
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= total:
            raise ValueError(f"count must be an int in 0..{total}, got {count!r}")
        if frames.state != self._plan_state():
            raise ValueError("these raw records were checked against an earlier state of the log; check them again")
        data, offsets, positions, segments = frames.data, frames.offsets, frames.positions, frames.segments
        k = 0
        while k < count:
            base = segments[k]
            j = k + 1
            while j < count and segments[j] == base:
                j += 1
            active = self._segments[-1]
            if base != active.base:
                active = self._roll(base)
            if not active.pending:
                self._dirty.append(active)
            p0, p1 = positions[k], positions[j]
            shift = active.end - p0
            active.offsets.extend(offsets[k:j])
            active.positions.extend([p + shift for p in positions[k:j]])
            chunk = data[p0:p1]
            active.pending.append(chunk)
            active.pending_size += p1 - p0
            self._pending_bytes += p1 - p0
            pend = self._pending_records
            for i in range(k, j):
                pend[offsets[i]] = data[positions[i] : positions[i + 1]]
            k = j
        if count:
            self._next = offsets[count - 1] + 1
            if self._pending_bytes >= self._max_pending:
                self.flush()
        return frames

    def flush(self, sync: bool = True) -> None:
        """Write every buffered record and fsync: one fsync per touched segment,
        normally one.  ``sync=False`` writes without fsync (the records survive
        a crash of the process, not of the machine); the next ``flush()``
        fsyncs them too."""
        self._check_usable()
        if not self._dirty:
            if sync and self._unsynced:
                self._sync_unsynced()
            return
        created = False
        try:
            self._trim_rolled()
            active = self._segments[-1]
            for seg in self._dirty:
                data = b"".join(seg.pending)
                if self._memory:
                    seg.memory.extend(data)
                else:
                    if not seg.on_disk and self._unsynced:
                        # the segments before it durable before it exists, also in a flush(sync=False):
                        # after a crash only the last segment may have a torn tail
                        self._sync_unsynced()
                    fd = self._fd(seg, create=not seg.on_disk)
                    if not seg.on_disk:
                        seg.on_disk = True
                        created = True
                    preallocate.write_at(fd, data, seg.size, self._fs.pwrite)
                    if seg is active:
                        seg.allocated = preallocate.extend(
                            fd, seg.size + len(data), seg.allocated, self._segment_bytes, self._fs.pwrite
                        )
                    else:
                        seg.allocated = seg.size + len(data)
                    if self._fsync and sync:
                        self._fs.fsync(fd)
                        self._unsynced.discard(seg.base)
                    elif self._fsync:
                        self._unsynced.add(seg.base)
                seg.size += len(data)
                seg.pending.clear()
                seg.pending_size = 0
            if created and self._fsync:
                _fsync_dir(self._fs, self._dir)
        except OSError as exc:
            self._failed = exc
            raise _failure(self._fs, self._dir, "flushing", exc) from exc
        self._dirty.clear()
        self._pending_records.clear()
        self._pending_bytes = 0
        self._flushed_next = self._next
        if sync and self._unsynced:
            self._sync_unsynced()
        self._trim_fds()

    def _trim_rolled(self) -> None:
        """Cut the zeros off the segments rolled past, before anything is
        written to the next one: a segment that is not the last ends at its
        last record (recovery trims what a crash left there, too)."""
        while self._rolled:
            seg = self._rolled[0]
            if seg.on_disk and seg.allocated > seg.size and seg in self._segments:
                fd = self._fd(seg)
                self._fs.ftruncate(fd, seg.size)
                if self._fsync and not any(d is seg for d in self._dirty):  # else its flush below syncs it
                    self._fs.fsync(fd)
                seg.allocated = seg.size
            self._rolled.pop(0)

    def take_unsynced(self) -> list[int]:
        """The file descriptors of the segments written by ``flush(sync=False)``
        since the last fsync, which the caller now owes an fsync (or a sync
        of their filesystem: a queue host syncs many replicas' logs at once,
        :mod:`mirrorq.store.group_sync`); this log forgets them.  The
        descriptors stay valid until the log is next used."""
        self._check_usable()
        fds = []
        for base in sorted(self._unsynced):
            seg = next((sg for sg in self._segments if sg.base == base), None)
            if seg is not None and seg.on_disk:
                fds.append(self._fd(seg, create=False))
        self._unsynced.clear()
        return fds

    def _sync_unsynced(self) -> None:
        """fsync the segments written by ``flush(sync=False)`` since the last fsync."""
        try:
            for base in sorted(self._unsynced):
                seg = next((sg for sg in self._segments if sg.base == base), None)
                if seg is not None and seg.on_disk:
                    self._fs.fsync(self._fd(seg, create=False))
        except OSError as exc:
            self._failed = exc
            raise _failure(self._fs, self._dir, "fsync of", exc) from exc
        self._unsynced.clear()

    # ------------------------------------------------------------------ read

    def read_at(self, offset: int) -> Record:
        """The record at ``offset`` (flushed or not); KeyError if there is none."""
        return self.read_many((offset,))[0]

    def read_many(self, offsets: Iterable[int]) -> list[Record]:
        """The records at ``offsets`` (flushed or not), in the order given;
        KeyError if one is missing.  Records near each other in a segment
        are read with one ``pread`` (gaps up to :data:`READ_GAP` bytes, spans
        up to :data:`READ_SPAN`): a consumer's batch of ready messages costs
        a read or two, not one per message."""
        self._check_usable()
        offsets = list(offsets)
        found: dict[int, Record] = {}
        wanted: dict[int, list[int]] = {}  # segment index -> record indices in it
        for offset in offsets:
            data = self._pending_records.get(offset)
            if data is not None:
                found[offset] = _decode_pending(data)
                continue
            i = bisect.bisect_right(self._bases, offset) - 1
            if i >= 0:
                seg = self._segments[i]
                j = bisect.bisect_left(seg.offsets, offset)
                if j < len(seg.offsets) and seg.offsets[j] == offset:
                    wanted.setdefault(i, []).append(j)
                    continue
            raise KeyError(f"no record at offset {offset} in log {self._dir}")
        for i, ks in wanted.items():
            seg = self._segments[i]
            ks = sorted(set(ks))
            run = [ks[0]]
            for k in ks[1:]:
                if (
                    seg.positions[k] - self._end_of(seg, run[-1]) > READ_GAP
                    or self._end_of(seg, k) - seg.positions[run[0]] > READ_SPAN
                ):
                    found.update(self._read_records(seg, run))
                    run = []
                run.append(k)
            found.update(self._read_records(seg, run))
        return [found[o] for o in offsets]

    def read_from(
        self, offset: int, max_records: int | None = None, *, include_pending: bool = False
    ) -> list[tuple[int, Record]]:
        """Records with offsets >= ``offset`` in order, at most ``max_records`` of them.

        Only flushed records unless ``include_pending``.  An offset below
        ``first_offset`` (compacted away) starts at the oldest stored record.
        """
        self._check_usable()
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        if max_records is not None and (not isinstance(max_records, int) or max_records < 0):
            raise ValueError(f"max_records must be a non-negative int or None, got {max_records!r}")
        limit = self._next if include_pending else self._flushed_next
        want = max_records if max_records is not None else float("inf")
        out: list[tuple[int, Record]] = []
        si = max(0, bisect.bisect_right(self._bases, offset) - 1)
        for seg in self._segments[si:]:
            offs = seg.offsets
            i = bisect.bisect_left(offs, offset)
            while i < len(offs) and len(out) < want and offs[i] < limit:
                if offs[i] >= self._flushed_next:
                    out.append((offs[i], _decode_pending(self._pending_records[offs[i]])))
                    i += 1
                    continue
                j = i + 1
                start = seg.positions[i]
                while (
                    j < len(offs)
                    and offs[j] < self._flushed_next
                    and j - i < want - len(out)
                    and seg.positions[j] - start < _READ_CHUNK
                ):
                    j += 1
                out.extend(self._read_span(seg, i, j))
                i = j
            if len(out) >= want:
                break
        return out

    def read_raw(
        self,
        offset: int,
        *,
        max_records: int | None = None,
        max_bytes: int | None = None,
        until: int | None = None,
        include_pending: bool = False,
    ) -> RawRecords:
        """The encoded bytes of the records with offsets in [``offset``, ``until``), in order.

        At most ``max_records`` records and, past the first record, at most
        ``max_bytes`` bytes.  Only flushed records unless ``include_pending``.
        One read per segment touched; checksums are *not* verified here (the
        receiver's :meth:`check_raw` does).  An offset below ``first_offset``
        starts at the oldest stored record.
        """
        self._check_usable()
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        for name, v in (("max_records", max_records), ("max_bytes", max_bytes)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if until is not None and (not isinstance(until, int) or isinstance(until, bool) or until < 0):
            raise ValueError(f"until must be a non-negative int or None, got {until!r}")
        limit = self._next if include_pending else self._flushed_next
        if until is not None:
            limit = min(limit, until)
        want = max_records if max_records is not None else MAX_OFFSET
        budget = max_bytes if max_bytes is not None else MAX_OFFSET
        chunks: list = []
        count = 0
        size = 0
        last = -1
        full = False
        si = max(0, bisect.bisect_right(self._bases, offset) - 1)
        for seg in self._segments[si:]:
            offs, pos = seg.offsets, seg.positions
            i = bisect.bisect_left(offs, offset)
            j = bisect.bisect_left(offs, limit, i)
            if j - i > want - count:
                j, full = i + (want - count), True
            if i >= j:
                if full or (j < len(offs)):
                    break  # limits reached, or this segment's records are all >= limit
                continue
            start = pos[i]
            # byte budget: the first record of the read always goes in
            cap = start + max(budget - size, 1)
            end_of = lambda k, pos=pos, seg=seg: pos[k + 1] if k + 1 < len(pos) else seg.end  # noqa: E731
            if end_of(j - 1) > cap:
                # the last k in [i, j) whose record ends within cap (at least i when nothing is read yet)
                k = bisect.bisect_right(pos, cap, i + 1, j) - 1  # pos[k] <= cap: records i..k-1 end within cap
                j = max(k, i + 1 if count == 0 else i)
                full = True
                if j == i:
                    break
            stop = end_of(j - 1)
            flushed_end = min(stop, seg.size)
            if start < flushed_end:
                if self._memory:
                    chunks.append(bytes(seg.memory[start:flushed_end]))
                else:
                    chunks.append(_pread_all(self._fs.pread, self._fd(seg), flushed_end - start, start, seg.path))
            if stop > seg.size:
                first_pending = bisect.bisect_left(pos, seg.size, i, j)
                chunks.extend(self._pending_records[offs[k]] for k in range(first_pending, j))
            count += j - i
            size += stop - start
            last = offs[j - 1]
            if full:
                break
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        nxt = last + 1 if full else max(offset, limit)
        return RawRecords(data, count, nxt)

    def _read_span(self, seg: _Segment, i: int, j: int) -> list[tuple[int, Record]]:
        """Decode flushed records i..j-1 of ``seg``, verifying checksums."""
        return self._read_records(seg, range(i, j))

    @staticmethod
    def _end_of(seg: _Segment, k: int) -> int:
        return seg.positions[k + 1] if k + 1 < len(seg.positions) else seg.size

    def _read_records(self, seg: _Segment, ks: Sequence[int]) -> list[tuple[int, Record]]:
        """Decode flushed records ``ks`` (ascending indices) of ``seg`` from
        one read of the bytes they span, verifying checksums."""
        start = seg.positions[ks[0]]
        end = self._end_of(seg, ks[-1])
        if self._memory:
            data = bytes(seg.memory[start:end])
        else:
            data = _pread_all(self._fs.pread, self._fd(seg), end - start, start, seg.path)
        view = memoryview(data)
        out = []
        for k in ks:
            p = seg.positions[k] - start
            (hcrc,) = _HCRC.unpack_from(data, p)
            length, rtype, off, bcrc = _HTAIL.unpack_from(data, p + 4)
            e = p + HEADER_SIZE + length
            if _crc(view[p + 4 : p + HEADER_SIZE]) != hcrc:
                raise CorruptRecord(seg.path, seg.positions[k], "header CRC32C mismatch on read")
            if off != seg.offsets[k] or e > len(data):
                raise CorruptRecord(seg.path, seg.positions[k], "record does not match the index on read")
            if _crc(view[p + HEADER_SIZE : e]) != bcrc:
                raise CorruptRecord(seg.path, seg.positions[k], "body CRC32C mismatch on read")
            out.append((off, Record(rtype, _unpack(view[p + HEADER_SIZE : e]))))
        return out

    def _fd(self, seg: _Segment, create: bool = False) -> int:
        if seg.fd is None:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            seg.fd = self._fs.open(seg.path, flags, 0o644)
        fd = seg.fd
        self._fds[seg.base] = seg
        self._fds.move_to_end(seg.base)
        if len(self._fds) > _FD_CACHE:
            self._trim_fds()
        return fd

    def _trim_fds(self) -> None:
        active = self._segments[-1].base
        while len(self._fds) > _FD_CACHE:
            for base, seg in self._fds.items():
                if base != active and not seg.pending:
                    del self._fds[base]
                    assert seg.fd is not None  # a segment in _fds holds its descriptor (_fd opened it)
                    self._fs.close(seg.fd)
                    seg.fd = None
                    break
            else:
                return

    # ------------------------------------------------------------ compaction

    def delete_segment(self, base: int) -> None:
        """Remove a whole non-active, fully flushed segment (the owner decides
        it is dead), durably: the directory is fsynced before this returns, so
        a crash never brings back a segment whose records the owner counts as
        gone (a later segment it deletes may hold the only records that
        cancel this one's)."""
        self._check_usable()
        seg = self._segment(base)
        if seg is self._segments[-1]:
            raise ValueError(f"segment {base} is the active segment and cannot be deleted")
        if seg.pending_size:
            raise ValueError(f"segment {base} has unflushed records; flush first")
        i = self._bases.index(base)
        del self._bases[i]
        del self._segments[i]
        self._unsynced.discard(base)
        if seg.fd is not None:
            self._fds.pop(base, None)
            self._fs.close(seg.fd)
            seg.fd = None
        if not self._memory:
            try:
                self._fs.unlink(seg.path)
                if self._fsync:
                    _fsync_dir(self._fs, self._dir)
            except OSError as exc:
                self._failed = exc
                raise LogFailed(f"deleting segment {base} of {self._dir} failed: {exc}") from exc

    def truncate(self, offset: int) -> None:
        """Drop every record at ``offset`` or after, flushed or not, and make
        that durable: whole segments from ``offset`` on are deleted and the
        segment holding ``offset`` is cut at that record; the next record
        appended may take any offset from ``offset`` on.  Records below
        ``offset`` are untouched.  Raises ``ValueError`` if that would leave
        no segment (``offset`` at or below the first segment's base)."""
        self._check_usable()
        if not isinstance(offset, int) or offset <= self._bases[0]:
            raise ValueError(f"cannot truncate at offset {offset!r}: the first segment starts at {self._bases[0]}")
        self.flush()
        if offset >= self._next:
            return
        try:
            while self._bases[-1] >= offset:
                seg = self._segments.pop()
                self._bases.pop()
                self._unsynced.discard(seg.base)
                if seg.fd is not None:
                    self._fds.pop(seg.base, None)
                    self._fs.close(seg.fd)
                    seg.fd = None
                if not self._memory:
                    self._fs.unlink(seg.path)
            self._rolled = [sg for sg in self._rolled if sg in self._segments]
            seg = self._segments[-1]
            k = bisect.bisect_left(seg.offsets, offset)
            if k < len(seg.offsets):
                pos = seg.positions[k]
                if self._memory:
                    del seg.memory[pos:]
                else:
                    self._fd(seg)  # the active segment keeps its descriptor open
                    self._cut(seg, pos)
                del seg.offsets[k:]
                del seg.positions[k:]
                seg.size = pos
            if not self._memory and self._fsync:
                _fsync_dir(self._fs, self._dir)
        except OSError as exc:
            self._failed = exc
            raise LogFailed(f"truncating {self._dir} at offset {offset} failed: {exc}") from exc
        self._next = self._flushed_next = offset

    # ----------------------------------------------------------------- close

    def close(self, flush: bool = True) -> None:
        """Flush (unless ``flush=False``: unflushed records are dropped, as in a crash) and close.
        The active segment's preallocated zeros are cut off: a closed log's
        files end at their last record."""
        if self._closed:
            return
        try:
            if flush and self._failed is None:
                self.flush()
            active = self._segments[-1] if self._segments else None
            if self._failed is None and active is not None and active.on_disk and active.allocated > active.size:
                try:
                    self._fs.ftruncate(self._fd(active), active.size)
                    active.allocated = active.size
                except OSError:
                    pass  # zeros after the records are what recovery expects anyway
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        for seg in self._segments:
            if seg.fd is not None:
                self._fs.close(seg.fd)
                seg.fd = None
        self._fds.clear()
        if self._lock_fd is not None:
            self._fs.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
