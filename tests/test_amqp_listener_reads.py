"""The AMQP listener reads a client again in the same turn while the client
is mid-message (mirrorq.amqp.listener.AMQPListener._ready, READ_AGAIN): a
client that writes one message in several sends (pika: method, header and
body frames, one send each) costs one turn, not two."""

from __future__ import annotations

import socket

import pytest

from mirrorq.amqp import listener as L


class _Reads:
    """Stands in for the listener's RecvBuffer: hands out queued chunks,
    then would block."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.calls = 0

    def recv(self, sock):
        self.calls += 1
        if not self.chunks:
            raise BlockingIOError
        return self.chunks.pop(0)


class _FrontEnd:
    """Mid-message until it has ``need`` bytes; wants no more reads once
    it has ``block_after`` chunks (a connection blocked by a resource alarm)."""

    def __init__(self, need: int, block_after: int | None = None) -> None:
        self.need, self.got = need, []
        self.block_after = block_after

    def data(self, now, no, data):
        self.got.append(data)

    def mid_message(self, no):
        return sum(map(len, self.got)) < self.need

    def wants_read(self, no):
        return self.block_after is None or len(self.got) < self.block_after


def _listener(chunks, need, block_after=None):
    lis = object.__new__(L.AMQPListener)  # the read path only, no actor system
    a, b = socket.socketpair()
    lis.lsock = lis.tls_lsock = None
    lis.lingering = {}
    lis.clients = {a.fileno(): L._Client(7, a, "peer")}
    lis.rbuf = _Reads(chunks)
    lis.fe = _FrontEnd(need, block_after)
    lis.now = 0.0
    return lis, a, b


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_a_message_in_pieces_is_read_in_one_turn(pieces):
    lis, a, b = _listener([b"m" * 10, b"h" * 10, b"b" * 10][:pieces], need=10 * pieces)
    try:
        lis._ready([a.fileno()])
        assert lis.fe.got == [b"m" * 10, b"h" * 10, b"b" * 10][:pieces]
        assert lis.rbuf.calls == pieces  # no read after the message is whole
    finally:
        a.close()
        b.close()


def test_reads_again_at_most_read_again_times_and_stops_when_nothing_came():
    lis, a, b = _listener([b"x"] * 10, need=100)
    try:
        lis._ready([a.fileno()])
        assert lis.rbuf.calls == 1 + L.READ_AGAIN
        lis2, c, d = _listener([b"x"], need=100)
        lis2._ready([c.fileno()])
        assert lis2.fe.got == [b"x"] and lis2.rbuf.calls == 2  # the second read would block: the turn ends
        c.close()
        d.close()
    finally:
        a.close()
        b.close()


def test_a_connection_that_stops_wanting_reads_mid_message_is_not_read_again():
    """A publish's method frame blocks the connection (a resource alarm):
    its header and body wait in the socket until it is unblocked."""
    lis, a, b = _listener([b"m" * 10, b"h" * 10, b"b" * 10], need=30, block_after=1)
    try:
        lis._ready([a.fileno()])
        assert lis.fe.got == [b"m" * 10] and lis.rbuf.calls == 1
    finally:
        a.close()
        b.close()
