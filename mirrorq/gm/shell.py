"""The GM actor shell: runs a :class:`mirrorq.gm.core.GMMember` inside a
Thespian actor, translating its actions to Thespian and the node's services.

Embeddable by design: :class:`GMShell` is a plain object that an actor owns
and feeds from its ``receiveMessage``, so a queue replica actor can host its
GM member and its queue core in one OS process.  One actor may own several
shells (one per group); each recognises its own messages.

Protocol (what the shell adds to the core)
------------------------------------------
*Names and addresses.*  A member's name is ``"<node>/<host>:<port>/<uid>"``:
the node that hosts it (so a node's death names its members), the Thespian
TCP address of the hosting actor (so any member can send to any member from
the view alone, no address table in the registry) and a random uid (so a
name is unique for ever, even when a port is reused).  :func:`member_name`,
:func:`parse_member_name` and :func:`member_address` convert.

*Wire.*  Core messages to one right neighbour that arise in one *turn*
travel in one :class:`~mirrorq.gm.messages.GMFrame` (or in several, each of
at most :data:`~mirrorq.bounds.MAX_BATCH_BYTES` of pubs as the core
weighed its activities, which it keeps to that bound), packed with msgpack
(:func:`mirrorq.gm.messages.encode`); a frame names its destination member,
so a frame reaching a new actor on a reused port is dropped, never taken for
its predecessor's.  A host that is a
:class:`~mirrorq.node.posting.PostingActor` (it has ``post``) defines the
turn: one Thespian message it handled, however many GM messages, client
requests and timers that carried; it calls :meth:`GMShell.end_turn` at the
end, which flushes the core's broadcast buffer (no flush timer) and posts
one frame per neighbour.  Other hosts (tests' fake actors) get a frame per
call into the shell, sent with ``send``.

*Timers.*  ``SetTimer`` becomes ``wakeupAfter`` with a payload naming the
member, the key and a generation; ``CancelTimer`` forgets the generation, so
a wakeup of a cancelled or replaced timer is ignored (Thespian cannot cancel).

*Views.*  Views live in the registry table ``gm_group`` (name, version,
members).  The shell subscribes to the table through the local node agent
(``RegistrySubscribe``), reads the current row once (``RegistryGet``, and
again after a registry snapshot reset; a declare's founder, started before
the row exists, reads it only if its create is refused) and installs every
row of its group it hears of.  If the agent returns the subscription as a
``PoisonMessage`` (it cannot keep it), the shell reads the row every
``poll_interval`` instead.  A ``ProposeView`` of the core becomes a
``RegistryTxn`` that updates the row only if its version still is the proposal's expected
version, so of concurrent proposals exactly one wins; the losers re-propose
against the view that won (the core does this on every view and tick).
:meth:`GMShell.create` founds a group (a put with the precondition "row
absent", retried until the row exists); :meth:`GMShell.join` asks to be
appended to the ring (and founds the group alone if it does not exist).

*Deaths.*  The shell subscribes to the agent's node events.  ``NodeEvent``
"down" for a node makes every member hosted there (in any view heard of,
then or later while the node stays down) ``member_down``; "up" with the same
incarnation takes the suspicion back (``member_up``: a false alarm), "up"
with a new incarnation does not (the old members died with the old
incarnation).  ``ActorDown`` of a local member's actor does the same for
that member.

*Callbacks.*  ``Delivered``, ``Confirmed``, ``MembersChanged`` and
``Removed`` go to a callback object (:class:`GMCallbacks`) in the order the
core emitted them.  A callback may call back into the shell (e.g. broadcast
on a confirm): such calls are queued behind the actions being executed, so
the order of frames on the wire is the core's order.

Guarantees: those of :mod:`mirrorq.gm.core`, given the assumptions below.

Assumptions: the node agent is this actor's node's agent (it runs the
transactions and reports node liveness); Thespian delivers the frames of one
sender to one receiver in order while both live (the core tolerates loss and
reordering, at the price of a stall until its retransmission tick).

Failure behaviour: frames to a dead member vanish (Thespian is silent); the
core retransmits after a view change.  A frame that is not a GM frame for
this member, or whose body does not decode, is dropped and counted in
:attr:`GMShell.counters` (network input never raises).  A proposal that the
registry refuses or cannot commit (minority) is simply re-proposed by the
core on its tick.  Calls with bad arguments raise ``ValueError``/``TypeError``
naming what was wrong.

Registry answers: the shell's requests carry ``ref=REGISTRY_REF``, which the
agent echoes; it takes only answers with that ref, so a host that sends
registry requests of its own from the same actor tags them otherwise.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from thespian.actors import ActorAddress, PoisonMessage, WakeupMessage

from mirrorq.bounds import ITEM_BYTES, batches
from mirrorq.gm.core import (
    Activity,
    Confirmed,
    Delivered,
    GMMember,
    MembersChanged,
    Nudge,
    ProposeView,
    Removed,
)
from mirrorq.gm.messages import GMCodecError, GMFrame, decode, encode
from mirrorq.gm.names import GM_TABLE, MemberRef, create_txn, member_name, parse_member_name, propose_txn
from mirrorq.gm.view import View
from mirrorq.node.addresses import address_from_text, address_host_port
from mirrorq.node.messages import (
    ActorDown,
    NodeEvent,
    RegistryChanges,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    Subscribe,
)
from mirrorq.sansio import Action, CancelTimer, Emit, Persist, Send, SetTimer

__all__ = [
    "GM_TABLE",
    "GMCallbacks",
    "GMShell",
    "MemberRef",
    "address_host_port",
    "member_address",
    "member_name",
    "parse_member_name",
    "propose_txn",
    "create_txn",
]

# GMMember settings for the real transport: a Thespian message costs ~2 ms
# whatever its size up to hundreds of KiB, so let a frame carry up to 400
# pubs (the flush timer still sends a partial batch after 1 ms).  The tick
# (retransmission when no ack progressed, re-proposals) is 2 s: under a deep
# window on a loaded machine a round can take over 1 s, and a spurious
# retransmission re-sends the whole unacked window.
SHELL_MEMBER_DEFAULTS = {"max_batch": 400, "flush_interval": 0.001, "tick_interval": 2.0}
#: for hosts with turns (PostingActor): the broadcast buffer leaves at the end of the turn, no timer;
#: an ack round that found no rider leaves after 0.2 s (it frees the members' buffers only: three
#: turns of the ring that a lone publisher's chain would share its cores with)
TURN_MEMBER_DEFAULTS = {**SHELL_MEMBER_DEFAULTS, "flush_interval": None, "ack_delay": 0.2}
TIMER_TAG = "mirrorq.gm.timer"
CREATE_TIMER = ("shell", "create")
POLL_TIMER = ("shell", "poll")
CREATE_RETRY = 0.5
REGISTRY_REF = "mirrorq.gm.shell"  # the ref of the shell's registry requests (echoed in the answers)


# ---- transport tuning ----------------------------------------------------
def tune_thespian_backoff(min_delay: float = 0.001) -> None:
    """Make Thespian retry a blocked socket send after ``min_delay`` seconds
    instead of its default 20 ms (growing 1.7x per retry).

    A GM frame carries ~100 KiB (100 pubs of 1 KiB); a send that finds the
    socket buffer full (EAGAIN, common for such frames) otherwise idles the
    sender 20+ ms, which caps a hop at ~50 frames/s whatever the CPU does.
    Process-wide, off by default (``GMShell(send_backoff=0.001)`` turns it
    on)."""
    from datetime import timedelta

    import thespian.system.transport as tr

    if isinstance(min_delay, bool) or not isinstance(min_delay, (int, float)) or min_delay <= 0:
        raise ValueError(f"min_delay must be a positive number of seconds, got {min_delay!r}")
    tr.MIN_BACKOFF_DELAY = timedelta(seconds=min_delay)


# ---- names ---------------------------------------------------------------
def _core_msg_size(m: Any) -> int:
    """A core message's estimated size in a frame (an activity's pubs, as the core weighed them)."""
    return ITEM_BYTES + (m.nbytes if isinstance(m, Activity) else 0)


def member_address(name: str) -> ActorAddress:
    """The Thespian address of the actor hosting member ``name``."""
    ref = parse_member_name(name)
    return address_from_text(f"{ref.host}:{ref.port}")


def member_dst(name: str) -> str:
    """``"host:port"`` of the actor hosting member ``name``."""
    ref = parse_member_name(name)
    return f"{ref.host}:{ref.port}"


# ---- callbacks -------------------------------------------------------------
class GMCallbacks:
    """What the host hears from its member.  Override what you need.

    A host running a composite core (``core_factory``) may also define
    ``gm_host_send(dst, msg)`` (the core's sends that are not GM messages)
    and ``gm_event(ev)`` (the core's other ``Emit`` events)."""

    def gm_delivered(self, origin: str, seq: int, payload: Any) -> None:
        """``payload`` is ``origin``'s ``seq``-th broadcast (own ones too)."""

    def gm_confirmed(self, first: int, last: int) -> None:
        """Own broadcasts ``first..last`` are held by every member of the view."""

    def gm_members_changed(self, view: View, births: tuple[str, ...], deaths: tuple[str, ...]) -> None:
        """A view was installed."""

    def gm_removed(self) -> None:
        """This member is not in the group any more; it has stopped for good."""


# ---- the shell -------------------------------------------------------------
class GMShell:
    """One GM member hosted by a Thespian actor.

    ``actor``: the hosting actor (``send``, ``wakeupAfter``, ``myAddress``).
    ``agent``: the local node agent's address.  ``node``: this node's name.
    ``callbacks``: a :class:`GMCallbacks`.  ``registry_tables``: further
    registry tables the host wants ``RegistryChanges`` for (the agent keeps
    one table set per subscriber, so the shell subscribes for both).
    ``uid``: for tests; default random.  ``poll_interval``: view polling
    period if the agent refuses the table subscription.  ``send_backoff``:
    see :func:`tune_thespian_backoff` (None: leave Thespian alone).
    ``core_factory(name)``: build a composite core instead of a bare
    GMMember (a queue replica): it has the GMMember entry points (``start``,
    ``receive``, ``timer``, ``install_view``, ``member_down``,
    ``member_up``; ``join``/``broadcast`` fall back to its GMMember) and
    exposes its GMMember as ``.gm``.  Without it, further keywords go to
    :class:`~mirrorq.gm.core.GMMember` (``flush_interval``, ``max_batch``,
    ``tick_interval``; defaults :data:`SHELL_MEMBER_DEFAULTS`).
    """

    def __init__(
        self,
        actor: Any,
        group: str,
        callbacks: GMCallbacks,
        *,
        agent: Any,
        node: str,
        registry_tables: Iterable[str] = (),
        uid: str | None = None,
        poll_interval: float = 0.1,
        send_backoff: float | None = None,
        core_factory: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **member_kw: Any,
    ) -> None:
        if not isinstance(group, str) or not group:
            raise ValueError(f"GM group name must be a non-empty string, got {group!r}")
        if agent is None:
            raise ValueError("GMShell needs the node agent's address (agent=...)")
        for meth in ("gm_delivered", "gm_confirmed", "gm_members_changed", "gm_removed"):
            if not callable(getattr(callbacks, meth, None)):
                raise TypeError(f"GM callbacks object {type(callbacks).__name__} has no method {meth}")
        hp = address_host_port(getattr(actor, "myAddress", None))
        if hp is None:
            raise ValueError(f"GMShell needs an actor with a TCP address, got {getattr(actor, 'myAddress', None)!r}")
        self.actor = actor
        # a PostingActor host: ordered, coalescing sends and turns (end_turn)
        self.host_turns = callable(getattr(actor, "post", None))
        self._tx = actor.post if self.host_turns else actor.send
        self.agent = agent
        self.group = group
        self.node = node
        self.callbacks = callbacks
        self.clock = clock
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) or poll_interval <= 0:
            raise ValueError(f"poll_interval must be a positive number, got {poll_interval!r}")
        self.poll_interval = poll_interval
        if send_backoff is not None:
            tune_thespian_backoff(send_backoff)
        self.polling = False  # True: views are read every poll_interval (no subscription)
        self._host_send = getattr(callbacks, "gm_host_send", None) or self._no_host_send
        self._host_event = getattr(callbacks, "gm_event", None) or (lambda ev: None)
        self.name = member_name(node, hp[0], hp[1], uid or uuid.uuid4().hex[:16])
        if core_factory is None:
            defaults = TURN_MEMBER_DEFAULTS if self.host_turns else SHELL_MEMBER_DEFAULTS
            self.core: Any = GMMember(self.name, **{**defaults, **member_kw})
        else:
            if member_kw:
                raise ValueError(f"GMShell: {sorted(member_kw)} go to the core_factory's GMMember, not the shell")
            self.core = core_factory(self.name)
        # the GMMember itself (a composite core exposes it as .gm)
        self.member: GMMember = getattr(self.core, "gm", self.core)
        if not isinstance(self.member, GMMember):
            raise TypeError(f"GMShell core {type(self.core).__name__} is not a GMMember and has no .gm GMMember")
        self._entry = {
            m: getattr(self.core, m, None) or getattr(self.member, m)
            for m in (
                "start",
                "receive",
                "timer",
                "install_view",
                "member_down",
                "member_up",
                "join",
                "broadcast",
                "end_turn",
            )
        }
        self.registry_tables = tuple(dict.fromkeys((GM_TABLE, *registry_tables)))
        self.counters = {
            "frames_in": 0,
            "frames_out": 0,
            "core_msgs_in": 0,
            "core_msgs_out": 0,
            "bad_frames": 0,
            "misrouted": 0,
            "proposals": 0,
            "undeliverable": 0,
        }
        self.last_bad_frame = ""
        self._pending: deque[Action] = deque()
        self._running = False
        self._out: dict[str, list] = {}
        self._timers: dict[Hashable, int] = {}
        self._gen = 0
        self._addr: dict[str, ActorAddress] = {}
        self._down_nodes: dict[str, int] = {}
        self._txns = 0
        self._gets = 0
        self._row_exists: bool | None = None
        self._founders: tuple[str, ...] | None = None
        self._started = False

    # ---- what the host calls ---------------------------------------------------
    def start(self, read_row: bool = True) -> None:
        """Subscribe to node events and the gm_group table, read the group's
        row, start the core.  Call once, before create/join/broadcast.

        ``read_row=False``: the group's row does not exist yet and the
        subscription will bring it (a declare's founders: every one is
        started before the group is created); a refused create reads it."""
        if self._started:
            raise RuntimeError(f"GM shell {self.name} already started")
        self._started = True
        self._tx(self.agent, Subscribe())
        self._tx(self.agent, RegistrySubscribe(self.registry_tables))
        if read_row:
            self._read_row()
        self._turn(self._entry["start"](self.clock()))

    def create(self, founders: Iterable[str]) -> None:
        """Found the group with ``founders`` (names, ring order) at version 1.
        Every founder must be started before the group is used and must not
        call :meth:`join`.  Retried until the group's row exists."""
        self._need_started()
        fs = tuple(founders)
        if not fs:
            raise ValueError("a GM group needs at least one founder")
        for f in fs:
            parse_member_name(f)
        if len(set(fs)) != len(fs):
            raise ValueError(f"founders name a member twice: {list(fs)}")
        self._founders = fs
        self._send_create()

    def join(self) -> None:
        """Ask to be appended to the group's ring (founding it alone if it
        does not exist)."""
        self._need_started()
        self._turn(self._entry["join"](self.clock()))
        if self._row_exists is False and self._founders is None:
            self._founders = (self.name,)
            self._send_create()

    def broadcast(self, payload: Any) -> None:
        self._turn(self._entry["broadcast"](self.clock(), payload))

    def broadcast_many(self, payloads: Iterable[Any]) -> None:
        """Broadcast several payloads in one turn (one frame per hop)."""
        now = self.clock()
        b = self._entry["broadcast"]
        acts: list[Action] = []
        for p in payloads:
            acts.extend(b(now, p))
        self._turn(acts)

    def handle(self, msg: Any, sender: Any = None) -> bool:
        """Feed a message the host actor received.  Returns True when the
        message was the shell's alone (a frame or timer of this member, or
        the answer to one of its registry requests); False when the host
        should look at it too (node events, actor deaths, other tables'
        changes) or it is not the shell's business."""
        if isinstance(msg, GMFrame):
            return self._on_frame(msg)
        if isinstance(msg, WakeupMessage):
            return self._on_wakeup(msg.payload)
        if isinstance(msg, RegistryChanges):
            return self._on_changes(msg)
        if isinstance(msg, RegistryRows) and msg.ref == REGISTRY_REF:
            return self._on_rows(msg)
        if isinstance(msg, RegistryResult) and msg.ref == REGISTRY_REF:
            if self._txns > 0:
                self._txns -= 1
                if not msg.ok and self._founders is not None and not self._row_exists and self._gets == 0:
                    self._read_row()  # the create was refused: the row may exist already
                return True
            return False
        if isinstance(msg, NodeEvent):
            self._on_node_event(msg)
            return False
        if isinstance(msg, ActorDown):
            self._on_actor_down(msg)
            return False
        if isinstance(msg, PoisonMessage):
            inner = msg.poisonMessage
            if isinstance(inner, GMFrame) and inner.src == self.name:
                self.counters["undeliverable"] += 1
                return True
            if isinstance(inner, RegistrySubscribe) and tuple(inner.tables) == self.registry_tables:
                # the agent could not take the subscription: read the row
                # every poll_interval instead
                if not self.polling:
                    self.polling = True
                    self._poll()
                return True
        return False

    @property
    def view(self) -> View | None:
        return self.member.view

    @property
    def removed(self) -> bool:
        return self.member.removed

    def info(self) -> dict[str, Any]:
        d = self.member.info()
        d["group"] = self.group
        d["counters"] = dict(self.counters)
        d["stats"] = vars(self.member.stats).copy()
        return d

    def run(self, actions: list[Action]) -> None:
        """Execute actions the host got from its own call into the core
        (a composite core's own entry points), as one turn."""
        self._turn(list(actions))

    def end_turn(self) -> None:
        """The host's turn ends (hosts with turns call this once per Thespian
        message handled): the core's buffered broadcasts leave, then one frame
        per neighbour carrying everything of the turn."""
        self._turn(self._entry["end_turn"](self.clock()))
        self._flush_out()

    # ---- executing core actions ---------------------------------------------------
    def _turn(self, actions: list[Action]) -> None:
        """Perform actions of the core, in order; frames wait for the end of
        the host's turn (:meth:`end_turn`), or of this call for a host
        without turns."""
        self._pending.extend(actions)
        if self._running:
            return  # a callback called us: the outer turn runs these next
        self._running = True
        try:
            pending = self._pending
            while pending:
                self._do(pending.popleft())
        finally:
            self._running = False
            if not self.host_turns:
                self._flush_out()

    def _do(self, a: Action) -> None:
        if isinstance(a, Emit):
            ev = a.event
            if isinstance(ev, Delivered):
                self.callbacks.gm_delivered(ev.origin, ev.seq, ev.payload)
            elif isinstance(ev, Confirmed):
                self.callbacks.gm_confirmed(ev.first, ev.last)
            elif isinstance(ev, ProposeView):
                self._propose(ev)
            elif isinstance(ev, MembersChanged):
                self.callbacks.gm_members_changed(ev.view, ev.births, ev.deaths)
            elif isinstance(ev, Removed):
                self.callbacks.gm_removed()
            else:
                self._host_event(ev)
        elif isinstance(a, Send):
            if isinstance(a.msg, (Activity, Nudge)):
                self._out.setdefault(a.dst, []).append(a.msg)
            else:
                self._host_send(a.dst, a.msg)
        elif isinstance(a, SetTimer):
            self._set_timer(a.key, a.delay)
        elif isinstance(a, CancelTimer):
            self._timers.pop(a.key, None)
        elif isinstance(a, Persist):
            self.core.persist(self.clock())  # before the turn's frames and posts leave (end of the host's turn)
        else:
            raise TypeError(f"GM shell got an unknown action {a!r}")

    def _flush_out(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, {}
        for dst, msgs in out.items():
            addr = self._addr.get(dst)
            if addr is None:
                addr = self._addr[dst] = member_address(dst)
            for run in batches(msgs, _core_msg_size) if len(msgs) > 1 else (msgs,):
                self._tx(addr, GMFrame(self.group, self.name, dst, encode(run, dst)))
                self.counters["frames_out"] += 1
            self.counters["core_msgs_out"] += len(msgs)

    # ---- inputs ---------------------------------------------------------------------
    def _on_frame(self, f: GMFrame) -> bool:
        if f.group != self.group:
            return False
        if f.dst != self.name:
            self.counters["misrouted"] += 1
            return True
        try:
            msgs = decode(f.body)
        except GMCodecError as e:
            self.counters["bad_frames"] += 1
            self.last_bad_frame = f"from {f.src!r}: {e}"
            return True
        self.counters["frames_in"] += 1
        self.counters["core_msgs_in"] += len(msgs)
        now = self.clock()
        acts: list[Action] = []
        for m in msgs:
            acts.extend(self._entry["receive"](now, f.src, m))
        self._turn(acts)
        return True

    def _on_wakeup(self, payload: Any) -> bool:
        if not (isinstance(payload, tuple) and len(payload) == 4 and payload[0] == TIMER_TAG):
            return False
        _, name, key, gen = payload
        if name != self.name:
            return False
        if self._timers.get(key) != gen:
            return True  # cancelled or replaced
        del self._timers[key]
        if key == CREATE_TIMER:
            if not self._row_exists and self._founders is not None:
                self._send_create()
            return True
        if key == POLL_TIMER:
            self._poll()
            return True
        self._turn(self._entry["timer"](self.clock(), key))
        return True

    def _on_changes(self, msg: RegistryChanges) -> bool:
        if msg.changes is None:  # the registry was reset from a snapshot
            self._read_row()
            return False
        mine = True
        for table, key, _old, new in msg.changes:
            k = tuple(key) if isinstance(key, (list, tuple)) else (key,)
            if table == GM_TABLE and k == (self.group,):
                if new is not None:
                    self._install_row(new)
            else:
                mine = False
        return mine

    def _on_rows(self, msg: RegistryRows) -> bool:
        if self._gets <= 0:
            return True  # an answer to a read the shell no longer waits for
        rows = msg.rows if msg.ok else []
        self._gets -= 1
        if not msg.ok:
            self._read_row()  # try again
            return True
        if rows:
            self._install_row(rows[0])
        elif self._row_exists is None:
            self._row_exists = False
            if self.member.joining and self._founders is None:
                self._founders = (self.name,)
                self._send_create()
        return True

    def _on_node_event(self, ev: NodeEvent) -> None:
        if ev.kind == "down":
            self._down_nodes[ev.node] = ev.incarnation
            self._suspect(lambda ref: ref.node == ev.node)
        elif ev.kind == "up":
            inc = self._down_nodes.pop(ev.node, None)
            if inc is not None and inc == ev.incarnation:
                now = self.clock()
                acts: list[Action] = []
                for m in self._known_members():
                    if parse_member_name(m).node == ev.node:
                        acts.extend(self._entry["member_up"](now, m))
                self._turn(acts)

    def _on_actor_down(self, ev: ActorDown) -> None:
        hp = address_host_port(ev.address)
        if hp is not None:
            self._suspect(lambda ref: (ref.host, ref.port) == hp)

    # ---- helpers -------------------------------------------------------------------------
    def _known_members(self) -> list[str]:
        seen: dict[str, None] = {}
        for v in (self.member.view, self.member.latest_seen):
            if v is not None:
                seen.update(dict.fromkeys(v.members))
        return [m for m in seen if m != self.name]

    def _suspect(self, pred: Callable[[MemberRef], bool]) -> None:
        now = self.clock()
        acts: list[Action] = []
        for m in self._known_members():
            try:
                ref = parse_member_name(m)
            except ValueError:
                continue
            if pred(ref):
                acts.extend(self._entry["member_down"](now, m))
        self._turn(acts)

    def _install_row(self, row: dict) -> None:
        self._row_exists = True
        view = View(int(row["version"]), tuple(row["members"]))
        now = self.clock()
        acts = self._entry["install_view"](now, view)
        if self.member.view is view and self._down_nodes:
            for m in view.members:
                if m != self.name:
                    try:
                        if parse_member_name(m).node in self._down_nodes:
                            acts.extend(self._entry["member_down"](now, m))
                    except ValueError:
                        pass
        self._turn(acts)

    def _poll(self) -> None:
        if self.member.removed:
            return
        if self._gets < 2:  # never pile reads up behind a slow agent
            self._read_row()
        self._set_timer(POLL_TIMER, self.poll_interval)

    def _set_timer(self, key: Hashable, delay: float) -> None:
        self._gen += 1
        self._timers[key] = self._gen
        self.actor.wakeupAfter(delay, payload=(TIMER_TAG, self.name, key, self._gen))

    def _read_row(self) -> None:
        self._gets += 1
        self._tx(self.agent, RegistryGet(GM_TABLE, self.group, ref=REGISTRY_REF))

    def _propose(self, ev: ProposeView) -> None:
        self.counters["proposals"] += 1
        self._txns += 1
        self._tx(self.agent, RegistryTxn(propose_txn(self.group, ev), ref=REGISTRY_REF))

    def _send_create(self) -> None:
        assert self._founders is not None
        self._txns += 1
        self._tx(self.agent, RegistryTxn(create_txn(self.group, self._founders), ref=REGISTRY_REF))
        self._set_timer(CREATE_TIMER, CREATE_RETRY)

    def _no_host_send(self, dst: Any, msg: Any) -> None:
        raise TypeError(
            f"GM core of {self.name} sent a {type(msg).__name__} to {dst!r}: only Activity/Nudge go between "
            "members; a composite core's other sends need a gm_host_send(dst, msg) callback"
        )

    def _need_started(self) -> None:
        if not self._started:
            raise RuntimeError(f"GM shell {self.name}: call start() first")
