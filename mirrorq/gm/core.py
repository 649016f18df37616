"""Guaranteed Multicast (GM): the ring protocol as a sans-IO core.

This is mirrorq's version of RabbitMQ's ``gm.erl``.  A group's members form a
ring in view order (:class:`~mirrorq.gm.view.View`); each member sends only to
its right and receives only from its left.  The driver contract is
:mod:`mirrorq.sansio`; :class:`GMMember` is the core.

Protocol
--------
*Publishing.*  ``broadcast(now, payload)`` gives the payload the member's next
sequence number (``pub_count``), delivers it locally at once
(``Emit(Delivered(origin, seq, payload))``), keeps it in ``pending_ack`` and
puts it in the ``broadcast_buffer``.  The buffer is flushed to the right when
it holds ``max_batch`` payloads, as a rider on the next message this member
forwards anyway, and at the end of the driver's turn (``end_turn``: every
broadcast of one turn leaves in one message, at once); a member built with
a ``flush_interval`` instead arms a flush timer (for drivers without turns).

*Activity.*  Every message between members is one :class:`Activity`: the
sender's view version and a list of :class:`Item` ``(origin, pubs, marker,
ack)``, at most one item per origin.  One message per hop carries any number
of publishes, round markers and acks of any number of origins: the real
transport costs 1-3 ms per message, so batching is the design, not a tweak.
Up to ``max_bytes`` of pubs (:data:`~mirrorq.bounds.MAX_BATCH_BYTES`,
weighed by ``payload_size``): what does not fit leaves in the next
activities, in order, an origin's pub list cut into runs (see
``GMMember._split``: a catch-up's runs are all full and carry its base), so
no message outgrows its transport.

*Members state.*  Each member keeps, per origin, a ``members_state`` entry:
``pending_ack`` (the pubs it holds that are not yet acked, in seq order),
``last_pub`` (highest seq delivered) and ``last_ack`` (highest seq acked).
A member delivers pub ``s`` of an origin only when ``s == last_pub + 1``:
duplicates (``s <= last_pub``) are dropped, and a pub after a gap is not
delivered (the gap is filled by a retransmitted catch-up, below).  It forwards
to its right exactly the pubs that were new to it.  So per view, a member has
sent its right everything it has delivered; pubs stop at the first member
that already has them.

*Rounds and confirms.*  In each view each origin has one *source*: the origin
itself while it is a member, otherwise (a dead origin) the first member of
the view, its *alias*.  The source starts a round by sending a *marker*
``m`` (its ``last_pub``).  A member that receives marker ``m`` from its left
forwards ``min(m, last_pub)``: "everybody from the source up to me holds all
pubs up to here".  When a marker comes back to the source *in the same view*
the round is complete: every member of the view holds those pubs.  The source
then sets ``last_ack``, drops them from ``pending_ack`` and sends the ack
round; if the source is the origin it emits ``Confirmed(first, last)``.  The
member just before the source knows it one hop earlier: as it forwards the
marker to the source it emits ``AllHold(origin, m)`` (an application may
answer from there: a mirror confirming its master's publishes).  Acks
are cumulative; a member drops pubs up to the ack and forwards an ack only
when it is new to it, so the ack round stops back at the source.  With
``ack_delay`` set, the source does not send an ack round on its own: the ack
rides on the next message it sends its right anyway, or leaves alone after
``ack_delay`` seconds (the ack round only frees the others' buffers; no
confirm waits for it), which halves the messages of a lone publisher.

*Views.*  The core never decides a view.  Views come from the replicated
registry (Raft, a majority): ``install_view(now, view)``.  A member asks for a
change with ``Emit(ProposeView(expected_version, members))``; the registry
applies it only if its version still equals ``expected_version``, so of
several concurrent proposals one wins and the others re-propose against the
new view.  ``member_down(now, name)`` (node liveness) makes the first
member of the view that it does not suspect propose a view without the dead
members at once (one proposal per death, however many survivors); every
survivor re-proposes on its tick until a view without them is installed.
``join(now)`` proposes the view plus this member (appended at the end of the
ring).  A member that finds itself not in a view
after having been in one emits ``Removed()`` and stops for good (a member
name is never reused: a restarted replica joins under a new name).

*Catch-up.*  Every message is tagged with the sender's view version.  A member
processes only messages from its left in its current view; messages for a
view it has not installed yet are buffered until it installs it, messages of
older views are dropped.  On installing a view every member sends its right a
*catch-up*: one Activity whose items are *full* (its whole ``pending_ack``
and ``last_ack`` for every origin it knows), plus the markers of the rounds
it is source of.  The receiver delivers what is new to it, in order,
suppressing duplicates by seq, and forwards what was new.  So the member left
of a dead one re-sends its new right whatever it may have missed; the same
happens at every hop, so nothing in flight is lost as long as one surviving
member holds it, and rounds restart in the new view.  Unlike gm.erl, every
member sends a catch-up, not only those whose right changed: old-view
messages are dropped even on unchanged links, so that no marker can carry a
path through an old view into the new one (that is what makes a confirm mean
"every member of the *current* view").  The cost is one message per member
per view change.

*Founders.*  A member that installs its first view without having called
``join`` is a founder: it was in the group before any round completed (the
members the group was created with), so it takes base 0 for every member of
that view.  Its catch-up there would be empty (base 0 everywhere, nothing
pending, no marker), so a founder sends none on its first view unless it
already holds pubs.

*Join.*  A new member knows no origin at first.  It takes its base for an
origin from the first full item it gets from its left (``last_pub := that
last_ack``) and delivers that item's pending pubs: it receives what is in
flight, never older messages.  Until then it forwards no marker of that
origin, so no round completes without it.  Members already in the group take
``0`` as the base of an origin that is new in a view (it cannot have had a
round completed before it was in a view with them).

*Retransmission (lost messages).*  The real transport is TCP (FIFO while a
link lives), so a message is lost only when a link breaks (a kill or a
partition).  The core does not rely on that: a member with unacked pubs that
sees no ack progress for ``tick_interval`` re-sends its catch-up to its right
and sends its left a :class:`Nudge`, which makes the left re-send its own
catch-up (that recovers a lost ack or marker upstream).  Catch-ups are
idempotent, so a dropped or reordered message is never skipped: it leaves a
gap that blocks delivery (and markers, hence confirms) until it is filled.
This costs two small messages per tick per stalled member, only while a
round is outstanding and not progressing.

Guarantees (checked on thousands of simulated runs in ``tests/test_gm_sim.py``)
-------------------------------------------------------------------------------
1. Per-sender FIFO, no duplicates: each member delivers an origin's messages
   in seq order, each at most once, without gaps (a joiner starts at its
   base), also across view changes and partitions that heal.
2. Agreement: a message delivered to any member that survives (stays in the
   views) is delivered to every surviving member, except messages older than
   a joiner's base, which are not the joiner's business.
3. Confirm: ``Confirmed(first, last)`` is emitted at the origin only when
   every member of the origin's current view has delivered those messages,
   each seq is confirmed once, in order; every message of a surviving origin
   is confirmed once the group is stable.
4. Minority: a member cut off from part of its view (and from the registry's
   majority) can neither change the view nor complete a round, so it confirms
   nothing more until the partition heals (and then either carries on or
   learns it was removed).

Assumptions
-----------
Member names are unique for ever.  Views installed at a member only grow in
version; the registry installs every committed view at every member
eventually (members may skip versions).  Node liveness eventually reports a
dead member to some surviving member (``member_down``).  A dead or removed
origin's unconfirmed messages are either delivered by all survivors (if any
survivor got them) or by none; the origin never learns which.

Limits
------
``members_state`` keeps a few integers for every origin ever seen (dead ones
too: forgetting one could let a late catch-up deliver its pubs twice).  A
catch-up carries the whole ``pending_ack``, so it is as big as the unacked
window (in activities of at most ``max_bytes`` each).  A founder must
install its founding view; a member created to join must call ``join``
before views reach it (views without it are otherwise ignored, not taken
as a removal).

Failure behaviour
-----------------
A member whose neighbour dies stalls (no confirms) until the registry installs
a view without it.  A member whose proposals cannot reach the registry stays
stalled.  Bad input (a non-View to ``install_view``, a foreign message,
``broadcast`` after removal) raises an exception that says what was wrong.
Anything suspicious that the protocol says cannot happen (an ack beyond what
a member holds) is counted in ``stats.anomalies``, which tests assert to be 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from mirrorq.bounds import ITEM_BYTES, MAX_BATCH_BYTES, plain_size
from mirrorq.gm.view import View
from mirrorq.sansio import Action, CancelTimer, Emit, Send, SetTimer

__all__ = [
    "Activity",
    "AllHold",
    "Confirmed",
    "Delivered",
    "GMMember",
    "GMStats",
    "GMStopped",
    "Item",
    "MembersChanged",
    "Nudge",
    "ProposeView",
    "Removed",
    "View",
    "FLUSH_TIMER",
    "TICK_TIMER",
]

FLUSH_TIMER = ("gm", "flush")
TICK_TIMER = ("gm", "tick")
ACK_TIMER = ("gm", "ack")

# Cap on messages buffered for views not installed yet; beyond it the oldest
# are dropped (retransmission recovers them).
MAX_FUTURE = 10_000


# ---- wire messages -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Item:
    """What one message says about one origin.

    ``pubs``: ``(seq, payload)`` pairs in seq order.  ``marker``: a round
    marker (everyone from the round's source to the sender holds all pubs up
    to it).  ``ack``: cumulative ack.  ``full``: the pubs are the sender's
    whole ``pending_ack`` and ``ack`` its ``last_ack`` (a catch-up item; a
    member that does not know the origin takes its base from it)."""

    origin: str
    pubs: tuple[tuple[int, Any], ...] = ()
    marker: int | None = None
    ack: int | None = None
    full: bool = False


@dataclass(frozen=True, slots=True)
class Activity:
    version: int
    items: tuple[Item, ...]
    #: the sender's estimate of the pubs' size (for framing; not on the wire)
    nbytes: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Nudge:
    """Sent by a stalled member to its left: "send me your catch-up"."""

    version: int


# ---- events (Emit) --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Delivered:
    origin: str
    seq: int
    payload: Any


@dataclass(frozen=True, slots=True)
class Confirmed:
    """Own messages ``first..last`` (inclusive) are held by every member of
    the current view."""

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class AllHold:
    """Every member of the current view holds ``origin``'s pubs up to
    ``upto``: emitted by the member just before the round's source (its
    right) as it forwards the round's marker there, one hop before the
    source learns it (see *Rounds and confirms*)."""

    origin: str
    upto: int


@dataclass(frozen=True, slots=True)
class ProposeView:
    """Ask the registry to replace view ``expected_version`` by ``members``."""

    expected_version: int
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MembersChanged:
    """A view was installed (gm.erl's ``members_changed`` callback)."""

    view: View
    births: tuple[str, ...]
    deaths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    """This member is not in the group's view any more; it has stopped."""


class GMStopped(RuntimeError):
    pass


@dataclass
class GMStats:
    sent: int = 0
    catchups: int = 0
    retransmits: int = 0
    gaps: int = 0  # pubs not delivered because an earlier one was missing
    anomalies: int = 0  # must stay 0: see the module docstring
    stale: int = 0  # messages dropped: old view or not from our left
    buffered: int = 0  # messages kept for a view not installed yet
    split: int = 0  # activities added because one would have held more than max_bytes of pubs


@dataclass(slots=True)
class MemberState:
    """gm.erl's ``#member{}``: one origin as seen by this member."""

    last_pub: int
    last_ack: int
    pending_ack: deque[tuple[int, Any]] = field(default_factory=deque)  # of (seq, payload)

    def drop_acked(self, upto: int) -> None:
        pa = self.pending_ack
        while pa and pa[0][0] <= upto:
            pa.popleft()


class _Entry:
    """What one :class:`_Outbox` holds for one origin: the item it becomes."""

    __slots__ = ("pubs", "marker", "ack", "full")

    def __init__(self) -> None:
        self.pubs: list[tuple[int, Any]] = []
        self.marker: int | None = None
        self.ack: int | None = None
        self.full = False


class _Outbox:
    """What this member will send its right at the end of one entry point."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}  # origin -> its entry

    def _e(self, origin: str) -> _Entry:
        e = self.entries.get(origin)
        if e is None:
            e = self.entries[origin] = _Entry()
        return e

    def pub(self, origin: str, seq: int, payload: Any) -> None:
        self._e(origin).pubs.append((seq, payload))

    def marker(self, origin: str, m: int) -> None:
        e = self._e(origin)
        e.marker = m if e.marker is None else max(e.marker, m)

    def ack(self, origin: str, a: int) -> None:
        e = self._e(origin)
        e.ack = a if e.ack is None else max(e.ack, a)

    def full(self, origin: str) -> None:
        self._e(origin).full = True


def _check_number(name: str, value: Any, *, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


class GMMember:
    """One member of one GM group (sans-IO).

    Entry points (each returns a list of :mod:`mirrorq.sansio` actions):
    ``start``, ``receive``, ``timer`` (the contract), plus ``install_view``,
    ``broadcast``, ``flush``, ``member_down``, ``member_up`` and ``join``.
    """

    def __init__(
        self,
        name: str,
        *,
        flush_interval: float | None = 0.001,
        max_batch: int = 100,
        tick_interval: float = 1.0,
        ack_delay: float | None = None,
        max_bytes: int = MAX_BATCH_BYTES,
        payload_size: Callable[[Any], int] = plain_size,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"GM member name must be a non-empty string, got {name!r}")
        if flush_interval is not None:
            _check_number("flush_interval", flush_interval)
        _check_number("tick_interval", tick_interval)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.name = name
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self.tick_interval = tick_interval
        if ack_delay is not None:
            _check_number("ack_delay", ack_delay)
        self.ack_delay = ack_delay
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.payload_size = payload_size
        self._lazy_ack: dict[str, int] = {}  # rounds completed here whose ack round has not left yet
        self._ack_armed = False

        self.view: View | None = None
        self.left: str | None = None
        self.right: str | None = None
        self.latest_seen: View | None = None  # newest view heard of, member or not
        self.pub_count = 0
        self.members_state: dict[str, MemberState] = {name: MemberState(0, 0)}
        self.broadcast_buffer: list[tuple[int, Any]] = []
        self.removed = False
        self.joining = False
        self.joining_called = False  # False: a founder (see install_view)
        self.suspected: set[str] = set()
        self.stats = GMStats()

        self._members_set: frozenset[str] = frozenset()
        self._src_marker: dict[str, int] = {}  # rounds this member started, this view
        self._left_marker: dict[str, int] = {}  # markers from the left, this view
        self._fwd_marker: dict[str, int] = {}  # markers forwarded, this view
        self._future: deque[tuple[str, Activity]] = deque()
        self._flush_armed = False
        self._tick_armed = False
        self._acked_since_tick = False

    # ---- the sansio contract -------------------------------------------
    def start(self, now: float) -> list[Action]:
        return self._arm_tick([])

    def receive(self, now: float, src: str, msg: Any) -> list[Action]:
        if not isinstance(msg, (Activity, Nudge)):
            raise TypeError(
                f"GM member {self.name!r} got a {type(msg).__name__} from {src!r}; expected Activity or Nudge"
            )
        if self.removed:
            return []
        view = self.view
        if isinstance(msg, Nudge):
            if view is None or msg.version != view.version or src != self.right or src == self.name:
                self.stats.stale += 1
                return []
            actions: list[Action] = []
            out = _Outbox()
            self._take_buffer(out, actions)
            self._catchup(out)
            self.stats.retransmits += 1
            self._send(out, actions)
            return self._arm_tick(actions)
        if view is None or msg.version > view.version:
            self._future.append((src, msg))
            self.stats.buffered += 1
            if len(self._future) > MAX_FUTURE:
                self._future.popleft()
            return []
        if msg.version < view.version or src != self.left or src == self.name:
            self.stats.stale += 1
            return []
        actions = []
        out = _Outbox()
        self._process(msg, out, actions)
        self._take_buffer(out, actions)
        self._send(out, actions)
        return self._arm_tick(actions)

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if self.removed:
            return []
        if key == FLUSH_TIMER:
            self._flush_armed = False
            return self.flush(now)
        if key == TICK_TIMER:
            self._tick_armed = False
            return self._arm_tick(self._tick())
        if key == ACK_TIMER:
            self._ack_armed = False
            actions: list[Action] = []
            out = _Outbox()
            for origin, a in self._lazy_ack.items():
                out.ack(origin, a)
            self._lazy_ack.clear()
            self._send(out, actions)
            return self._arm_tick(actions)
        raise ValueError(f"GM member {self.name!r} has no timer {key!r}")

    # ---- further entry points ------------------------------------------
    def broadcast(self, now: float, payload: Any) -> list[Action]:
        """Publish ``payload`` to the group.  Its seq is ``self.pub_count``
        right after the call.  Before the first view is installed the
        payload waits in the buffer."""
        if self.removed:
            raise GMStopped(f"GM member {self.name!r} was removed from the group; it cannot broadcast")
        self.pub_count += 1
        seq = self.pub_count
        st = self.members_state[self.name]
        st.pending_ack.append((seq, payload))
        st.last_pub = seq
        self.broadcast_buffer.append((seq, payload))
        actions: list[Action] = [Emit(Delivered(self.name, seq, payload))]
        if self.view is None:
            return actions
        if len(self.broadcast_buffer) >= self.max_batch or self.right == self.name:
            actions.extend(self.flush(now))
        elif not self._flush_armed and self.flush_interval is not None:
            self._flush_armed = True
            actions.append(SetTimer(FLUSH_TIMER, self.flush_interval))
        return actions

    def end_turn(self, now: float) -> list[Action]:
        """The driver's turn ends: what was broadcast in it leaves now."""
        if not self.broadcast_buffer:
            return []
        return self.flush(now)

    def flush(self, now: float) -> list[Action]:
        """Send the broadcast buffer now (one message)."""
        actions: list[Action] = []
        if self.removed or self.view is None:
            return actions
        out = _Outbox()
        self._take_buffer(out, actions)
        self._send(out, actions)
        return self._arm_tick(actions)

    def install_view(self, now: float, view: View) -> list[Action]:
        """Install a view committed by the registry."""
        if not isinstance(view, View):
            raise TypeError(f"install_view needs a View, got {type(view).__name__}")
        if self.removed:
            return []
        if self.latest_seen is None or view.version > self.latest_seen.version:
            self.latest_seen = view
        old = self.view
        if old is not None and view.version <= old.version:
            return []
        actions: list[Action] = []
        if self.name not in view:
            if old is not None:
                self.removed = True
                self.view = None
                self.broadcast_buffer.clear()
                self._future.clear()
                self._lazy_ack.clear()
                return [CancelTimer(FLUSH_TIMER), CancelTimer(TICK_TIMER), CancelTimer(ACK_TIMER), Emit(Removed())]
            if self.joining:
                actions.append(Emit(ProposeView(view.version, view.members + (self.name,))))
            return self._arm_tick(actions)

        self.joining = False
        if old is None:
            births = tuple(m for m in view.members if m != self.name)
            deaths: tuple[str, ...] = ()
            if not self.joining_called:
                # a founder: in the group since before any round completed,
                # so base 0 is right for every member of its first view
                for m in births:
                    self.members_state.setdefault(m, MemberState(0, 0))
        else:
            births = tuple(m for m in view.members if m not in old)
            deaths = tuple(m for m in old.members if m not in view)
            for m in births:
                # an origin new to the group since our last view: it has had
                # no completed round, so everything it sent is still pending
                # at its source and will reach us; base 0 is right.
                self.members_state.setdefault(m, MemberState(0, 0))
        self.view = view
        self._members_set = frozenset(view.members)
        self.left = view.left(self.name)
        self.right = view.right(self.name)
        self._src_marker.clear()
        self._left_marker.clear()
        self._fwd_marker.clear()
        actions.append(Emit(MembersChanged(view, births, deaths)))

        # the broadcast buffer is part of pending_ack, which the catch-up carries
        self.broadcast_buffer.clear()
        if self._flush_armed:
            self._flush_armed = False
            actions.append(CancelTimer(FLUSH_TIMER))
        out = _Outbox()
        if (
            old is not None
            or self.joining_called
            or any(st.last_pub or st.pending_ack for st in self.members_state.values())
        ):
            self._catchup(out)  # a founder's first view with nothing sent yet has nothing to catch up
            self.stats.catchups += 1
        self._send(out, actions)
        if self.right == self.name:
            self._settle_alone(actions)

        # replay what our new left sent us while we were behind
        future, self._future = self._future, deque()
        out = _Outbox()
        for src, msg in future:
            if msg.version > view.version:
                self._future.append((src, msg))
            elif isinstance(msg, Activity) and msg.version == view.version and src == self.left != self.name:
                self._process(msg, out, actions)
            else:
                self.stats.stale += 1
        self._send(out, actions)

        if any(m in view for m in self.suspected):
            actions.append(self._propose_removal())
        return self._arm_tick(actions)

    def member_down(self, now: float, name: str) -> list[Action]:
        """Node liveness says member ``name`` is dead: propose a view without
        it (and without any other member reported dead)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"member_down needs a member name, got {name!r}")
        if self.removed or name == self.name:
            return []
        self.suspected.add(name)
        if self.view is None or name not in self.view:
            return []
        if self._proposer():
            return self._arm_tick([self._propose_removal()])
        # another survivor proposes now (one proposal per death, not one per
        # survivor); this member proposes on its tick if the view still has it
        return self._arm_tick([])

    def member_up(self, now: float, name: str) -> list[Action]:
        """Node liveness takes back a death report (the node answers again)."""
        self.suspected.discard(name)
        return []

    def join(self, now: float) -> list[Action]:
        """Ask to be added to the group (at the end of the ring).  Proposes
        against the newest view heard of, and again on every view installed
        without us, until a view with us is installed."""
        if self.removed:
            raise GMStopped(f"GM member {self.name!r} was removed; a new member needs a new name")
        if self.view is not None:
            return []
        self.joining = True
        self.joining_called = True
        actions: list[Action] = []
        if self.latest_seen is not None:
            v = self.latest_seen
            actions.append(Emit(ProposeView(v.version, v.members + (self.name,))))
        return self._arm_tick(actions)

    def info(self) -> dict[str, Any]:
        """A snapshot for the ring view in mirrorctl and for debugging."""
        return {
            "name": self.name,
            "view": None if self.view is None else (self.view.version, list(self.view.members)),
            "left": self.left,
            "right": self.right,
            "pub_count": self.pub_count,
            "removed": self.removed,
            "members_state": {
                o: {"last_pub": s.last_pub, "last_ack": s.last_ack, "pending_ack": len(s.pending_ack)}
                for o, s in sorted(self.members_state.items())
            },
        }

    def idle(self) -> bool:
        """Nothing pending, nothing buffered, nothing to propose."""
        return (
            not self.broadcast_buffer
            and all(not s.pending_ack for s in self.members_state.values())
            and not self._wants_proposal()
        )

    # ---- internals -------------------------------------------------------
    def _is_source(self, origin: str) -> bool:
        if origin == self.name:
            return True
        return origin not in self._members_set and self.view is not None and self.view.members[0] == self.name

    def _source_of(self, origin: str) -> str | None:
        """Who starts ``origin``'s rounds in this view: the origin, or its alias."""
        if origin in self._members_set:
            return origin
        return self.view.members[0] if self.view is not None else None

    def _process(self, msg: Activity, out: _Outbox, actions: list[Action]) -> None:
        for item in msg.items:
            self._process_item(item, out, actions)

    def _process_item(self, item: Item, out: _Outbox, actions: list[Action]) -> None:
        origin = item.origin
        st = self.members_state.get(origin)
        if st is None:
            if not item.full or item.ack is None:
                return  # we have no base for this origin yet: wait for a full item
            st = self.members_state[origin] = MemberState(item.ack, item.ack)
            out.full(origin)  # our right may not know it either
        source = self._is_source(origin)
        if origin != self.name:
            before = st.last_pub
            for seq, payload in item.pubs:
                if seq <= st.last_pub:
                    continue
                if seq != st.last_pub + 1:
                    self.stats.gaps += 1
                    break
                st.last_pub = seq
                st.pending_ack.append((seq, payload))
                out.pub(origin, seq, payload)
                actions.append(Emit(Delivered(origin, seq, payload)))
            if source and st.last_pub > before:
                # a dead origin's pubs reached its alias: start a round for them
                self._src_marker[origin] = st.last_pub
                out.marker(origin, st.last_pub)
        if item.ack is not None and item.ack > st.last_ack:
            if origin == self.name or item.ack > st.last_pub:
                self.stats.anomalies += 1
                st.last_pub = max(st.last_pub, item.ack)
            self._apply_ack(st, origin, item.ack, out)
        if item.marker is not None:
            if source:
                self._complete_round(st, origin, item.marker, out, actions)
            else:
                lm = self._left_marker.get(origin)
                if lm is None or item.marker > lm:
                    self._left_marker[origin] = item.marker
        if not source:
            lm = self._left_marker.get(origin)
            if lm is not None:
                eff = min(lm, st.last_pub)
                if eff > st.last_ack and eff > self._fwd_marker.get(origin, -1):
                    self._fwd_marker[origin] = eff
                    out.marker(origin, eff)
                    if self.right == self._source_of(origin):
                        actions.append(Emit(AllHold(origin, eff)))

    def _apply_ack(self, st: MemberState, origin: str, ack: int, out: _Outbox) -> None:
        st.last_ack = ack
        st.drop_acked(ack)
        out.ack(origin, ack)
        self._acked_since_tick = True

    def _complete_round(self, st: MemberState, origin: str, hi: int, out: _Outbox, actions: list[Action]) -> None:
        hi = min(hi, st.last_pub)
        if hi <= st.last_ack:
            return
        first = st.last_ack + 1
        if self.ack_delay is not None and self.right != self.name:
            st.last_ack = hi  # the ack round waits for a rider or ACK_TIMER (_send)
            st.drop_acked(hi)
            self._acked_since_tick = True
            self._lazy_ack[origin] = hi
        else:
            self._apply_ack(st, origin, hi, out)
        if origin == self.name:
            actions.append(Emit(Confirmed(first, hi)))

    def _settle_alone(self, actions: list[Action]) -> None:
        """Alone in the view: everything held is everywhere."""
        out = _Outbox()  # nobody to send to
        for origin in sorted(self.members_state):
            st = self.members_state[origin]
            if st.last_pub > st.last_ack:
                self._complete_round(st, origin, st.last_pub, out, actions)

    def _take_buffer(self, out: _Outbox, actions: list[Action]) -> None:
        if not self.broadcast_buffer:
            return
        for seq, payload in self.broadcast_buffer:
            out.pub(self.name, seq, payload)
        self.broadcast_buffer.clear()
        last = self.members_state[self.name].last_pub
        self._src_marker[self.name] = last
        out.marker(self.name, last)
        if self._flush_armed:
            self._flush_armed = False
            actions.append(CancelTimer(FLUSH_TIMER))
        if self.right == self.name:
            self._settle_alone(actions)

    def _catchup(self, out: _Outbox) -> None:
        for origin in sorted(self.members_state):
            st = self.members_state[origin]
            out.full(origin)
            if self._is_source(origin):
                if st.last_pub > st.last_ack:
                    self._src_marker[origin] = st.last_pub
                    out.marker(origin, st.last_pub)
            else:
                fm = self._fwd_marker.get(origin)
                if fm is not None and fm > st.last_ack:
                    out.marker(origin, fm)

    def _send(self, out: _Outbox, actions: list[Action]) -> None:
        if self._lazy_ack:
            if self.view is None or self.right == self.name:
                self._lazy_ack.clear()
            elif out.entries:
                for origin, a in self._lazy_ack.items():
                    out.ack(origin, a)  # the ack rides on what leaves anyway
                self._lazy_ack.clear()
            elif not self._ack_armed:
                assert self.ack_delay is not None  # _complete_round fills _lazy_ack only when ack_delay is set
                self._ack_armed = True
                actions.append(SetTimer(ACK_TIMER, self.ack_delay))
        if not out.entries or self.view is None or self.right == self.name:
            return
        right = self.right
        assert right is not None  # install_view sets right with the view
        items = []
        for origin, e in out.entries.items():
            pubs, marker, ack, full = e.pubs, e.marker, e.ack, e.full
            if full:
                st = self.members_state[origin]
                items.append(Item(origin, tuple(st.pending_ack), marker, st.last_ack, True))
            elif origin != right:
                items.append(Item(origin, tuple(pubs), marker, ack, False))
            elif marker is not None or ack is not None:
                # the right's own pubs: it never takes them back (messages.encode leaves them out too)
                items.append(Item(origin, (), marker, ack, False))
        if not items:
            return
        parts = self._split(items)
        self.stats.split += len(parts) - 1
        for part, nbytes in parts:
            self.stats.sent += 1
            actions.append(Send(right, Activity(self.view.version, part, nbytes)))

    def _split(self, items: list[Item]) -> list[tuple[tuple[Item, ...], int]]:
        """``items`` as activities of at most ``max_bytes`` of pubs
        (estimated with ``payload_size``), with their estimates.  An item
        whose pubs do not fit is cut into runs, in seq order, each in the
        next activity: a full item's runs are all full and carry its ack
        (the base a member that does not know the origin takes); otherwise
        the ack and the marker go with the last run, after the pubs they
        may cover.  A pub bigger than ``max_bytes`` travels alone."""
        limit, size = self.max_bytes, self.payload_size
        parts: list[tuple[tuple[Item, ...], int]] = []
        cur: list[Item] = []
        total = 0
        for it in items:
            pubs = it.pubs
            if not pubs:
                cur.append(it)
                total += ITEM_BYTES
                continue
            n = len(pubs)
            start = 0
            while start < n:
                first = size(pubs[start][1]) + ITEM_BYTES
                if cur and total + first > limit:
                    parts.append((tuple(cur), total))
                    cur, total = [], 0
                end = start + 1
                total += first
                while end < n:
                    nxt = size(pubs[end][1]) + ITEM_BYTES
                    if total + nxt > limit:
                        break
                    total += nxt
                    end += 1
                if start == 0 and end == n:
                    cur.append(it)
                else:
                    last = end == n
                    cur.append(
                        Item(
                            it.origin,
                            pubs[start:end],
                            it.marker if last else None,
                            it.ack if last or it.full else None,
                            it.full,
                        )
                    )
                start = end
        if cur:
            parts.append((tuple(cur), total))
        return parts

    def _wants_proposal(self) -> bool:
        if self.joining and self.view is None:
            return True
        return self.view is not None and any(m in self.view for m in self.suspected)

    def _proposer(self) -> bool:
        """This member is the first of the view that nobody here suspects:
        it proposes a removal at once, the others on their tick."""
        assert self.view is not None  # member_down asks only with a view installed
        return next((m for m in self.view.members if m not in self.suspected), None) == self.name

    def _propose_removal(self) -> Emit:
        assert self.view is not None
        return Emit(ProposeView(self.view.version, self.view.without(*sorted(self.suspected))))

    def _outstanding(self) -> bool:
        return bool(self._future) or not self.idle()

    def _tick(self) -> list[Action]:
        actions: list[Action] = []
        if self.view is not None and self.right != self.name:
            left = self.left
            assert left is not None  # install_view sets left with the view
            stalled = any(s.pending_ack for s in self.members_state.values()) and not self._acked_since_tick
            if stalled:
                # push what we hold to our right, and ask our left for its
                # catch-up (an ack or pub lost upstream of us)
                out = _Outbox()
                self._take_buffer(out, actions)
                self._catchup(out)
                self.stats.retransmits += 1
                self._send(out, actions)
                actions.append(Send(left, Nudge(self.view.version)))
        self._acked_since_tick = False
        if self._wants_proposal():
            if self.view is not None:
                actions.append(self._propose_removal())
            elif self.latest_seen is not None:
                v = self.latest_seen
                actions.append(Emit(ProposeView(v.version, v.members + (self.name,))))
        return actions

    def _arm_tick(self, actions: list[Action]) -> list[Action]:
        if not self._tick_armed and not self.removed and self._outstanding():
            self._tick_armed = True
            actions.append(SetTimer(TICK_TIMER, self.tick_interval))
        return actions
