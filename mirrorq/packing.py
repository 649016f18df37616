"""msgpack encoding with one reusable Packer per thread.

``msgpack.packb`` builds a new ``Packer`` for every call, and with it a
256 KiB buffer.  In the node processes glibc hands that buffer out with
``mmap`` and takes it back with ``munmap``, a page-faulting round trip per
record, per GM frame, per Raft entry.  A Packer kept per thread keeps its
buffer.  :func:`pack` returns exactly what ``msgpack.packb(obj,
use_bin_type=True)`` returns and raises what it raises (a failed pack
leaves the Packer empty, so the next call starts clean).

A Packer whose buffer grew past :data:`KEEP_BYTES` for one large object is
dropped after that call, so a thread holds at most that much between calls.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

KEEP_BYTES = 1 << 20

_local = threading.local()


def pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)`` without a new buffer per call."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    out = packer.pack(obj)
    if len(out) > KEEP_BYTES:
        _local.packer = None
    return out
