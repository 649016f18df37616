"""The majority lease: until when this node may serve without hearing a majority.

RabbitMQ's ``pause_minority`` stops a node that sees only a minority of its
cluster.  Here the node agent decides it (the membership core's
``QuorumLost`` / ``QuorumRegained``) and every process of the node that
serves clients or queues must act on it at once, including the first turn
after the whole node was stopped (SIGSTOP, a paused VM) and resumed, before
the agent has ticked again.  A message from the agent cannot do that: it
would be read after whatever else waited in the process's inbox.  So the
agent keeps a *lease* in a file of the node's data dir that every serving
process maps and reads at the start of each turn, with that turn's ``now``.

Protocol
--------
* The file ``majority.lease`` holds one 8-byte float: a time on the
  machine's ``CLOCK_MONOTONIC`` (``time.monotonic()``: one clock for every
  process of the host, running while processes are stopped) until which the
  node may serve.  ``inf``: no limit (``cluster_partition_handling: ignore``
  or a cluster of fewer than three voters); ``0``: paused.
* The agent renews the lease on every membership tick (the turn its own
  heartbeats leave in) while it hears a majority, to ``now + heartbeat_timeout -
  heartbeat_interval``; when the core reports ``QuorumLost`` it writes
  0 at once; on ``QuorumRegained`` it renews it.  It writes the lease before
  it tells the node's processes anything (``NodeEvent`` "paused" /
  "resumed", which wake an idle process).
* A reader sees one of three states (:meth:`LeaseReader.state`):
  ``PAUSED`` (the lease is 0: the node is in a minority: it serves no
  client), ``EXPIRED`` (``now >= lease`` > 0: the agent has not renewed it
  in time -- it, or the whole node, was stopped or starved -- so what the
  node believes may be stale: the majority may have acted on its
  silence), or ``SERVING``.  A queue host treats both of the first two
  alike: it serves no client, and when the lease is valid again each of its
  masters asks the Raft leader whether it still is one before it serves
  (mirrorq.queues.host).  The front end closes its clients only when
  ``PAUSED``: a stall of the agent (an fsync of its Raft log held up by the
  disk) costs a round of checks, not the clients' connections.

Guarantee: the lease ends before the other nodes can report this one down,
so a process that resumes after its node was stopped for longer than the
timeout finds it expired in its first turn: the lease was last renewed at
the agent's last turn, and the other nodes report this one down no earlier
than a heartbeat timeout after its last heartbeat, which left in its last
tick (mirrorq.node.membership: a refused connection does not make that
sooner).  So the node's
masters hold their clients' requests before the majority can act on its
absence.

Assumes: one machine's monotonic clock for the agent and its readers (they
are processes of one node); an aligned 8-byte store into a shared mapping is
seen whole by readers.  So the value is stored and loaded through a
``memoryview`` cast to ``d`` (one 8-byte store, one 8-byte load), never
with ``struct.pack_into``, which copies byte by byte: a reader racing it saw
torn values, 0.0 among them, about once in 2,400 reads (measured), and took
them for a minority.  A missing or
unreadable file reads as no limit, so a tool or a test without an agent is
never paused by it.
"""

from __future__ import annotations

import math
import mmap
import os

FILENAME = "majority.lease"
_SIZE = 8


def lease_path(data_dir: str) -> str:
    return os.path.join(data_dir, FILENAME)


class LeaseWriter:
    """The agent's end: creates the file (paused until the first renewal)."""

    def __init__(self, data_dir: str) -> None:
        path = lease_path(data_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._cell = memoryview(self._map).cast("d")
        self.until = 0.0
        self.write(0.0)

    def write(self, until: float) -> None:
        self.until = until
        self._cell[0] = until  # one aligned 8-byte store

    def close(self) -> None:
        self._cell.release()
        self._map.close()


SERVING, EXPIRED, PAUSED = "serving", "expired", "paused"


class LeaseReader:
    """A serving process's end (a missing file reads as no limit)."""

    def __init__(self, data_dir: str) -> None:
        self.path = lease_path(data_dir)
        self._map: mmap.mmap | None = None
        self._cell: memoryview[float] | None = None
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size >= _SIZE:
                self._map = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
                self._cell = memoryview(self._map).cast("d")
        finally:
            os.close(fd)

    def until(self) -> float:
        if self._cell is None:
            self._open()  # the agent creates it first; a tool without an agent never finds it
            if self._cell is None:
                return math.inf
        return self._cell[0]  # one aligned 8-byte load

    def state(self, now: float) -> str:
        until = self.until()
        if until <= 0.0:
            return PAUSED
        return EXPIRED if now >= until else SERVING

    def paused(self, now: float) -> bool:
        """Not :data:`SERVING` (paused, or expired)."""
        return now >= self.until()
