"""Promotion: how the survivors of a classic mirrored queue agree on what a dead master sent, and elect its successor.

Every replica runs this protocol (the shell: :class:`~.replica.QueueReplica`);
this module is its core, without GM and without the queue: events in
(the payloads GM delivered, and whether the member holds a set of marks),
decisions out (a payload to broadcast, or the election).

Guarantees
----------
* **Agreement on the prefix.**  Before the new master writes anything, it
  and every survivor hold every operation of the dead master(s) that any
  survivor holds: a new master's operations never conflict with late ones.
* **One master per view.**  Only the view's promoter elects, once per view
  (:attr:`Phase.ELECTED`); the member it names promotes itself.  A view
  change starts the protocol again under the new version; payloads of an
  older version are ignored.
* **The election rule** (:func:`elect_master`, also the placement's
  prediction in :mod:`mirrorq.policy.placement`): the member the old master
  handed over to, if it survives synchronised; else the oldest synchronised
  member; with none, ``ha-promote-on-failure`` (after a failure; default
  ``always``: the oldest member) or ``ha-promote-on-shutdown`` (after a
  graceful stop; default ``when-synced``: nobody, the queue is down until a
  synchronised replica returns) decides.

Assumptions: GM's guarantees (a message delivered to one survivor of a view
is delivered to every survivor; per-origin order), ring order is age order
(founders in creation order, joiners at the end), so the promoter -- the
first member of the view -- is the oldest survivor.

The protocol, in view ``v`` (the view without the master)
----------------------------------------------------------
1. every member broadcasts ``Report(v, {dead origin: last seq it
   delivered}, synced)`` when it installs ``v``;
2. when the promoter has the reports of all members of ``v`` it takes the
   per-origin maximum ``K``.  Once it has delivered up to ``K`` itself: if
   every report equals ``K`` it elects at once; otherwise it broadcasts
   ``Cutoff(v, K)``;
3. a member that delivered ``Cutoff(v, K)`` and has delivered up to ``K``
   broadcasts ``Ready(v)``;
4. with ``Ready(v)`` from every member of ``v`` the promoter elects: it
   promotes itself, or broadcasts ``Elect(v, target)`` and ``target``
   promotes itself when it delivers it.

Why ``K`` covers everything: a dead origin's messages only travel, in
``v``, from members that hold them; every member reports after installing
``v`` a seq at least as high as anything it holds then; so no survivor ever
delivers a seq above ``K``, and after step 3/4 every survivor holds
everything up to ``K``.

The founding view of a declared queue (version 1, installed by its
founders) skips steps 1-4: nothing was broadcast before it and every founder
is synchronised, so the promoter promotes at once and the others wait for
its ``promoted``.  A joiner, or a founder whose first view is a later one,
runs the protocol.

Failure cases: a member that dies during the protocol brings a new view
(the protocol restarts); a promoter that finds no eligible member reports
the queue down (:class:`NoMaster`) and elects nobody in that view.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

Marks = Mapping[str, int]  # dead origin -> the last of its GM seqs delivered


# ---- payloads (broadcast through GM; their encoding is :mod:`.payloads`') ---------------
@dataclass(frozen=True, slots=True)
class Report:
    """Step 1: what a member delivered of the dead origins, and whether it is synchronised."""

    version: int
    marks: dict[str, int]
    synced: bool


@dataclass(frozen=True, slots=True)
class Cutoff:
    """Step 2: the prefix every member must hold before the election."""

    version: int
    marks: dict[str, int]


@dataclass(frozen=True, slots=True)
class Ready:
    """Step 3: the sender holds the cutoff."""

    version: int


@dataclass(frozen=True, slots=True)
class Elect:
    """Step 4: the promoter names the new master."""

    version: int
    target: str


Payload = Report | Cutoff | Ready | Elect


# ---- decisions ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Broadcast:
    """Broadcast ``payload`` to the group (it is delivered back to the sender too)."""

    payload: Payload


@dataclass(frozen=True, slots=True)
class Promote:
    """This member is the new master."""


@dataclass(frozen=True, slots=True)
class NoMaster:
    """No member may become master: the queue is down (``reason`` says which policy key decided)."""

    reason: str


Decision = Broadcast | Promote | NoMaster


class Phase(enum.Enum):
    """Where one member is in the protocol of one view."""

    #: its report is out; the promoter waits for every member's
    REPORTED = "reported"
    #: the promoter broadcast the cutoff and waits for it to come back
    CUTOFF_SENT = "cutoff_sent"
    #: the cutoff was delivered: the member delivers up to it, then says ready
    CUTOFF_KNOWN = "cutoff_known"
    #: the member holds the cutoff and said so; the promoter waits for every ready
    READY_SENT = "ready_sent"
    #: the promoter elected (or found nobody); nothing more happens in this view
    ELECTED = "elected"


def elect_master(
    members: Sequence[str], synced: Callable[[str], bool], promote_unsynced: bool, preferred: str | None = None
) -> str | None:
    """The election rule: ``preferred`` (the member a master handed over to)
    if it is a synchronised member; else the oldest synchronised member
    (``members`` oldest first); else, if ``promote_unsynced``, the oldest
    member; else nobody."""
    if preferred is not None and preferred in members and synced(preferred):
        return preferred
    for m in members:
        if synced(m):
            return m
    return members[0] if promote_unsynced and members else None


def promote_unsynced(policy: Mapping[str, object], graceful: bool) -> tuple[bool, str]:
    """Whether an unsynchronised member may become master, and the policy
    key that says so: ``ha-promote-on-shutdown`` (default ``when-synced``)
    after a graceful stop, ``ha-promote-on-failure`` (default ``always``)
    after a failure (RabbitMQ's defaults)."""
    key, default = ("ha-promote-on-shutdown", "when-synced") if graceful else ("ha-promote-on-failure", "always")
    return policy.get(key, default) == "always", key


@dataclass
class Promotion:
    """One member's run of the protocol in the view ``version`` (members
    oldest first; the first is the promoter).  ``old_master``: the master
    the view lost (None when unknown, as for a joiner)."""

    me: str
    version: int
    members: tuple[str, ...]
    old_master: str | None
    phase: Phase = Phase.REPORTED
    reports: dict[str, dict[str, int]] = field(default_factory=dict)
    synced: dict[str, bool] = field(default_factory=dict)
    cutoff: dict[str, int] | None = None
    ready: set[str] = field(default_factory=set)
    #: why the queue is down (the promoter found nobody to elect), else None
    down: str | None = None

    @property
    def promoter(self) -> str:
        return self.members[0]

    # ---- events: the payloads of this view, as GM delivers them ----------------------
    def report(self, origin: str, payload: Report) -> None:
        if payload.version == self.version:
            self.reports[origin] = dict(payload.marks)
            self.synced[origin] = bool(payload.synced)

    def cut(self, payload: Cutoff) -> None:
        if payload.version == self.version:
            self.cutoff = dict(payload.marks)
            if self.phase in (Phase.REPORTED, Phase.CUTOFF_SENT):
                self.phase = Phase.CUTOFF_KNOWN

    def readied(self, origin: str, payload: Ready) -> None:
        if payload.version == self.version:
            self.ready.add(origin)

    def elected_me(self, payload: Elect) -> bool:
        """``payload`` names this member master in this view."""
        return payload.version == self.version and payload.target == self.me

    # ---- the step: what to do now ---------------------------------------------------------
    def advance(
        self, holds: Callable[[Marks], bool], policy: Mapping[str, object], handed_to: str | None, graceful: bool
    ) -> Decision | None:
        """The next decision, given what this member holds now (``holds``:
        it delivered up to these marks).  For the election (the promoter,
        once per view): the queue's ``policy``, the member the old master
        handed over to (``handed_to``) and whether it stopped gracefully."""
        if self.phase is Phase.ELECTED:
            return None
        me = self.promoter == self.me
        if me and self.phase is Phase.REPORTED and set(self.reports) >= set(self.members):
            cutoff: dict[str, int] = {}
            for marks in self.reports.values():
                for o, k in marks.items():
                    cutoff[o] = max(cutoff.get(o, 0), k)
            if holds(cutoff):
                if all(r == cutoff for r in self.reports.values()):
                    return self._elect(policy, handed_to, graceful)
                self.phase = Phase.CUTOFF_SENT
                return Broadcast(Cutoff(self.version, cutoff))  # it comes back as a delivery
        if self.phase is Phase.CUTOFF_KNOWN and self.cutoff is not None and holds(self.cutoff):
            self.phase = Phase.READY_SENT
            return Broadcast(Ready(self.version))
        if me and self.phase is Phase.READY_SENT and self.ready >= set(self.members):
            return self._elect(policy, handed_to, graceful)
        return None

    def _elect(self, policy: Mapping[str, object], handed_to: str | None, graceful: bool) -> Decision:
        """Every member holds the cutoff: name the new master (:func:`elect_master`)."""
        self.phase = Phase.ELECTED
        allowed, key = promote_unsynced(policy, graceful)
        target = elect_master(self.members, lambda m: self.synced.get(m, False), allowed, handed_to)
        if target is None:
            self.down = f"no synchronised mirror survives and {key} is when-synced"
            return NoMaster(self.down)
        if target == self.me:
            return Promote()
        return Broadcast(Elect(self.version, target))
