"""Get messages and publish through the management API on a real 3-node
cluster (issue #35; mirrorq/admin/messages.py): RabbitMQ's
``POST /api/queues/{vhost}/{name}/get`` with each ack mode, encodings and
truncation, and ``POST /api/exchanges/{vhost}/{name}/publish`` answering
whether the message was routed; the broker's refusals as RabbitMQ's API
codes (404 no queue / exchange, 401 a user without the permission), bad
bodies a 400 naming the field.  The gets run on a node that is not the
queue's master's, so the conversation crosses the cluster as a client's.
"""

from __future__ import annotations

import base64

import pytest
from test_mgmt_cluster import GUEST, cluster, conn, http, ok  # noqa: F401

pytestmark = pytest.mark.cluster

Q = "mgmt.get"


def _get(c, body, node=1, queue=Q):
    return http(c, "POST", f"/api/queues/%2F/{queue}/get", body, node=node)


def _publish(c, body, exchange="amq.default", node=1):
    return http(c, "POST", f"/api/exchanges/%2F/{exchange}/publish", body, node=node)


def _messages(c, node=0) -> int:
    return ok(c, "GET", f"/api/queues/%2F/{Q}", node=node)["messages"]


def test_publish_then_get_with_each_ackmode(cluster):  # noqa: F811
    c = cluster
    ok(c, "PUT", f"/api/queues/%2F/{Q}", {"durable": True}, want=201)
    props = {"delivery_mode": 2, "content_type": "text/plain", "headers": {"k": "v", "n": 3}, "message_id": "m-1"}
    body = {"routing_key": Q, "payload": "héllo", "payload_encoding": "string", "properties": props}
    status, out, _ = _publish(c, body)
    assert (status, out) == (200, {"routed": True})
    raw = bytes(range(256))
    blob = {"routing_key": Q, "payload": base64.b64encode(raw).decode(), "payload_encoding": "base64", "properties": {}}
    assert _publish(c, blob)[:2] == (200, {"routed": True})
    nowhere = {"routing_key": "no.such.queue", "payload": "x", "payload_encoding": "string", "properties": {}}
    assert _publish(c, nowhere)[:2] == (200, {"routed": False})
    assert _messages(c) == 2

    # ack_requeue_true: both shown, both still there (redelivered next time)
    status, got, _ = _get(c, {"count": 5, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 50000})
    assert status == 200 and len(got) == 2, got
    first, second = got
    assert first["payload"] == "héllo" and first["payload_encoding"] == "string"
    assert first["payload_bytes"] == len("héllo".encode()) and first["redelivered"] is False
    assert (first["exchange"], first["routing_key"], first["message_count"]) == ("", Q, 1)
    assert first["properties"] == props
    assert second["payload_encoding"] == "base64" and base64.b64decode(second["payload"]) == raw
    assert _messages(c) == 2

    # reject_requeue_true with base64 and truncate: requeued, now redelivered
    status, got, _ = _get(c, {"count": "1", "ackmode": "reject_requeue_true", "encoding": "base64", "truncate": 2})
    assert status == 200 and len(got) == 1
    assert got[0]["redelivered"] is True and got[0]["payload_encoding"] == "base64"
    assert base64.b64decode(got[0]["payload"]) == "héllo".encode()[:2] and got[0]["payload_bytes"] == 6
    assert _messages(c) == 2

    # ack_requeue_false: gone
    status, got, _ = _get(c, {"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"})
    assert status == 200 and [m["payload"] for m in got] == ["héllo"]
    assert _messages(c) == 1
    # reject_requeue_false: gone too (no dead-letter exchange here)
    status, got, _ = _get(c, {"count": 3, "ackmode": "reject_requeue_false", "encoding": "auto"})
    assert status == 200 and len(got) == 1 and got[0]["payload_encoding"] == "base64"
    assert _messages(c) == 0
    assert _get(c, {"count": 3, "ackmode": "ack_requeue_false", "encoding": "auto"})[:2] == (200, [])


def test_refusals_and_bad_bodies(cluster):  # noqa: F811
    c = cluster
    good = {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}
    status, out, _ = _get(c, good, queue="no.such.queue")
    assert status == 404 and "no.such.queue" in out["reason"]
    pub = {"routing_key": "k", "payload": "x", "payload_encoding": "string", "properties": {}}
    status, out, _ = _publish(c, pub, exchange="no.such.exchange")
    assert status == 404 and "no.such.exchange" in out["reason"]
    for bad, field in (
        ({"ackmode": "ack_requeue_true", "encoding": "auto"}, "count"),
        ({**good, "count": 0}, "count"),
        ({**good, "ackmode": "ack"}, "ackmode"),
        ({**good, "encoding": "utf8"}, "encoding"),
        ({**good, "truncate": -1}, "truncate"),
    ):
        status, out, _ = _get(c, bad)
        assert status == 400 and out["reason"].startswith(f"{field}:"), (bad, out)
    for bad, field in (
        ({k: v for k, v in pub.items() if k != "properties"}, "properties"),
        ({**pub, "payload_encoding": "hex"}, "payload_encoding"),
        ({**pub, "payload_encoding": "base64", "payload": "!!"}, "payload"),
        ({**pub, "properties": {"delivery_mode": 3}}, "properties.delivery_mode"),
        ({**pub, "properties": {"colour": "red"}}, "properties.colour"),
    ):
        status, out, _ = _publish(c, bad)
        assert status == 400 and out["reason"].startswith(f"{field}:"), (bad, out)

    # an administrator without permissions on the vhost: the broker refuses it, a 401 with its text
    ok(c, "PUT", "/api/users/ops", {"password": "pw", "tags": "administrator"}, want=201)
    try:
        status, out, _ = http(c, "POST", f"/api/queues/%2F/{Q}/get", good, node=1, auth=("ops", "pw"))
        assert status == 401 and out["error"] == "not_authorised", out
        status, out, _ = http(c, "POST", "/api/exchanges/%2F/amq.default/publish", pub, node=1, auth=("ops", "pw"))
        assert status == 401 and out["error"] == "not_authorised", out
    finally:
        ok(c, "DELETE", "/api/users/ops", want=204)
