"""Message sizes through a real 3-node mirrored queue (mirrorq.bounds).

A 16 MiB message (the default ``max_message_size``) is published with
confirms on one node into a queue mirrored on all three, and consumed intact
on another; a message one byte over the limit is refused with 406 naming
the limit, and the connection goes on working.
"""

from __future__ import annotations

import hashlib
import os

import pytest

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

LIMIT = 16 << 20  # the default max_message_size


def test_a_16_mib_message_goes_round_the_ring_and_one_byte_more_is_refused_naming_the_limit(cluster3):
    c = cluster3
    assert (
        c.ctl("set_policy", "--apply-to", "queues", "ha-big", r"^big\.", '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        == 0
    )
    with c.channel(0) as ch:
        ch.queue_declare("big.q", durable=True)
    c.wait_mirrored("big.q")
    body = os.urandom(LIMIT)
    with c.channel(1) as ch:
        ch.basic_publish("", "big.q", body, pika.BasicProperties(delivery_mode=2))  # confirmed by every mirror
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish("", "big.q", bytes(LIMIT + 1), pika.BasicProperties(delivery_mode=2))
        assert refused.value.reply_code == 406
        text = refused.value.reply_text
        assert f"message size {LIMIT + 1} is larger than configured max size {LIMIT}" in text
        assert "max_message_size" in text
        again = ch.connection.channel()  # the connection is still good
        again.confirm_delivery()
        again.basic_publish("", "big.q", b"small", pika.BasicProperties(delivery_mode=2))
    with c.channel(2, confirm=False) as ch:
        m, _props, got = ch.basic_get("big.q", auto_ack=True)
        assert m is not None and len(got) == LIMIT
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(body).hexdigest()
        m, _props, got = ch.basic_get("big.q", auto_ack=True)
        assert got == b"small"
        assert ch.basic_get("big.q", auto_ack=True) == (None, None, None)
