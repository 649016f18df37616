"""Room on CPython's frame stack for a whole process's calls.

CPython 3.11 keeps Python frames on a per-thread stack of chunks: the
first is 16 KiB; a call whose frame does not fit in the current chunk gets
a new chunk (mmap), and the chunk is unmapped (munmap) as soon as that
frame returns.  A node process's turns run some 60 frames deep (the
daemon, Thespian's admin and actor loops, the posting shell, the host, the
GM shell, the replica, the queue core, the store), right about 16 KiB: a
loop whose callee lands on the chunk boundary pays an mmap and a munmap on
every call.  Measured on a mirror applying a GM frame's records
(``MirrorQueueSlave._apply`` -> ``BackingQueue._mutate`` / ``SegmentLog.append``):
43% of the process's samples in ``mmap``/``munmap``; in a micro-benchmark,
a call at the boundary costs ~200x a call anywhere else.

:func:`run_with_room` calls a function under one frame big enough
(:data:`SLOTS` local slots, 72 KB) that CPython puts it in a fresh chunk of
128 KiB, leaving ~56 KiB after it for everything the function calls, and
that chunk lives as long as the call.  Run a process's main under it and
every frame of the process's main thread (and of every process forked
from it while the call is on the stack) fits in that one chunk, so no
call maps or unmaps a chunk.  The node daemon's start runs under it, so
the admin and every actor the admin forks do; a helper process started
with ``subprocess`` needs its own main under it (the asyncio AMQP shell
has; the management server, off the data path, has not), and so would a
thread.

Guarantees: the function's result and exceptions are passed through
unchanged; the cost is one 72 KB frame, touched once.  Assumes CPython's
chunked frame stack (3.11-3.13); elsewhere it is a plain call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: local variables of the trampoline's frame: 8 bytes each
SLOTS = 9000


def _build() -> Callable:
    names = " = ".join(f"_{i}" for i in range(SLOTS))
    src = (
        "def run_with_room(fn, args, kwargs):\n"
        "    if fn is None:  # never true: the names only size the frame\n"
        f"        {names} = None\n"
        "    return fn(*args, **kwargs)\n"
    )
    ns: dict = {}
    exec(compile(src, __name__, "exec"), ns)
    return ns["run_with_room"]


_trampoline = _build()


def run_with_room(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with ~56 KiB of frame stack for its calls."""
    if not callable(fn):
        raise TypeError(f"run_with_room needs a callable, got {fn!r}")
    return _trampoline(fn, args, kwargs)
