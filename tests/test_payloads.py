"""The classic queue's GM payloads (mirrorq.classic.payloads): one
encode/decode table, the encoded forms GM carries, and clear errors for
what the table does not know."""

from __future__ import annotations

import msgpack
import pytest

from mirrorq.classic import payloads as pl
from mirrorq.classic.promotion import Cutoff, Elect, Ready, Report
from mirrorq.packing import pack

CASES = [
    (
        pl.Ops([[0, 1, ["m", b"x", {}, True]]], [[["c", 1], 3]], [], [[["c", 1], [3]]]),
        ["ops", [[0, 1, ["m", b"x", {}, True]]], [[["c", 1], 3]], [], [[["c", 1], [3]]]],
    ),
    (pl.Promoted("n1/h:1/a", "h:1"), ["promoted", "n1/h:1/a", "h:1"]),
    (pl.Synced("n2/h:2/b"), ["synced", "n2/h:2/b"]),
    (pl.Leaving("n2/h:2/b"), ["leaving", "n2/h:2/b"]),
    (pl.Leaving("n1/h:1/a", "n2/h:2/b"), ["leaving", "n1/h:1/a", "n2/h:2/b"]),
    (pl.Deleted("auto-delete"), ["deleted", "auto-delete"]),
    (Report(3, {"n0/h:0/z": 7}, True), ["report", 3, {"n0/h:0/z": 7}, True]),
    (Cutoff(3, {"n0/h:0/z": 8}), ["cutoff", 3, {"n0/h:0/z": 8}]),
    (Ready(3), ["ready", 3]),
    (Elect(3, "n2/h:2/b"), ["elect", 3, "n2/h:2/b"]),
]


@pytest.mark.parametrize(("payload", "encoded"), CASES, ids=[c[1][0] + str(len(c[1])) for c in CASES])
def test_each_kind_encodes_as_gm_carries_it_and_decodes_back_across_the_wire(payload, encoded):
    assert pl.encode(payload) == encoded
    # through msgpack as GM's codec decodes it on another node: lists arrive as tuples
    got = pl.decode(msgpack.unpackb(pack(pl.encode(payload)), raw=False, use_list=False, strict_map_key=False))
    assert type(got) is type(payload) and _lists(pl.encode(got)) == encoded


def _lists(x):
    """``x`` with its tuples as lists (what the sender encoded)."""
    if isinstance(x, (list, tuple)):
        return [_lists(i) for i in x]
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (["frobnicate", 1], "unknown classic queue payload 'frobnicate'"),
        (["ready"], "payload 'ready' takes 1..1 fields, got 0"),
        (["leaving", "a", "b", "c"], "payload 'leaving' takes 1..2 fields, got 3"),
        ([], "a classic queue payload is [name, fields...]"),
        ("ops", "a classic queue payload is [name, fields...]"),
    ],
)
def test_what_the_table_does_not_know_is_a_bad_payload_naming_it(raw, says):
    with pytest.raises(pl.BadPayload, match=None) as e:
        pl.decode(raw)
    assert says in str(e.value)


def test_encoding_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="not a classic queue payload"):
        pl.encode(["ops", [], [], [], []])
