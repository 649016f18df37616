"""The link shell (LinkSockets with PostingActor's transmit logic) on real
socket pairs, without an actor system: the cases where a pipelined link
meets a break.

One checker per promise of mirrorq.node.posting / mirrorq.outbox:
* a transmit on a link is done once written, up to MAX_UNACKED bundles; the
  next one waits for acks;
* a waiting transmit that an ack covered is done even if the link breaks
  before it is reported (the outbox never stalls);
* a transmit reported done and then handed back by a break is replayed, not
  completed twice (a stale "done" must not release its successor early);
* a bundle too big for a frame does not overtake what the link holds;
* whatever breaks, the receiver ends up with every message once, in order.
"""

from __future__ import annotations

import os
import socket

import pytest

from mirrorq.node import link as link_mod
from mirrorq.node import posting as P
from mirrorq.node.link import ACK, MAX_UNACKED, NONCE_LEN, Link, frame
from mirrorq.outbox import Inbox, Outbox

KEY = b"k" * 32


class _Ref:
    def __init__(self, actor: _Actor) -> None:
        self.actor = actor

    def _send_intent(self, intent) -> None:
        self.actor.thespian.append(intent)


class _Actor:
    """PostingActor's transmit half, with Thespian's transport replaced by a list."""

    _done = P.PostingActor._done
    _replay = P.PostingActor._replay
    _transmit = P.PostingActor._transmit
    _transmit_ready = P.PostingActor._transmit_ready
    _links_done = P.PostingActor._links_done
    clock = staticmethod(lambda: 0.0)

    def __init__(self) -> None:
        self._outbox = Outbox("S:1/x")
        self._in_turn = False
        self._retry_armed = None
        self.thespian: list = []
        self._myRef = _Ref(self)
        self.timers: list = []
        self.now = 0.0

    def _addr(self, dst):
        return dst

    def wakeupAfter(self, delay, payload=None) -> None:
        self.timers.append(payload)

    def link_event(self, *a, **kw) -> None:
        pass

    def transmit_failed(self, dst, dead) -> None:
        pass

    def outbox_gave_up(self, dst) -> None:
        pass

    def _arm_retry(self) -> None:
        pass


class _Receiver:
    """The far end: a Link over the other half of the socket pair, an Inbox."""

    def __init__(self, sock: socket.socket, lk: Link) -> None:
        self.sock, self.link, self.inbox, self.got = sock, lk, Inbox(), []

    def read(self) -> list:
        data = b""
        while True:
            try:
                chunk = self.sock.recv(1 << 24)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        bundles = self.link.receive(data).bundles or []
        for b in bundles:
            self.accept(b)
        return bundles

    def accept(self, b) -> None:
        if self.inbox.accept(b):
            self.got.extend(b.msgs)


class _Full:
    """A socket whose send buffer is full (every send would block)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data) -> int:
        raise BlockingIOError

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _pair():
    actor = _Actor()
    links = P.LinkSockets(actor, "127.0.0.1", "S:1", [KEY])
    actor._links = links
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    c = P._Conn(a, Link("S:1", [KEY], connector=False, nonce=os.urandom(NONCE_LEN)), None, 0.0)
    links.conns[c.fd] = c
    far = Link("R:1", [KEY], connector=True, nonce=os.urandom(NONCE_LEN))
    links._flush(c)  # GREET
    far.receive(b.recv(1 << 16))
    b.send(far.take())  # HELLO
    links.ready([c.fd], 0.0)
    far.receive(b.recv(1 << 16))  # WELCOME
    assert c.link.up and far.up and links.send_on["R:1"] is c
    return actor, links, c, _Receiver(b, far)


def _post(actor: _Actor, n: int, start: int = 0) -> None:
    """n posts, each transmitted at once (as n turns would)."""
    for i in range(start, start + n):
        actor._outbox.post("R:1", i)
        actor._transmit_ready()


def _finish(actor: _Actor, rcv: _Receiver) -> None:
    """Let Thespian deliver everything in flight, in order, until the outbox is idle."""
    for _ in range(1000):
        if not actor.thespian:
            break
        intent = actor.thespian.pop(0)
        rcv.accept(intent.message)
        intent.tx_done(P.SendStatus.Sent)
    assert actor._outbox.busy() == 0 and not actor.thespian


def test_transmits_are_done_once_written_until_the_link_holds_max_unacked():
    actor, links, c, rcv = _pair()
    _post(actor, MAX_UNACKED)
    ob = actor._outbox.links["R:1"]
    assert ob.inflight is not None and ob.inflight.seq == MAX_UNACKED and c.waiting == MAX_UNACKED
    assert len(c.link.unacked) == MAX_UNACKED and not actor.thespian  # all on the link, none waited for an ack
    _post(actor, 1, start=MAX_UNACKED)
    assert len(ob.pending) == 1  # the next waits for room
    rcv.read()
    rcv.link.write_ack()
    rcv.sock.send(rcv.link.take())
    links.ready([c.fd], 0.0)
    actor._links_done()
    # the ack released the waiting one, and its successor left on the link and is done too
    assert [b.seq for b, _n, _t in c.link.unacked] == [MAX_UNACKED + 1] and c.waiting is None
    assert ob.inflight is None and not ob.pending
    rcv.read()
    assert rcv.got == list(range(MAX_UNACKED + 1))


def test_a_waiting_transmit_acked_just_before_a_break_is_done_and_the_outbox_goes_on():
    actor, links, c, rcv = _pair()
    _post(actor, MAX_UNACKED)
    assert c.waiting == MAX_UNACKED
    rcv.read()
    c.sock = _Full(c.sock)  # our socket's send buffer is full from here on
    c.link.out += b"\0\0"  # a tail of a partly written frame of ours: the waiting transmit cannot settle
    rcv.sock.send(frame(ACK, MAX_UNACKED.to_bytes(8, "big")))
    links.ready([c.fd], 0.0)
    assert not c.link.unacked and c.waiting == MAX_UNACKED  # acked, but its bytes' flush is pending
    rcv.sock.close()  # the link breaks before the write timer
    links.ready([c.fd], 0.0)
    actor._links_done()
    assert c.fd not in links.conns
    _post(actor, 1, start=MAX_UNACKED)
    assert [i.message.msgs for i in actor.thespian] == [(MAX_UNACKED,)]  # not stuck behind a lost transmit
    rcv.accept(actor.thespian[0].message)
    assert rcv.got == list(range(MAX_UNACKED + 1))


def test_a_transmit_done_then_handed_back_by_a_break_is_replayed_not_completed_twice(monkeypatch):
    actor, links, c, rcv = _pair()
    _post(actor, MAX_UNACKED)
    _post(actor, 1, start=MAX_UNACKED)  # waits behind the full link
    rcv.read()
    # one read brings acks that make room (the waiting transmit is done) and then EOF
    monkeypatch.setattr(P, "READ_CHUNK", 26)  # two ACK frames fill a "chunk": the loop reads on and meets EOF
    rcv.sock.send(frame(ACK, (MAX_UNACKED - 2).to_bytes(8, "big")) + frame(ACK, (MAX_UNACKED - 1).to_bytes(8, "big")))
    rcv.sock.close()
    links.ready([c.fd], 0.0)
    actor._links_done()
    ob = actor._outbox.links["R:1"]
    # the replay of the unacknowledged one is in flight through Thespian, and nothing overtook it
    assert [i.message.seq for i in actor.thespian] == [MAX_UNACKED]
    assert ob.inflight.seq == MAX_UNACKED and len(ob.pending) == 1
    actor.thespian.pop(0).tx_done(P.SendStatus.Failed)  # that transmit fails: it must come again
    assert ob.inflight.seq == MAX_UNACKED and ob.retry_at is not None
    for _dst, b in actor._outbox.due(ob.retry_at):
        actor._transmit("R:1", b)
    _finish(actor, rcv)
    assert rcv.got == list(range(MAX_UNACKED + 1))


def test_a_bundle_too_big_for_a_frame_does_not_overtake_what_the_link_holds(monkeypatch):
    actor, links, c, rcv = _pair()
    _post(actor, 3)
    assert len(c.link.unacked) == 3
    monkeypatch.setattr(link_mod, "MAX_FRAME", 200)
    actor._outbox.post("R:1", "x" * 500)
    actor._transmit_ready()
    assert c.fd not in links.conns  # closed: the held bundles and the big one leave in order
    assert [i.message.seq for i in actor.thespian] == [1]
    _finish(actor, rcv)
    rcv.read()  # what the link carried arrives late: dropped as duplicates
    assert rcv.got == [0, 1, 2, "x" * 500]


@pytest.mark.parametrize("seed", range(30), ids=lambda s: f"seed={s}")
def test_breaks_at_random_lose_repeat_and_reorder_nothing(seed):
    import random

    rng = random.Random(seed)
    actor, links, c, rcv = _pair()
    n = 0
    for _round in range(rng.randint(1, 4)):
        k = rng.randint(1, 2 * MAX_UNACKED)
        _post(actor, k, start=n)
        n += k
        if rng.random() < 0.5:
            rcv.read()
            if rng.random() < 0.5:
                rcv.link.write_ack()
                rcv.sock.send(rcv.link.take())
                links.ready([c.fd], 0.0)
                actor._links_done()
    rcv.sock.close()
    if c.fd in links.conns:
        links.ready([c.fd], 0.0)
        actor._links_done()
    _finish(actor, rcv)
    assert rcv.got == list(range(n))


def test_an_actor_that_closed_its_links_offers_none():
    actor, links, _c, _rcv = _pair()
    assert links.listen_port() > 0
    links.close_all()
    assert links.listen_port() == 0


def test_recv_buffer_reads_what_recv_reads_and_keeps_nothing_of_it():
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        rb = P.RecvBuffer(8)
        with pytest.raises(BlockingIOError):
            rb.recv(b)
        a.sendall(b"0123456789abc")
        first = rb.recv(b)
        assert first == b"01234567" and type(first) is bytes
        second = rb.recv(b)  # the same buffer again: the first result must not change
        assert second == b"89abc" and first == b"01234567"
        with pytest.raises(BlockingIOError):
            rb.recv(b)
        a.close()
        assert rb.recv(b) == b""
    finally:
        a.close()
        b.close()
