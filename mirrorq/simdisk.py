"""A simulated disk: files in memory that a crash can take back.

:class:`SimDisk` implements :class:`mirrorq.fsapi.FileSystem` -- the few
descriptor-level calls the logs make (``open``/``close``/``pread``/
``pwrite``/``fsync``/``ftruncate``/``fstat``/``flock``, ``listdir``/
``unlink``/``rename``/``replace``/``makedirs``/``exists``/``getsize``/
``statvfs``) -- so that a :class:`~mirrorq.store.segment_log.SegmentLog`,
a :class:`~mirrorq.classic.backing_queue.BackingQueue` or a
:class:`~mirrorq.mnesia_like.raft_log.FileRaftLog` given ``fs=SimDisk()``
runs its production code over it.  The simulator (:mod:`mirrorq.simulator`)
keeps one per node in the node's ``disk`` dict (:func:`of`) and calls
:meth:`SimDisk.crash` when it kills the node: every kill is a power loss.

Model
-----
* **Reads see every write** made before them, synced or not, until a crash
  (one page cache, shared by every descriptor).
* **File data.**  Each file (inode) keeps its *durable* content and the
  operations on it since its last ``fsync`` -- writes (``pwrite``) and size
  changes (``ftruncate``, ``O_TRUNC``), in the order they were made.
  ``fsync(fd)`` makes them all durable.
* **Directory entries** (a create, an unlink, a rename/replace) are
  operations on the directory, durable only once that *directory* is
  fsynced (``fsync`` of a descriptor ``open``-ed on the directory) -- the
  POSIX rule, stricter than ext4 in practice (whose journal commits a
  create with the file's own fsync): a file's fsync makes its content
  durable, not its name.  A log must therefore fsync the file *and* its
  directory after creating, renaming or deleting a file whose presence a
  promise depends on, which is what both logs do.  Renames and replaces
  stay within one directory (all the logs do).  Directories themselves
  (``makedirs``) are durable at once: the logs fsync the directory they
  change, never its parent, and a node's data directory is made once at
  setup; modelling that would only say that a log created in the last
  instants before a power loss may vanish whole.
* **A crash** (:meth:`SimDisk.crash`, ``rng`` handed in) is a power loss.
  Every descriptor is closed and every lock released.  Per file, the
  unsynced operations survive *in order up to a random point* (the kernel
  may have written some back): a random prefix of them is applied to the
  durable content; the first operation after that prefix, if it is a write,
  may be **torn** -- a random prefix of its bytes lands, the rest of its
  range keeps what was durable there, and if it extended the file the file
  ends either after the bytes that landed or (its size committed, its data
  not) at the write's end, the gap reading as zeros.  Everything after is
  lost.  The directories' unsynced entry operations likewise survive in the
  order they were made (a journal commits metadata in order) up to a random
  point.  After a crash the files read exactly what survived.
* Deterministic: the same calls and the same ``rng`` state give the same
  disk; :meth:`listdir` is sorted; nothing depends on hashing.

Not modelled: torn writes that are not a prefix (sectors written out of
order), bit rot, reordering of one file's writes by the kernel, short reads
and writes, ``ENOSPC`` (``statvfs`` reports ``free`` bytes, nothing
enforces them), permissions and ``mode``, hard links, cross-directory
renames (``OSError(EXDEV)``).  Errors are the ``OSError`` subclasses ``os``
raises (``FileNotFoundError``, ``FileExistsError``, ``IsADirectoryError``,
``BlockingIOError`` for a held lock, ``EBADF``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import posixpath
import random
from dataclasses import dataclass
from typing import Any

from mirrorq.fsapi import FileSystem

#: the key of a node's SimDisk in the simulator's per-node ``disk`` dict
DISK_KEY = "simdisk"

_ACCESS = os.O_RDONLY | os.O_WRONLY | os.O_RDWR


@dataclass(frozen=True)
class Stat:
    st_size: int


@dataclass(frozen=True)
class StatVfs:
    f_bavail: int
    f_frsize: int


class _Inode:
    __slots__ = ("number", "data", "durable", "ops")

    def __init__(self, number: int) -> None:
        self.number = number
        self.data = bytearray()  # what reads see
        self.durable = bytearray()  # what a crash keeps for sure
        # since the last fsync, in order: (offset, bytes) a write, (length, None) a size change
        self.ops: list[tuple[int, bytes | None]] = []


class _Dir:
    __slots__ = ("entries", "durable")

    def __init__(self) -> None:
        self.entries: dict[str, _Inode] = {}  # what lookups see
        self.durable: dict[str, _Inode] = {}  # what a crash keeps for sure


@dataclass
class _Open:
    inode: _Inode | None  # None: a directory
    dir_path: str  # the directory's path (a directory's descriptor), else ""
    readable: bool
    writable: bool


def _apply(content: bytearray, offset: int, data: bytes | None) -> None:
    if data is None:  # a size change
        if offset < len(content):
            del content[offset:]
        else:
            content.extend(bytes(offset - len(content)))
        return
    if offset > len(content):
        content.extend(bytes(offset - len(content)))
    content[offset : offset + len(data)] = data


def _ebadf(fd: int) -> OSError:
    return OSError(errno.EBADF, os.strerror(errno.EBADF), fd)


class SimDisk:
    """An in-memory file system whose :meth:`crash` is a power loss (see
    the module docstring for what survives).  ``free``: what ``statvfs``
    reports as available bytes."""

    def __init__(self, *, free: int = 1 << 40) -> None:
        self.free = free
        self._dirs: dict[str, _Dir] = {"/": _Dir()}
        # unsynced entry operations, in order: (directory, "link"|"unlink"|"rename", name, inode|None|new name)
        self._meta: list[tuple[str, str, str, Any]] = []
        self._fds: dict[int, _Open] = {}
        self._locks: dict[int, int] = {}  # inode number -> the descriptor holding its lock
        self._next_fd = 3
        self._next_inode = 1
        #: counters, for tests: crashes, unsynced operations lost, writes torn
        self.crashes = 0
        self.lost = 0
        self.torn = 0

    # ---- paths -------------------------------------------------------------
    @staticmethod
    def _norm(path: Any) -> str:
        return posixpath.normpath(posixpath.join("/", os.fspath(path)))

    def _parent(self, path: str) -> tuple[_Dir, str, str]:
        """The directory holding ``path``, its path, and the entry name."""
        parent, name = posixpath.split(path)
        d = self._dirs.get(parent)
        if d is None or not name:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return d, parent, name

    def _lookup(self, path: Any) -> _Inode:
        p = self._norm(path)
        if p in self._dirs:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
        d, _, name = self._parent(p)
        inode = d.entries.get(name)
        if inode is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), p)
        return inode

    def _open_of(self, fd: int) -> _Open:
        o = self._fds.get(fd)
        if o is None:
            raise _ebadf(fd)
        return o

    def _file(self, fd: int, *, write: bool = False) -> _Inode:
        o = self._open_of(fd)
        if o.inode is None:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), o.dir_path)
        if not (o.writable if write else o.readable):
            raise _ebadf(fd)
        return o.inode

    # ---- descriptors -----------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        p = self._norm(path)
        access = flags & _ACCESS
        if p in self._dirs:
            if access != os.O_RDONLY or flags & os.O_CREAT:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
            return self._new_fd(_Open(None, p, True, False))
        d, parent, name = self._parent(p)
        inode = d.entries.get(name)
        if inode is None:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), p)
            inode = _Inode(self._next_inode)
            self._next_inode += 1
            d.entries[name] = inode
            self._meta.append((parent, "link", name, inode))
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), p)
        writable = access in (os.O_WRONLY, os.O_RDWR)
        if flags & os.O_TRUNC and writable and inode.data:
            del inode.data[:]
            inode.ops.append((0, None))
        return self._new_fd(_Open(inode, "", access != os.O_WRONLY, writable))

    def _new_fd(self, o: _Open) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = o
        return fd

    def close(self, fd: int) -> None:
        self._open_of(fd)
        del self._fds[fd]
        for number, holder in list(self._locks.items()):
            if holder == fd:
                del self._locks[number]

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        if n < 0 or offset < 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return bytes(self._file(fd).data[offset : offset + n])

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        inode = self._file(fd, write=True)
        if offset < 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        b = bytes(data)
        if b:
            _apply(inode.data, offset, b)
            inode.ops.append((offset, b))
        return len(b)

    def ftruncate(self, fd: int, length: int) -> None:
        inode = self._file(fd, write=True)
        if length < 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        _apply(inode.data, length, None)
        inode.ops.append((length, None))

    def fsync(self, fd: int) -> None:
        o = self._open_of(fd)
        if o.inode is None:  # a directory: its entry operations become durable
            keep = []
            d = self._dirs[o.dir_path]
            for op in self._meta:
                if op[0] == o.dir_path:
                    self._apply_meta(d, op)
                else:
                    keep.append(op)
            self._meta = keep
            return
        inode = o.inode
        for offset, data in inode.ops:
            _apply(inode.durable, offset, data)
        inode.ops = []

    def fstat(self, fd: int) -> Stat:
        o = self._open_of(fd)
        return Stat(0 if o.inode is None else len(o.inode.data))

    def flock(self, fd: int, operation: int) -> None:
        number = self._file(fd).number
        if operation & fcntl.LOCK_UN:
            if self._locks.get(number) == fd:
                del self._locks[number]
            return
        holder = self._locks.get(number)
        if holder is not None and holder != fd:
            if operation & fcntl.LOCK_NB:
                raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))
            raise RuntimeError("a blocking flock on a held lock would block the simulation forever")
        self._locks[number] = fd

    # ---- names -----------------------------------------------------------------
    def listdir(self, path: str) -> list[str]:
        p = self._norm(path)
        d = self._dirs.get(p)
        if d is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), p)
        prefix = p.rstrip("/") + "/"
        subdirs = [q[len(prefix) :] for q in self._dirs if q.startswith(prefix) and "/" not in q[len(prefix) :]]
        return sorted(list(d.entries) + subdirs)

    def unlink(self, path: str) -> None:
        p = self._norm(path)
        self._lookup(p)
        d, parent, name = self._parent(p)
        del d.entries[name]
        self._meta.append((parent, "unlink", name, None))

    def rename(self, src: str, dst: str) -> None:
        """Also ``replace`` (POSIX ``rename`` replaces an existing ``dst``)."""
        s, t = self._norm(src), self._norm(dst)
        inode = self._lookup(s)
        if t in self._dirs:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), t)
        d, parent, name = self._parent(s)
        d2, parent2, name2 = self._parent(t)
        if parent2 != parent:
            raise OSError(errno.EXDEV, "SimDisk renames only within a directory", t)
        if name == name2:
            return
        del d.entries[name]
        d.entries[name2] = inode
        self._meta.append((parent, "rename", name, name2))

    replace = rename

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        p = self._norm(path)
        if p in self._dirs:
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), p)
            return
        parent, name = posixpath.split(p)
        if parent not in self._dirs:
            self.makedirs(parent, exist_ok=True)
        if name in self._dirs[parent].entries:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), p)
        self._dirs[p] = _Dir()

    def exists(self, path: str) -> bool:
        p = self._norm(path)
        if p in self._dirs:
            return True
        parent, name = posixpath.split(p)
        d = self._dirs.get(parent)
        return d is not None and name in d.entries

    def getsize(self, path: str) -> int:
        p = self._norm(path)
        if p in self._dirs:
            return 0
        return len(self._lookup(p).data)

    def statvfs(self, path: str) -> StatVfs:
        if not self.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return StatVfs(self.free, 1)

    # ---- for tests ---------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """What a read of the whole file ``path`` returns now."""
        return bytes(self._lookup(path).data)

    def unsynced(self) -> int:
        """How many operations a crash now could lose (file and directory)."""
        return len(self._meta) + sum(len(i.ops) for i in self._inodes())

    def _inodes(self) -> list[_Inode]:
        seen: dict[int, _Inode] = {}
        for d in self._dirs.values():
            for inode in d.entries.values():
                seen[inode.number] = inode
        for o in self._fds.values():
            if o.inode is not None:
                seen[o.inode.number] = o.inode
        return [seen[k] for k in sorted(seen)]

    # ---- the crash ---------------------------------------------------------------
    def crash(self, rng: random.Random) -> None:
        """A power loss: see the module docstring for what survives.  The
        choices come from ``rng`` alone."""
        self.crashes += 1
        for inode in self._inodes():
            ops = inode.ops
            if not ops:
                continue
            keep = rng.randint(0, len(ops))
            for offset, data in ops[:keep]:
                _apply(inode.durable, offset, data)
            self.lost += len(ops) - keep
            if keep < len(ops) and ops[keep][1] is not None and rng.random() < 0.5:
                offset, data = ops[keep]
                assert data is not None
                landed = rng.randrange(len(data))
                if landed:
                    _apply(inode.durable, offset, data[:landed])
                if len(inode.durable) < offset + len(data) and rng.random() < 0.5:
                    _apply(inode.durable, offset + len(data), None)  # the size reached the disk, not the data
                self.torn += 1
            inode.data = bytearray(inode.durable)
            inode.ops = []
        keep = rng.randint(0, len(self._meta))
        for op in self._meta[:keep]:
            self._apply_meta(self._dirs[op[0]], op)
        self.lost += len(self._meta) - keep
        self._meta = []
        for d in self._dirs.values():
            d.entries = dict(d.durable)
        self._fds.clear()
        self._locks.clear()

    def close_all(self) -> None:
        """A process dies, the machine does not: its descriptors close and its
        locks go; everything written stays (in the page cache)."""
        self._fds.clear()
        self._locks.clear()

    @staticmethod
    def _apply_meta(d: _Dir, op: tuple[str, str, str, Any]) -> None:
        _, kind, name, arg = op
        if kind == "link":
            d.durable[name] = arg
        elif kind == "unlink":
            d.durable.pop(name, None)
        else:  # rename: name -> arg
            d.durable[arg] = d.durable.pop(name)  # in order: its source is durable by now


def of(disk: dict[Any, Any], **kwargs: Any) -> SimDisk:
    """The :class:`SimDisk` kept in a simulator node's ``disk`` dict (made on
    first use, with ``kwargs``): it survives kills as the node's disk does,
    and :meth:`mirrorq.simulator.Simulator.kill` crashes it."""
    fs = disk.get(DISK_KEY)
    if fs is None:
        fs = disk[DISK_KEY] = SimDisk(**kwargs)
    assert isinstance(fs, SimDisk)
    return fs


def _conforms(disk: SimDisk) -> FileSystem:
    return disk  # mypy checks that a SimDisk is a FileSystem
