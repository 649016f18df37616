"""Targeted tests of a quorum queue member (mirrorq.quorum.replica): one
entry per turn, replies only after commit, follower answers, epochs, a new
leader's redelivery, refusal of malformed requests, publishes after a gap,
the TTL tick and snapshots.  A 3-member group in the simulator without loss;
``client`` nodes record what reaches them."""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import FileRaftLog, MemoryRaftLog, MessageIgnored
from mirrorq.queues import messages as wire
from mirrorq.queues.messages import epoch, epoch_member, epoch_term
from mirrorq.quorum import machine as qm
from mirrorq.quorum.replica import TTL_TIMER, QuorumReplica
from mirrorq.sansio import Emit
from mirrorq.simulator import Simulator

Q = "q"
VOTERS = ("m0", "m1", "m2")
PUB = ("client", 1)
CON = ("client", 2)


class Member(QuorumReplica):
    def requests(self, now, *msgs):
        """Several channel requests in one turn."""
        return [a for m in msgs for a in self.receive(now, "client", m)]


class Client:
    def __init__(self):
        self.got: list = []

    def start(self, now):
        return []

    def receive(self, now, src, msg):
        self.got.append(msg)
        return []

    def timer(self, now, key):
        return []

    def of(self, kind):
        return [m for m in self.got if type(m) is kind]


def cluster(seed=1, snapshot_every=4096, **arguments):
    sim = Simulator(seed, min_delay=0.001, max_delay=0.003)
    for name in VOTERS:
        sim.add_node(
            name,
            lambda n, d: Member(
                n,
                Q,
                MemoryRaftLog(d),
                random.Random(n),
                voters=VOTERS,
                arguments=arguments,
                snapshot_every=snapshot_every,
            ),
        )
    sim.add_node("client", lambda n, d: Client())
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    return sim, sim.core("client")


def leader(sim):
    """The member leading with its down(None) applied, if any."""
    for name in sim.alive():
        core = sim.core(name)
        if (
            isinstance(core, Member)
            and core.led_term is not None
            and core.raft.log.term_at(core.raft.commit_index) == core.raft.term
        ):
            return core
    return None


def publish(seqs, publisher=PUB):
    return wire.Publish(Q, publisher, tuple((s, f"m{s}".encode(), {}, True) for s in seqs))


def test_one_turn_is_one_entry_and_replies_follow_commit():
    sim, client = cluster()
    lead = leader(sim)
    before = lead.raft.last_index
    sim.call(
        lead.member,
        "requests",
        publish([1, 2]),
        publish([1], ("client", 3)),
        wire.Consume(Q, CON, "t", prefetch=1, request_id=7),
    )
    assert lead.raft.last_index == before + 1  # one entry for the whole turn
    entry = lead.raft.log.entry(before + 1)
    _, commands = qm.decode_entry(entry.data)
    assert [type(c) for c in commands] == [qm.Enqueue, qm.Enqueue, qm.Enqueue, qm.Checkout]
    assert client.of(wire.Confirm) == [] and client.of(wire.Deliveries) == []  # nothing before commit
    sim.run_for(0.05)
    acks = sorted((c.publisher, c.acks) for c in client.of(wire.Confirm))
    assert acks == [(PUB, (1, 2)), (("client", 3), (1,))]
    [ok] = client.of(wire.CommandResult)
    assert ok.request_id == 7 and ok.ok
    [d] = client.of(wire.Deliveries)
    assert d.epoch == lead.epoch and d.seq == 1 and [it[3] for it in d.items] == [b"m1"]


def test_a_leader_alone_does_not_confirm():
    sim, client = cluster()
    lead = leader(sim)
    sim.partition([lead.member, "client"], [m for m in VOTERS if m != lead.member] + ["client"])
    sim.call(lead.member, "requests", publish([1]))
    sim.run_for(0.5)
    assert client.of(wire.Confirm) == []
    assert lead.machine.message_count == 0  # not committed, not applied


def test_a_follower_answers_not_master_with_the_leaders_epoch():
    sim, client = cluster()
    lead = leader(sim)
    follower = next(m for m in VOTERS if m != lead.member)
    req = publish([1])
    sim.call(follower, "requests", req)
    sim.run_for(0.01)
    [nm] = client.of(wire.NotMaster)
    assert nm.master == lead.epoch and nm.request == req
    assert epoch_member(nm.master) == lead.member and epoch_term(nm.master) == lead.raft.term


def test_a_follower_forwards_channel_closed_to_the_leader():
    sim, client = cluster()
    lead = leader(sim)
    sim.call(lead.member, "requests", publish([1]), wire.Consume(Q, CON, "t"))
    sim.run_for(0.05)
    assert lead.machine.checked_out_count == 1
    follower = next(m for m in VOTERS if m != lead.member)
    sim.call(follower, "requests", wire.ChannelClosed(Q, CON))
    sim.run_for(0.05)
    assert lead.machine.checked_out_count == 0 and CON in lead.machine.closed
    assert client.of(wire.NotMaster) == []


def test_first_contact_in_an_epoch_is_told_new_master():
    sim, client = cluster()
    lead = leader(sim)
    sim.call(lead.member, "requests", publish([1]))
    sim.call(lead.member, "requests", publish([2]))
    sim.run_for(0.05)
    assert client.of(wire.NewMaster) == [wire.NewMaster(Q, lead.epoch, lead.member)]


def test_a_settle_of_another_epoch_is_void():
    sim, client = cluster()
    lead = leader(sim)
    sim.call(lead.member, "requests", publish([1]), wire.Consume(Q, CON, "t"))
    sim.run_for(0.05)
    [d] = client.of(wire.Deliveries)
    offset = d.items[0][1]
    stale = epoch(lead.member, lead.raft.term - 1)
    sim.call(lead.member, "requests", wire.Settle(Q, CON, stale, ack=(offset,)))
    sim.run_for(0.05)
    assert lead.machine.checked_out_count == 1
    sim.call(lead.member, "requests", wire.Settle(Q, CON, lead.epoch, ack=(offset,)))
    sim.run_for(0.05)
    assert lead.machine.message_count == 0


def test_a_new_leader_returns_old_consumers_messages_and_tells_the_front_end():
    sim, client = cluster()
    old = leader(sim)
    sim.call(old.member, "requests", publish([1, 2]), wire.Consume(Q, CON, "t", prefetch=5))
    sim.run_for(0.05)
    assert old.machine.checked_out_count == 2
    client.got.clear()
    sim.kill(old.member)
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    new = leader(sim)
    sim.run_for(0.3)  # (a reordered first append costs a heartbeat)
    assert new.machine.checked_out_count == 0 and new.machine.ready_count == 2
    assert wire.NewMaster(Q, new.epoch, new.member) in client.got  # to the dst that had consumers
    sim.call(new.member, "requests", wire.Consume(Q, CON, "t", prefetch=5))  # the channel consumes again
    sim.run_for(0.05)
    [d] = client.of(wire.Deliveries)
    assert d.epoch == new.epoch and d.seq == 1
    assert [(it[3], it[4].get("x-delivery-count"), it[5]) for it in d.items] == [(b"m1", 1, True), (b"m2", 1, True)]


def test_publishes_after_a_gap_wait_for_it():
    sim, client = cluster()
    lead = leader(sim)
    sim.call(lead.member, "requests", publish([3, 4]))  # overtook the batch with 1, 2
    sim.run_for(0.05)
    assert lead.machine.message_count == 0 and client.of(wire.Confirm) == []
    sim.call(lead.member, "requests", publish([1, 2]))
    sim.run_for(0.05)
    assert sorted(s for c in client.of(wire.Confirm) for s in c.acks) == [1, 2, 3, 4]
    assert [lead.message(i).body for i in lead.machine.ready] == [b"m1", b"m2", b"m3", b"m4"]


def test_malformed_requests_are_refused_not_logged():
    sim, client = cluster()
    lead = leader(sim)
    before = lead.raft.last_index
    bad = wire.Publish(Q, PUB, ((1, "not bytes", {}, True),))
    sim.call(
        lead.member,
        "requests",
        bad,
        wire.Consume(Q, CON, "t", prefetch=-1, request_id=3),
        wire.Consume(Q, CON, "x", exclusive=True, request_id=4),
    )
    sim.run_for(0.05)
    assert lead.raft.last_index == before
    [nack] = client.of(wire.Confirm)
    assert nack.nacks == (1,) and "enqueue.body must be bytes" in nack.reason
    results = {r.request_id: r for r in client.of(wire.CommandResult)}
    assert not results[3].ok and results[3].code == 406 and "checkout.prefetch" in results[3].error
    assert not results[4].ok and results[4].code == 540
    acts = lead.receive(sim.now, "x", object())
    assert [type(a.event) for a in acts if type(a) is Emit] == [MessageIgnored]
    acts = lead.receive(sim.now, "x", wire.Get(Q, ("x", "no number"), 1))
    assert [type(a.event) for a in acts if type(a) is Emit] == [MessageIgnored]


def test_the_ttl_timer_proposes_an_entry_for_time_to_pass():
    sim, client = cluster(**{"x-message-ttl": 200})
    lead = leader(sim)
    sim.call(lead.member, "requests", publish([1]))
    sim.run_for(0.05)
    assert lead.machine.message_count == 1 and TTL_TIMER in sim.nodes[lead.member].timers
    last = lead.raft.last_index
    sim.run_for(0.3)
    assert lead.machine.message_count == 0  # expired when the timer's empty entry applied
    assert lead.raft.last_index == last + 1
    assert qm.decode_entry(lead.raft.log.entry(last + 1).data)[1] == []
    assert TTL_TIMER not in sim.nodes[lead.member].timers


def test_the_log_keeps_every_live_body_and_is_cut_below_the_release_index():
    """Bodies stay in the entries that enqueued them: with nothing consumed
    the log keeps them all (checkpoints wait); once the oldest are acked,
    the newest checkpoint below the oldest live message becomes the
    snapshot.  A restarted member restores from it, replays the rest and
    delivers the right bodies."""
    sim, client = cluster(snapshot_every=3)
    lead = leader(sim)
    for s in range(1, 10):
        sim.call(lead.member, "requests", publish([s]))
        sim.run_for(0.01)
    sim.run_for(0.05)
    first = min(lead.machine.messages) >> qm.MSG_ID_SHIFT
    assert lead.raft.log.snapshot_index < first  # the oldest live body is still in the log
    assert lead.raft.log.checkpoints  # kept aside, waiting
    assert all(m.body is None for m in lead.machine.messages.values())  # the machine keeps no body
    sim.call(lead.member, "requests", wire.Consume(Q, CON, "t", prefetch=6))
    sim.run_for(0.05)
    ids = [it[1] for d in client.of(wire.Deliveries) for it in d.items]
    assert [it[3] for d in client.of(wire.Deliveries) for it in d.items] == [f"m{s}".encode() for s in range(1, 7)]
    sim.call(lead.member, "requests", wire.Settle(Q, CON, lead.epoch, ack=tuple(ids)))
    for _ in range(8):  # entries for checkpoints to be taken past the acks
        sim.call(lead.member, "requests", publish([1]))  # a resend: confirmed again, nothing stored
        sim.run_for(0.01)
    sim.run_for(0.05)
    release = lead.machine.release_index()
    assert release == min(lead.machine.messages) >> qm.MSG_ID_SHIFT
    assert 0 < lead.raft.log.snapshot_index < release
    other = next(m for m in VOTERS if m != lead.member)
    sim.restart(other)
    sim.run_for(0.2)
    assert sim.core(other).machine.snapshot() == lead.machine.snapshot()
    assert sim.core(other).machine.message_count == 3
    assert [sim.core(other).message(i).body for i in sorted(sim.core(other).machine.messages)] == [b"m7", b"m8", b"m9"]


def test_an_empty_queue_compacts_at_once():
    sim, client = cluster(snapshot_every=3)
    lead = leader(sim)
    sim.call(lead.member, "requests", wire.Consume(Q, CON, "t", no_ack=True))
    for s in range(1, 10):
        sim.call(lead.member, "requests", publish([s]))
        sim.run_for(0.01)
    sim.run_for(0.05)
    assert lead.machine.message_count == 0
    assert lead.raft.log.checkpoints == ()
    assert lead.raft.log.snapshot_index >= lead.raft.applied_index - 3


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(queue=""), "queue"),
        (dict(snapshot_every=0), "snapshot_every"),
        (dict(arguments={"x-overflow": "sideways"}), "x-overflow"),
    ],
)
def test_bad_construction_raises(bad, match):
    kw = dict(queue=Q, snapshot_every=10, arguments={})
    kw.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        QuorumReplica("m0", kw.pop("queue"), MemoryRaftLog({}), random.Random(0), voters=VOTERS, **kw)


def test_a_member_on_a_file_log_restarts_with_its_queue(tmp_path):
    """Entries and snapshots go through msgpack on disk (tuples come back as
    lists): a one-member group restarted from its FileRaftLog holds the same
    queue, snapshot included."""

    def build():
        return Member(
            "m0",
            Q,
            FileRaftLog(tmp_path / "m0"),
            random.Random(0),
            voters=("m0",),
            snapshot_every=3,
            arguments={"x-delivery-limit": 5},
        )

    sim = Simulator(3)
    sim.add_node("m0", lambda n, d: build())
    sim.add_node("client", lambda n, d: Client())
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    for s in range(1, 8):
        sim.call("m0", "requests", publish([s]))
    sim.call("m0", "requests", wire.Consume(Q, CON, "t", prefetch=2), publish([1, 2], ("client", 3)))
    sim.run_for(0.05)
    first = sim.core("m0")
    assert first.raft.log.checkpoints  # kept aside: the live bodies are in the log below them
    [d] = sim.core("client").of(wire.Deliveries)
    sim.call("m0", "requests", wire.Settle(Q, CON, first.epoch, requeue=(d.items[0][1],)))
    sim.run_for(0.05)
    before = first.machine.snapshot()
    sim.kill("m0")  # a crash: only what Persist flushed is on disk
    sim.start("m0")
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    again = sim.core("m0").machine
    assert again.hwm(PUB) == 7 and again.hwm(("client", 3)) == 2
    assert again.message_count == 9 and again.checked_out_count == 0  # the new term returned what t held
    held = {i for consumer in before["consumers"] for i in consumer[5]}
    counts = {m[0]: m[3] for m in before["messages"]}
    assert {i: m.count for i, m in again.messages.items()} == {i: n + (i in held) for i, n in counts.items()}
    bodies = sorted(sim.core("m0").message(i).body for i in again.messages)
    assert bodies == sorted([f"m{s}".encode() for s in range(1, 8)] + [b"m1", b"m2"])


# ---- membership (add_member / delete_member at the leader) ------------------------------------
OP = ("client", 9)


def _member_command(sim, lead, command, member, rid):
    sim.call(lead.member, "requests", wire.QueueCommand(Q, OP, rid, command, {"member": member}))


def _result(client, rid):
    return next((m for m in client.of(wire.CommandResult) if m.request_id == rid), None)


def test_add_member_catches_up_from_a_snapshot_is_promoted_and_then_counts_for_commit():
    sim, client = cluster(snapshot_every=3)
    lead = leader(sim)
    sim.call(lead.member, "requests", wire.Consume(Q, CON, "drain", no_ack=True))
    for s in range(1, 6):  # consumed at once: the log before them may go
        sim.call(lead.member, "requests", publish([s]))
        sim.run_for(0.01)
    sim.call(lead.member, "requests", wire.Cancel(Q, CON, "drain"))
    for s in range(6, 16):
        sim.call(lead.member, "requests", publish([s]))
        sim.run_for(0.01)
    sim.run_for(0.05)
    assert lead.raft.log.snapshot_index > 0  # the joiner cannot get the log from index 1
    # the joiner is built with the group's bootstrap voters: passive until a configuration names it
    sim.add_node("m3", lambda n, d: Member(n, Q, MemoryRaftLog(d), random.Random(n), voters=VOTERS, snapshot_every=3))
    sim.run_for(0.5)
    assert sim.core("m3").raft.term == 0  # it never campaigned
    _member_command(sim, lead, "add_member", "m3", 1)
    assert sim.run_until(lambda: _result(client, 1) is not None, 5.0)
    res = _result(client, 1)
    assert res.ok and res.value["voters"] == ["m0", "m1", "m2", "m3"], res
    joiner = sim.core("m3")
    assert sim.run_until(lambda: joiner.raft.applied_index == lead.raft.applied_index, 2.0)
    assert joiner.machine.snapshot() == lead.machine.snapshot() and joiner.machine.message_count == 10
    assert [joiner.message(i).body for i in sorted(joiner.machine.messages)] == [f"m{s}".encode() for s in range(6, 16)]
    st = joiner.info()
    assert (st["membership"], st["raft_state"], st["leader"]) == ("voter", "follower", lead.member)
    assert set(lead.info()["match"]) == {"m0", "m1", "m2", "m3"} - {lead.member}
    # 4 voters: a commit needs 3 -- with two members down the queue confirms nothing
    down = [m for m in VOTERS if m != lead.member]
    for m in down:
        sim.kill(m)
    sim.call(lead.member, "requests", publish([16]))
    sim.run_for(0.3)
    assert all(16 not in c.acks for c in client.of(wire.Confirm))
    sim.start(down[0])
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    sim.call(leader(sim).member, "requests", publish([16]))  # the channel's resend
    assert sim.run_until(lambda: any(16 in c.acks for c in client.of(wire.Confirm)), 5.0)


def test_delete_member_removes_it_and_the_last_voter_is_refused():
    sim, client = cluster()
    lead = leader(sim)
    others = [m for m in VOTERS if m != lead.member]
    _member_command(sim, lead, "delete_member", others[0], 1)
    assert sim.run_until(lambda: _result(client, 1) is not None, 5.0)
    assert _result(client, 1).ok and others[0] not in lead.raft.committed_config.members
    _member_command(sim, lead, "delete_member", others[0], 2)  # not a member any more: done already
    assert sim.run_until(lambda: _result(client, 2) is not None, 5.0) and _result(client, 2).ok
    # with the removed member dead, the two left still commit
    sim.kill(others[0])
    sim.call(lead.member, "requests", publish([1]))
    assert sim.run_until(lambda: any(1 in c.acks for c in client.of(wire.Confirm)), 5.0)
    _member_command(sim, lead, "delete_member", others[1], 3)
    assert sim.run_until(lambda: _result(client, 3) is not None, 5.0)
    assert lead.raft.committed_config.voters == (lead.member,)
    _member_command(sim, lead, "delete_member", lead.member, 4)
    assert sim.run_until(lambda: _result(client, 4) is not None, 5.0)
    res = _result(client, 4)
    assert not res.ok and res.code == 406 and "last voter" in res.error


def test_the_leader_removing_itself_answers_then_steps_down_and_a_follower_answers_member_status():
    sim, client = cluster()
    lead = leader(sim)
    _member_command(sim, lead, "delete_member", lead.member, 1)
    assert sim.run_until(lambda: _result(client, 1) is not None, 5.0)
    assert _result(client, 1).ok
    assert sim.run_until(lambda: leader(sim) is not None and leader(sim) is not lead, 5.0)
    new = leader(sim)
    assert lead.member not in new.raft.config.members
    follower = next(m for m in VOTERS if m not in (lead.member, new.member))
    sim.call(follower, "requests", wire.QueueCommand(Q, OP, 5, "member_status"))
    assert sim.run_until(lambda: _result(client, 5) is not None, 2.0)
    st = _result(client, 5).value
    assert (
        st["raft_state"] == "follower"
        and st["leader"] == new.member
        and st["voters"] == sorted(m for m in VOTERS if m != lead.member)
    )


def test_a_membership_command_at_a_follower_is_answered_not_master():
    sim, client = cluster()
    lead = leader(sim)
    follower = next(m for m in VOTERS if m != lead.member)
    sim.call(follower, "requests", wire.QueueCommand(Q, OP, 1, "add_member", {"member": "m9"}))
    sim.run_for(0.05)
    assert [m.master for m in client.of(wire.NotMaster)] == [epoch(lead.member, lead.raft.term)]


def test_the_leader_dead_letters_stop_and_wait_with_the_machines_sequence_numbers():
    """x-dead-letter-exchange: what the machine drops (here rejects) goes to
    the router as DeadLetter items numbered by the machine,
    one DeadLetter unanswered at a time, sent again after RETRY without an
    answer; the router's DeadLetterDone lets the next one go."""
    from mirrorq.quorum import dead_letter as dl

    sim, client = cluster(**{"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "dead"})
    lead = leader(sim)
    lead.dead_letters.dst = "client"
    sim.call(lead.member, "requests", publish([1, 2, 3]), wire.Consume(Q, CON, "t", prefetch=3))
    sim.run_for(0.05)
    [d] = client.of(wire.Deliveries)
    offsets = [it[1] for it in d.items]
    sim.call(lead.member, "requests", wire.Settle(Q, CON, lead.epoch, discard=(offsets[0],)))
    sim.run_for(0.05)
    [first] = client.of(wire.DeadLetter)
    assert (first.exchange, first.routing_key, first.master_dst) == ("dlx", "dead", lead.member)
    assert [(it[0], it[1], it[3]) for it in first.items] == [(1, b"m1", "rejected")]
    sim.call(lead.member, "requests", wire.Settle(Q, CON, lead.epoch, discard=(offsets[1], offsets[2])))
    sim.run_for(0.05)
    assert len(client.of(wire.DeadLetter)) == 1  # waits for the first's answer
    sim.run_for(dl.RETRY)
    again = client.of(wire.DeadLetter)
    assert len(again) == 2  # no answer: what waits is sent again, the unanswered one first
    assert [(it[0], it[1]) for it in again[1].items] == [(1, b"m1"), (2, b"m2"), (3, b"m3")]
    sim.call(lead.member, "receive", "client", wire.DeadLetterDone(Q, (1,)))  # the first send's late answer
    sim.run_for(0.05)
    assert len(lead.dead_letters.pending) == 3 and len(client.of(wire.DeadLetter)) == 2
    sim.call(lead.member, "receive", "client", wire.DeadLetterDone(Q, (1, 2, 3)))
    sim.run_for(dl.RETRY + 0.1)
    assert len(client.of(wire.DeadLetter)) == 2 and not lead.dead_letters.pending


def test_without_a_dead_letter_exchange_nothing_is_sent():
    sim, client = cluster()
    lead = leader(sim)
    lead.dead_letters.dst = "client"
    sim.call(lead.member, "requests", publish([1]), wire.Consume(Q, CON, "t", prefetch=1))
    sim.run_for(0.05)
    [d] = client.of(wire.Deliveries)
    sim.call(lead.member, "requests", wire.Settle(Q, CON, lead.epoch, discard=(d.items[0][1],)))
    sim.run_for(0.05)
    assert client.of(wire.DeadLetter) == [] and lead.machine.message_count == 0


def test_dead_lettering_is_at_most_once_across_a_leader_change():
    """RabbitMQ's at-most-once strategy: what a dead leader had not had
    answered is not sent by the next one; the next one numbers on."""
    sim, client = cluster(**{"x-dead-letter-exchange": "dlx"})
    old = leader(sim)
    old.dead_letters.dst = "client"
    sim.call(old.member, "requests", publish([1, 2]), wire.Consume(Q, CON, "t", prefetch=2))
    sim.run_for(0.05)
    [d] = client.of(wire.Deliveries)
    sim.call(old.member, "requests", wire.Settle(Q, CON, old.epoch, discard=(d.items[0][1],)))
    sim.run_for(0.05)
    assert [[it[0] for it in x.items] for x in client.of(wire.DeadLetter)] == [[1]]  # never answered
    sim.kill(old.member)
    assert sim.run_until(lambda: leader(sim) is not None, 5.0)
    new = leader(sim)
    new.dead_letters.dst = "client"
    client.got.clear()
    sim.call(new.member, "requests", wire.Consume(Q, CON, "t", prefetch=2))
    sim.run_for(0.3)
    [d] = client.of(wire.Deliveries)
    assert [it[3] for it in d.items] == [b"m2"]
    sim.call(new.member, "requests", wire.Settle(Q, CON, new.epoch, discard=(d.items[0][1],)))
    sim.run_for(0.05)
    assert [[(it[0], it[1]) for it in x.items] for x in client.of(wire.DeadLetter)] == [[(2, b"m2")]]
    assert new.machine.message_count == 0
