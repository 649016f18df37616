"""The Spark client's own decoding of range-read frames (basic.deliver, content
headers) gives what pamqp's generic unmarshalling gives."""

from __future__ import annotations

import datetime as dt

import pytest
from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp.client import decode_deliver, decode_properties

PROPS = [
    C.Basic.Properties(),
    C.Basic.Properties(delivery_mode=2, headers={"x-stream-offset": 42}),
    C.Basic.Properties(
        content_type="application/json",
        content_encoding="gzip",
        headers={"x-stream-offset": 7, "k": "v", "n": 1.5, "nested": {"a": [1, "b"]}},
        delivery_mode=1,
        priority=9,
        correlation_id="corr",
        reply_to="amq.rabbitmq.reply-to",
        expiration="60000",
        message_id="m-1",
        timestamp=dt.datetime(2026, 11, 29, 20, 0, 5, tzinfo=dt.UTC),
        message_type="order",
        user_id="guest",
        app_id="app",
    ),
]


@pytest.mark.parametrize("props", PROPS, ids=["empty", "offset", "all"])
def test_content_header_decodes_as_pamqp_does(props):
    raw = H.ContentHeader(0, 1234, props).marshal()
    size, got = decode_properties(raw)
    want = H.ContentHeader()
    want.unmarshal(raw)
    assert size == 1234 == want.body_size
    for name in want.properties.__slots__:
        expected = getattr(want.properties, name)
        if name == "cluster_id" and expected == "":
            expected = None  # pamqp's default for an absent (deprecated) cluster-id
        assert getattr(got, name) == expected, name


def test_deliver_decodes_as_pamqp_does():
    m = C.Basic.Deliver("ctag-1", 2**40 + 3, True, "ex", "rk.é")
    payload = m.marshal()
    head = b"\x00\x3c\x00\x3c"
    assert decode_deliver(head + payload) == ("ctag-1", 2**40 + 3, True, "ex", "rk.é")
    assert decode_deliver(head + C.Basic.Deliver("t", 1, False, "", "q").marshal()) == ("t", 1, False, "", "q")


def _slow_with_header(raw, size, key, value):
    hdr = H.ContentHeader(0, size, C.Basic.Properties())
    if raw is not None:
        hdr.unmarshal(raw)
    headers = dict(hdr.properties.headers or {})
    headers[key] = value
    hdr.properties.headers = headers
    hdr.body_size = size
    return hdr.marshal()


def _decoded(raw):
    h = H.ContentHeader()
    h.unmarshal(raw)
    return h.body_size, {n: getattr(h.properties, n) for n in h.properties.__slots__}


@pytest.mark.parametrize("props", PROPS + [C.Basic.Properties(content_type="t", headers={"a": 1})], ids=str)
@pytest.mark.parametrize("value", [0, 7, 300, 2**31 + 5, 2**40])
def test_offset_header_spliced_as_decoding_and_encoding_does(props, value):
    """The front end's fast path of with_header (the table entry appended in
    place) decodes to what decoding, setting and re-encoding gives (pamqp
    sorts a table's keys; the appended entry comes last)."""
    from mirrorq.amqp.stream import _splice_header, with_header

    raw = H.ContentHeader(0, 99, props).marshal()
    want = _decoded(_slow_with_header(raw, 1234, "x-delivery-count", value))
    spliced = _splice_header(raw, 1234, "x-delivery-count", value)
    assert spliced is not None and _decoded(spliced) == want
    assert _decoded(with_header(raw, 1234, "x-delivery-count", value)) == want
    # a table that may hold the key already takes the decoding path
    if props.headers and "x-stream-offset" in props.headers:
        assert _splice_header(raw, 1234, "x-stream-offset", value) is None
        assert with_header(raw, 1234, "x-stream-offset", value) == _slow_with_header(
            raw, 1234, "x-stream-offset", value
        )
    assert with_header(None, 5, "x-stream-offset", value) == _slow_with_header(None, 5, "x-stream-offset", value)
