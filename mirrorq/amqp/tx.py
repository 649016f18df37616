"""Transactions over AMQP 0-9-1: ``tx.select``, ``tx.commit``, ``tx.rollback``.

The connection (:class:`~mirrorq.amqp.connection.Connection`, through the
:class:`TxHost` interface) hands this module the three methods, and
:func:`progress` after the channel's publishes were confirmed.  A
channel's transaction is its :class:`~mirrorq.amqp.channel.Transaction`
record (``ch.tx``).

A transactional channel holds its complete publishes
(:func:`mirrorq.amqp.publish.complete`) and its acks / rejects / nacks
(:mod:`mirrorq.amqp.consume`; their delivery tags are checked when they
arrive: an unknown or already settled tag is 406) until ``tx.commit``,
which settles the held deliveries, routes the held publishes (returns for
unroutable mandatory ones come first) and answers ``commit-ok`` once every
queue's master confirmed each publish -- for a mirrored queue, once every
mirror of its view has it, as RabbitMQ's mirrored queues do.  Frames on
the channel wait behind the commit.  ``tx.rollback`` drops what is held
(rolled-back acks leave their messages unacknowledged).  A channel is
either transactional or in confirm mode (406 on switching, as RabbitMQ);
``tx.commit`` / ``tx.rollback`` on a channel that is not transactional is
406 (:data:`~mirrorq.amqp.states.MODE_TRANSITIONS`).
"""

from __future__ import annotations

from typing import Any, Protocol

from pamqp import commands as C

from mirrorq.amqp import consume, publish
from mirrorq.amqp.channel import Channel
from mirrorq.amqp.states import ModeEvent


class TxHost(publish.PublishHost, consume.ConsumeHost, Protocol):
    """What transactions need of the connection: what publishing and
    consuming need (a commit publishes and settles)."""


def select(host: TxHost, now: float, ch: Channel, m: Any) -> None:
    publish.mode_step(ch, ModeEvent.TX_SELECT, m)
    host.writer.method(ch.number, C.Tx.SelectOk())


def commit(host: TxHost, now: float, ch: Channel, m: Any) -> None:
    publish.mode_step(ch, ModeEvent.TX_COMMIT, m)
    tx = ch.tx
    settles, tx.settles = tx.settles, []
    tx.settled = set()
    for tags, how in settles:
        consume.settle_tags(host, now, ch, tags, how)
    publishes, tx.publishes = tx.publishes, []
    for c in publishes:
        publish.complete(host, now, ch, c, held=False)
    publish.flush(host, now, ch)
    tx.commit = ch.pub.next_tag - 1
    ch.waiting = True  # later frames of the channel wait for commit-ok
    progress(host, now, ch)


def progress(host: TxHost, now: float, ch: Channel) -> None:
    """commit-ok once every publish of the commit is confirmed."""
    upto = ch.tx.commit
    if upto is None or publish.unconfirmed_upto(ch, upto):
        return
    publish.confirmed_upto(ch, upto)
    ch.tx.commit = None
    host.writer.method(ch.number, C.Tx.CommitOk())
    host.resume(now, ch)


def rollback(host: TxHost, now: float, ch: Channel, m: Any) -> None:
    publish.mode_step(ch, ModeEvent.TX_ROLLBACK, m)
    drop(ch)
    host.writer.method(ch.number, C.Tx.RollbackOk())


def drop(ch: Channel) -> None:
    """Forget what the transaction holds (a rollback; the channel closed)."""
    tx = ch.tx
    tx.publishes, tx.settles, tx.settled, tx.commit = [], [], set(), None
