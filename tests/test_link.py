"""The link protocol (mirrorq.node.link) without sockets: two Link objects
wired back to back, bytes cut at arbitrary points.

One checker per guarantee of the module docstring:
* nothing is unpickled before the peer proved the secret (a wrong MAC, or
  data before the handshake, is a LinkError and no bundle comes out);
* bundles arrive whole, in order, however the stream is cut, and the
  cumulative acks release each sent bundle exactly once;
* an ack owed rides in front of the receiver's next bundle; alone, it is
  due after ACK_EVERY bundles; a sender holding MAX_UNACKED bundles has no
  room until acks come;
* an ACK for a bundle never sent on the link is a protocol violation.
"""

from __future__ import annotations

import os
import pickle
import random

import pytest

from mirrorq.node.link import ACK, ACK_EVERY, BUNDLE, MAX_FRAME, MAX_UNACKED, NONCE_LEN, Link, LinkError, frame
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
    acked = {id(a): 0, id(b): 0}
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
                cuts = (
                    sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 6))))
                    if len(data) > 1
                    else []
                )
                pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
            for p in pieces:
                r = dst.receive(p)
                ups[id(dst)] += r.up
                got[id(dst)] += r.bundles or []
                acked[id(dst)] += r.acked
        if not moved:
            return got, acked, ups
    raise AssertionError("links never went quiet")


def test_handshake_brings_both_sides_up_and_names_the_peers():
    acc, con = _pair()
    assert not acc.up and not con.up
    _got, _acks, ups = _pump(acc, con)
    assert acc.up and con.up and ups[id(acc)] == 1 and ups[id(con)] == 1
    assert acc.peer == "127.0.0.1:2000" and con.peer == "127.0.0.1:1000"


@pytest.mark.parametrize("seed", range(20))
def test_bundles_arrive_whole_in_order_and_are_released_once_however_the_stream_is_cut(seed):
    rng = random.Random(seed)
    acc, con = _pair()
    _pump(acc, con, rng)
    sent_c = [
        Bundle("c/1", i, tuple(os.urandom(rng.randint(0, 3000)) for _ in range(rng.randint(1, 5))))
        for i in range(1, 30)
    ]
    sent_a = [Bundle("a/1", i, (i, "x" * rng.randint(0, 100))) for i in range(1, 30)]
    got = {id(acc): [], id(con): []}
    acked = {id(acc): 0, id(con): 0}

    def pump():
        g, a, _ = _pump(acc, con, rng)
        for k in got:
            got[k] += g[k]
            acked[k] += a[k]

    next_a = 0
    for b1 in sent_c:
        con.send_bundle(b1)
        if rng.random() < 0.7:  # some bundles cross, some go one way only
            acc.send_bundle(sent_a[next_a])
            next_a += 1
        if rng.random() < 0.3:
            pump()
    for b2 in sent_a[next_a:]:
        acc.send_bundle(b2)
    pump()
    assert got[id(acc)] == sent_c and got[id(con)] == sent_a
    # acks still owed (nothing went back to pay them) are written alone; then nothing is held
    acc.write_ack()
    con.write_ack()
    pump()
    assert not acc.unacked and not con.unacked and acc.unacked_bytes == con.unacked_bytes == 0
    assert acked[id(con)] == len(sent_c) and acked[id(acc)] == len(sent_a)
    assert acc.owed == con.owed == 0 and not acc.write_ack()


def test_an_owed_ack_rides_in_front_of_the_next_bundle_or_is_due_after_ack_every():
    acc, con = _pair()
    _pump(acc, con)
    con.send_bundle(Bundle("c/1", 1, ("x",)))
    r = acc.receive(con.take())
    assert [b.seq for b in r.bundles] == [1] and acc.owed == 1 and not acc.ack_due()
    assert acc.take() == b""  # nothing written for the ack alone
    acc.send_bundle(Bundle("a/1", 1, ("y",)))
    out = acc.take()
    assert out.startswith(frame(ACK, (1).to_bytes(8, "big")))  # the ack first, then the bundle
    r = con.receive(out)
    assert r.acked == 1 and not con.unacked and [b.seq for b in r.bundles] == [1]
    for seq in range(2, 2 + ACK_EVERY):
        con.send_bundle(Bundle("c/1", seq, ()))
        acc.receive(con.take())
        assert acc.ack_due() == (seq - 1 >= ACK_EVERY)
    assert acc.write_ack()
    assert con.receive(acc.take()).acked == ACK_EVERY and not con.unacked


def test_a_sender_holding_max_unacked_bundles_has_no_room_until_acked():
    acc, con = _pair()
    _pump(acc, con)
    for seq in range(1, MAX_UNACKED + 1):
        assert con.room()
        con.send_bundle(Bundle("c/1", seq, ()))
    assert not con.room()
    acc.receive(con.take())
    acc.write_ack()
    assert con.receive(acc.take()).acked == MAX_UNACKED and con.room()


def test_an_ack_for_a_bundle_never_sent_is_refused():
    acc, con = _pair()
    _pump(acc, con)
    con.send_bundle(Bundle("c/1", 5, ()))
    assert con.receive(frame(ACK, (3).to_bytes(8, "big"))).acked == 0  # an old ack: nothing to release
    with pytest.raises(LinkError, match="never sent"):
        con.receive(frame(ACK, (6).to_bytes(8, "big")))


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
