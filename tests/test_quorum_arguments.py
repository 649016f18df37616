"""The declare rules of quorum queues (mirrorq/queues/semantics.py), through
the same entry point as every queue declare (semantics.validate_queue_arguments)."""

from __future__ import annotations

import pytest

from mirrorq.queues import semantics

Q = {"x-queue-type": "quorum"}


def test_supported_arguments_pass_normalised():
    args = semantics.validate_queue_arguments(
        "q",
        {
            **Q,
            "x-delivery-limit": 3,
            "x-max-length": 10,
            "x-overflow": b"reject-publish",
            "x-message-ttl": 1000,
            "x-quorum-initial-group-size": 2,
            "x-queue-leader-locator": "balanced",
            "x-dead-letter-exchange": b"dlx",
            "x-dead-letter-routing-key": "dead",
            "x-dead-letter-strategy": "at-most-once",
        },
    )
    assert args["x-overflow"] == "reject-publish" and args["x-delivery-limit"] == 3
    assert args["x-dead-letter-exchange"] == "dlx" and args["x-dead-letter-routing-key"] == "dead"


@pytest.mark.parametrize(
    "arguments,words",
    [
        ({"x-max-priority": 3}, "'x-max-priority'.*classic queues only"),
        ({"x-queue-mode": "lazy"}, "'x-queue-mode'"),
        ({"x-queue-master-locator": "min-masters"}, "'x-queue-master-locator'"),
        ({"x-ha-deliver-mode": "replicated"}, "'x-ha-deliver-mode'.*classic queues only"),
        ({"x-dead-letter-strategy": "at-least-once"}, "'x-dead-letter-strategy'.*only at-most-once"),
        ({"x-dead-letter-exchange": 5}, "'x-dead-letter-exchange'.*string"),
        ({"x-expires": 1000}, "'x-expires'"),
        ({"x-overflow": "reject-publish-dlx"}, "'x-overflow'"),
        ({"x-overflow": "nonsense"}, "'x-overflow'"),
        ({"x-delivery-limit": -1}, "'x-delivery-limit'"),
        ({"x-quorum-initial-group-size": 0}, "'x-quorum-initial-group-size'"),
        ({"x-quorum-initial-group-size": "3"}, "'x-quorum-initial-group-size'"),
        ({"x-queue-leader-locator": "random"}, "'x-queue-leader-locator'"),
    ],
)
def test_refused_arguments_are_406_naming_the_argument(arguments, words):
    with pytest.raises(semantics.PreconditionFailed, match=words) as e:
        semantics.validate_queue_arguments("q", {**Q, **arguments})
    assert e.value.reply_code == 406 and "queue type quorum" in e.value.text


@pytest.mark.parametrize(
    "flags,words",
    [({"durable": False}, "non-durable"), ({"exclusive": True}, "exclusive"), ({"auto_delete": True}, "auto-delete")],
)
def test_quorum_queues_are_durable_and_neither_exclusive_nor_auto_delete(flags, words):
    with pytest.raises(semantics.PreconditionFailed, match=words):
        semantics.validate_quorum_declare("q", dict(Q), **flags)
