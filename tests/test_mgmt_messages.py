"""Get messages and publish (issue #35; mirrorq/admin/messages.py,
mirrorq/amqp/client.py) without a cluster: the request bodies RabbitMQ's API
takes and the 400s naming what is wrong, messages and properties in its
JSON, the routes over test_mgmt_app's fake source (the asking user's
credentials passed on, the broker's refusal a 401), and the client against
a scripted AMQP server: a get, a returned publish, and a server that never
answers given up at the deadline.  Also the exchange, binding (the
``Location`` of a new one) and connection routes over the fake source, and
the admin layer's count of the queues each node holds.  tests/cluster/test_mgmt_messages.py runs
them on a real cluster."""

from __future__ import annotations

import base64
import datetime
import socket
import threading
import time

import pytest
from pamqp import body as B
from pamqp import commands as C
from pamqp import frame as F
from pamqp import header as H

from mirrorq.admin import messages as M
from mirrorq.admin.cluster import AccessRefused, CommandTimeout, Invalid
from mirrorq.amqp.client import AmqpError, AmqpTimeout, BlockingClient, Got

GOOD_GET = {"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto"}
GOOD_PUB = {"routing_key": "k", "payload": "x", "payload_encoding": "string", "properties": {}}


def test_get_bodies_parse_as_rabbitmq_and_bad_ones_name_the_field():
    assert M.parse_get(GOOD_GET) == M.GetRequest(2, "ack_requeue_true", "auto", None)
    assert M.parse_get({**GOOD_GET, "count": "7", "truncate": "50000"}) == M.GetRequest(
        7, "ack_requeue_true", "auto", 50000
    )
    assert M.parse_get({**GOOD_GET, "truncate": ""}).truncate is None
    for bad, field in (
        ({k: v for k, v in GOOD_GET.items() if k != "count"}, "count"),
        ({**GOOD_GET, "count": M.MAX_GET_COUNT + 1}, "count"),
        ({**GOOD_GET, "count": True}, "count"),
        ({**GOOD_GET, "count": 1.5}, "count"),
        ({k: v for k, v in GOOD_GET.items() if k != "ackmode"}, "ackmode"),
        ({**GOOD_GET, "ackmode": "nack"}, "ackmode"),
        ({**GOOD_GET, "encoding": "string"}, "encoding"),
        ({**GOOD_GET, "truncate": "ten"}, "truncate"),
    ):
        with pytest.raises(Invalid) as e:
            M.parse_get(bad)
        assert str(e.value).startswith(f"{field}:"), (bad, e.value)


def test_publish_bodies_and_properties():
    props = {
        "delivery_mode": 2,
        "priority": 5,
        "headers": {"a": 1, "b": ["x", True], "c": {"d": None}},
        "timestamp": 1700000000,
        "type": "order",
        "expiration": 60000,
    }
    req = M.parse_publish(
        {
            **GOOD_PUB,
            "payload": base64.b64encode(b"\x00\xff").decode(),
            "payload_encoding": "base64",
            "properties": props,
        }
    )
    assert req.payload == b"\x00\xff" and req.routing_key == "k"
    p = req.properties
    assert (p.delivery_mode, p.priority, p.message_type, p.expiration) == (2, 5, "order", "60000")
    assert p.timestamp == datetime.datetime.fromtimestamp(1700000000, datetime.UTC)
    back = M.properties_json(p)
    assert back == {**props, "expiration": "60000"}
    for bad, field in (
        ({k: v for k, v in GOOD_PUB.items() if k != "routing_key"}, "routing_key"),
        ({**GOOD_PUB, "routing_key": 5}, "routing_key"),
        ({**GOOD_PUB, "payload": {"a": 1}}, "payload"),
        ({**GOOD_PUB, "payload_encoding": "base64", "payload": "%%"}, "payload"),
        ({**GOOD_PUB, "payload_encoding": "utf8"}, "payload_encoding"),
        ({**GOOD_PUB, "properties": []}, "properties"),
        ({**GOOD_PUB, "properties": {"priority": 256}}, "properties.priority"),
        ({**GOOD_PUB, "properties": {"headers": "x"}}, "properties.headers"),
        ({**GOOD_PUB, "properties": {"reply_to": 3}}, "properties.reply_to"),
        ({**GOOD_PUB, "properties": {"x": 1}}, "properties.x"),
    ):
        with pytest.raises(Invalid) as e:
            M.parse_publish(bad)
        assert str(e.value).startswith(f"{field}:"), (bad, e.value)


def test_a_message_as_rabbitmq_shows_it():
    got = Got(1, True, "ex", "rk", 4, C.Basic.Properties(content_type="text/plain"), "héllo".encode())
    assert M.message_json(got, "auto", None) == {
        "payload_bytes": 6,
        "redelivered": True,
        "exchange": "ex",
        "routing_key": "rk",
        "message_count": 4,
        "properties": {"content_type": "text/plain"},
        "payload": "héllo",
        "payload_encoding": "string",
    }
    cut = M.message_json(got, "auto", 2)  # a cut inside "é" is not UTF-8: base64
    assert cut["payload_encoding"] == "base64" and base64.b64decode(cut["payload"]) == b"h\xc3"
    assert cut["payload_bytes"] == 6
    assert M.message_json(got, "base64", None)["payload"] == base64.b64encode("héllo".encode()).decode()


# ---- the routes ------------------------------------------------------------------------------
def test_get_and_publish_routes_pass_the_user_on_and_map_refusals():
    pytest.importorskip("aiohttp")
    from test_mgmt_app import ADMIN, basic, run

    h = basic(*ADMIN)

    async def body(client, source):
        r = await client.post("/api/queues/my%2Fvhost/q1/get", json=GOOD_GET, headers=h)
        assert r.status == 200 and (await r.json())[0]["payload"] == "m"
        assert source.calls[-1] == ("get_messages", "my/vhost", "q1", GOOD_GET, *ADMIN)
        r = await client.post("/api/exchanges/%2F/amq.default/publish", json=GOOD_PUB, headers=h)
        assert r.status == 200 and await r.json() == {"routed": True}
        assert source.calls[-1] == ("publish", "/", "amq.default", GOOD_PUB, *ADMIN)
        r = await client.post("/api/exchanges/%2F/unrouted/publish", json=GOOD_PUB, headers=h)
        assert await r.json() == {"routed": False}
        r = await client.post("/api/queues/%2F/q1/get", data=b"[1]", headers=h)
        assert r.status == 400 and "JSON object" in (await r.json())["reason"]
        source.fail = AccessRefused("ACCESS_REFUSED - access to queue 'q1' in vhost '/' refused for user 'admin'")
        r = await client.post("/api/queues/%2F/q1/get", json=GOOD_GET, headers=h)
        answer = await r.json()
        assert r.status == 401 and answer["error"] == "not_authorised" and "ACCESS_REFUSED" in answer["reason"]
        assert "WWW-Authenticate" not in r.headers  # the login was good: no browser prompt
        source.fail = Invalid("count: missing (1..1000)")
        r = await client.post("/api/queues/%2F/q1/get", json={}, headers=h)
        assert r.status == 400 and (await r.json())["reason"] == "count: missing (1..1000)"
        r = await client.get("/api/queues/%2F/q1/get", headers=h)
        assert r.status == 405

    run(body)


# ---- the client against a scripted server ----------------------------------------------------
class ScriptedServer:
    """One connection on 127.0.0.1: the handshake, then ``script(frame) ->
    [(channel, frame)]`` answers each frame the client sends (None: no answer)."""

    def __init__(self, script):
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            buf = b""
            assert conn.recv(8) == b"AMQP\x00\x00\x09\x01"
            conn.sendall(F.marshal(C.Connection.Start(server_properties={}, mechanisms="PLAIN", locales="en_US"), 0))
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:  # the client gave up and reset the connection
                    return
                if not data:
                    return
                buf += data
                while buf:
                    try:
                        n, ch, value = F.unmarshal(buf)
                    except Exception:  # noqa: BLE001 - not all of the frame yet
                        break
                    buf = buf[n:]
                    self.seen.append(getattr(value, "name", type(value).__name__))
                    for ch2, out in self._answer(ch, value) or []:
                        conn.sendall(F.marshal(out, ch2))

    def _answer(self, ch, value):
        if isinstance(value, C.Connection.StartOk):
            return [(0, C.Connection.Tune(channel_max=0, frame_max=131072, heartbeat=0))]
        if isinstance(value, C.Connection.Open):
            return [(0, C.Connection.OpenOk())]
        if isinstance(value, C.Channel.Open):
            return [(ch, C.Channel.OpenOk())]
        if isinstance(value, C.Channel.Close):
            return [(ch, C.Channel.CloseOk())]
        if isinstance(value, C.Connection.Close):
            return [(0, C.Connection.CloseOk())]
        return self.script(ch, value)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def test_client_gets_a_message_and_hears_a_return_before_the_ack():
    body = b"x" * 300_000  # more than one frame

    def script(ch, v):
        if isinstance(v, C.Basic.Get):
            return [
                (ch, C.Basic.GetOk(delivery_tag=1, redelivered=False, exchange="", routing_key="q", message_count=0)),
                (ch, H.ContentHeader(0, len(body), C.Basic.Properties(message_id="m"))),
                *[(ch, B.ContentBody(body[i : i + 131064])) for i in range(0, len(body), 131064)],
            ]
        if isinstance(v, C.Confirm.Select):
            return [(ch, C.Confirm.SelectOk())]
        if isinstance(v, B.ContentBody):  # the publish's last frame (its body is one frame)
            return [
                (ch, C.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="", routing_key="nowhere")),
                (ch, H.ContentHeader(0, 1, C.Basic.Properties())),
                (ch, B.ContentBody(b"p")),
                (ch, C.Basic.Ack(delivery_tag=1)),
            ]
        return None

    srv = ScriptedServer(script)
    try:
        with BlockingClient("127.0.0.1", srv.port, "u", "p", "/", time.monotonic() + 10) as c:
            got = c.get("q", no_ack=False)
            assert got is not None and got.body == body and got.properties.message_id == "m"
            assert c.publish("", "nowhere", b"p", C.Basic.Properties()) is False
    finally:
        srv.close()
    assert srv.seen[-2:] == ["Channel.Close", "Connection.Close"]


def test_a_server_that_never_answers_is_given_up_at_the_deadline():
    srv = ScriptedServer(lambda ch, v: None)  # never answers a get
    t0 = time.monotonic()
    try:
        with pytest.raises(AmqpTimeout):
            with BlockingClient("127.0.0.1", srv.port, "u", "p", "/", time.monotonic() + 1.0) as c:
                c.get("q", no_ack=True)
    finally:
        srv.close()
    assert time.monotonic() - t0 < 5  # the deadline bounds the get and the close after it
    with pytest.raises(CommandTimeout):
        raise M._mapped(AmqpTimeout("basic.get"), "get")
    assert isinstance(M._mapped(AmqpError(403, "ACCESS_REFUSED"), "get"), AccessRefused)


# ---- exchanges, bindings, connections: the routes ------------------------------------------
def test_exchange_binding_and_connection_routes():
    pytest.importorskip("aiohttp")
    from test_mgmt_app import ADMIN, basic, run

    h = basic(*ADMIN)

    async def body(client, source):
        r = await client.put("/api/exchanges/%2F/new.x", json={"type": "topic"}, headers=h)
        assert r.status == 201 and source.calls[-1] == ("put_exchange", "/", "new.x", {"type": "topic"}, "admin")
        r = await client.put("/api/exchanges/%2F/old.x", json={"type": "topic"}, headers=h)
        assert r.status == 204
        r = await client.delete("/api/exchanges/%2F/old.x?if-unused=true", headers=h)
        assert r.status == 204 and source.calls[-1] == ("delete_exchange", "/", "old.x", True, "admin")
        r = await client.post(
            "/api/bindings/v%2F1/e/src/q/dst q", json={"routing_key": "rk", "arguments": {"a": 1}}, headers=h
        )
        assert r.status == 201 and r.headers["Location"] == "/api/bindings/v%2F1/e/src/q/dst%20q/rk~0123456789abcdef"
        assert source.calls[-1][:5] == ("add_binding", "v/1", "src", "queue", "dst q")
        r = await client.get("/api/bindings/%2F/e/src/e/dst/rk~0123456789abcdef", headers=h)
        assert r.status == 200 and (await r.json())["destination"] == "dst"
        assert source.calls[-1] == ("bindings_of", "/", "src", "exchange", "dst")
        r = await client.get("/api/bindings/%2F/e/src/e/dst/other", headers=h)
        assert r.status == 404
        r = await client.delete("/api/bindings/%2F/e/src/q/dst/rk~0123456789abcdef", headers=h)
        assert r.status == 204 and source.calls[-1][0] == "delete_binding"
        r = await client.get("/api/bindings/%2F/e/src/x/dst", headers=h)
        assert r.status == 404  # only q and e name a destination's kind
        name = "127.0.0.1:5000 -> 127.0.0.1:5672"
        r = await client.delete(
            "/api/connections/127.0.0.1%3A5000%20-%3E%20127.0.0.1%3A5672", headers={**h, "X-Reason": "maintenance"}
        )
        assert r.status == 204 and source.calls[-1] == ("close_connection", name, "maintenance")
        r = await client.delete("/api/connections/nope", headers=h)
        assert r.status == 404 and source.calls[-1] == ("close_connection", "nope", "Closed via management plugin")

    run(body)


def test_queue_hosts_counts_masters_and_mirrors_per_node():
    from mirrorq.admin.ops import queue_hosts

    records = [
        {"vhost": "/", "name": "b", "pid": "n1/h:1/u", "slave_pids": ["n2/h:2/u", "n3/h:3/u"]},
        {"vhost": "/", "name": "a", "pid": "n2/h:2/u", "slave_pids": []},
        {"vhost": "/", "name": "q", "type": "quorum", "pid": "n3/h:3/u", "members": ["n1/h:1/u", "n3/h:3/u"]},
        {"vhost": "/", "name": "down", "pid": None, "slave_pids": ["n2/h:2/u"]},
    ]
    assert queue_hosts(records) == {
        "n1": {"masters": [("/", "b")], "mirrors": [("/", "q")]},
        "n2": {"masters": [("/", "a")], "mirrors": [("/", "b"), ("/", "down")]},
        "n3": {"masters": [("/", "q")], "mirrors": [("/", "b")]},
    }
