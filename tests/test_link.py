"""The link protocol (mirrorq.node.link) without sockets: two Link objects
wired back to back, bytes cut at arbitrary points.

One checker per guarantee of the module docstring:
* nothing is unpickled before the peer proved the secret (a wrong MAC, or
  data before the handshake, is a LinkError and no bundle comes out);
* bundles arrive whole, in order, each acknowledged once by its sequence
  number, however the stream is cut.
"""

from __future__ import annotations

import os
import pickle
import random

import pytest

from mirrorq.node.link import ACK, BUNDLE, MAX_FRAME, NONCE_LEN, Link, LinkError, frame
from mirrorq.outbox import Bundle

KEY = b"k" * 32


def _pair(akey=KEY, ckey=KEY):
    acc = Link("127.0.0.1:1000", [akey], connector=False, nonce=os.urandom(NONCE_LEN))
    con = Link("127.0.0.1:2000", [ckey], connector=True, nonce=os.urandom(NONCE_LEN))
    return acc, con


def _pump(a: Link, b: Link, rng: random.Random | None = None):
    """Move bytes both ways until quiet, cut into random pieces; returns what
    each side received, merged."""
    got = {id(a): [], id(b): []}
    acks = {id(a): [], id(b): []}
    ups = {id(a): 0, id(b): 0}
    for _ in range(100):
        moved = False
        for src, dst in ((a, b), (b, a)):
            data = src.take()
            if not data:
                continue
            moved = True
            pieces = [data]
            if rng is not None:
                cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 6)))) if len(data) > 1 else []
                pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
            for p in pieces:
                r = dst.receive(p)
                ups[id(dst)] += r.up
                got[id(dst)] += r.bundles or []
                acks[id(dst)] += r.acks or []
        if not moved:
            return got, acks, ups
    raise AssertionError("links never went quiet")


def test_handshake_brings_both_sides_up_and_names_the_peers():
    acc, con = _pair()
    assert not acc.up and not con.up
    _got, _acks, ups = _pump(acc, con)
    assert acc.up and con.up and ups[id(acc)] == 1 and ups[id(con)] == 1
    assert acc.peer == "127.0.0.1:2000" and con.peer == "127.0.0.1:1000"


@pytest.mark.parametrize("seed", range(20))
def test_bundles_arrive_whole_in_order_and_are_acked_however_the_stream_is_cut(seed):
    rng = random.Random(seed)
    acc, con = _pair()
    _pump(acc, con, rng)
    sent_c = [Bundle("c/1", i, tuple(os.urandom(rng.randint(0, 3000)) for _ in range(rng.randint(1, 5))))
              for i in range(1, 30)]
    sent_a = [Bundle("a/1", i, (i, "x" * rng.randint(0, 100))) for i in range(1, 30)]
    for b1, b2 in zip(sent_c, sent_a):
        con.send_bundle(b1)
        acc.send_bundle(b2)
    got, acks, _ = _pump(acc, con, rng)
    assert got[id(acc)] == sent_c and got[id(con)] == sent_a
    assert acks[id(con)] == [b.seq for b in sent_c] and acks[id(acc)] == [b.seq for b in sent_a]


def test_a_connector_without_the_secret_is_refused_before_anything_is_unpickled(tmp_path):
    acc, con = _pair(ckey=b"w" * 32)
    con.receive(acc.take())  # GREET -> HELLO (with the wrong key's MAC)
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    hostile = con.take() + frame(BUNDLE, pickle.dumps(Boom()))  # a bundle right behind its HELLO
    with pytest.raises(LinkError, match="without the cluster secret"):
        acc.receive(hostile)
    assert not acc.up and not marker.exists()


def test_an_acceptor_without_the_secret_is_refused_by_the_connector():
    acc, con = _pair(akey=b"w" * 32)
    con.receive(acc.take())
    with pytest.raises(LinkError):  # the acceptor cannot check HELLO: the connector never sees WELCOME
        acc.receive(con.take())
    assert not con.up
    # an acceptor that answers anyway with a forged WELCOME is refused too
    acc2, con2 = _pair()
    con2.receive(acc2.take())
    with pytest.raises(LinkError, match="WELCOME"):
        con2.receive(frame(3, b"\0" * 32))
    assert not con2.up


def test_data_before_the_handshake_is_refused():
    acc, _con = _pair()
    with pytest.raises(LinkError, match="before the handshake"):
        acc.receive(frame(BUNDLE, pickle.dumps(Bundle("x", 1, ()))))
    acc2, _ = _pair()
    with pytest.raises(LinkError, match="before the handshake"):
        acc2.receive(frame(ACK, b"\0" * 8))


def test_malformed_frames_are_refused():
    acc, con = _pair()
    _pump(acc, con)
    with pytest.raises(LinkError, match="unknown frame type"):
        acc.receive(b"\0\0\0\x01\x09")
    acc, con = _pair()
    _pump(acc, con)
    with pytest.raises(LinkError, match="out of range"):
        acc.receive((MAX_FRAME + 1).to_bytes(4, "big") + bytes([BUNDLE]))
    acc, con = _pair()
    _pump(acc, con)
    with pytest.raises(LinkError, match="malformed ACK"):
        acc.receive(frame(ACK, b"\0"))
    with pytest.raises(LinkError, match="not up"):
        Link("a:1", [KEY], connector=True, nonce=os.urandom(NONCE_LEN)).send_bundle(Bundle("x", 1, ()))


def test_a_link_needs_the_secret_and_a_nonce():
    with pytest.raises(ValueError, match="secret"):
        Link("a:1", [], connector=True, nonce=os.urandom(NONCE_LEN))
    with pytest.raises(ValueError, match="nonce"):
        Link("a:1", [KEY], connector=False, nonce=b"short")
