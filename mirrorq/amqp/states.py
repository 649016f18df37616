"""The AMQP connection's and channels' states, as transition tables.

After h11's ``_state.py``: explicit states, events in, ONE table per
machine mapping ``(state, event)`` to the next state, and an error for an
event the table does not have -- the error RabbitMQ gives, or nothing
(the event is ignored) where RabbitMQ ignores it.  The tables say what may
happen; :class:`~mirrorq.amqp.connection.Connection` does what each
transition means (the frames it answers with) and enters the next state.

Connection (:class:`ConnState`, :data:`CONNECTION_TRANSITIONS`)
    The handshake runs protocol header -> ``connection.start`` sent ->
    ``start-ok`` -> ``tune`` sent -> ``tune-ok`` -> ``open`` awaited ->
    ``open`` (``open-ok`` sent).  There is no SASL challenge state
    (``connection.secure``): ``PLAIN`` and ``AMQPLAIN`` complete in
    ``start-ok``.  A connection error sends ``connection.close`` and waits
    for ``close-ok`` (:attr:`ConnState.CLOSING`; before the protocol
    header the socket is just closed); only ``close`` / ``close-ok`` are
    heeded then.  A client's ``close`` or ``close-ok``, and the socket
    closing, end in :attr:`ConnState.CLOSED`, where nothing is read.  A
    method on channel 0 the table does not have is 503 COMMAND_INVALID on
    an open connection and 504 CHANNEL_ERROR during the handshake, and so
    is a frame on another channel before the connection is open.
Channel (:class:`ChanState`, :data:`CHANNEL_TRANSITIONS`)
    ``channel.open`` is answered at once (no opening state here); every
    channel number not open is :attr:`ChanState.CLOSED`.  A channel error
    sends ``channel.close`` (:attr:`ChanState.CLOSING`): until its
    ``close-ok`` the channel's frames are dropped, a ``channel.close``
    crossing ours is answered ``close-ok``.  A frame on a closed channel
    other than ``channel.open`` is 504, a second ``channel.open`` is 504,
    ``close-ok`` with no close sent is 505 UNEXPECTED_FRAME.
Channel mode (:class:`ChanMode`, :data:`MODE_TRANSITIONS`)
    A channel is plain, in confirm mode (``confirm.select``) or
    transactional (``tx.select``), for good: switching between the two is
    406 PRECONDITION_FAILED, as RabbitMQ, and so is ``tx.commit`` /
    ``tx.rollback`` on a channel that is not transactional.  (Flow,
    ``channel.flow``, has no invalid transitions: the channel's
    ``flow_active`` flag.)
Content assembly (:class:`ContentState`, :data:`CONTENT_EXPECTS`)
    A content method (``basic.publish``) is followed on its channel by a
    content header frame, then body frames until the header's body size
    is reached, with no other frame of that channel between them: idle ->
    (the method) header awaited -> (the header) body awaited, or idle
    again for an empty body -> (the last body frame) idle.  A frame of
    another type than the state's is 505 UNEXPECTED_FRAME with the text of
    :data:`CONTENT_REFUSALS` (a connection error).  What the header and
    the body must hold (class 60, the size limits) is checked by
    :mod:`mirrorq.amqp.publish`.
Publishing under a resource alarm (:class:`Throttle`)
    RabbitMQ's reader states as ``list_connections`` shows them: running;
    blocking (an alarm is in effect, the connection has not published
    yet: it goes on); blocked (it is not read).  Internal events only (the
    alarm, the first publish, the alarms clearing): nothing to refuse.
"""

from __future__ import annotations

from enum import Enum, StrEnum, auto

from pamqp import constants as K


class ConnState(StrEnum):
    """A connection's state; the value is how errors and listings name it."""

    AWAIT_HEADER = "header"  # nothing read yet: the protocol header is awaited
    START_SENT = "start"  # connection.start sent, start-ok awaited
    TUNE_SENT = "tune"  # connection.tune sent, tune-ok awaited
    AWAIT_OPEN = "open"  # tune-ok came, connection.open awaited
    OPEN = "opened"  # open-ok sent: channels may be used
    CLOSING = "closing"  # we sent connection.close, close-ok awaited
    CLOSED = "closed"  # the socket is closed (or closing): nothing more is read


class ConnEvent(Enum):
    """What happens to a connection: the client's frames on channel 0 (and
    on the others, :attr:`CHANNEL_FRAME`), a connection error, the socket
    closing."""

    HEADER = auto()  # the protocol header
    START_OK = auto()
    TUNE_OK = auto()
    OPEN = auto()  # connection.open
    CLOSE = auto()  # the client's connection.close
    CLOSE_OK = auto()
    BLOCKED = auto()  # the client's connection.blocked / unblocked (heeded by no one)
    UPDATE_SECRET = auto()
    METHOD = auto()  # any other method on channel 0
    CHANNEL_FRAME = auto()  # a frame on a channel other than 0
    ERROR = auto()  # a connection error: connection.close goes out
    TRANSPORT_CLOSED = auto()  # the socket closed (by the client, by us, a timeout)


_HANDSHAKE = (ConnState.START_SENT, ConnState.TUNE_SENT, ConnState.AWAIT_OPEN)
_NOT_CLOSED = (ConnState.AWAIT_HEADER, *_HANDSHAKE, ConnState.OPEN, ConnState.CLOSING)

#: (state, event) -> next state
CONNECTION_TRANSITIONS: dict[tuple[ConnState, ConnEvent], ConnState] = {
    (ConnState.AWAIT_HEADER, ConnEvent.HEADER): ConnState.START_SENT,
    (ConnState.AWAIT_HEADER, ConnEvent.ERROR): ConnState.CLOSED,  # no connection.close before the header
    (ConnState.START_SENT, ConnEvent.START_OK): ConnState.TUNE_SENT,
    (ConnState.TUNE_SENT, ConnEvent.TUNE_OK): ConnState.AWAIT_OPEN,
    (ConnState.AWAIT_OPEN, ConnEvent.OPEN): ConnState.OPEN,
    (ConnState.OPEN, ConnEvent.BLOCKED): ConnState.OPEN,
    (ConnState.OPEN, ConnEvent.UPDATE_SECRET): ConnState.OPEN,
    (ConnState.OPEN, ConnEvent.CHANNEL_FRAME): ConnState.OPEN,
    **{(s, ConnEvent.ERROR): ConnState.CLOSING for s in (*_HANDSHAKE, ConnState.OPEN)},
    **{(s, ConnEvent.CLOSE): ConnState.CLOSED for s in (*_HANDSHAKE, ConnState.OPEN, ConnState.CLOSING)},
    **{(s, ConnEvent.CLOSE_OK): ConnState.CLOSED for s in (*_HANDSHAKE, ConnState.OPEN, ConnState.CLOSING)},
    **{(s, ConnEvent.TRANSPORT_CLOSED): ConnState.CLOSED for s in _NOT_CLOSED},
}

#: an event a state's row does not have: (reply code, text) of the connection error, or None: ignored
CONNECTION_REFUSALS: dict[ConnState, tuple[int, str] | None] = {
    ConnState.AWAIT_HEADER: None,  # (frames are not read before the header)
    **{s: (504, "unexpected method {method} on channel 0 in state '{state}'") for s in _HANDSHAKE},
    ConnState.OPEN: (503, "unexpected method {method} on channel 0 in state '{state}'"),
    ConnState.CLOSING: None,  # after a close is sent, only close / close-ok are heeded
    ConnState.CLOSED: None,
}
#: ... the text for a frame on a channel other than 0 (same codes)
CHANNEL_FRAME_REFUSAL = "frame on channel {channel} before the connection is open"


class Throttle(StrEnum):
    RUNNING = "running"
    BLOCKING = "blocking"  # an alarm is in effect; blocked at the first publish
    BLOCKED = "blocked"  # not read until every alarm has cleared


class ChanState(StrEnum):
    """An AMQP channel's state (a channel number not open is CLOSED)."""

    CLOSED = "closed"
    OPEN = "running"  # as RabbitMQ's listings name it
    CLOSING = "closing"  # we sent channel.close, close-ok awaited


class ChanEvent(Enum):
    OPEN = auto()  # channel.open
    CLOSE = auto()  # the client's channel.close
    CLOSE_OK = auto()
    METHOD = auto()  # any other method, or a content frame
    ERROR = auto()  # a channel error: channel.close goes out


#: (state, event) -> next state
CHANNEL_TRANSITIONS: dict[tuple[ChanState, ChanEvent], ChanState] = {
    (ChanState.CLOSED, ChanEvent.OPEN): ChanState.OPEN,
    (ChanState.OPEN, ChanEvent.METHOD): ChanState.OPEN,
    (ChanState.OPEN, ChanEvent.CLOSE): ChanState.CLOSED,  # close-ok goes out
    (ChanState.OPEN, ChanEvent.ERROR): ChanState.CLOSING,
    (ChanState.CLOSING, ChanEvent.CLOSE): ChanState.CLOSING,  # close-ok goes out; ours still waits
    (ChanState.CLOSING, ChanEvent.CLOSE_OK): ChanState.CLOSED,
}

#: an event not in the table: (reply code, text) of the (connection) error, or None: ignored
CHANNEL_REFUSALS: dict[tuple[ChanState, ChanEvent], tuple[int, str] | None] = {
    **{
        (ChanState.CLOSED, e): (504, "expected 'channel.open' on channel {channel}")
        for e in (ChanEvent.CLOSE, ChanEvent.CLOSE_OK, ChanEvent.METHOD)
    },
    (ChanState.CLOSED, ChanEvent.ERROR): None,  # (a channel gone has nothing to close)
    (ChanState.OPEN, ChanEvent.OPEN): (504, "second 'channel.open' seen on channel {channel}"),
    (ChanState.OPEN, ChanEvent.CLOSE_OK): (505, "channel.close-ok without a channel.close"),
    # dropped until our close's close-ok
    **{(ChanState.CLOSING, e): None for e in (ChanEvent.OPEN, ChanEvent.METHOD, ChanEvent.ERROR)},
}


class ChanMode(Enum):
    PLAIN = auto()
    CONFIRM = auto()  # confirm.select: publishes are acked / nacked
    TX = auto()  # tx.select: publishes and settlements wait for tx.commit


class ModeEvent(Enum):
    CONFIRM_SELECT = auto()
    TX_SELECT = auto()
    TX_COMMIT = auto()
    TX_ROLLBACK = auto()


#: (mode, event) -> next mode
MODE_TRANSITIONS: dict[tuple[ChanMode, ModeEvent], ChanMode] = {
    (ChanMode.PLAIN, ModeEvent.CONFIRM_SELECT): ChanMode.CONFIRM,
    (ChanMode.CONFIRM, ModeEvent.CONFIRM_SELECT): ChanMode.CONFIRM,
    (ChanMode.PLAIN, ModeEvent.TX_SELECT): ChanMode.TX,
    (ChanMode.TX, ModeEvent.TX_SELECT): ChanMode.TX,
    (ChanMode.TX, ModeEvent.TX_COMMIT): ChanMode.TX,
    (ChanMode.TX, ModeEvent.TX_ROLLBACK): ChanMode.TX,
}

#: an event not in the table: (reply code, text) of the channel error
MODE_REFUSALS: dict[tuple[ChanMode, ModeEvent], tuple[int, str]] = {
    (ChanMode.TX, ModeEvent.CONFIRM_SELECT): (406, "cannot switch from tx to confirm mode"),
    (ChanMode.CONFIRM, ModeEvent.TX_SELECT): (406, "cannot switch from confirm to tx mode"),
    **{
        (m, e): (406, "channel is not transactional")
        for m in (ChanMode.PLAIN, ChanMode.CONFIRM)
        for e in (ModeEvent.TX_COMMIT, ModeEvent.TX_ROLLBACK)
    },
}


class ContentState(Enum):
    """Where a channel is in a publish's frames (a channel with no publish
    under way is IDLE)."""

    IDLE = auto()  # a method frame comes next
    HEADER = auto()  # basic.publish came: its content header comes next
    BODY = auto()  # the header came: body frames until its body size


#: state -> the type of the frame it takes
CONTENT_EXPECTS: dict[ContentState, int] = {
    ContentState.IDLE: K.FRAME_METHOD,
    ContentState.HEADER: K.FRAME_HEADER,
    ContentState.BODY: K.FRAME_BODY,
}

#: (state, the type of a frame it does not take) -> (reply code, text, whether the error names the frame's method)
CONTENT_REFUSALS: dict[tuple[ContentState, int], tuple[int, str, bool]] = {
    (ContentState.IDLE, K.FRAME_HEADER): (505, "unexpected content header frame on channel {channel}", False),
    (ContentState.IDLE, K.FRAME_BODY): (505, "unexpected content body frame on channel {channel}", False),
    (ContentState.HEADER, K.FRAME_METHOD): (505, "expected content header for class 60, got a method frame", True),
    (ContentState.HEADER, K.FRAME_BODY): (505, "expected content header for class 60, got a body frame", False),
    (ContentState.BODY, K.FRAME_METHOD): (505, "expected content body, got a method frame", False),
    (ContentState.BODY, K.FRAME_HEADER): (505, "expected content body, got a header frame", False),
}
