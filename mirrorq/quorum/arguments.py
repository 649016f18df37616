"""The declare rules of quorum queues (RabbitMQ 3.x's, for what mirrorq builds).

:func:`validate_quorum_declare` checks a ``queue.declare`` with
``x-queue-type: quorum`` and returns its arguments, normalised; it raises
:class:`~mirrorq.queue_process.amqqueue.PreconditionFailed` (406) naming the
argument or flag at fault:

* quorum queues are durable, never exclusive, never auto-delete;
* the arguments of classic queues (``x-max-priority``, ``x-queue-mode``,
  ``x-queue-master-locator``, ``x-queue-version``, ``x-ha-*``) are refused,
  as RabbitMQ refuses them ("invalid arg ... of queue type quorum");
* arguments of quorum features mirrorq does not build yet
  (``x-single-active-consumer``, ``x-expires``,
  ``x-overflow: reject-publish-dlx``, ``x-dead-letter-strategy:
  at-least-once``) are refused rather than ignored;
* ``x-dead-letter-exchange`` and ``x-dead-letter-routing-key`` are strings
  (dead-lettering: :mod:`mirrorq.quorum.dead_letter`);
* ``x-quorum-initial-group-size`` is a positive integer; ``x-delivery-limit``,
  ``x-max-length``, ``x-max-length-bytes``, ``x-message-ttl`` and
  ``x-overflow`` follow :func:`mirrorq.quorum.machine.validate_arguments`;
  ``x-queue-leader-locator`` is ``client-local`` or ``balanced``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mirrorq.quorum import machine

CLASSIC_ONLY = (
    "x-max-priority",
    "x-queue-mode",
    "x-queue-master-locator",
    "x-queue-version",
    "x-ha-policy",
    "x-ha-policy-params",
)
NOT_BUILT = ("x-single-active-consumer", "x-expires")
DEAD_LETTER_STRATEGIES = ("at-most-once",)
LOCATORS = ("client-local", "balanced")


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, (bytes, bytearray)) else v


def validate_quorum_declare(
    name: str,
    arguments: Mapping[str, Any] | None,
    *,
    durable: bool = True,
    exclusive: bool = False,
    auto_delete: bool = False,
) -> dict[str, Any]:
    from mirrorq.queue_process.amqqueue import PreconditionFailed

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
    args = {k: _text(v) for k, v in dict(arguments or {}).items()}
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
        args = machine.validate_arguments(args)
    except machine.BadCommand as e:
        arg = next((a for a in args if a in str(e)), "arguments")
        raise bad(arg, str(e)) from None
    return args
