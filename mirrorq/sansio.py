"""The contract between mirrorq's sans-IO protocol cores and whatever drives them.

A core (membership, GM, Raft, the queue state machines) is a plain object: no
sockets, no threads, no clocks, no Thespian, no disk flush of its own.  It is
driven through three methods, each taking the current time and returning a
list of actions:

``start(now)``
    once, when the core's process starts (or restarts after a crash);
``receive(now, src, msg)``
    a message ``msg`` arrived from the core named ``src``;
``timer(now, key)``
    the timer set with ``SetTimer(key, ...)`` fired.

Cores may offer further entry points of their own (``propose``,
``broadcast``...); they follow the same rule: arguments in, actions out.

Actions are what the driver must do on the core's behalf:

``Send(dst, msg, early=False)``
    deliver ``msg`` to the core named ``dst``.  Delivery is best effort: it may
    be lost, delayed, duplicated by nothing, reordered with other sends.  A
    core that needs more must build it (sequence numbers, retries).
    ``early=True`` says the message depends on nothing the turn has written
    and not yet persisted: it may leave before the turn's ``Persist`` is
    carried out (a Raft leader's ``AppendEntries``, sent while its own fsync
    of the same entries runs).  The flag permits, never requires: a driver
    may hold an early send like any other.
``SetTimer(key, delay)``
    call ``timer(now, key)`` after ``delay`` seconds.  Setting a key that is
    already pending replaces it.
``CancelTimer(key)``
    forget a pending timer.
``Emit(event)``
    hand ``event`` to the local world: subscribers in the real node, the
    checker in the simulator.
``Persist()``
    make durable what the core has written to its store so far: the driver
    calls the core's ``persist(now)`` and carries out the actions it returns
    (a core may return none; one that counted on its own writes only once
    durable -- a Raft leader in a quorum -- returns what they unblock).  No
    ``Send`` of the same turn may leave before it, except those marked
    ``early``: the driver holds a turn's sends until the turn ends,
    and the core puts ``Persist`` before the end of the turn (in what
    ``end_turn`` returns), so what it wrote reaches the disk before any
    message that depends on it (a confirm, a frame carrying a publish) --
    etcd raft's ``Ready``: entries to persist before messages to send.

Time: one clock per turn.  A *turn* is one input handled (a message, a
timer, a call) plus ``end_turn(now)`` if the core has it; the driver reads
its clock once when the turn starts and hands that same ``now`` to every
entry point it calls during the turn.  A core never reads a clock and never
sees two clocks: the queue replica's driver hands it wall-clock seconds
(message deadlines are stored and replicated), GM and Raft get whatever one
clock their driver has (monotonic seconds in the node, virtual time in the
simulator).

Two drivers exist: :mod:`mirrorq.simulator` (deterministic, virtual time, for
tests) and the Thespian actor shells (real processes).  Neither adds meaning;
both only translate.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Send:
    dst: str
    msg: Any
    #: may leave before the turn's Persist (it depends on no write of the turn)
    early: bool = False


@dataclass(frozen=True, slots=True)
class SetTimer:
    key: Hashable
    delay: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    key: Hashable


@dataclass(frozen=True, slots=True)
class Emit:
    event: Any


@dataclass(frozen=True, slots=True)
class Persist:
    pass


Action = Send | SetTimer | CancelTimer | Emit | Persist


class Core(Protocol):
    def start(self, now: float) -> list[Action]: ...

    def receive(self, now: float, src: str, msg: Any) -> list[Action]: ...

    def timer(self, now: float, key: Hashable) -> list[Action]: ...
