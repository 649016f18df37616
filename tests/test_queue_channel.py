"""QueueChannel (mirrorq/queues/channel.py) alone: settlement
coalescing and the order of what it sends, masters' news arriving out of
order (a registry read older than a NewMaster), and the size of its
Publish messages."""

from __future__ import annotations

from mirrorq.bounds import MAX_BATCH_BYTES
from mirrorq.queues import channel as chmod
from mirrorq.queues import messages as m
from mirrorq.sansio import Emit, Send


def _deliver(ch: chmod.QueueChannel, epoch: str, offsets, seq: int = 1, tag: str = "c") -> list:
    items = tuple((tag, o, f"id{o}", b"b", {}, False) for o in offsets)
    return ch.receive(0.0, epoch, m.Deliveries("q", ch.channel, epoch, items, seq=seq))


def _sends(actions) -> list:
    return [a for a in actions if isinstance(a, Send)]


def test_acks_of_one_turn_leave_as_one_settle_per_master():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    _deliver(ch, "A", range(5))
    for o in range(5):
        assert ch.settle(0.0, "A", ack=[o]) == []  # recorded, nothing sent yet
    ch.settle(0.0, "A", requeue=[7])
    out = _sends(ch.flush(0.0))
    assert len(out) == 1 and out[0].dst == "A"
    s = out[0].msg
    assert isinstance(s, m.Settle) and s.ack == (0, 1, 2, 3, 4) and s.requeue == (7,) and s.epoch == "A"
    assert ch.flush(0.0) == []  # nothing twice


def test_recorded_settlements_go_ahead_of_a_cancel_and_a_close():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    ch.consume(0.0, "c")
    ch.settle(0.0, "A", ack=[1, 2])
    out = _sends(ch.cancel(0.0, "c"))
    assert [type(a.msg) for a in out] == [m.Settle, m.Cancel]
    ch.settle(0.0, "A", ack=[3])
    out = _sends(ch.close(0.0))
    assert [type(a.msg) for a in out] == [m.Settle, m.ChannelClosed]


def test_settlements_of_an_unannounced_master_wait_for_it():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    ch.settle(0.0, "B", ack=[4])  # B's deliveries overtook the news of B
    assert _sends(ch.flush(0.0)) == []
    out = _sends(ch.new_master(0.0, "B", "B"))
    assert any(isinstance(a.msg, m.Settle) and a.msg.epoch == "B" and a.msg.ack == (4,) and a.dst == "B" for a in out)


def test_a_stale_master_never_comes_back():
    """NewMaster(B) from B itself, then a registry read still naming A (the
    dead master): the channel must stay with B, or B's deliveries become void
    and their acks are dropped (the consumer stalls with everything unacked)."""
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    ch.consume(0.0, "c")
    ch.new_master(0.0, "B", "B")
    assert ch.new_master(0.0, "A", "A") == []
    assert ch.master == "B"
    _deliver(ch, "B", [10, 11])
    ch.settle(0.0, "B", ack=[10, 11])
    out = _sends(ch.flush(0.0))
    assert len(out) == 1 and out[0].dst == "B" and out[0].msg.ack == (10, 11)


def test_failover_cancels_x_cancel_on_ha_failover_consumers_and_reregisters_the_others():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    ch.consume(0.0, "keep")
    ch.consume(0.0, "cancel-me", arguments={"x-cancel-on-ha-failover": True})
    out = ch.new_master(0.0, "B", "B")
    cancelled = [a.event for a in out if isinstance(a, Emit) and isinstance(a.event, chmod.Cancelled)]
    assert [(c.consumer_tag, c.reason) for c in cancelled] == [("cancel-me", "ha-failover")]
    assert [a.msg.consumer_tag for a in _sends(out) if isinstance(a.msg, m.Consume)] == ["keep"]
    assert set(ch.consumers) == {"keep"}


def test_unanswered_commands_are_sent_again_to_a_new_master():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    rid, out = ch.command(0.0, "info")
    assert [a.dst for a in _sends(out)] == ["A"]
    resent = [a for a in _sends(ch.new_master(0.0, "B", "B")) if isinstance(a.msg, m.QueueCommand)]
    assert [(a.dst, a.msg.request_id, a.msg.command) for a in resent] == [("B", rid, "info")]
    done = ch.receive(0.0, "B", m.CommandResult("q", ch.channel, rid, True, {"messages_ready": 3}))
    assert [type(a.event) for a in done] == [chmod.CommandDone]
    assert not [
        a for a in _sends(ch.new_master(0.0, "C", "C")) if isinstance(a.msg, m.QueueCommand)
    ]  # answered: not again


def test_a_quorum_leader_of_a_lower_term_is_stale_news():
    """Quorum leaders are epochs ``member#term``: a late record or NewMaster
    naming an earlier term (a deposed leader, never seen by this channel)
    must not move the channel back; a higher term does."""
    ch = chmod.QueueChannel(("me", 1), "q", "n2/h:2/b", "n2/quorum/b#5")
    ch.publish(0.0, [(b"x", {}, True)])
    assert ch.new_master(0.0, "n1/quorum/a#4", "n1/h:1/a") == []
    assert ch.new_master(0.0, "n1/quorum/a#5", "n1/h:1/a") == []  # the same term cannot have two leaders
    assert ch.master == "n2/quorum/b#5"
    out = _sends(ch.new_master(0.0, "n1/quorum/a#6", "n1/h:1/a"))
    assert ch.master == "n1/quorum/a#6" and ch.master_dst == "n1/h:1/a"
    assert [type(a.msg) for a in out] == [m.Publish] and out[0].dst == "n1/h:1/a"  # the unconfirmed publish, resent


def test_unanswered_commands_are_sent_again_to_the_same_master_on_request():
    """A command refused by the replica the channel takes for the master
    (NotMaster before its promotion completed) waits; resend_commands sends
    every unanswered one again to that master, answered ones not."""
    ch = chmod.QueueChannel(("me", 1), "q", "M2", "M2")
    rid1, _ = ch.command(0.0, "info")
    rid2, _ = ch.command(0.0, "info")
    ch.receive(0.0, "M2", m.CommandResult("q", ch.channel, rid1, True, {}))
    refused = ch.receive(0.0, "M2", m.NotMaster("q", None, None))
    assert [type(a.event) for a in refused] == [chmod.Refused]
    again = _sends(ch.resend_commands(0.0))
    assert [(a.dst, a.msg.request_id) for a in again] == [("M2", rid2)]


def _publishes(actions) -> list:
    return [a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, m.Publish)]


def _confirm(ch: chmod.QueueChannel, p: m.Publish, src: str = "A") -> list:
    return ch.receive(0.0, src, m.Confirm("q", ch.channel, tuple(it[0] for it in p.items)))


def test_publish_messages_are_bounded_by_bytes_and_at_most_two_in_flight():
    """A publisher far ahead of its master (no confirms coming back): each
    Publish holds at most MAX_BATCH_BYTES of publishes and only
    MAX_PUBLISH_BATCHES are unconfirmed; the rest follow as confirms come,
    in seq order, each publish once."""
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    body = bytes(1_500_000)
    sent = _publishes(ch.publish(0.0, [(body, {"delivery_mode": 2}, True)] * 10))
    assert len(sent) == chmod.MAX_PUBLISH_BATCHES
    seen = list(sent)
    while sent:
        sent = _publishes(_confirm(ch, sent[0])) + sent[1:]
        seen += [p for p in sent if p not in seen]
    assert [it[0] for p in seen for it in p.items] == list(range(1, 11))
    assert all(p.wire_size() <= MAX_BATCH_BYTES for p in seen)
    # the estimate each Publish carries is the one it would be weighed by
    assert all(p.nbytes == m.Publish(p.queue, p.publisher, p.items).wire_size() for p in seen)
    assert [len(p.items) for p in seen] == [2, 2, 2, 2, 2]  # a third 1.5 MB body would pass 4 MiB
    assert not ch.unconfirmed


def test_a_publish_over_the_byte_bound_goes_alone():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    big = bytes(MAX_BATCH_BYTES + 1)
    first = _publishes(ch.publish(0.0, [(b"a", {}, True)]))
    second = _publishes(ch.publish(0.0, [(big, {}, True), (b"b", {}, True)]))
    assert [[it[1] for it in p.items] for p in first + second] == [[b"a"], [big]]
    third = _publishes(_confirm(ch, first[0]))
    assert [[it[1] for it in p.items] for p in third] == [[b"b"]]


def test_a_failover_resends_the_unconfirmed_in_bounded_messages_oldest_first():
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    body = bytes(1_500_000)
    ch.publish(0.0, [(body, {}, True)] * 9)
    ch.consume(0.0, "c")
    out = _sends(ch.new_master(0.0, "B", "B"))
    resent = [a.msg for a in out if isinstance(a.msg, m.Publish)]
    assert all(a.dst == "B" for a in out)
    assert [[it[0] for it in p.items] for p in resent] == [[1, 2], [3, 4]]
    assert isinstance(out[len(resent)].msg, m.Consume)  # after the publishes, as before
    later = _publishes(_confirm(ch, resent[0], "B"))
    assert [[it[0] for it in p.items] for p in later] == [[5, 6]]


def test_a_closing_channel_sends_every_publish_it_was_given_before_its_close():
    """Publishes waiting behind the batch window when the channel closes
    (a publisher without confirms closing its channel or connection) go to
    the master at the close, in seq order and bounded messages, each once,
    ahead of ChannelClosed: the queue gets what came before the close."""
    ch = chmod.QueueChannel(("me", 1), "q", "A", "A")
    body = bytes(1_500_000)
    first = _publishes(ch.publish(0.0, [(body, {}, True)] * 9))
    assert [[it[0] for it in p.items] for p in first] == [[1, 2], [3, 4]]
    out = _sends(ch.close(0.0))
    assert all(a.dst == "A" for a in out)
    assert isinstance(out[-1].msg, m.ChannelClosed)
    rest = [a.msg for a in out[:-1]]
    assert all(isinstance(p, m.Publish) and p.wire_size() <= MAX_BATCH_BYTES for p in rest)
    assert [[it[0] for it in p.items] for p in rest] == [[5, 6], [7, 8], [9]]
