"""A quorum queue leader's dead-lettering: what its machine drops goes to the
node's dead-letter router (:mod:`mirrorq.amqp.dead_letter`).

A quorum queue declared with ``x-dead-letter-exchange`` (and optionally
``x-dead-letter-routing-key``) dead-letters what it rejects, expires, drops
for length or for ``x-delivery-limit``, as RabbitMQ's quorum queues do with
their default ``x-dead-letter-strategy: at-most-once``.  The leader hands the
``Dropped`` effects of the entries it applies (``purged`` excepted) to
:class:`DeadLetterSender`, a sans-IO part of
:class:`~mirrorq.quorum.replica.QuorumReplica`, which sends them to the router
as :class:`~mirrorq.queues.messages.DeadLetter` items carrying the
machine's dead-letter sequence numbers (``Dropped.seqs``: the same on every
member).

Protocol: stop and wait, as a classic master's (``Coordinator._send_dead_letters``):
one ``DeadLetter`` unanswered at a time, each the *prefix* of what waits, sent
again after :data:`RETRY` seconds without a ``DeadLetterDone``.  So the router
publishes a queue's dead letters to a target in sequence order, and the
target's high-water-mark de-duplication on ``_d = [source, seq]`` drops the
resends and nothing else.

Guarantees: while one leader lives, every message it dropped reaches each of
its targets once, in sequence order.  Failure: what waits is volatile; a
leader that loses its leadership or dies forgets it (at-most-once across a
leader change, RabbitMQ's default strategy for quorum queues).  A new leader
sends the drops of the entries it applies itself, with the same sequence
numbers, so the targets drop what was already stored.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from mirrorq.queues.messages import DEAD_LETTER_RETRY, DeadLetter, dead_letter_prefix
from mirrorq.sansio import Action, Send, SetTimer

__all__ = ["RETRY", "TIMER", "DeadLetterSender", "target_of"]

TIMER = ("quorum", "dead-letter")
RETRY = DEAD_LETTER_RETRY  # seconds without an answer before the unanswered DeadLetter is sent again


def target_of(arguments: dict | None) -> tuple[str, str | None] | None:
    """``(exchange, routing key or None)`` from the queue's arguments; None
    without ``x-dead-letter-exchange``."""
    args = arguments or {}
    exchange = args.get("x-dead-letter-exchange")
    if exchange is None:
        return None
    key = args.get("x-dead-letter-routing-key")
    return (_text(exchange), None if key is None else _text(key))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


class DeadLetterSender:
    """The leader's dead letters on their way to the router at :attr:`dst`."""

    def __init__(
        self, queue: str, vhost: str, incarnation: str, address: Any, target: tuple[str, str | None] | None
    ) -> None:
        self.queue, self.vhost, self.incarnation, self.address = queue, vhost, incarnation, address
        self.target = target
        self.dst: Any = None  # the node's router (its front end); nothing leaves without one
        self.pending: deque = deque()  # (seq, body, properties, reason, persistent), in seq order
        self.in_flight = 0  # items at the head of pending sent and not answered
        self._armed = False

    def add(self, reasons_and_messages: Any) -> None:
        """A machine ``Dropped`` effect (ignored without a dead-letter exchange)."""
        if self.target is None or not reasons_and_messages.seqs:
            return
        for seq, m in zip(reasons_and_messages.seqs, reasons_and_messages.messages):
            self.pending.append((seq, m.body, m.properties, reasons_and_messages.reason, True))

    def pump(self, now: float) -> list[Action]:
        """Send the next prefix if nothing is unanswered."""
        if self.in_flight or not self.pending or self.dst is None or self.target is None:
            return []
        batch = dead_letter_prefix(self.pending)
        self.in_flight = len(batch)
        out: list[Action] = [
            Send(
                self.dst,
                DeadLetter(
                    self.queue,
                    self.vhost,
                    self.address,
                    self.target[0],
                    self.target[1],
                    tuple(batch),
                    self.incarnation,
                    now,
                ),
            )
        ]
        if not self._armed:
            self._armed = True
            out.append(SetTimer(TIMER, RETRY))
        return out

    def done(self, now: float, seqs: Any) -> list[Action]:
        """The router's ``DeadLetterDone``: the answered prefix goes, the next leaves."""
        answered = set(seqs or ())
        if not self.in_flight or not all(self.pending[i][0] in answered for i in range(self.in_flight)):
            return []  # an answer to an earlier send (a resend's twin) or a stranger's
        for _ in range(self.in_flight):
            self.pending.popleft()
        self.in_flight = 0
        return self.pump(now)

    def timer(self, now: float) -> list[Action]:
        """No answer in time: send the unanswered prefix again."""
        self._armed = False
        if not self.pending:
            return []
        self.in_flight = 0
        return self.pump(now)

    def clear(self) -> None:
        """The leadership is gone: forget what waits (at-most-once)."""
        self.pending.clear()
        self.in_flight = 0
