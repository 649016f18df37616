"""Group fsync: make the writes of many files durable with one device flush.

A queue host's turn may leave writes in the logs of many quorum groups, and
each must reach the disk before the messages that depend on it leave (Raft
acknowledgements, votes, confirms).  One ``fsync`` per file costs one
device flush each (about 0.2 ms on these machines: 100 groups touched in a
turn cost 16-20 ms).  Linux's ``syncfs(2)`` writes back every dirty file of
a filesystem and flushes the device once (under 1 ms for the same 100).

:func:`sync_files` takes the files a turn wrote, grouped by filesystem:
a lone file is fsynced; two or more on one filesystem are made durable by
one ``syncfs`` of it.  Without ``syncfs`` (not Linux, or a kernel before
5.8, whose ``syncfs`` does not report writeback errors) every file is
fsynced.

Guarantee: for every key it does not return as failed, everything written
to that file descriptor before the call is on the disk, as after an
``fsync`` of it.  Failure: an ``OSError`` of the call that covered a file
is returned for that file's key (every file of a failed ``syncfs`` fails
with it); the caller must treat those files' writes as not durable (the
queue host stops those replicas: they restart from what their logs hold).
Assumes: the descriptors are open for the whole call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

__all__ = ["sync_files", "syncfs_available"]


def _load_syncfs() -> Callable[[int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (5, 8):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    return syncfs


_SYNCFS = _load_syncfs()

_K = TypeVar("_K", bound=Hashable)  # what names a file in sync_files


def syncfs_available() -> bool:
    """Whether :func:`sync_files` can sync a filesystem in one call here."""
    return _SYNCFS is not None


def sync_files(
    files: Mapping[_K, int],
    *,
    syncfs: Callable[[int], None] | None = None,
    fsync: Callable[[int], None] = os.fsync,
) -> dict[_K, OSError]:
    """Make what was written to ``files`` (key -> file descriptor) durable;
    returns the keys that failed, with their error (see the module
    docstring).  ``syncfs`` / ``fsync`` are for tests."""
    syncfs = _SYNCFS if syncfs is None else syncfs
    failed: dict[_K, OSError] = {}
    by_dev: dict[int, list[_K]] = {}
    for key, fd in files.items():
        try:
            by_dev.setdefault(os.fstat(fd).st_dev, []).append(key)
        except OSError as e:
            failed[key] = e
    for keys in by_dev.values():
        if len(keys) > 1 and syncfs is not None:
            try:
                syncfs(files[keys[0]])
            except OSError as e:
                failed.update((k, e) for k in keys)
            continue
        for k in keys:
            try:
                fsync(files[k])
            except OSError as e:
                failed[k] = e
    return failed
