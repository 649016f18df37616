"""Record upkeep: how the replica that runs a queue keeps the queue's ``amqqueue`` row saying so.

The registry's ``amqqueue`` row of a queue names who runs it: a classic
queue's master (``pid``, ``slave_pids``, ``sync_slave_pids``, ``gm_pids``,
kept by :mod:`mirrorq.classic.actor` after every promotion, view change and
sync), a quorum queue's leader (``pid`` = its epoch ``member#term``,
``members``, ``leader_dst``, kept by :mod:`mirrorq.quorum.hosted` when it
wins an election and whenever a configuration commits).  Front ends, queue
managers and mirrorctl read it.  :class:`RecordUpkeep` is that upkeep for
both, a sans-IO core (:mod:`mirrorq.sansio`): the owner (the shell of the
replica) says what the row should say, the core reads the row and writes
what differs until the registry shows it.

Events in
---------
``keep(now, Wanted)``
    the row should say ``Wanted.fields`` (a view change, a promotion, a
    sync, an election, a configuration): read it now and write what
    differs.  ``Wanted`` also carries the whole row (for when there is
    none), the writer's fence, whether every write puts the whole row, and
    rows the writes must delete (a quorum leader's removed members).
``release(now)``
    the owner keeps the row no more (deposed, stopped, handed over, the
    queue deleted): nothing more is read or written; a write in flight is
    the fence's business.
``receive(now, src, msg)``
    the node agent's answers: ``RegistryRows`` with a :class:`RecordRead`
    ref, ``RegistryResult`` with a :class:`RecordWrite` ref
    (:func:`is_answer` tells an owner which messages are the upkeep's).
``timer(now, RETRY_TIMER)``
    the retry timer fired.

Actions out: ``Send(agent, RegistryGet | RegistryTxn)``,
``SetTimer`` / ``CancelTimer`` of :data:`RETRY_TIMER`, and ``Emit`` of
what the owner hears: :class:`UpkeepDone` (the row shows what was
wanted), :class:`WriteRefused` (a write's checks failed, or the registry
refused it: logged by the owner), :class:`RowsDeleted` (a committed write
deleted these rows), :class:`Superseded` (a quorum row names a leader of a
newer term: the upkeep ends without writing).

The protocol
------------
1. ``keep``: read the row (the node agent answers from its local tables)
   and arm the retry timer, :data:`RECORD_RETRY` at first, doubled at each
   firing up to :data:`RECORD_RETRY_MAX` -- thousands of masters or leaders
   elected at once must not flood a registry that is slow to commit (or has
   no leader) with a read and a write each every half second;
2. the rows: if the row shows every wanted field and no wanted delete is
   outstanding, the upkeep is done (the timer is cancelled).  Otherwise,
   unless a write went out less than the current retry ago (it may not be
   committed yet: the timer reads again), write: one transaction of the
   fence's checks, the write -- a put of the whole row when it is absent
   or ``Wanted.whole``, else an update of the wanted fields checked to
   exist -- and the outstanding deletes;
3. a committed write whose fields are still the wanted ones ends the
   upkeep without a read back; a refused one is reported
   (:class:`WriteRefused`) and the next read writes again;
4. the timer: read again, while not done.

Fences
------
* :class:`ViewFence` (a classic master): the write commits only while
  ``gm_group[group]`` is at ``version``, the GM view the master holds.  A
  master deposed by a newer view (a promotion elsewhere) whose write was
  still in flight cannot overwrite its successor's record.  ``version``
  None (no view installed yet): no fence.
* :class:`TermFence` (a quorum leader of ``term``): a row whose ``pid`` is
  an epoch of a higher term is never written over (read: the upkeep ends,
  :class:`Superseded`), and every write is checked against the row as read
  (``pid`` equals the ``pid`` read, or the row is absent when none was
  read), so a row written by anyone between the read and the write (a
  newer leader's) refuses the write, and the next read sees the newer
  term.

Guarantees
----------
* **Fenced**: a write lands only on the row its writer's fence allows: for
  a view fence, while the writer's view is the queue's current view; for a
  term fence, over a row the writer read and found of no higher term,
  whose ``pid`` is still the one read (or that is still absent).
* **Convergence**: while the owner keeps the row, its fence lets it write
  (its view is current; no higher term wrote the row), the registry
  commits and its answers arrive, the row comes to show the wanted fields:
  every read that does not show them leads to a write (within the retry),
  every write is answered, and reads repeat until done, at most
  :data:`RECORD_RETRY_MAX` apart.  A term-fenced upkeep that reads a
  higher term ends there; a view-fenced one whose view is gone goes on
  reading (and being refused) until its owner releases it.
* **Deletes once**: a wanted delete is part of every write until a write
  carrying it commits; it is not sent again after (:class:`RowsDeleted`).

Assumptions: reads may be stale (the agent's local tables lag the
registry's leader): a write built on a stale read is refused by a term
fence's check and read again, and with a view fence it writes only what
the holder of the current view wants.  A row without a leader (``pid``
None: a quorum leader that removed itself) carries no term: it is fenced
by the ``equals`` check only.  The owner releases the upkeep when it stops
being master or leader; until it learns it, its fence stops its writes.

Failure cases: a read or an answer lost (an agent restarted, a host
evicted) -- the timer reads again; a registry without a leader -- reads
still answer, writes are refused or stay unanswered, the timer reads and
writes again; the owner killed -- the upkeep dies with it, and its last
write in flight is fenced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mirrorq.gm.names import GM_TABLE
from mirrorq.node.messages import RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queues.messages import epoch_term
from mirrorq.sansio import Action, CancelTimer, Emit, Send, SetTimer

TABLE = "amqqueue"
RECORD_RETRY = 0.5  # the first re-read of the row this long after a read that did not show it ...
RECORD_RETRY_MAX = 8.0  # ... doubling up to this (a busy or leaderless registry is not flooded)
RETRY_TIMER = ("record_upkeep", "retry")


# ---- what the owner says ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ViewFence:
    """A classic master's: its writes commit only while ``gm_group[group]``
    is at ``version`` (None: no view yet, no fence)."""

    group: str
    version: int | None


@dataclass(frozen=True, slots=True)
class TermFence:
    """A quorum leader's: it leads in ``term``; it never writes over a row
    naming a higher term, and its writes are checked against the row read."""

    term: int


Fence = ViewFence | TermFence


@dataclass(frozen=True, slots=True)
class RowKey:
    """A registry row: its table and key."""

    table: str
    key: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wanted:
    """What the row should say.  ``fields``: what it must show; ``row``: the
    whole row (fields included), put when there is none or when ``whole``;
    ``deletes``: rows every write deletes until one commits."""

    fields: Mapping[str, Any]
    row: Mapping[str, Any]
    fence: Fence
    whole: bool = False
    deletes: tuple[RowKey, ...] = ()


# ---- the refs of the upkeep's requests (echoed by the agent) ---------------------------------
@dataclass(frozen=True, slots=True)
class RecordRead:
    owner: str


@dataclass(frozen=True, slots=True)
class RecordWrite:
    owner: str
    fields: Mapping[str, Any]
    deletes: tuple[RowKey, ...]


# ---- what the owner hears ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UpkeepDone:
    """The row shows ``fields``."""

    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WriteRefused:
    """A write was refused (a fence's check, or the registry): read again."""

    error: str


@dataclass(frozen=True, slots=True)
class RowsDeleted:
    """A committed write deleted these rows."""

    rows: tuple[RowKey, ...]


@dataclass(frozen=True, slots=True)
class Superseded:
    """The row names ``pid``, a leader of a newer term than the fence's: the
    upkeep ended without writing."""

    pid: str


def is_answer(msg: object) -> bool:
    """Whether ``msg`` answers an upkeep's request (an owner routes it to its upkeep)."""
    return (isinstance(msg, RegistryRows) and isinstance(msg.ref, RecordRead)) or (
        isinstance(msg, RegistryResult) and isinstance(msg.ref, RecordWrite)
    )


def write_txn(
    key: Sequence[str], wanted: Wanted, read: Mapping[str, Any] | None, deletes: Sequence[RowKey]
) -> dict[str, Any]:
    """The registry transaction of one write, ``read`` being the row as read
    (None: absent): the fence's checks, then a put of the whole row (absent,
    or ``wanted.whole``) or an update of the wanted fields, then ``deletes``."""
    row_key = list(key)
    checks: list[dict[str, Any]] = []
    fence = wanted.fence
    if isinstance(fence, ViewFence):
        if fence.version is not None:
            checks.append({"table": GM_TABLE, "key": fence.group, "field": "version", "equals": fence.version})
    elif read is None:
        checks.append({"table": TABLE, "key": row_key, "absent": True})
    else:
        checks.append({"table": TABLE, "key": row_key, "field": "pid", "equals": read.get("pid")})
    if wanted.whole or read is None:
        ops: list[dict[str, Any]] = [
            {"op": "put", "table": TABLE, "key": row_key, "record": {**wanted.row, **wanted.fields}}
        ]
    else:
        checks.insert(0, {"table": TABLE, "key": row_key, "exists": True})
        ops = [{"op": "update", "table": TABLE, "key": row_key, "fields": dict(wanted.fields)}]
    ops += [{"op": "delete", "table": d.table, "key": list(d.key)} for d in deletes]
    return {"checks": checks, "ops": ops}


def _same(a: Any, b: Any) -> bool:
    """Equal as the registry keeps them (a list read back may have been a tuple written)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _shows(row: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    return all(_same(row.get(k), v) for k, v in fields.items())


class RecordUpkeep:
    """One queue's ``amqqueue`` row (``key``: vhost, name) kept by ``owner``
    (its replica's name) through ``agent``, the node agent as the owner's
    driver names it (a simulated actor's name, a Thespian address).  See
    the module docstring."""

    def __init__(self, owner: str, agent: Any, key: tuple[str, str]) -> None:
        self.owner = owner
        self.agent = agent
        self.key = key
        self.wanted: Wanted | None = None
        self.pending = False  # the registry does not show what is wanted yet
        self.retry = RECORD_RETRY  # the delay the timer is armed with next
        self.armed = False
        self.written_at: float | None = None  # the last write not known to be refused
        self.deleted: set[RowKey] = set()  # deletes a committed write carried

    # ---- events in ---------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        return []

    def keep(self, now: float, wanted: Wanted) -> list[Action]:
        self.wanted = wanted
        self.pending = True
        self.retry = RECORD_RETRY
        self.written_at = None  # what was written is out of date: write the new fields at once
        return self._read()

    def release(self, now: float) -> list[Action]:
        self.wanted = None
        self.pending = False
        self.written_at = None
        return self._disarm()

    def receive(self, now: float, src: str, msg: Any) -> list[Action]:
        if isinstance(msg, RegistryRows) and isinstance(msg.ref, RecordRead) and msg.ref.owner == self.owner:
            return self._rows(now, msg)
        if isinstance(msg, RegistryResult) and isinstance(msg.ref, RecordWrite) and msg.ref.owner == self.owner:
            return self._written(msg.ref, msg)
        return []

    def timer(self, now: float, key: object) -> list[Action]:
        if key != RETRY_TIMER:
            return []
        self.armed = False  # this timer chain's turn
        return self._read()

    # ---- the protocol --------------------------------------------------------------------------
    def _read(self) -> list[Action]:
        if not self.pending:
            return []
        out: list[Action] = [Send(self.agent, RegistryGet(TABLE, list(self.key), ref=RecordRead(self.owner)))]
        if not self.armed:  # one timer chain
            self.armed = True
            out.append(SetTimer(RETRY_TIMER, self.retry))
            self.retry = min(2 * self.retry, RECORD_RETRY_MAX)
        return out

    def _rows(self, now: float, msg: RegistryRows) -> list[Action]:
        wanted = self.wanted
        if not self.pending or wanted is None or not msg.ok:
            return []
        row: Mapping[str, Any] | None = msg.rows[0] if msg.rows else None
        fence = wanted.fence
        if isinstance(fence, TermFence) and row is not None and epoch_term(str(row.get("pid") or "")) > fence.term:
            self.pending = False
            return [*self._disarm(), Emit(Superseded(str(row.get("pid"))))]
        outstanding = self._outstanding(wanted)
        if row is not None and not outstanding and _shows(row, wanted.fields):
            return self._done(wanted)
        if self.written_at is not None and now - self.written_at < self.retry:
            return []  # the last write may not be committed yet: the timer reads again
        self.written_at = now
        txn = write_txn(self.key, wanted, row, outstanding)
        ref = RecordWrite(self.owner, dict(wanted.fields), outstanding)
        return [Send(self.agent, RegistryTxn(txn, ref=ref))]

    def _written(self, ref: RecordWrite, msg: RegistryResult) -> list[Action]:
        if not msg.ok:
            if self.pending:
                self.written_at = None  # it will not commit: the next read writes again
            return [Emit(WriteRefused(msg.error))]
        out: list[Action] = []
        new = tuple(d for d in ref.deletes if d not in self.deleted)
        self.deleted.update(ref.deletes)
        if new:
            out.append(Emit(RowsDeleted(new)))
        wanted = self.wanted
        if self.pending and wanted is not None and _shows(ref.fields, wanted.fields):
            if not self._outstanding(wanted):
                out += self._done(wanted)
        return out

    def _outstanding(self, wanted: Wanted) -> tuple[RowKey, ...]:
        return tuple(d for d in wanted.deletes if d not in self.deleted)

    def _done(self, wanted: Wanted) -> list[Action]:
        self.pending = False
        self.retry = RECORD_RETRY
        return [*self._disarm(), Emit(UpkeepDone(dict(wanted.fields)))]

    def _disarm(self) -> list[Action]:
        if not self.armed:
            return []
        self.armed = False
        return [CancelTimer(RETRY_TIMER)]


class UpkeepDriver:
    """A shell's side of one upkeep: carries out its actions -- sends through
    ``post(dst, msg)``, the retry timer as ``wake_after(delay, token)``, one
    generation-numbered token per arming, so a wakeup cancelled or re-armed
    since is told apart (:meth:`fired`) -- and returns what it emitted for
    the owner."""

    def __init__(self, post: Callable[[Any, Any], None], wake_after: Callable[[float, int], None]) -> None:
        self._post, self._wake_after = post, wake_after
        self._generation = 0
        self._armed: int | None = None  # the token of the pending wakeup

    def carry_out(self, actions: Sequence[Action]) -> list[Any]:
        events: list[Any] = []
        for a in actions:
            if isinstance(a, Send):
                self._post(a.dst, a.msg)
            elif isinstance(a, SetTimer):
                self._generation += 1
                self._armed = self._generation
                self._wake_after(a.delay, self._generation)
            elif isinstance(a, CancelTimer):
                self._armed = None
            elif isinstance(a, Emit):
                events.append(a.event)
        return events

    def fired(self, token: Any) -> bool:
        """Whether a wakeup with ``token`` is the pending one (then it is no longer pending)."""
        if token is None or token != self._armed:
            return False
        self._armed = None
        return True
