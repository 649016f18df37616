"""The connection's and channels' transition tables (mirrorq/amqp/states.py)
against the connection core: every (state, event) pair of each table leads
where the table says, and every client event a state's row does not have
gets the error the refusal table names (or is ignored)."""

from __future__ import annotations

from typing import Any

import pytest
from amqp_harness import Harness
from pamqp import commands as C

from mirrorq.amqp import framing
from mirrorq.amqp.errors import amqp_error
from mirrorq.amqp.states import (
    CHANNEL_FRAME_REFUSAL,
    CHANNEL_REFUSALS,
    CHANNEL_TRANSITIONS,
    CONNECTION_REFUSALS,
    CONNECTION_TRANSITIONS,
    MODE_REFUSALS,
    MODE_TRANSITIONS,
    ChanEvent,
    ChanMode,
    ChanState,
    ConnEvent,
    ConnState,
    ModeEvent,
)

BAD_FRAME = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # a method frame on channel 0 not ending in 0xCE: 501


def conn_at(state: ConnState) -> Harness:
    h = Harness()
    steps = [
        (ConnState.START_SENT, lambda: h.send_raw(framing.PROTOCOL_HEADER)),
        (ConnState.TUNE_SENT, lambda: h.send(0, C.Connection.StartOk(response="\0guest\0guest"))),
        (ConnState.AWAIT_OPEN, lambda: h.send(0, C.Connection.TuneOk(2047, 131072, 0))),
        (ConnState.OPEN, lambda: h.send(0, C.Connection.Open("/"))),
        (ConnState.CLOSING, lambda: h.send_raw(BAD_FRAME)),
    ]
    if state is ConnState.CLOSED:
        h.conn.connection_lost(h.now)
    for reached, step in steps:
        if h.conn.state is state:
            break
        step()
        assert h.conn.state is reached
    assert h.conn.state is state
    h.frames()
    return h


CONN_METHODS: dict[ConnEvent, Any] = {
    ConnEvent.START_OK: C.Connection.StartOk(response="\0guest\0guest"),
    ConnEvent.TUNE_OK: C.Connection.TuneOk(2047, 131072, 0),
    ConnEvent.OPEN: C.Connection.Open("/"),
    ConnEvent.CLOSE: C.Connection.Close(200, "bye", 0, 0),
    ConnEvent.CLOSE_OK: C.Connection.CloseOk(),
    ConnEvent.BLOCKED: C.Connection.Blocked("low on memory"),
    ConnEvent.UPDATE_SECRET: C.Connection.UpdateSecret("token", "refresh"),
    ConnEvent.METHOD: C.Basic.Qos(prefetch_count=1),
}


def _boom() -> None:
    raise amqp_error(541, "boom")


def fire(h: Harness, ev: ConnEvent) -> None:
    if ev is ConnEvent.HEADER:
        h.send_raw(framing.PROTOCOL_HEADER)
    elif ev is ConnEvent.CHANNEL_FRAME:
        h.send(1, C.Channel.Open())
    elif ev is ConnEvent.ERROR:
        if h.conn.state is ConnState.AWAIT_HEADER:  # no frames are read yet: an internal error
            h.conn._guarded(h.now, _boom)
            h._run(h.conn._flush(h.now))
        else:
            h.send_raw(BAD_FRAME)
    elif ev is ConnEvent.TRANSPORT_CLOSED:
        h._run(h.conn.connection_lost(h.now))
    else:
        h.send(0, CONN_METHODS[ev])


@pytest.mark.parametrize("state,event", sorted(CONNECTION_TRANSITIONS, key=lambda k: (k[0].value, k[1].name)))
def test_connection_transition(state: ConnState, event: ConnEvent) -> None:
    h = conn_at(state)
    fire(h, event)
    assert h.conn.state is CONNECTION_TRANSITIONS[state, event]


CLIENT_EVENTS = [e for e in ConnEvent if e not in (ConnEvent.ERROR, ConnEvent.TRANSPORT_CLOSED, ConnEvent.HEADER)]
REFUSED = [
    (s, e)
    for s in (ConnState.START_SENT, ConnState.TUNE_SENT, ConnState.AWAIT_OPEN, ConnState.OPEN, ConnState.CLOSING)
    for e in CLIENT_EVENTS
    if (s, e) not in CONNECTION_TRANSITIONS
]


@pytest.mark.parametrize("state,event", REFUSED)
def test_connection_event_outside_the_table(state: ConnState, event: ConnEvent) -> None:
    h = conn_at(state)
    fire(h, event)
    refusal = CONNECTION_REFUSALS[state]
    if refusal is None:  # ignored
        assert h.conn.state is state and h.frames() == []
        return
    code, _ = refusal
    closes = [v for _, v in h.frames() if isinstance(v, C.Connection.Close)]
    assert h.conn.state is ConnState.CLOSING and [c.reply_code for c in closes] == [code]
    if event is ConnEvent.CHANNEL_FRAME:
        assert closes[0].reply_text.endswith(CHANNEL_FRAME_REFUSAL.format(channel=1))
    else:
        assert closes[0].reply_text.endswith(f"on channel 0 in state '{state.value}'")
    assert code == (503 if state is ConnState.OPEN else 504)


def test_no_state_is_left_out_of_the_tables() -> None:
    assert {s for s, _ in CONNECTION_TRANSITIONS} | {ConnState.CLOSED} == set(ConnState)
    assert set(CONNECTION_TRANSITIONS.values()) | {ConnState.AWAIT_HEADER} == set(ConnState)
    assert set(CONNECTION_REFUSALS) == set(ConnState)
    for s in ChanState:
        for e in ChanEvent:
            assert ((s, e) in CHANNEL_TRANSITIONS) != ((s, e) in CHANNEL_REFUSALS), (s, e)
    for m in ChanMode:
        for me in ModeEvent:
            assert ((m, me) in MODE_TRANSITIONS) != ((m, me) in MODE_REFUSALS), (m, me)


# ---- channels ------------------------------------------------------------------------------------
def chan_at(state: ChanState) -> Harness:
    h = conn_at(ConnState.OPEN)
    if state is not ChanState.CLOSED:
        h.open_channel(1)
    if state is ChanState.CLOSING:
        h.send(1, C.Basic.Ack(delivery_tag=99))  # 406 unknown delivery tag
        assert [type(v) for _, v in h.frames()] == [C.Channel.Close]
    assert chan_state(h) is state
    return h


def chan_state(h: Harness) -> ChanState:
    ch = h.conn.chans.get(1)
    return ChanState.CLOSED if ch is None else ch.state


CHAN_METHODS: dict[ChanEvent, Any] = {
    ChanEvent.OPEN: C.Channel.Open(),
    ChanEvent.CLOSE: C.Channel.Close(200, "bye", 0, 0),
    ChanEvent.CLOSE_OK: C.Channel.CloseOk(),
    ChanEvent.METHOD: C.Basic.Qos(prefetch_count=1),
    ChanEvent.ERROR: C.Basic.Ack(delivery_tag=99),  # on an open channel: 406
}


@pytest.mark.parametrize("state,event", sorted(CHANNEL_TRANSITIONS, key=lambda k: (k[0].value, k[1].name)))
def test_channel_transition(state: ChanState, event: ChanEvent) -> None:
    h = chan_at(state)
    h.send(1, CHAN_METHODS[event])
    assert chan_state(h) is CHANNEL_TRANSITIONS[state, event]
    want = {
        ChanEvent.OPEN: [C.Channel.OpenOk],
        ChanEvent.CLOSE: [C.Channel.CloseOk],
        ChanEvent.CLOSE_OK: [],
        ChanEvent.METHOD: [C.Basic.QosOk],
        ChanEvent.ERROR: [C.Channel.Close],
    }[event]
    assert [type(v) for _, v in h.frames()] == want
    assert h.conn.state is ConnState.OPEN


@pytest.mark.parametrize("state,event", sorted(CHANNEL_REFUSALS, key=lambda k: (k[0].value, k[1].name)))
def test_channel_event_outside_the_table(state: ChanState, event: ChanEvent) -> None:
    h = chan_at(state)
    if event is ChanEvent.ERROR:  # not a client's frame: a channel error the connection raises
        ch = h.conn.chans.get(1)
        if ch is not None:
            h.conn._channel_error(h.now, ch, amqp_error(406, "again"))
            h._run(h.conn._flush(h.now))
    else:
        h.send(1, CHAN_METHODS[event])
    refusal = CHANNEL_REFUSALS[state, event]
    if refusal is None:  # ignored
        assert chan_state(h) is state and h.frames() == [] and h.conn.state is ConnState.OPEN
        return
    code, text = refusal
    closes = [v for _, v in h.frames() if isinstance(v, C.Connection.Close)]
    assert [c.reply_code for c in closes] == [code] and closes[0].reply_text.endswith(text.format(channel=1))
    assert h.conn.state is ConnState.CLOSING


# ---- confirm / tx mode ---------------------------------------------------------------------------
MODE_METHODS = {
    ModeEvent.CONFIRM_SELECT: (C.Confirm.Select(), C.Confirm.SelectOk),
    ModeEvent.TX_SELECT: (C.Tx.Select(), C.Tx.SelectOk),
    ModeEvent.TX_COMMIT: (C.Tx.Commit(), C.Tx.CommitOk),
    ModeEvent.TX_ROLLBACK: (C.Tx.Rollback(), C.Tx.RollbackOk),
}


def mode_at(mode: ChanMode) -> Harness:
    h = chan_at(ChanState.OPEN)
    if mode is ChanMode.CONFIRM:
        h.send(1, C.Confirm.Select())
    elif mode is ChanMode.TX:
        h.send(1, C.Tx.Select())
    h.frames()
    assert h.conn.chans[1].mode is mode
    return h


@pytest.mark.parametrize("mode,event", sorted(MODE_TRANSITIONS, key=lambda k: (k[0].name, k[1].name)))
def test_mode_transition(mode: ChanMode, event: ModeEvent) -> None:
    h = mode_at(mode)
    method, ok = MODE_METHODS[event]
    h.send(1, method)
    assert [type(v) for _, v in h.frames()] == [ok]
    assert h.conn.chans[1].mode is MODE_TRANSITIONS[mode, event]


@pytest.mark.parametrize("mode,event", sorted(MODE_REFUSALS, key=lambda k: (k[0].name, k[1].name)))
def test_mode_event_outside_the_table(mode: ChanMode, event: ModeEvent) -> None:
    h = mode_at(mode)
    h.send(1, MODE_METHODS[event][0])
    code, text = MODE_REFUSALS[mode, event]
    closes = [v for _, v in h.frames()]
    assert [(type(c), c.reply_code) for c in closes] == [(C.Channel.Close, code)]
    assert closes[0].reply_text == f"PRECONDITION_FAILED - {text}"
    assert chan_state(h) is ChanState.CLOSING and h.conn.state is ConnState.OPEN
