"""PostingActor: the Thespian shell of :mod:`mirrorq.outbox` for mirrorq's actors.

A mirrorq actor derives from :class:`PostingActor` and implements
``on_message(msg, sender)`` instead of ``receiveMessage``.  It sends to
other mirrorq actors with :meth:`PostingActor.post` (ordered, coalescing,
one bundle in flight per destination, retried on failure: the protocol is
in :mod:`mirrorq.outbox`) and keeps ``self.send`` for answers to tools that
``ask`` from outside the node (they do not unpack bundles).

One *turn* is one Thespian message handled: every message of a received
:class:`~mirrorq.outbox.Bundle` (in order) or a single plain message.  At
the end of a turn the actor's :meth:`end_turn` runs (a queue replica makes
its store durable there: one fsync per turn) and only THEN does anything
posted during the turn leave.  A transmit that completes between turns
starts the next bundle for that destination at once (from Thespian's
completion callback); one that completes during a turn leaves its
successor to the end of the turn, so no message posted in a turn can
overtake that turn's ``end_turn``.

Transmits use Thespian's ``TransmitIntent`` with success and failure
callbacks (``Actor._myRef._send_intent``: the documented ``Actor.send``
has no outcome), with a bounded period so a transmit stuck on a silent
peer fails and is retried instead of waiting Thespian's default five
minutes.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from thespian.actors import Actor, ActorAddress, WakeupMessage
from thespian.system.transport import SendStatus, TransmitIntent

from mirrorq.node.addresses import address_from_text, address_host_port, address_text, member_host
from mirrorq.outbox import Bundle, Inbox, Outbox

@dataclass
class ToReplica:
    """A message for one queue replica (``member``, its GM member name) of
    the queue host it lives in; the host answers the sender with
    ``NotMaster`` (for a client request) or drops it if no such replica
    lives there any more."""

    member: str
    msg: Any


#: a transmit that has not completed after this long fails (and is retried)
TRANSMIT_PERIOD = timedelta(seconds=10)
_RETRY = "mirrorq.outbox.retry"


class PostingActor(Actor):
    """Base class: bundles in, posts out (see the module docstring).

    ``self.now`` is read from ``clock`` once when a turn starts: the one
    time every core called during the turn is handed."""

    clock = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.now = self.clock()
        self._outbox: Outbox | None = None
        self._inbox = Inbox()
        self._addrs: dict[str, ActorAddress] = {}
        self._in_turn = False
        self._retry_armed: float | None = None
        #: the message being handled came in a Bundle: its sender is a
        #: PostingActor (answer with post); else a tool's ask (answer with send)
        self.bundled = False

    # ---- what subclasses implement ----------------------------------------------------
    def on_message(self, msg: Any, sender: Any) -> Any:
        """Handle one message (from a bundle or alone); may return a
        ``ThespianWatch`` (the last one of a turn is returned to Thespian)."""
        raise NotImplementedError

    def end_turn(self) -> None:
        """Called once at the end of every turn, before posted messages leave."""

    # ---- posting ----------------------------------------------------------------------
    @property
    def outbox(self) -> Outbox:
        if self._outbox is None:
            self._outbox = Outbox(f"{address_text(self.myAddress)}/{uuid.uuid4().hex[:12]}")
        return self._outbox

    def post(self, dst: Any, msg: Any) -> None:
        """Queue ``msg`` for the mirrorq actor ``dst`` (an ``ActorAddress`` or
        its ``"host:port"`` text) or for the queue replica named ``dst`` (a
        GM member name: the message goes to its queue host wrapped in a
        :class:`ToReplica`); it leaves at the end of the turn (or when the
        bundle in flight to that actor completes)."""
        if isinstance(dst, str):
            host = member_host(dst)
            if host is not None:
                msg, key = ToReplica(dst, msg), host
            else:
                key = dst
        else:
            hp = address_host_port(dst)
            if hp is None:
                # a child just created: its address is local until it reports in
                # (Thespian holds sends to it meanwhile); nothing to order it with
                self.send(dst, msg)
                return
            key = f"{hp[0]}:{hp[1]}"
            self._addrs.setdefault(key, dst)
        self.outbox.post(key, msg)
        if not self._in_turn:
            self._transmit_ready()  # posted from outside a turn (a callback): go now

    def as_turn(self, fn: Any) -> None:
        """Run ``fn()`` as a turn of its own when called from outside one (a
        transport callback): ``end_turn`` runs after it, then its posts leave."""
        if self._in_turn:
            fn()
            return
        self._in_turn = True
        self.now = self.clock()
        try:
            fn()
            self.end_turn()
        finally:
            self._in_turn = False
        self._transmit_ready()

    def tell(self, dst: Any, msg: Any, bundled: bool) -> None:
        """``post`` to a PostingActor (``bundled``), plain ``send`` to anyone
        else (a tool asking from outside the node)."""
        if bundled:
            self.post(dst, msg)
        else:
            self.send(dst, msg)

    def answer(self, sender: Any, msg: Any) -> None:
        """Answer the message being handled the way it came (:meth:`tell`)."""
        self.tell(sender, msg, self.bundled)

    # ---- Thespian -----------------------------------------------------------------------
    def receiveMessage(self, msg: Any, sender: Any) -> Any:
        self._in_turn = True
        self.now = self.clock()
        result = None
        try:
            if isinstance(msg, Bundle):
                if self._inbox.accept(msg):
                    self.bundled = True
                    try:
                        for m in msg.msgs:
                            result = self._one(m, sender)
                    finally:
                        self.bundled = False
            elif isinstance(msg, WakeupMessage) and msg.payload == _RETRY:
                self._retry_armed = None
                if self._outbox is not None:
                    for dst, b in self._outbox.due(time.monotonic()):
                        self._transmit(dst, b)
                    self._arm_retry()
            else:
                result = self._one(msg, sender)
            try:
                self.end_turn()
            except Exception as e:
                self.message_failed(msg, e)  # logged; raising would make Thespian retry a bundle the inbox drops
        finally:
            self._in_turn = False
        self._transmit_ready()
        return result

    def _one(self, msg: Any, sender: Any) -> Any:
        """One message: a failure is logged and stops only this message (the
        rest of its bundle is handled; Thespian would retry the whole bundle,
        which the inbox then drops as a duplicate)."""
        try:
            return self.on_message(msg, sender)
        except Exception as e:
            self.message_failed(msg, e)
            return None

    def message_failed(self, msg: Any, exc: BaseException) -> None:
        """Hook: handling ``msg`` raised ``exc`` (default: logged)."""
        text = "".join(traceback.format_exception(exc))
        logging.getLogger("mirrorq").error("%s failed on %s: %s", type(self).__name__, type(msg).__name__, text)
        log = getattr(self, "log", None)
        if callable(log):
            try:
                log("message_failed", level="error", actor=type(self).__name__, message=type(msg).__name__,
                    error=f"{type(exc).__name__}: {exc}", traceback=text[-4000:])
            except Exception:
                pass

    # ---- transmits ------------------------------------------------------------------------
    def _transmit_ready(self) -> None:
        if self._outbox is None:
            return
        for dst, b in self._outbox.take(time.monotonic()):
            self._transmit(dst, b)

    def _addr(self, dst: str) -> ActorAddress:
        a = self._addrs.get(dst)
        if a is None:
            a = self._addrs[dst] = address_from_text(dst)
        return a

    def _transmit(self, dst: str, b: Bundle) -> None:
        seq = b.seq

        def ok(_result: Any, _intent: Any) -> None:
            self._done(dst, seq, None)

        def err(result: Any, _intent: Any) -> None:
            self._done(dst, seq, result)

        self._myRef._send_intent(TransmitIntent(self._addr(dst), b, onSuccess=ok, onError=err, maxPeriod=TRANSMIT_PERIOD))

    def _done(self, dst: str, seq: int, failure: Any) -> None:
        ob = self._outbox
        now = time.monotonic()
        if failure is None:
            # during a turn the successor waits for the end of the turn (end_turn first)
            for d, b in ob.sent(dst, seq, now, start_next=not self._in_turn):
                self._transmit(d, b)
            return
        dead = failure == SendStatus.DeadTarget
        delay = ob.failed(dst, seq, now, dead=dead)
        if not self._in_turn:
            self.now = self.clock()  # the hooks below may run cores: hand them a current time
        self.transmit_failed(dst, dead)
        if delay is None:
            self.outbox_gave_up(dst)
        else:
            self._arm_retry()

    def _arm_retry(self) -> None:
        at = self._outbox.next_retry() if self._outbox is not None else None
        if at is None or (self._retry_armed is not None and self._retry_armed <= at):
            return
        self._retry_armed = at
        self.wakeupAfter(max(0.0, at - time.monotonic()), payload=_RETRY)

    def transmit_failed(self, dst: str, dead: bool) -> None:
        """Hook: a transmit to ``dst`` failed (``dead``: nothing listens there);
        it will be retried (see :mod:`mirrorq.outbox`)."""

    def outbox_gave_up(self, dst: str) -> None:
        """Hook: ``dst`` was given up (dead); its pending messages were dropped."""
