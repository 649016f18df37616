"""PollOnce: the selector Thespian's TCP loop uses in node processes
(mirrorq.node.loop_select) answers as ``selectors`` would for what the loop
asks of it."""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time

import pytest

from mirrorq.node import loop_select
from mirrorq.node.loop_select import EVENT_READ, EVENT_WRITE, PollOnce


def _pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def _ready(sel_cls, reads, writes, timeout):
    sel = sel_cls()
    for s in reads:
        sel.register(s.fileno(), EVENT_READ)
    for s in writes:
        sel.register(s.fileno(), EVENT_WRITE)
    out = sorted((key.fd, ev) for key, ev in sel.select(timeout))
    sel.close()
    return out


@pytest.mark.parametrize("case", ["idle", "readable", "writable", "both", "hung_up"])
def test_answers_as_the_default_selector(case):
    a, b = _pair()
    c, d = _pair()
    try:
        reads, writes = [a, c], []
        if case in ("readable", "both"):
            b.send(b"x")
        if case in ("writable", "both"):
            writes = [d]
        if case == "hung_up":
            b.close()
        got = _ready(PollOnce, reads, writes, 0)
        want = _ready(selectors.DefaultSelector, reads, writes, 0)
        assert got == want
        if case == "idle":
            assert got == []
        elif case == "readable":
            assert got == [(a.fileno(), EVENT_READ)]
        elif case == "writable":
            assert got == [(d.fileno(), EVENT_WRITE)]
    finally:
        for s in (a, b, c, d):
            s.close()


def test_timeouts_wait_and_none_blocks_until_ready():
    a, b = _pair()
    try:
        t = time.monotonic()
        assert _ready(PollOnce, [a], [], 0.05) == []
        assert time.monotonic() - t >= 0.045
        b.send(b"x")
        assert _ready(PollOnce, [a], [], None) == [(a.fileno(), EVENT_READ)]
    finally:
        a.close()
        b.close()


def test_a_descriptor_registered_twice_is_watched_for_both():
    a, b = _pair()
    try:
        b.send(b"x")
        sel = PollOnce()
        sel.register(a.fileno(), EVENT_READ)
        sel.register(a, EVENT_WRITE)  # a file object works too
        assert [(k.fd, ev) for k, ev in sel.select(0)] == [(a.fileno(), EVENT_READ | EVENT_WRITE)]
    finally:
        a.close()
        b.close()


def test_a_closed_descriptor_raises_ebadf_as_the_loop_expects():
    a, b = _pair()
    fd = a.fileno()
    a.close()
    b.close()
    sel = PollOnce()
    sel.register(fd, EVENT_READ)
    with pytest.raises(OSError) as e:
        sel.select(0)
    assert e.value.errno == errno.EBADF


def test_bad_registrations_are_refused():
    sel = PollOnce()
    with pytest.raises(ValueError, match="invalid file descriptor"):
        sel.register(-1, EVENT_READ)
    with pytest.raises(ValueError, match="invalid events"):
        sel.register(0, 0)


def test_install_puts_it_in_thespians_tcp_transport(monkeypatch):
    import thespian.system.transport.TCPTransport as tcp

    monkeypatch.setattr(tcp, "selectors", selectors)
    monkeypatch.delenv("MIRRORQ_EPOLL_LOOP", raising=False)
    loop_select.install()
    assert tcp.selectors.DefaultSelector is PollOnce
    assert (tcp.selectors.EVENT_READ, tcp.selectors.EVENT_WRITE) == (selectors.EVENT_READ, selectors.EVENT_WRITE)
    monkeypatch.setattr(tcp, "selectors", selectors)
    monkeypatch.setenv("MIRRORQ_EPOLL_LOOP", "1")
    loop_select.install()
    assert tcp.selectors is selectors


def test_thespians_fd_check_finds_a_bad_descriptor(monkeypatch):
    """TCPTransport._check_fd (how the loop finds which watched descriptor
    went bad) raises for a closed one and not for an open one."""
    import thespian.system.transport.TCPTransport as tcp

    monkeypatch.setattr(tcp, "selectors", loop_select.SELECTORS)
    r, w = os.pipe()
    tcp.TCPTransport._check_fd(r)
    os.close(r)
    os.close(w)
    with pytest.raises(OSError):
        tcp.TCPTransport._check_fd(r)
