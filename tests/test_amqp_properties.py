"""Message properties (mirrorq/amqp/properties.py): the stored form is what
it was before the keys had names -- byte for byte, so old queue logs read."""

from __future__ import annotations

import msgpack
from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp import properties as P
from mirrorq.classic.backing_queue import PRIORITY_KEY
from mirrorq.packing import pack

HDR = H.ContentHeader(0, 3, C.Basic.Properties(delivery_mode=2, headers={"k": 1})).marshal()


def test_the_keys_are_the_stored_ones() -> None:
    assert (P.HEADER, P.EXCHANGE, P.ROUTING_KEY, P.PUBLISHER_REF, P.DEAD_LETTER_REF) == ("_h", "_x", "_k", "_p", "_d")
    assert (P.EXPIRATION, P.PRIORITY, P.DELIVERY_COUNT) == ("expiration", "_pr", "x-delivery-count")
    assert P.PRIORITY == PRIORITY_KEY


def test_a_publish_encodes_as_before() -> None:
    """The AMQP connection's publishes (with and without ref, expiration, priority)."""
    old = {"_h": HDR, "_x": "ex", "_k": "rk"}
    assert pack(P.encode(HDR, "ex", "rk")) == pack(old)
    old = {"_h": HDR, "_x": "", "_k": "q", "_p": ["ref", 7], "expiration": "5000", "_pr": 3}
    new = P.encode(HDR, "", "q", publisher_ref=["ref", 7], expiration="5000", priority=3)
    assert pack(new) == pack(old) and list(new) == list(old)
    assert pack(P.encode(HDR, "", "q", expiration="0", priority=0)) == pack(
        {"_h": HDR, "_x": "", "_k": "q", "expiration": "0"}
    )


def test_a_dead_letter_publish_encodes_as_before() -> None:
    old = {"_h": HDR, "_x": "dlx", "_k": "rk", "_d": ["//src/inc", 10], "_pr": 5}
    new = P.encode(HDR, "dlx", "rk", dead_letter_ref=["//src/inc", 10], priority=5)
    assert pack(new) == pack(old) and list(new) == list(old)
    old = {"_h": HDR, "_x": "dlx", "_k": "rk", "_d": ["//src/inc", 11]}
    assert pack(P.encode(HDR, "dlx", "rk", dead_letter_ref=["//src/inc", 11], priority=None)) == pack(old)


def test_an_old_record_reads() -> None:
    stored = msgpack.packb({"_h": HDR, "_x": "ex", "_k": "rk", "_p": ["r", 1]}, use_bin_type=True)
    props = msgpack.unpackb(stored, raw=False)
    assert props.get(P.HEADER) == HDR and props.get(P.EXCHANGE) == "ex" and props.get(P.ROUTING_KEY) == "rk"
    assert props.get(P.PUBLISHER_REF) == ["r", 1]
