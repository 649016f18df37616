"""A master whose auto-delete queue just went: what its channels send after
that (a channel closing right behind its consumer's cancel, as pika's and
aio-pika's connection close does) is no fault of the replica."""

from __future__ import annotations

import pytest

from mirrorq.classic import amqqueue as aq
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.replica import QueueReplica, QueueSpec
from mirrorq.gm.view import View
from mirrorq.queues import messages as qm
from mirrorq.sansio import Emit

CH = ("fe:1", 7)


def master() -> QueueReplica:
    r = QueueReplica(
        "m",
        "m",
        QueueSpec("q", durable=False, auto_delete=True),
        BackingQueue(None, durable=False),
        master="m",
        gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
    )
    r.start(0.0)
    r.install_view(0.0, View(1, (r.member,)))
    r.receive(0.0, None, qm.Consume("q", CH, "c"))
    return r


def deleted(actions: list) -> list:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, aq.QueueDeleted)]


@pytest.mark.parametrize("one_turn", [True, False])
def test_a_channel_closed_after_the_cancel_that_auto_deleted_the_queue(one_turn):
    r = master()
    cancel, closed = qm.Cancel("q", CH, "c"), qm.ChannelClosed("q", CH)
    if one_turn:
        out = r.receive_many(0.1, [cancel, closed])
    else:
        out = r.receive(0.1, None, cancel) + r.receive(0.1, None, closed)
    assert [ev.reason for ev in deleted(out)] == ["auto-delete"]


def test_the_consumers_node_gone_after_the_queue_auto_deleted_with_a_message_unacked():
    r = master()
    r.receive(0.1, ("fe:2", 1), qm.Publish("q", ("fe:2", 1), ((1, b"m", {}, False),)))
    r.end_turn(0.1)
    out = r.receive(0.2, None, qm.Cancel("q", CH, "c"))
    assert [ev.reason for ev in deleted(out)] == ["auto-delete"]
    assert r.behaviour.channel_dsts() == ["fe:1"]  # the unacked delivery's channel
    assert deleted(r.dst_down(0.3, "fe:1")) == []  # nothing to requeue into a deleted queue
