"""The file-system calls the on-disk logs make, as one replaceable object.

:class:`~mirrorq.store.segment_log.SegmentLog` (and the
:class:`~mirrorq.classic.backing_queue.BackingQueue` over it),
:class:`~mirrorq.mnesia_like.raft_log.FileRaftLog` and
:mod:`mirrorq.preallocate` touch their files only through a
:class:`FileSystem` handed in as ``fs=``.  Production uses :data:`OS`, whose
methods *are* the ``os`` (and ``fcntl.flock``) functions, bound once at
import: a call through it is an attribute lookup and the C function, no
Python layer in between.  The simulator hands in a
:class:`mirrorq.simdisk.SimDisk` instead, which keeps the files in memory
and decides what a crash leaves of what was not fsynced.

Only descriptor-level calls are in the API (no buffered ``open()`` file
objects): what a log does to a file is a sequence of these calls, each one
an operation the simulated disk can lose or tear.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any, Protocol


class FileSystem(Protocol):
    """What a log may call (same signatures and errors as ``os``)."""

    def open(self, path: str, flags: int, mode: int = 0o777) -> int: ...
    def close(self, fd: int) -> None: ...
    def pread(self, fd: int, n: int, offset: int) -> bytes: ...
    def pwrite(self, fd: int, data: Any, offset: int) -> int: ...
    def fsync(self, fd: int) -> None: ...
    def ftruncate(self, fd: int, length: int) -> None: ...
    def fstat(self, fd: int) -> Any: ...  # has st_size
    def flock(self, fd: int, operation: int) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def unlink(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def replace(self, src: str, dst: str) -> None: ...
    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None: ...
    def exists(self, path: str) -> bool: ...
    def getsize(self, path: str) -> int: ...
    def statvfs(self, path: str) -> Any: ...  # has f_bavail, f_frsize


class OsFileSystem:
    """The real file system: each method is the ``os`` function itself."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pread = staticmethod(os.pread)
    pwrite = staticmethod(os.pwrite)
    fsync = staticmethod(os.fsync)
    ftruncate = staticmethod(os.ftruncate)
    fstat = staticmethod(os.fstat)
    flock = staticmethod(fcntl.flock)
    listdir = staticmethod(os.listdir)
    unlink = staticmethod(os.unlink)
    rename = staticmethod(os.rename)
    replace = staticmethod(os.replace)
    makedirs = staticmethod(os.makedirs)
    exists = staticmethod(os.path.exists)
    getsize = staticmethod(os.path.getsize)
    statvfs = staticmethod(os.statvfs)


#: the default ``fs`` of every log: the real ``os`` calls
OS: FileSystem = OsFileSystem()


def read_file(fs: FileSystem, path: str) -> bytes:
    """The whole content of ``path`` (``FileNotFoundError`` if there is none)."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        chunks = [fs.pread(fd, fs.fstat(fd).st_size, 0)]
        pos = len(chunks[0])
        while True:  # until the end of the file (it may have grown since the fstat)
            data = fs.pread(fd, 1 << 20, pos)
            if not data:
                break
            chunks.append(data)
            pos += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        fs.close(fd)
