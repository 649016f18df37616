"""What the console's forms and pages use of the management API, on a real
3-node cluster (issue #35).

Get messages and publish (mirrorq/admin/messages.py): RabbitMQ's
``POST /api/queues/{vhost}/{name}/get`` with each ack mode, encodings and
truncation, and ``POST /api/exchanges/{vhost}/{name}/publish`` answering
whether the message was routed; the broker's refusals as RabbitMQ's API
codes (404 no queue / exchange, 401 a user without the permission), bad
bodies a 400 naming the field.  The gets run on a node that is not the
queue's master's, so the conversation crosses the cluster as a client's.

Nodes: every node's memory, disk, alarms, uptime, descriptors and the
queues it holds masters and mirrors of.  Exchanges and bindings declared,
bound, unbound and deleted as the asking user; a connection listed,
looked up and closed (its client hears 320 CONNECTION_FORCED with the
X-Reason); the other listings paged as queues are.
"""

from __future__ import annotations

import base64
import urllib.parse

import pytest
from conftest import wait_for
from test_mgmt_cluster import GUEST, cluster, conn, http, ok  # noqa: F401

pika = pytest.importorskip("pika")

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


def test_nodes_show_resources_and_the_queues_they_hold(cluster):  # noqa: F811
    c = cluster
    ok(c, "PUT", "/api/policies/%2F/held", {"pattern": "^held\\.", "definition": {"ha-mode": "all"}}, want=201)
    ok(c, "PUT", "/api/queues/%2F/held.q", {"durable": True}, node=2, want=201)
    try:

        def held_everywhere():
            ns = ok(c, "GET", "/api/nodes", node=1)
            return all(n["queue_masters"] + n["queue_mirrors"] >= 1 for n in ns), ns

        nodes = wait_for(held_everywhere, 30, "every node holding held.q")
        assert [n["name"] for n in nodes] == ["node1", "node2", "node3"]
        for n in nodes:
            assert n["running"] and n["uptime"] > 0 and n["mem_used"] > 0 and n["disk_free"] > 0
            assert n["fd_used"] > 0 and n["sockets_used"] > 0 and n["proc_used"] >= 2 and n["fd_total"] > 0
            assert n["alarms"] == [] and n["partition"] == "serving" and n["registry"]["role"] in ("leader", "follower")
        master = ok(c, "GET", "/api/queues/%2F/held.q")["node"]
        one = ok(c, "GET", f"/api/nodes/{master}")
        assert {"vhost": "/", "name": "held.q"} in one["master_queues"]
        other = next(n["name"] for n in nodes if n["name"] != master)
        assert {"vhost": "/", "name": "held.q"} in ok(c, "GET", f"/api/nodes/{other}")["mirror_queues"]
        assert http(c, "GET", "/api/nodes/node9")[0] == 404
    finally:
        ok(c, "DELETE", "/api/queues/%2F/held.q", want=204)
        ok(c, "DELETE", "/api/policies/%2F/held", want=204)


def test_exchanges_and_bindings_as_the_user(cluster):  # noqa: F811
    c = cluster
    ok(c, "PUT", "/api/queues/%2F/bound.q", {"durable": True}, want=201)
    x = "/api/exchanges/%2F/console.x"
    assert http(c, "PUT", x, {"durable": True})[0] == 400  # no type
    ok(c, "PUT", x, {"type": "topic", "durable": True}, want=201)
    ok(c, "PUT", x, {"type": "topic", "durable": True}, want=204)  # equivalent: kept
    status, out, _ = http(c, "PUT", x, {"type": "fanout", "durable": True})
    assert status == 400 and "PRECONDITION_FAILED" in out["reason"], out
    shown = ok(c, "GET", x, node=2)
    assert (shown["name"], shown["type"], shown["durable"]) == ("console.x", "topic", True)
    assert ok(c, "GET", "/api/exchanges/%2F/amq.default")["name"] == ""

    pair = "/api/bindings/%2F/e/console.x/q/bound.q"
    status, _, headers = http(c, "POST", pair, {"routing_key": "orders.*", "arguments": {}})
    assert status == 201 and headers["Location"].endswith("/e/console.x/q/bound.q/orders.%2A"), headers["Location"]
    listed = ok(c, "GET", pair)
    assert [(b["routing_key"], b["properties_key"]) for b in listed] == [("orders.*", "orders.*")]
    assert ok(c, "GET", "/api/exchanges/%2F/console.x/bindings/source") == listed
    assert {b["source"] for b in ok(c, "GET", "/api/queues/%2F/bound.q/bindings")} == {"", "console.x"}
    pub = {"routing_key": "orders.new", "payload": "o", "payload_encoding": "string", "properties": {}}
    assert ok(c, "POST", "/api/exchanges/%2F/console.x/publish", pub) == {"routed": True}
    assert http(c, "POST", "/api/bindings/%2F/e/console.x/q/no.such.q", {"routing_key": "k"})[0] == 404

    ok(c, "DELETE", pair + "/" + urllib.parse.quote("orders.*", safe=""), want=204)
    assert ok(c, "GET", pair) == []
    assert ok(c, "POST", "/api/exchanges/%2F/console.x/publish", pub) == {"routed": False}
    ok(c, "DELETE", x, want=204)
    assert http(c, "GET", x)[0] == 404
    ok(c, "DELETE", "/api/queues/%2F/bound.q", want=204)


def test_a_connection_is_listed_paged_and_closed(cluster):  # noqa: F811
    c = cluster
    client = conn(c, node=2)
    try:
        ch = client.channel()
        ch.queue_declare("", exclusive=True)

        def listed():
            found = [x for x in ok(c, "GET", "/api/connections") if x["node"] == "node3"]
            return bool(found), found

        mine = wait_for(listed, 20, "the client's connection listed")[0]
        name = mine["name"]
        enc = urllib.parse.quote(name, safe="")
        assert ok(c, "GET", f"/api/connections/{enc}")["name"] == name
        chans = ok(c, "GET", f"/api/connections/{enc}/channels")
        assert len(chans) == 1 and ok(c, "GET", "/api/channels/" + urllib.parse.quote(chans[0]["name"], safe=""))
        page = ok(c, "GET", "/api/connections?page=1&page_size=1&name=" + urllib.parse.quote(name[:10]))
        assert page["item_count"] == 1 and page["filtered_count"] >= 1
        status, _, _ = http(c, "DELETE", f"/api/connections/{enc}", node=0)
        assert status == 204
        with pytest.raises(pika.exceptions.ConnectionClosed) as e:
            for _ in range(50):
                client.process_data_events(time_limit=0.2)
        assert "320" in str(e.value) or "CONNECTION_FORCED" in str(e.value), e.value
    finally:
        if client.is_open:
            client.close()
    assert http(c, "DELETE", f"/api/connections/{enc}")[0] == 404
    ex = ok(c, "GET", "/api/exchanges?page=1&page_size=2&sort=name")
    assert ex["item_count"] == 2 and ex["total_count"] >= 6 and ex["items"][0]["name"] == ""
    assert http(c, "GET", "/api/users?page=0")[0] == 400
