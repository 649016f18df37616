"""Zeros written ahead of an append-only file's records.

An fsync after an append changes the file's size, and on ext4 a size
change commits a journal transaction; an fsync after overwriting blocks the
file already has does not.  An append-only log that keeps some zeros
written after its records therefore pays less per fsync.  :func:`extend` is
that policy, for the segment log and the Raft log alike (which both write
through :func:`write_at`): when records pass
the zeros, write more, an eighth of what the file holds (between
:data:`MIN_BYTES` and :data:`MAX_BYTES`, to a page boundary, never past a
cap), so a queue that holds little wastes at most a page or two.

The files' readers must take zeros after the last record as the end of the
log, not as a torn record; their owners cut the zeros off when they close.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

MIN_BYTES = 4096
MAX_BYTES = 1024 * 1024
_ZEROS = bytes(MAX_BYTES + MIN_BYTES)


def target(end: int, cap: int) -> int:
    """The file length to extend to once records reach ``end``."""
    ahead = min(MAX_BYTES, max(MIN_BYTES, end // 8))
    return max(end, min(-(-(end + ahead) // MIN_BYTES) * MIN_BYTES, cap))


def write_at(fd: int, data: bytes | memoryview, pos: int, pwrite: Callable[[int, Any, int], int] = os.pwrite) -> int:
    """Write all of ``data`` at ``pos`` (``pwrite`` until done: the log's
    file system's, :mod:`mirrorq.fsapi`); returns the position after it."""
    view = memoryview(data)
    while view:
        n = pwrite(fd, view, pos)
        view = view[n:]
        pos += n
    return pos


def extend(fd: int, end: int, allocated: int, cap: int, pwrite: Callable[[int, Any, int], int] = os.pwrite) -> int:
    """Records now reach ``end`` of the file ``fd`` whose length is
    ``allocated``: if they are past it, write zeros from ``end`` up to
    :func:`target`.  Returns the file's length."""
    if end <= allocated:
        return allocated
    upto = target(end, cap)
    write_at(fd, memoryview(_ZEROS)[: upto - end], end, pwrite)
    return upto
