"""Message properties: what a queue keeps with each message's body.

A publish reaches its queues as ``(body, properties, persistent)``;
``properties`` is a plain dict, written into queue logs and sent between
nodes as it is (msgpack), so its keys are short and its encoded form is
fixed: an old log must still read.  This module is its one table -- the
keys (:data:`HEADER`, :data:`EXCHANGE`, ...), what each holds, and
the order :func:`encode` writes them in
-- which every producer (the AMQP connection's publishes, the dead-letter
router's) and reader (deliveries, ``basic.get``, range reads, the queue's
de-duplication and history) goes through.
"""

from __future__ import annotations

from typing import Any, Final

from mirrorq.classic.backing_queue import PRIORITY_KEY

#: bytes: the content-header frame's payload as the publisher sent it (delivered as it is)
HEADER: Final = "_h"
#: str: the exchange the message was published to (``basic.deliver`` / ``get-ok`` name it)
EXCHANGE: Final = "_x"
#: str: its routing key
ROUTING_KEY: Final = "_k"
#: ``[ref, publishing id]`` from headers ``x-publisher-ref`` / ``x-publishing-id``: the master de-duplicates by it
PUBLISHER_REF: Final = "_p"
#: ``[source, seq]``: a dead-letter router's publish, its source ("vhost/queue/incarnation") and dead-letter seq
DEAD_LETTER_REF: Final = "_d"
#: str: the publisher's ``expiration`` (per-message TTL, milliseconds as text)
EXPIRATION: Final = "expiration"
#: int: the publisher's ``priority``, when not 0 (a priority queue orders by it)
PRIORITY: Final = PRIORITY_KEY
#: int: returns before this delivery; a quorum queue adds it to what it delivers (RabbitMQ's header)
DELIVERY_COUNT: Final = "x-delivery-count"


def encode(
    header: bytes,
    exchange: str,
    routing_key: str,
    *,
    publisher_ref: list | None = None,
    dead_letter_ref: list | None = None,
    expiration: str | None = None,
    priority: Any = 0,
) -> dict[str, Any]:
    """A message's properties, keys in THE order (the encoded form of
    what queues store depends on it); absent ones are left out."""
    p: dict[str, Any] = {HEADER: header, EXCHANGE: exchange, ROUTING_KEY: routing_key}
    if publisher_ref is not None:
        p[PUBLISHER_REF] = publisher_ref
    if dead_letter_ref is not None:
        p[DEAD_LETTER_REF] = dead_letter_ref
    if expiration is not None:
        p[EXPIRATION] = expiration
    if priority:
        p[PRIORITY] = priority
    return p
