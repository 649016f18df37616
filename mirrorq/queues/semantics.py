"""Queue semantics both queue types share: errors, limits, and the rules for arguments.

A classic queue (:mod:`mirrorq.classic.amqqueue`) and a quorum queue
(:mod:`mirrorq.quorum.machine`) answer the same AMQP methods, so they
refuse the same things the same way.  This module is the one place those
rules live; both queue types and the AMQP front end import it, and it
imports neither.

* **Errors.**  :class:`AMQPError` and its subclasses carry the AMQP reply
  code and name the front end closes a channel (or the connection) with:
  406 PRECONDITION_FAILED, 405 RESOURCE_LOCKED, 403 ACCESS_REFUSED,
  404 NOT_FOUND, 530 NOT_ALLOWED, 540 NOT_IMPLEMENTED, 541 INTERNAL_ERROR.
  The text names what was wrong.
* **Limits.**  :data:`MAX_EXPIRY_MS` (RabbitMQ's largest TTL and
  expiration), :data:`MAX_PREFETCH` (basic.qos's prefetch-count is a
  short), :data:`MAX_PRIORITY`, and the two bounds on what a queue sends a
  consumer beyond what the client asked for: :data:`LOOKAHEAD_BYTES` and
  :data:`LINK_CREDIT_BYTES`.
* **Arguments.**  :func:`validate_queue_arguments` checks a declare's
  x-arguments with RabbitMQ's rules for the queue type it names (classic by
  default; ``x-queue-type: quorum`` goes to :func:`validate_quorum_declare`);
  :func:`quorum_arguments` is the part of the quorum rules a quorum queue's
  machine applies again to every declare in its log;
  :func:`validate_consumer_arguments` checks basic.consume's;
  mirrorq's own classic argument ``x-ha-deliver-mode`` is one of
  :data:`HA_DELIVER_MODES` (``immediate``, the default: a master delivers
  what it accepted at once; ``replicated``: once every mirror holds it);
  :func:`parse_expiration` reads the ``expiration`` property.  Every
  refusal is a :class:`PreconditionFailed` naming the argument, its value
  and the rule (the quorum machine's own check raises
  :class:`InvalidArgument`, which its caller turns into the machine's error).
  Unknown arguments are kept and ignored, as RabbitMQ does; arguments of
  features mirrorq lacks are refused rather than ignored.

Quorum queues' declare rules (RabbitMQ 3.x's, for what mirrorq builds):

* quorum queues are durable, never exclusive, never auto-delete;
* the arguments of classic queues (``x-max-priority``, ``x-queue-mode``,
  ``x-queue-master-locator``, ``x-queue-version``, ``x-ha-*``) are refused,
  as RabbitMQ refuses them ("invalid arg ... of queue type quorum");
* arguments of quorum features mirrorq does not build yet
  (``x-single-active-consumer``, ``x-expires``,
  ``x-overflow: reject-publish-dlx``, ``x-dead-letter-strategy:
  at-least-once``) are refused;
* ``x-dead-letter-exchange`` and ``x-dead-letter-routing-key`` are strings
  (dead-lettering: :mod:`mirrorq.quorum.dead_letter`);
* ``x-quorum-initial-group-size`` is a positive integer; ``x-delivery-limit``,
  ``x-max-length``, ``x-max-length-bytes`` and ``x-message-ttl`` are
  non-negative integers (the TTL at most :data:`MAX_EXPIRY_MS`),
  ``x-overflow`` is ``drop-head`` or ``reject-publish``;
  ``x-queue-leader-locator`` is ``client-local`` or ``balanced``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = [
    "AMQPError",
    "AccessRefused",
    "InvalidArgument",
    "LINK_CREDIT_BYTES",
    "LOOKAHEAD_BYTES",
    "MAX_EXPIRY_MS",
    "MAX_PREFETCH",
    "MAX_PRIORITY",
    "NotAllowed",
    "NotFound",
    "NotImplementedFeature",
    "PreconditionFailed",
    "QUORUM_OVERFLOW",
    "is_int",
    "ResourceLocked",
    "parse_expiration",
    "quorum_arguments",
    "validate_consumer_arguments",
    "validate_queue_arguments",
    "validate_quorum_declare",
]

# ------------------------------------------------------------------- limits

MAX_EXPIRY_MS = 4294967295  # RabbitMQ's ?MAX_EXPIRY_TIMER
MAX_PREFETCH = 65535  # basic.qos prefetch-count is a short
#: the largest x-max-priority (RabbitMQ's)
MAX_PRIORITY = 255
#: a consumer is given lookahead deliveries only while the bodies it holds
#: unacked (its prefetch's included) stay under this: its front end holds
#: them in memory, and the client never asked for them
LOOKAHEAD_BYTES = 4 << 20
#: a consumer's link credit: body bytes delivered to it that its front end
#: has not yet reported written to the client (:meth:`AMQQueue.link_credit`).
#: At this much the queue sends it nothing more, whatever its prefetch: a
#: client that does not read its socket (or a front end that cannot write)
#: stops the queue instead of growing a buffer.  A delivery may pass the
#: bound by one message.
LINK_CREDIT_BYTES = 8 << 20

# ------------------------------------------------------------------- errors


class AMQPError(Exception):
    """A refused operation, with the AMQP reply code the front end should use."""

    reply_code = 541
    reply_name = "INTERNAL_ERROR"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"{self.reply_name} - {self.text}"


class PreconditionFailed(AMQPError, ValueError):
    reply_code = 406
    reply_name = "PRECONDITION_FAILED"


class ResourceLocked(AMQPError):
    reply_code = 405
    reply_name = "RESOURCE_LOCKED"


class AccessRefused(AMQPError):
    reply_code = 403
    reply_name = "ACCESS_REFUSED"


class NotFound(AMQPError):
    reply_code = 404
    reply_name = "NOT_FOUND"


class NotAllowed(AMQPError):
    reply_code = 530
    reply_name = "NOT_ALLOWED"


class NotImplementedFeature(AMQPError):
    reply_code = 540
    reply_name = "NOT_IMPLEMENTED"


# --------------------------------------------------------------- arguments


def is_int(x: Any) -> TypeGuard[int]:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def _text(x: Any) -> str | None:
    if isinstance(x, bytes):
        try:
            return x.decode()
        except UnicodeDecodeError:
            return None
    return x if isinstance(x, str) else None


_OVERFLOW = ("drop-head", "reject-publish", "reject-publish-dlx")
#: ``x-ha-deliver-mode`` / policy ``ha-deliver-mode``: when a mirrored
#: classic queue's master may deliver a message (:mod:`mirrorq.classic.coordinator`)
HA_DELIVER_MODES = ("immediate", "replicated")


def validate_queue_arguments(name: str, arguments: dict[str, Any] | None) -> dict[str, Any]:
    """Check a queue's x-arguments with RabbitMQ's rules; returns a copy.

    Unknown arguments are kept and ignored, as RabbitMQ does; arguments of
    features mirrorq lacks (other queue types, single active consumer) are
    refused rather than silently ignored.
    """
    if arguments is None:
        return {}
    if not isinstance(arguments, dict):
        raise TypeError(f"queue arguments must be a dict, got {arguments!r}")
    args = dict(arguments)
    if _text(args.get("x-queue-type")) == "quorum":
        return validate_quorum_declare(name, args)  # flags are checked by the declare (durable, exclusive)

    def bad(arg: str, why: str) -> PreconditionFailed:
        return PreconditionFailed(f"invalid arg '{arg}' for queue '{name}': {why}")

    for arg in ("x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes"):
        if arg not in args:
            continue
        v = args[arg]
        if not is_int(v):
            raise bad(arg, f"unacceptable type {type(v).__name__} ({v!r}), expected an integer")
        if v < 0:
            raise bad(arg, f"value_negative {v}")
        if arg == "x-expires" and v == 0:
            raise bad(arg, "value_zero 0")
        if arg in ("x-message-ttl", "x-expires") and v > MAX_EXPIRY_MS:
            raise bad(arg, f"value_too_large {v} > {MAX_EXPIRY_MS}")
    if "x-max-priority" in args:
        v = args["x-max-priority"]
        if not is_int(v):
            raise bad("x-max-priority", f"unacceptable type {type(v).__name__} ({v!r}), expected an integer")
        if not 0 <= v <= MAX_PRIORITY:
            raise bad("x-max-priority", f"value {v} out of range [0, {MAX_PRIORITY}]")
    for arg in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        if arg in args:
            v = _text(args[arg])
            if v is None:
                raise bad(arg, f"unacceptable type {type(args[arg]).__name__} ({args[arg]!r}), expected a string")
            args[arg] = v
    if "x-dead-letter-routing-key" in args and "x-dead-letter-exchange" not in args:
        raise bad(
            "x-dead-letter-routing-key",
            "x-dead-letter-routing-key should be specified together with x-dead-letter-exchange",
        )
    if "x-overflow" in args:
        v = _text(args["x-overflow"])
        if v not in _OVERFLOW:
            raise bad("x-overflow", f"invalid_overflow {args['x-overflow']!r} (expected one of {', '.join(_OVERFLOW)})")
        args["x-overflow"] = v
    if "x-ha-deliver-mode" in args:
        v = _text(args["x-ha-deliver-mode"])
        if v not in HA_DELIVER_MODES:
            raise bad(
                "x-ha-deliver-mode",
                f"invalid value {args['x-ha-deliver-mode']!r} (expected one of {', '.join(HA_DELIVER_MODES)})",
            )
        args["x-ha-deliver-mode"] = v
    if "x-queue-type" in args and _text(args["x-queue-type"]) not in ("classic", "quorum"):
        raise bad("x-queue-type", f"only 'classic' and 'quorum' queues are supported, got {args['x-queue-type']!r}")
    if "x-single-active-consumer" in args:
        v = args["x-single-active-consumer"]
        if not isinstance(v, bool):
            raise bad("x-single-active-consumer", f"unacceptable type {type(v).__name__}, expected a bool")
        if v:
            raise bad("x-single-active-consumer", "single active consumer is not supported by mirrorq")
    return args


def validate_consumer_arguments(arguments: Any) -> dict[str, Any]:
    """basic.consume's arguments checked (``x-priority``, ``x-cancel-on-ha-failover``); a copy."""
    if arguments is None:
        return {}
    if not isinstance(arguments, dict):
        raise TypeError(f"consumer arguments must be a dict, got {arguments!r}")
    if "x-priority" in arguments and not is_int(arguments["x-priority"]):
        raise PreconditionFailed(f"invalid arg 'x-priority': expected an integer, got {arguments['x-priority']!r}")
    if "x-cancel-on-ha-failover" in arguments and not isinstance(arguments["x-cancel-on-ha-failover"], bool):
        v = arguments["x-cancel-on-ha-failover"]
        raise PreconditionFailed(f"invalid arg 'x-cancel-on-ha-failover': expected a bool, got {v!r}")
    return dict(arguments)


def parse_expiration(value: Any) -> int | None:
    """The ``expiration`` property as milliseconds (None if absent).

    RabbitMQ's rule: a string of decimal digits, 0 .. 2^32-1.
    """
    if value is None:
        return None
    text = _text(value)
    digits = text[1:] if text is not None and text.startswith("-") else text
    if text is None or digits is None or not digits or not (digits.isascii() and digits.isdigit()):
        raise PreconditionFailed(f"invalid expiration {value!r}: expected a string of decimal digits (milliseconds)")
    ms = int(text)
    if ms < 0:
        raise PreconditionFailed(f"invalid expiration {value!r}: value_negative")
    if ms > MAX_EXPIRY_MS:
        raise PreconditionFailed(f"invalid expiration {value!r}: value_too_large (max {MAX_EXPIRY_MS})")
    return ms


# ------------------------------------------------------------ quorum queues


class InvalidArgument(ValueError):
    """A quorum queue argument its machine cannot act on (the text names it)."""


#: the overflow behaviours of quorum queues
QUORUM_OVERFLOW = ("drop-head", "reject-publish")
_QUORUM_INT_ARGS = ("x-max-length", "x-max-length-bytes", "x-message-ttl", "x-delivery-limit")


def _quorum_text(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


def quorum_arguments(arguments: Any) -> dict[str, Any]:
    """The queue arguments a quorum queue's machine acts on, checked; a copy.
    Other x-arguments are kept and ignored.  Raises :class:`InvalidArgument`."""
    if arguments is None:
        return {}
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"queue arguments must be a dict, got {arguments!r}")
    args = dict(arguments)
    for name in _QUORUM_INT_ARGS:
        if name in args:
            v = args[name]
            if type(v) is not int or v < 0:
                raise InvalidArgument(f"queue argument {name} must be a non-negative int, got {v!r}")
    if "x-message-ttl" in args and args["x-message-ttl"] > MAX_EXPIRY_MS:
        raise InvalidArgument(f"queue argument x-message-ttl {args['x-message-ttl']} is above {MAX_EXPIRY_MS}")
    if "x-overflow" in args:
        v = _quorum_text(args["x-overflow"])
        if v not in QUORUM_OVERFLOW:
            raise InvalidArgument(f"queue argument x-overflow must be one of {', '.join(QUORUM_OVERFLOW)}, got {v!r}")
        args["x-overflow"] = v
    return args


CLASSIC_ONLY = (
    "x-max-priority",
    "x-queue-mode",
    "x-queue-master-locator",
    "x-queue-version",
    "x-ha-policy",
    "x-ha-policy-params",
    "x-ha-deliver-mode",
)
NOT_BUILT = ("x-single-active-consumer", "x-expires")
DEAD_LETTER_STRATEGIES = ("at-most-once",)
LOCATORS = ("client-local", "balanced")


def validate_quorum_declare(
    name: str,
    arguments: Mapping[str, Any] | None,
    *,
    durable: bool = True,
    exclusive: bool = False,
    auto_delete: bool = False,
) -> dict[str, Any]:
    def bad(arg: str, why: str) -> PreconditionFailed:
        return PreconditionFailed(f"invalid arg '{arg}' for queue '{name}' of queue type quorum: {why}")

    if not durable:
        raise PreconditionFailed(f"invalid property 'non-durable' for queue '{name}': quorum queues are durable")
    if exclusive:
        raise PreconditionFailed(
            f"invalid property 'exclusive-owner' for queue '{name}': quorum queues cannot be exclusive"
        )
    if auto_delete:
        raise PreconditionFailed(
            f"invalid property 'auto-delete' for queue '{name}': quorum queues cannot be auto-delete"
        )
    args = {k: _quorum_text(v) for k, v in dict(arguments or {}).items()}
    for arg in CLASSIC_ONLY:
        if arg in args:
            raise bad(arg, "an argument of classic queues only")
    for arg in NOT_BUILT:
        if arg in args:
            raise bad(arg, "not supported by mirrorq's quorum queues yet")
    for arg in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        if arg in args and not isinstance(args[arg], str):
            raise bad(arg, f"expected a string, got {args[arg]!r}")
    strategy = args.get("x-dead-letter-strategy")
    if strategy is not None and strategy not in DEAD_LETTER_STRATEGIES:
        raise bad(
            "x-dead-letter-strategy", f"only at-most-once is supported by mirrorq's quorum queues, got {strategy!r}"
        )
    if args.get("x-overflow") == "reject-publish-dlx":
        raise bad("x-overflow", "reject-publish-dlx is not supported by mirrorq's quorum queues yet")
    size = args.get("x-quorum-initial-group-size")
    if size is not None and (type(size) is not int or size < 1):
        raise bad("x-quorum-initial-group-size", f"expected a positive integer, got {size!r}")
    loc = args.get("x-queue-leader-locator")
    if loc is not None and loc not in LOCATORS:
        raise bad("x-queue-leader-locator", f"expected one of {', '.join(LOCATORS)}, got {loc!r}")
    try:
        return quorum_arguments(args)
    except InvalidArgument as e:
        arg = next((a for a in args if a in str(e)), "arguments")
        raise bad(arg, str(e)) from None
