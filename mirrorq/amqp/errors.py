"""AMQP 0-9-1 errors as the connection raises and reports them.

Every protocol error closes the channel (403, 404, 405, 406) or the
connection (the spec's hard errors: :data:`HARD_ERRORS`) with
``"<NAME> - <text naming the cause>"`` and the class/method that caused it
(:class:`AMQPException`).  A 404 from this node's topology cache may be
stale (:class:`NotKnownHere`): the method runs again once the registry
leader was asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLY_NAMES = {
    200: "OK",
    311: "CONTENT_TOO_LARGE",
    312: "NO_ROUTE",
    313: "NO_CONSUMERS",
    320: "CONNECTION_FORCED",
    402: "INVALID_PATH",
    403: "ACCESS_REFUSED",
    404: "NOT_FOUND",
    405: "RESOURCE_LOCKED",
    406: "PRECONDITION_FAILED",
    501: "FRAME_ERROR",
    502: "SYNTAX_ERROR",
    503: "COMMAND_INVALID",
    504: "CHANNEL_ERROR",
    505: "UNEXPECTED_FRAME",
    506: "RESOURCE_ERROR",
    530: "NOT_ALLOWED",
    540: "NOT_IMPLEMENTED",
    541: "INTERNAL_ERROR",
}
#: codes that close the connection (the others close the channel)
HARD_ERRORS = {320, 402, 501, 502, 503, 504, 505, 506, 530, 540, 541}


class AMQPException(Exception):
    """A protocol error: ``code``, ``text`` and the method (its class and
    method ids go into the close) that caused it."""

    def __init__(self, code: int, text: str, method: Any = None) -> None:
        super().__init__(text)
        self.code, self.text = code, text
        index = getattr(method, "index", 0) or 0
        self.class_id, self.method_id = index >> 16, index & 0xFFFF

    @property
    def reply_text(self) -> str:
        return f"{REPLY_NAMES.get(self.code, 'ERROR')} - {self.text}"


def amqp_error(code: int, text: str, method: Any = None) -> AMQPException:
    return AMQPException(code, text, method)


class NotKnownHere(AMQPException):
    """A 404 from this node's topology cache, which may lag behind a
    declare committed through another node: the method is run again once
    ``tables`` have been re-read through the registry leader, and only a
    second miss reaches the client -- or, when ``on_second_miss`` is
    given, is answered by it (``fn(now)``: a method for which a missing
    entity is no error, such as an unbind)."""

    def __init__(
        self, code: int, text: str, method: Any, tables: tuple, on_second_miss: Callable[[float], None] | None = None
    ) -> None:
        super().__init__(code, text, method)
        self.tables = tables
        self.on_second_miss = on_second_miss


def unknown_queue(text: str, method: Any) -> NotKnownHere:
    return NotKnownHere(404, text, method, ("amqqueue",))


def unknown_exchange(text: str, method: Any) -> NotKnownHere:
    return NotKnownHere(404, text, method, ("exchange",))


def strip_name(text: str) -> str:
    """'NAME - text' from the queue -> 'text' (the connection adds the name again)."""
    head, sep, rest = (text or "").partition(" - ")
    return rest if sep and head.isupper() else (text or "refused")
