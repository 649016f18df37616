"""A cheaper selector for Thespian's TCP loop, one ``poll(2)`` per turn.

Why
---
Thespian's TCP transport builds a ``selectors.DefaultSelector()`` on every
iteration of its loop, registers every socket it watches, selects once and
closes it: on Linux an ``epoll_create1``, one ``epoll_ctl`` per socket (a
front end watches about a dozen), an ``epoll_wait`` and a ``close``, plus a
``SelectorKey`` built per registration.  Every turn of every node process
pays that, and a lone mirrored publish is five turns in a row.  A one-shot
selector is exactly what ``poll(2)`` is: the set of descriptors goes to the
kernel with the wait, nothing is kept between calls.

:class:`PollOnce` is that, with the part of the ``selectors`` interface the
loop uses (``register``, ``select``, ``close``, the ``fd`` of a returned
key); :func:`install` puts it in Thespian's ``TCPTransport`` module as that
module's ``selectors`` (a module-level seam, as :mod:`mirrorq.node.wire`
does for its serializer).

Guarantees: the loop sees what ``selectors`` gives it -- a descriptor
readable (or hung up, or in error) is reported with ``EVENT_READ``, one
writable (or hung up, or in error) with ``EVENT_WRITE``, each only if it
was registered for it; a descriptor that is not open raises
``OSError(EBADF)`` from :meth:`PollOnce.select`, which is what the loop's
recovery (finding a watched descriptor that went bad) expects of
``epoll``'s ``register``.  A descriptor registered twice is
watched for the union of its events (``selectors`` would raise).

``MIRRORQ_EPOLL_LOOP=1`` in a node's environment leaves Thespian's own
selector in place (to compare the two).
"""

from __future__ import annotations

import errno
import math
import os
import select
import selectors
import types
from typing import Any

EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE

_READ_MASK = select.POLLIN | select.POLLPRI
_WRITE_MASK = select.POLLOUT
#: poll bits reported as readable / writable (hang-ups and errors wake both,
#: as ``selectors.PollSelector`` maps them)
_AS_READ = ~select.POLLOUT
_AS_WRITE = ~(select.POLLIN | select.POLLPRI)


class _Key:
    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd


class PollOnce:
    """A selector used once: register descriptors, select, close."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: dict[int, int] = {}  # fd -> EVENT_READ | EVENT_WRITE asked for

    def register(self, fileobj: Any, events: int, data: Any = None) -> None:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        if fd < 0:
            raise ValueError(f"invalid file descriptor {fd}")
        events &= EVENT_READ | EVENT_WRITE
        if not events:
            raise ValueError(f"invalid events: {events!r}")
        self._events[fd] = self._events.get(fd, 0) | events

    def select(self, timeout: float | None = None) -> list[tuple[_Key, int]]:
        if timeout is None:
            ms = None
        elif timeout <= 0:
            ms = 0
        else:
            ms = math.ceil(timeout * 1e3)
        p = select.poll()
        asked = self._events
        for fd, events in asked.items():
            p.register(fd, (_READ_MASK if events & EVENT_READ else 0) | (_WRITE_MASK if events & EVENT_WRITE else 0))
        out = []
        for fd, ev in p.poll(ms):
            if ev & select.POLLNVAL:
                raise OSError(errno.EBADF, f"poll: descriptor {fd} is not open")
            got = ((EVENT_READ if ev & _AS_READ else 0) | (EVENT_WRITE if ev & _AS_WRITE else 0)) & asked[fd]
            if got:
                out.append((_Key(fd), got))
        return out

    def close(self) -> None:
        self._events.clear()


#: what Thespian's TCPTransport reads from its ``selectors`` global
SELECTORS = types.SimpleNamespace(DefaultSelector=PollOnce, EVENT_READ=EVENT_READ, EVENT_WRITE=EVENT_WRITE)


def install() -> None:
    """Make Thespian's TCP loop in this process (and the processes it forks
    later) select through :class:`PollOnce`.  Idempotent."""
    if os.environ.get("MIRRORQ_EPOLL_LOOP") == "1":
        return
    import thespian.system.transport.TCPTransport as tcp

    tcp.selectors = SELECTORS
