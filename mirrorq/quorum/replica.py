"""One member of a quorum queue: a Raft node, the queue's state machine, and
the channel protocol, as one sans-IO core.

:class:`QuorumReplica` wraps a :class:`~mirrorq.mnesia_like.raft.RaftNode`
(the consensus) and a :class:`~.machine.QuorumQueueMachine` (the queue) for
one member of one queue's Raft group.  It follows :mod:`mirrorq.sansio`:
``start``, ``receive``, ``timer``, ``end_turn``, ``persist`` and the entry
points below take ``now`` and return actions (``Send``, ``SetTimer``,
``CancelTimer``, ``Emit``, ``Persist``).  Channels talk to it with the
messages of :mod:`mirrorq.queues.messages`, exactly as they talk to a
classic queue's master, so :class:`~mirrorq.queues.channel.QueueChannel`
and the AMQP front end work unchanged.

Protocol
--------
* **Only the leader proposes.**  A channel request (``Publish``,
  ``Consume``, ``Cancel``, ``Settle``, ``Get``, ``ChannelClosed``,
  ``QueueCommand``) reaching a member that does not lead is answered
  ``NotMaster(queue, hint, request)``, ``hint`` being the leader's epoch when
  known (a ``ChannelClosed`` is forwarded to the leader it knows, or dropped:
  see *Epochs*).  On the leader,
  every request handled in one turn becomes a command of ONE Raft entry,
  proposed at ``end_turn`` (``[now, commands]``, see :mod:`.machine`): one
  log append, one flush, one replication round for the whole turn.  A turn
  whose commands weigh more than :data:`~mirrorq.bounds.MAX_BATCH_BYTES`
  proposes them as several entries in order, each within that bound (a
  bigger command alone), in the same append and flush.
* **Replies follow the log.**  Nothing is answered before the entry holding
  the request is committed and applied: confirms (``Confirm`` acks and nacks),
  deliveries, ``basic.get`` answers, consume and purge results are all made
  from the effects the machine returns when the leader applies the entry.
  The Raft core puts ``Persist`` before the end of every turn that wrote;
  the leader's ``AppendEntries`` leave before it (``early``: the followers
  write and fsync while the leader does), every reply after it, and the
  leader counts its own copy toward commit only once persisted (the Raft
  core's ``early_appends``): commit needs a majority of members that
  persisted before acknowledging, so a confirm means "fsync'd on a
  majority".  Replies of one turn are coalesced and leave at
  ``end_turn``: one ``Confirm`` per publisher (nacks grouped by reason), then
  the other replies in the order the log made them, consecutive deliveries
  to a channel sharing one ``Deliveries`` of at most
  :data:`~mirrorq.bounds.MAX_BATCH_BYTES` (numbered ``seq`` 1, 2... per
  channel and epoch, so the channel restores the order).  Replies keep the
  epoch they were made in even when the leadership ends within the turn
  (a leader that removed itself).
* **Publishes in order, once.**  A publisher's seqs are proposed in seq order
  from the machine's high-water mark: a seq at or below what is applied or
  proposed is proposed again (the machine confirms it as a duplicate); a seq
  that would leave a gap waits (``early``) until the gap is filled -- by a
  late batch, or by the applied state catching up after a leader change.  A
  resend after ``NotMaster`` / ``NewMaster`` is therefore neither lost nor
  stored twice.
* **Epochs.**  The leader of term ``t`` is the epoch ``"member#t"``
  (:func:`epoch`), unique for ever.  Deliveries carry it; a ``Settle`` of
  another epoch is void.  On becoming leader a member first proposes
  ``down(None)``: every consumer of earlier terms is removed and every message
  they held comes back (``delivery_count + 1``, redelivered), as RabbitMQ's
  quorum queues redeliver on a leader change.  When that entry applies, the
  leader sends ``NewMaster(queue, epoch, address)`` to every front end
  (``dst``) that held consumers or published; any later request from a
  ``dst`` not yet told in this term is preceded by a ``NewMaster`` too.
  Channels then resend unconfirmed publishes and consume again.  The leader
  sends deliveries, get answers and command results only for entries of its
  own term: anything an entry of an earlier term checked out went to a
  consumer that ``down(None)`` removes.  Confirms and nacks are sent for
  entries of any term (a committed confirm is true whoever sends it).  So a
  channel's consumer state lives only with the current leader; a
  ``ChannelClosed`` reaching another member is forwarded to the leader it
  knows (leader hints name ever higher terms, so forwarding ends), so that
  the machine marks the channel closed and a late, reordered ``Consume`` of
  it cannot leave a ghost consumer.
* **Time.**  The leader's ``now`` is recorded in each entry; the machine
  expires messages with it.  The leader keeps a timer for the head's
  deadline and proposes an empty entry when it fires.
* **Membership.**  ``QueueCommand("add_member" | "delete_member",
  args={"member": name})`` at the leader (elsewhere: ``NotMaster``) waits in
  arrival order and is proposed as a single-server change once the Raft
  core can take one (no other change uncommitted, an entry of the leader's
  term committed); an added member joins as a learner and the Raft core
  promotes it once caught up (from the log, or by ``InstallSnapshot``).  The
  command is answered ``CommandResult(ok, {"member", "members", "voters"})``
  when the committed configuration shows it done: the member a voter (add),
  or no member (delete).  Both are idempotent: a member already a learner
  is waited for, one already a voter (or already gone) is answered at once,
  so a tool resends after a leader change.  Removing the last voter is
  refused (406); a leadership lost first answers ``NotMaster``.  A leader
  that removes itself answers, then steps down (the Raft core's rule).
  ``QueueCommand("member_status")`` is answered by any member with
  :meth:`QuorumReplica.info` (its Raft state, term, indexes, membership and,
  on the leader, each follower's match index).  A member built for joining
  gets the group's *bootstrap* voters (``voters``), stays passive until a
  configuration names it, and is never named by its own bootstrap.
* **Dead-lettering.**  With ``x-dead-letter-exchange``, the leader hands
  what the entries it applies drop (``purged`` excepted) to
  :attr:`QuorumReplica.dead_letters`
  (:class:`~mirrorq.quorum.dead_letter.DeadLetterSender`): ``DeadLetter``
  messages to the router at ``dead_letters.dst``, stop and wait, answered
  by ``DeadLetterDone`` (at-most-once across a leader change).
* **Bodies stay in the log.**  The machine keeps message ids, sizes and
  counts only (``bodies_in_log``); a body and its properties stay in the
  Raft entry that enqueued them.  The leader reads them back from the log
  to deliver, answer a ``basic.get`` or dead-letter (:meth:`message`); the
  entry just applied, or the one last read, is at hand.  So a member's
  memory follows the number of messages, not their bytes.
* **Checkpoints and the release index.**  Every ``snapshot_every`` applied
  entries (and no sooner than :data:`CHECKPOINT_WORK` times fewer commands
  than live messages, as a checkpoint's cost follows them) the replica
  saves the machine's :meth:`~.machine.QuorumQueueMachine.snapshot` as a
  checkpoint (``RaftNode.checkpoint``).  The newest checkpoint below the
  machine's *release index* (the lowest entry a live message's body is in,
  looked up every :data:`RELEASE_CHECK_ENTRIES` entries) becomes the
  snapshot (``RaftNode.promote``) and the log below it goes; with no
  message in the log the state is compacted at once.  At most
  :data:`MAX_CHECKPOINTS` wait (the closest-spaced go).  A snapshot's state
  may still name messages whose entries it cut away, but each is gone by
  the time the release index passed it, so replaying the log from there
  removes it again: no leader delivers one (deliveries come from entries of
  its own term, after every committed entry), and a dead letter of one is
  skipped (at-most-once, as dead-lettering is).  A member too far behind
  receives the snapshot by ``InstallSnapshot`` and the entries after it by
  ``AppendEntries``, bodies with them.

Guarantees (checked by tests/test_quorum_sim.py under crashes, partitions,
loss and reordering, and with members added and removed meanwhile): a confirmed publish is never lost -- it stays in the
queue until delivered and settled, discarded, or dropped by the queue's own
limits; it is stored once however often it is resent; a settled (acked)
message is never delivered again; messages never returned reach consumers
in each publisher's order; no delivery exceeds ``x-delivery-limit``; every
member holds the same state at the same applied index.  Delivery is
at-least-once: a leader change (or a settle that was not committed before
it) redelivers.

Assumptions: those of the Raft core (messages may be lost, delayed,
duplicated, reordered, never forged; the log's ``flush`` is durable); every
member is built with the same ``voters`` and queue ``arguments``; channel
ids are never reused (messages.py); the shell calls ``end_turn`` after every
turn and carries ``Persist`` out before the turn's sends leave (``early``
ones excepted), then the actions ``persist`` / ``persisted`` return.

Failure: progress needs a majority of members up and connected; a minority
member answers ``NotMaster``.  A malformed or foreign message from the
network is ignored with ``Emit(MessageIgnored(src, reason))``; a request
with a malformed field is refused (a nack, or ``CommandResult`` with code
406) and never reaches the log.  A log entry the machine cannot decode, or
misuse of the entry points, raises.

Integration: what the shell must provide
----------------------------------------
* **Addressing.**  Raft messages are ``Send(member_name, raft_message)``;
  the host shell wraps them with the queue name (many replicas share one
  host actor), maps member names to host addresses, and hands incoming ones
  to ``receive(now, src_member, msg)``.  Channel replies are sent to the
  channel's ``dst`` (``channel[0]``); ``address`` (constructor) is what
  ``NewMaster.dst`` tells channels -- the host's address.  The registry's
  ``amqqueue`` record should name the leader: the shell watches
  ``Emit(LeaderChanged(term, leader))``.
* **Timers.**  ``SetTimer`` / ``CancelTimer`` keys are the Raft core's
  (``("raft", ...)``), :data:`TTL_TIMER` and the dead-letter sender's
  (``("quorum", "dead-letter")``); call ``timer(now, key)`` when
  one fires.  One ``now`` per turn; the leader's ``now`` ends up in the log
  and drives TTLs, so hand every replica comparable wall-clock seconds.
* **Persistence.**  A :class:`~mirrorq.mnesia_like.raft_log.FileRaftLog` per
  replica (one directory per queue member); ``Persist`` -> ``persist(now)``
  (one flush) before the turn's sends leave, ``early`` ones (the leader's
  appends) excepted, which should leave before the flush starts; a host may
  flush all its replicas' logs together once per turn and then call
  ``persisted(now)``.  Both return actions to carry out (a lone voter's
  commit).  Entries and snapshots are
  msgpack-able plain data.
* **Turns.**  Call ``end_turn(now)`` after each Thespian message handled
  (all the replica's requests of that message then share one entry).
* **Liveness hints.**  ``leader_lost(now, member)`` when node liveness says
  the leader's node died; ``dst_down(now, dst)`` when a front end's node or
  process is gone (its channels are ``down``).
* **Dead letters.**  Set ``dead_letters.dst`` to the node's dead-letter
  router (its front end) and hand the router's ``DeadLetterDone`` to
  ``receive``.
* **Front end.**  Epochs are ``"member#term"``: on ``NotMaster`` /
  ``NewMaster`` the front end moves a channel to the epoch's member only if
  its term (:func:`~mirrorq.queues.messages.epoch_term`) is higher than the channel's current one.
  ``Deliveries`` properties carry ``x-delivery-count`` (from the second
  delivery on) for the front end to put into the AMQP headers.  A
  consume's ``lookahead`` becomes the checkout's (the machine grants it);
  a ``Settle``'s ``release`` (deliveries the front end gives back unseen)
  becomes ``release``, which does not count a delivery.  ``exclusive``
  consumers are not supported yet (an exclusive consume is refused with
  540).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from mirrorq.bounds import MAX_BATCH_BYTES, MESSAGE_BYTES, batches
from mirrorq.mnesia_like.raft import (
    LEADER,
    PRE_CANDIDATE,
    AppendEntries,
    AppendEntriesReply,
    ApplySnapshot,
    Committed,
    ConfigChangeRejected,
    InstallSnapshot,
    InstallSnapshotReply,
    LeaderChanged,
    MembershipCommitted,
    MessageIgnored,
    RaftLog,
    RaftNode,
    RequestVote,
    RequestVoteReply,
)
from mirrorq.queues import messages as wire
from mirrorq.queues.messages import epoch
from mirrorq.quorum import machine as qm
from mirrorq.quorum.dead_letter import TIMER as DEAD_LETTER_TIMER
from mirrorq.quorum.dead_letter import DeadLetterSender, target_of
from mirrorq.sansio import Action, CancelTimer, Emit, Send, SetTimer

__all__ = ["QuorumReplica", "TTL_TIMER"]

TTL_TIMER = ("quorum", "ttl")
MAX_CHECKPOINTS = 8  # checkpoints kept while the release index stays below them
CHECKPOINT_WORK = 4  # a checkpoint waits for at least 1/4 as many commands as live messages
RELEASE_CHECK_ENTRIES = 256  # applied entries between two looks at the release index
_TIMER_SLACK = 1e-6
_RAFT_MESSAGES = (
    RequestVote,
    RequestVoteReply,
    AppendEntries,
    AppendEntriesReply,
    InstallSnapshot,
    InstallSnapshotReply,
)
_REQUESTS = (wire.Publish, wire.Consume, wire.Cancel, wire.Settle, wire.Get, wire.ChannelClosed, wire.QueueCommand)


class _Deliveries:
    """A channel's deliveries of one turn, sent as one ``Deliveries`` (of
    at most MAX_BATCH_BYTES: :meth:`QuorumReplica._deliveries`)."""

    __slots__ = ("channel", "epoch", "items", "bytes")

    def __init__(self, channel: tuple, epoch: str):
        self.channel = channel
        self.epoch = epoch  # the leadership that made them (it may end before the turn's replies leave)
        self.items: list = []
        self.bytes = 0  # the items' estimated size (delivery_item_size)


@dataclass
class _MemberOp:
    """A membership command at the leader: ``add`` (done once ``member`` is
    a voter of the committed configuration) or remove (done once it is no
    member of it)."""

    add: bool
    member: str
    request: Any  # the QueueCommand (answered NotMaster if leadership goes)
    proposed: bool = False


class QuorumReplica:
    """One member of one quorum queue (see the module docstring)."""

    def __init__(
        self,
        member: str,
        queue: str,
        log: RaftLog,
        rng: random.Random,
        *,
        voters: Iterable[str],
        address: str | None = None,
        arguments: dict | None = None,
        snapshot_every: int = 4096,
        raft_options: dict | None = None,
        vhost: str = "/",
        incarnation: str = "",
    ):
        if not isinstance(queue, str) or not queue:
            raise TypeError(f"queue must be a non-empty str, got {queue!r}")
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        self.member = member
        self.queue = queue
        self.address = address if address is not None else member
        self.snapshot_every = snapshot_every
        self.raft = RaftNode(
            member,
            log,
            rng,
            voters=voters,
            **{"entry_size": qm.entry_size, "early_appends": True, **dict(raft_options or {})},
        )
        self.machine = qm.QuorumQueueMachine(arguments, bodies_in_log=True)
        self._checkpoints: list[int] = list(log.checkpoints)  # kept, not yet the snapshot
        self._checkpoint_work = 0  # commands applied since the last checkpoint
        self._release_seen = (0, 0)  # (applied index, release index) when last looked
        self._read: tuple[int, list] | None = None  # (index, commands) of the last entry bodies came from
        #: called as ``on_apply(index, term, now, commands, effects)`` after
        #: each applied entry (metrics, history, checkers); it must not raise
        self.on_apply: Callable[[int, int, float, list, list], None] | None = None
        self.led_term: int | None = None  # the term this member leads, if it does
        self.epoch: str | None = None
        self._reset_leader_state()
        self._replies: list = []  # (dst, message or _Deliveries), this turn, in order
        self._open: dict[tuple, _Deliveries] = {}  # channel -> its last reply, if a _Deliveries
        self._confirms: dict[tuple, list] = {}  # publisher -> acked seqs, this turn
        self._nacks: dict[tuple, dict[str, list]] = {}  # publisher -> reason -> seqs
        self._dropped: list = []  # machine Dropped effects to emit (leader)
        self.dead_letters = DeadLetterSender(queue, vhost, incarnation, self.address, target_of(arguments))
        self._ttl_at: float | None = None
        self._dseq: dict[tuple, int] = {}  # (epoch, channel) -> Deliveries sent in that epoch
        self._dseq_epoch: str | None = None

    def _reset_leader_state(self) -> None:
        self._batch: list = []  # commands for this turn's entry
        self._requests: list = []  # the requests behind them (answered NotMaster on a step-down)
        self._tick = False  # an (empty) entry is wanted for time to pass
        self._early: dict[tuple, dict[int, Any]] = {}  # publisher -> seq -> item beyond a gap
        self._proposed: dict[tuple, int] = {}  # publisher -> highest seq proposed this term
        self._told: set = set()  # dsts told this epoch (NewMaster)
        self._member_ops: list[_MemberOp] = []  # membership commands, in arrival order

    # ---- sansio -----------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        return self._drive(now, self.raft.start(now))

    def receive(self, now: float, src: str, msg: Any) -> list[Action]:
        if isinstance(msg, _RAFT_MESSAGES):
            return self._drive(now, self.raft.receive(now, src, msg))
        if isinstance(msg, _REQUESTS):
            return self._request(now, src, msg)
        if isinstance(msg, wire.DeadLetterDone):
            return self.dead_letters.done(now, msg.seqs) if self.led_term is not None else []
        return [Emit(MessageIgnored(src, f"not a quorum queue message: {type(msg).__name__}"))]

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if key == TTL_TIMER:
            self._ttl_at = None
            if self.led_term is not None:
                self._tick = True
            return []
        if key == DEAD_LETTER_TIMER:
            return self.dead_letters.timer(now)
        return self._drive(now, self.raft.timer(now, key))

    def end_turn(self, now: float) -> list[Action]:
        """Propose the turn's commands as one entry (or as several, each of
        at most :data:`~.machine.MAX_COMMANDS_PER_ENTRY` commands and
        :data:`~mirrorq.bounds.MAX_BATCH_BYTES`, a bigger command alone);
        send the turn's replies."""
        out: list[Action] = []
        while self.led_term is not None and (self._batch or self._tick):
            batch, self._batch, self._requests, self._tick = self._batch, [], [], False
            chunks = batches(batch, qm.command_size, MAX_BATCH_BYTES, qm.MAX_COMMANDS_PER_ENTRY) or [[]]
            items = [(None, qm.encode_entry(now, chunk)) for chunk in chunks]
            out += self._drive(now, self.raft.propose_batch(now, items))
        if self._member_ops:
            out += self._pump_members(now)
        out += self._arm_ttl(now)
        out += self._flush_replies()
        if self.led_term is not None:
            out += self.dead_letters.pump(now)
        return out

    def persist(self, now: float) -> list[Action]:
        """Carry out ``Persist`` (one flush of the log); returns what that
        unblocks (:meth:`persisted`)."""
        self.raft.log.flush()
        return self.persisted(now)

    def persisted(self, now: float) -> list[Action]:
        """The log's writes are durable (the driver flushed them, its own
        way or by :meth:`persist`): the leader counts its own copy toward
        commit now (the Raft core's ``early_appends``).  A commit that makes
        (a lone voter's) is applied and its replies are returned with the
        rest of the turn (what ``end_turn`` does), a further ``Persist``
        among them if the turn proposes again."""
        actions = self.raft.persisted(now)
        if not actions:
            return []
        return self._drive(now, actions) + self.end_turn(now)

    def leader_lost(self, now: float, member: str) -> list[Action]:
        return self._drive(now, self.raft.leader_lost(now, member))

    def dst_down(self, now: float, dst: str) -> list[Action]:
        """Every channel of the front end at ``dst`` is gone (its node or
        process died): they go ``down``.  Only the leader acts."""
        if self.led_term is None:
            return []
        for ch in sorted(c for c in self.machine.channels() | set(self._early) if c[0] == dst):
            self._early.pop(ch, None)
            self._batch.append(qm.Down(ch))
        return []

    # ---- reading ----------------------------------------------------------------------
    def _own_epoch(self) -> str:
        """This member's epoch while it leads (``_follow_leadership`` sets it
        with ``led_term``): what its replies as the leader carry."""
        if self.epoch is None:
            raise RuntimeError(f"{self.member}: replying as the leader of queue {self.queue!r}, which it does not lead")
        return self.epoch

    def leader_epoch(self) -> str | None:
        """The epoch of the leader as this member knows it (None: unknown)."""
        leader = self.raft.leader_id
        return None if leader is None else epoch(leader, self.raft.term)

    def info(self) -> dict:
        """The queue's counts and this member's Raft state (``member_status``
        answers it from any member; ``info`` from the leader)."""
        m = self.machine
        raft = self.raft
        cfg = raft.config
        role = raft.role
        return {
            "queue": self.queue,
            "type": "quorum",
            "member": self.member,
            "epoch": self.leader_epoch(),
            "term": raft.term,
            "members": list(cfg.members),
            "voters": list(cfg.voters),
            "learners": list(cfg.learners),
            "raft_state": "pre_vote" if role == PRE_CANDIDATE else role,
            "membership": "voter"
            if self.member in cfg.voters
            else "learner"
            if self.member in cfg.learners
            else "none",
            "leader": raft.leader_id,
            "messages": m.message_count,
            "messages_ready": m.ready_count,
            "messages_unacknowledged": m.checked_out_count,
            "consumers": len(m.rotation),
            "applied_index": raft.applied_index,
            "commit_index": raft.commit_index,
            "last_index": raft.last_index,
            "snapshot_index": raft.log.snapshot_index,
            # the leader's view of each follower's log (its match index)
            "match": raft.match_indexes() if role == LEADER else {},
        }

    # ---- driving the Raft core --------------------------------------------------------
    def _drive(self, now: float, actions: list) -> list[Action]:
        """Carry the Raft core's actions through: apply what it committed,
        follow leadership, pass the rest on."""
        out: list[Action] = []
        work = deque(actions)
        while True:
            while work:
                a = work.popleft()
                if type(a) is not Emit:
                    out.append(a)
                    continue
                ev = a.event
                t = type(ev)
                if t is Committed:
                    self._apply(ev)
                elif t is ApplySnapshot:
                    self.machine.restore(ev.data)
                    self._checkpoints = [c for c in self._checkpoints if c > ev.index]
                    self._read = None
                    out.append(a)
                elif t is LeaderChanged:
                    self._follow_leadership(now, work, out)
                    out.append(a)
                elif t is MembershipCommitted:
                    if self._member_ops:
                        self._members_done()
                    out.append(a)
                elif t is MessageIgnored:
                    out.append(a)
                # proposal outcomes are not needed: replies come from applied effects
            if not self._follow_leadership(now, work, out):
                break
        out += self._upkeep(now)
        return out

    # ---- log upkeep: checkpoints and the release index ------------------------------------
    def _release_index(self, force: bool = False) -> int:
        """The machine's release index, looked up at most once every
        :data:`RELEASE_CHECK_ENTRIES` applied entries (it scans past the
        ids settled at the front) unless ``force``d or the queue is empty."""
        applied = self.raft.applied_index
        if not self.machine.messages:
            return applied + 1
        seen_at, release = self._release_seen
        if force or applied - seen_at >= RELEASE_CHECK_ENTRIES:
            release = self.machine.release_index()
            self._release_seen = (applied, release)
        return release

    def _upkeep(self, now: float) -> list[Action]:
        """Checkpoint the machine every ``snapshot_every`` applied entries
        (less often while a checkpoint would cost more than the work since
        the last: its size follows the live messages); make the newest
        checkpoint below the release index the snapshot; keep at most
        :data:`MAX_CHECKPOINTS`."""
        raft = self.raft
        out: list[Action] = []
        applied = raft.applied_index
        last = self._checkpoints[-1] if self._checkpoints else raft.log.snapshot_index
        if (
            applied - last >= self.snapshot_every
            and self._checkpoint_work * CHECKPOINT_WORK >= self.machine.message_count
        ):
            self._checkpoint_work = 0
            if self._release_index(force=True) > applied:
                out += raft.compact(now, applied, self.machine.snapshot())  # nothing live is in the log
                self._checkpoints = []
                return out
            out += raft.checkpoint(now, applied, self.machine.snapshot())
            self._checkpoints.append(applied)
            if len(self._checkpoints) > MAX_CHECKPOINTS:
                cps = self._checkpoints  # drop the one whose neighbours are closest: they stay spread
                k = min(range(1, len(cps) - 1), key=lambda i: cps[i + 1] - cps[i - 1])
                raft.log.drop_checkpoint(cps.pop(k))
        if self._checkpoints and self._checkpoints[0] < self._release_index():
            release = self._release_index()
            usable = [c for c in self._checkpoints if c < release]
            for c in usable[:-1]:
                raft.log.drop_checkpoint(c)
            out += raft.promote(now, usable[-1])
            self._checkpoints = [c for c in self._checkpoints if c >= release]
        return out

    # ---- bodies ---------------------------------------------------------------------------
    def _hydrate(self, m: qm.Message) -> qm.Message | None:
        """``m`` with its body and properties, read back from the entry that
        enqueued it (None if that entry has left the log: a message of an
        entry below the release index, gone by the time the log was cut)."""
        if m.body is not None:
            return m
        index = m.msg_id >> qm.MSG_ID_SHIFT
        read = self._read
        if read is None or read[0] != index:
            log = self.raft.log
            if not log.snapshot_index < index <= log.last_index:
                return None
            read = self._read = (index, log.entry(index).data[1])
        c = read[1][m.msg_id & (qm.MAX_COMMANDS_PER_ENTRY - 1)]
        return replace(m, body=c[3], properties=c[4])

    def message(self, msg_id: int) -> qm.Message:
        """A live message with its body and properties (tools and tests)."""
        return self._hydrated(self.machine.messages[msg_id].public())

    def _hydrated(self, m: qm.Message) -> qm.Message:
        full = self._hydrate(m)
        if full is None:
            raise RuntimeError(
                f"{self.member}: message {m.msg_id} of queue {self.queue!r} is delivered, but "
                f"its entry is not in the log (snapshot at {self.raft.log.snapshot_index})"
            )
        return full

    def _follow_leadership(self, now: float, work: deque, out: list) -> bool:
        """Take up or give up leadership as the Raft core now says; True if
        that produced more work."""
        term = self.raft.term if self.raft.is_leader() else None
        if term == self.led_term:
            return False
        if self.led_term is not None:
            waiting = self._requests + [m for early in self._early.values() for _, m in early.values()]
            answered: set = set()
            waiting += [op.request for op in self._member_ops]
            for req in waiting:
                if id(req) not in answered:
                    answered.add(id(req))
                    self._reply(_reply_dst(req), wire.NotMaster(self.queue, self.leader_epoch(), req))
            self._reset_leader_state()
            self.dead_letters.clear()
            self.led_term = self.epoch = None
            if self._ttl_at is not None:
                self._ttl_at = None
                out.append(CancelTimer(TTL_TIMER))
        if term is None:
            return False
        self.led_term = term
        self.epoch = epoch(self.member, term)
        # the first command of the term: every consumer of earlier terms goes
        work.extend(self.raft.propose_batch(now, [(None, qm.encode_entry(now, [qm.Down(None)]))]))
        return True

    def _apply(self, ev: Committed) -> None:
        now, commands = qm.decode_entry(ev.command)
        effects = self.machine.apply(ev.index, now, commands)
        self._checkpoint_work += len(commands) + 1
        if self.on_apply is not None:
            self.on_apply(ev.index, ev.term, now, commands, effects)
        if self.led_term is None:
            return
        self._route(effects, ev.term == self.led_term)
        for pub in [p for p in self._early if self._early[p]]:
            self._drain(pub)

    def _route(self, effects: list, own: bool) -> None:
        """Turn a leader's applied effects into replies (see the docstring)."""
        name = self.queue
        for e in effects:
            t = type(e)
            if t is qm.Confirm:
                self._confirms.setdefault(e.publisher, []).append(e.seq)
            elif t is qm.Reject:
                self._nacks.setdefault(e.publisher, {}).setdefault(e.reason, []).append(e.seq)
            elif t is qm.Dropped:
                if self.dead_letters.target is not None and e.seqs and any(m.body is None for m in e.messages):
                    kept = [
                        (seq, full) for seq, m in zip(e.seqs, e.messages) if (full := self._hydrate(m)) is not None
                    ]  # at-most-once: see _hydrate
                    e = qm.Dropped(e.reason, tuple(m for _, m in kept), tuple(seq for seq, _ in kept))
                self._dropped.append(e)
                self.dead_letters.add(e)
            elif not own:
                continue  # a reply to an earlier term's request: its channel asks again
            elif t is qm.Deliver:
                ch, tag = e.consumer
                item = (tag,) + _item(self._hydrated(e.message))
                self._deliveries(ch, wire.delivery_item_size(item)).items.append(item)
            elif t is qm.GetResult:
                if e.message is None:
                    self._reply(e.channel[0], wire.GetEmpty(name, e.channel, e.request_id))
                else:
                    self._reply(
                        e.channel[0],
                        wire.Deliveries(
                            name,
                            e.channel,
                            self._own_epoch(),
                            ((None,) + _item(self._hydrated(e.message)),),
                            e.request_id,
                            e.remaining,
                        ),
                    )
            elif t is qm.CheckoutOk:
                if e.request_id is not None:
                    ch = e.consumer[0]
                    self._reply(ch[0], wire.CommandResult(name, ch, e.request_id, True))
            elif t is qm.CheckoutRefused:
                ch = e.consumer[0]
                rid = -1 if e.request_id is None else e.request_id
                self._reply(ch[0], wire.CommandResult(name, ch, rid, False, error=e.reason, code=406))
            elif t is qm.Purged:
                if e.channel is not None and e.request_id is not None:
                    self._reply(e.channel[0], wire.CommandResult(name, e.channel, e.request_id, True, e.count))
            elif t is qm.ConsumersDown and e.channel is None:
                # our down(None) is applied: tell every front end of the queue where it is now
                dsts = {cid[0][0] for cid in e.consumers} | {p[0] for p in self.machine.publishers}
                for dst in sorted(dsts - self._told):
                    self._tell(dst)

    # ---- channel requests -------------------------------------------------------------
    def _request(self, now: float, src: str, msg: Any) -> list[Action]:
        try:
            ch = wire.channel_id(msg.publisher if type(msg) is wire.Publish else msg.channel)
            qm._channel(ch, type(msg).__name__)
        except ValueError as e:
            return [Emit(MessageIgnored(src, f"malformed {type(msg).__name__}: {e}"))]
        dst = ch[0]
        if type(msg) is wire.QueueCommand and msg.command == "member_status":  # any member answers
            self._reply(dst, wire.CommandResult(self.queue, ch, msg.request_id, True, self.info()))
            return []
        if self.led_term is None:
            if type(msg) is not wire.ChannelClosed:
                self._reply(dst, wire.NotMaster(self.queue, self.leader_epoch(), msg))
                return []
            leader = self.raft.leader_id
            return [Send(leader, msg)] if leader is not None and leader != self.member else []
        if dst not in self._told:
            self._tell(dst)
        t = type(msg)
        if t is wire.Publish:
            self._publish(ch, msg)
        elif t is wire.Settle:
            if msg.epoch == self.epoch:  # else: delivered by another epoch, returned since
                for cls, ids in (
                    (qm.Settle, msg.ack),
                    (qm.Return, msg.requeue),
                    (qm.Discard, msg.discard),
                    (qm.Release, msg.release),
                    (qm.Credit, msg.credit),
                ):
                    if ids:

                        def build(
                            cls: Callable[[qm.ChannelId, tuple[Any, ...]], qm.Command] = cls, ids: Any = ids
                        ) -> qm.Command:
                            return cls(ch, tuple(ids))

                        self._propose(msg, src, build)
        elif t is wire.Consume:
            if msg.exclusive:
                self._refuse(ch, msg.request_id, "exclusive consumers are not supported on quorum queues", 540)
            else:
                self._propose(
                    msg,
                    src,
                    lambda: qm.Checkout(
                        (ch, msg.consumer_tag), msg.prefetch, msg.no_ack, False, msg.request_id, msg.lookahead
                    ),
                    msg.request_id,
                )
        elif t is wire.Cancel:
            self._propose(msg, src, lambda: qm.Checkout((ch, msg.consumer_tag), cancel=True))
        elif t is wire.Get:
            self._propose(msg, src, lambda: qm.Dequeue(ch, msg.request_id, msg.no_ack), msg.request_id)
        elif t is wire.ChannelClosed:
            self._early.pop(ch, None)
            self._propose(msg, src, lambda: qm.Down(ch))
        elif t is wire.QueueCommand:
            self._command(ch, msg, src)
        return []

    def _propose(self, msg: Any, src: str, build: Callable[[], Any], request_id: Any = None) -> None:
        """Add the command ``build()`` makes to this turn's entry; a
        malformed request is refused instead."""
        try:
            command = build()
        except (qm.BadCommand, TypeError) as e:
            ch = wire.channel_id(msg.channel)
            self._refuse(ch, request_id, f"malformed {type(msg).__name__}: {e}", 406)
            return
        self._batch.append(command)
        self._requests.append(msg)

    def _refuse(self, ch: tuple, request_id: Any, error: str, code: int) -> None:
        rid = -1 if request_id is None else request_id
        self._reply(ch[0], wire.CommandResult(self.queue, ch, rid, False, error=error, code=code))

    def _command(self, ch: tuple, msg: wire.QueueCommand, src: str) -> None:
        if msg.command == "info":
            self._reply(ch[0], wire.CommandResult(self.queue, ch, msg.request_id, True, self.info()))
        elif msg.command == "purge":
            self._propose(msg, src, lambda: qm.Purge(ch, msg.request_id), msg.request_id)
        elif msg.command in ("add_member", "delete_member"):
            member = (msg.args or {}).get("member")
            if not isinstance(member, str) or not member:
                self._refuse(ch, msg.request_id, f"{msg.command}: args must name the member, got {msg.args!r}", 406)
                return
            add = msg.command == "add_member"
            # a resend (the tool's retry after a leader change) replaces the waiting one
            self._member_ops = [op for op in self._member_ops if op.member != member or op.add != add]
            self._member_ops.append(_MemberOp(add, member, msg))
        else:
            self._refuse(ch, msg.request_id, f"command {msg.command!r} is not supported on quorum queues", 540)

    def _publish(self, pub: tuple, msg: wire.Publish) -> None:
        early = self._early.setdefault(pub, {})
        for item in msg.items:
            try:
                seq, body, properties, _persistent = item
                enqueue = qm.Enqueue(pub, seq, body, dict(properties or {}))
            except (qm.BadCommand, TypeError, ValueError) as e:
                seq = item[0] if isinstance(item, (list, tuple)) and item else None
                if type(seq) is int:
                    self._nacks.setdefault(pub, {}).setdefault(f"malformed publish: {e}", []).append(seq)
                continue
            if enqueue.seq <= self._top(pub):
                self._batch.append(enqueue)  # a resend: the machine confirms it again
                self._requests.append(msg)
            else:
                early[enqueue.seq] = (enqueue, msg)
        self._drain(pub)

    def _top(self, pub: tuple) -> int:
        return max(self._proposed.get(pub, 0), self.machine.hwm(pub))

    def _drain(self, pub: tuple) -> None:
        """Propose ``pub``'s waiting publishes that no longer leave a gap."""
        early = self._early.get(pub)
        if early is None:
            return
        top = self._top(pub)
        for seq in [s for s in early if s <= top]:
            del early[seq]  # applied meanwhile (an earlier term's entry): nothing to propose
        while top + 1 in early:
            enqueue, msg = early.pop(top + 1)
            self._batch.append(enqueue)
            self._requests.append(msg)
            top += 1
        self._proposed[pub] = top
        if not early:
            del self._early[pub]

    # ---- membership ---------------------------------------------------------------------
    def _pump_members(self, now: float) -> list[Action]:
        """Propose the waiting membership changes the Raft core can take now
        (one uncommitted change at a time, after the leader committed in its
        term); answer those that are done or refused."""
        out: list[Action] = []
        self._members_done()
        raft = self.raft
        for op in list(self._member_ops):
            if op.proposed or self.led_term is None:
                continue
            cfg = raft.config
            if op.add and op.member in cfg.members:
                op.proposed = (
                    True  # a learner already (a resend, or a previous leader's change): promoted when caught up
                )
                continue
            if cfg != raft.committed_config or raft.log.term_at(raft.commit_index) != raft.term or raft.role != LEADER:
                break  # another change is in flight, or the term has not committed yet: next turn
            if not op.add and cfg.voters == (op.member,):
                self._member_failed(op, f"member {op.member!r} is the last voter of the queue", 406)
                continue
            change = raft.add_server if op.add else raft.remove_server
            actions = change(now, op.member)
            refused = [a.event for a in actions if type(a) is Emit and type(a.event) is ConfigChangeRejected]
            out += self._drive(now, actions)
            if refused:
                self._member_failed(op, refused[0].reason, 406)
            else:
                op.proposed = True
        self._members_done()
        return out

    def _members_done(self) -> None:
        """Answer the membership commands the committed configuration shows done."""
        cfg = self.raft.committed_config
        for op in list(self._member_ops):
            if (op.member in cfg.voters) if op.add else (op.member not in cfg.members):
                self._member_ops.remove(op)
                ch = wire.channel_id(op.request.channel)
                self._reply(
                    ch[0],
                    wire.CommandResult(
                        self.queue,
                        ch,
                        op.request.request_id,
                        True,
                        {"member": op.member, "members": list(cfg.members), "voters": list(cfg.voters)},
                    ),
                )

    def _member_failed(self, op: _MemberOp, error: str, code: int) -> None:
        self._member_ops.remove(op)
        ch = wire.channel_id(op.request.channel)
        self._refuse(ch, op.request.request_id, error, code)

    # ---- replies ----------------------------------------------------------------------
    def _reply(self, dst: Any, msg: Any) -> None:
        self._replies.append((dst, msg))
        channel = getattr(msg, "channel", None)
        if channel is not None:
            self._open.pop(channel, None)  # later deliveries must not overtake this reply

    def _tell(self, dst: str) -> None:
        self._told.add(dst)
        self._reply(dst, wire.NewMaster(self.queue, self._own_epoch(), self.address))

    def _deliveries(self, ch: tuple, size: int) -> _Deliveries:
        """The channel's ``Deliveries`` of this turn to add an item of
        ``size`` (estimated bytes) to: the last reply queued for that
        channel, or a new one when there is none or the item would take it
        past MAX_BATCH_BYTES."""
        d = self._open.get(ch)
        if d is None or d.bytes + size > MAX_BATCH_BYTES:
            d = _Deliveries(ch, self._own_epoch())
            self._reply(ch[0], d)
            self._open[ch] = d
        d.bytes += size
        return d

    def _flush_replies(self) -> list[Action]:
        out: list[Action] = []
        name = self.queue
        for pub, seqs in self._confirms.items():
            out.append(Send(pub[0], wire.Confirm(name, pub, tuple(seqs))))
        for pub, by_reason in self._nacks.items():
            for reason, seqs in by_reason.items():
                out.append(Send(pub[0], wire.Confirm(name, pub, (), tuple(seqs), reason)))
        for dst, m in self._replies:
            if type(m) is _Deliveries:
                m = wire.Deliveries(name, m.channel, m.epoch, tuple(m.items), nbytes=MESSAGE_BYTES + m.bytes)
            if type(m) is wire.Deliveries:
                k = (m.epoch, m.channel)
                n = self._dseq[k] = self._dseq.get(k, 0) + 1
                m = wire.Deliveries(m.queue, m.channel, m.epoch, m.items, m.request_id, m.remaining, n, m.nbytes)
            out.append(Send(dst, m))
        out += [Emit(e) for e in self._dropped]
        self._confirms, self._nacks, self._replies, self._dropped, self._open = {}, {}, [], [], {}
        if self._dseq_epoch != self.epoch:  # an epoch ended: its numbering with it
            self._dseq_epoch = self.epoch
            self._dseq = {k: n for k, n in self._dseq.items() if k[0] == self.epoch}
        return out

    def _arm_ttl(self, now: float) -> list[Action]:
        if self.led_term is None:
            return []
        deadline = self.machine.next_deadline()
        if deadline == self._ttl_at:
            return []
        if deadline is not None and deadline <= now and self.raft.last_index > self.raft.applied_index:
            # due, but an entry is in flight: applying it (later, with a
            # newer time) comes back here -- no empty entry per turn meanwhile
            return []
        self._ttl_at = deadline
        if deadline is None:
            return [CancelTimer(TTL_TIMER)]
        return [SetTimer(TTL_TIMER, max(0.0, deadline - now) + _TIMER_SLACK)]


def _item(m: qm.Message) -> tuple:
    """A ``Deliveries`` item without its consumer tag: offset, msg id, body,
    properties (with ``x-delivery-count`` once returned), redelivered."""
    props = m.properties
    assert props is not None  # hydrated: read back from the log if the machine does not hold it
    if m.delivery_count:
        props = dict(props)
        props["x-delivery-count"] = m.delivery_count
    return (m.msg_id, m.msg_id, m.body, props, m.redelivered)


def _reply_dst(msg: Any) -> Any:
    return (msg.publisher if type(msg) is wire.Publish else msg.channel)[0]
