"""The management app (mirrorq.mgmt.api) over a fake data source: routes,
URL-decoded vhosts, status codes, JSON errors, auth, /metrics rendering, the
page, and the rate sampler -- no cluster (tests/cluster/test_mgmt_cluster.py
runs the real thing)."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mirrorq.admin.cluster import ClusterError, CommandTimeout, Invalid, NodeUnavailable, NotFound  # noqa: E402
from mirrorq.mgmt import auth, metrics, page, shapes  # noqa: E402
from mirrorq.mgmt.api import build_app  # noqa: E402
from mirrorq.mgmt.rates import Rates  # noqa: E402

ADMIN = ("admin", "pw")
PLAIN = ("bob", "pw")


def basic(user: str, pw: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}


class FakeSource:
    """The NodeSource methods the app calls, over dicts; records the calls."""

    def __init__(self):
        self.calls: list = []
        self.policies_: dict = {}
        self.fail: Exception | None = None
        self.queue_list = [{"name": "q</script>1", "vhost": "/", "ring": []}]

    def authenticate(self, user, password, peer):
        if (user, password) == ADMIN:
            return 0, ""
        if (user, password) == PLAIN:
            return 403, "user 'bob' is not an administrator"
        return 401, f"user '{user}' - invalid credentials"

    def _maybe_fail(self):
        if self.fail is not None:
            raise self.fail

    def queues(self, vhost=None):
        self.calls.append(("queues", vhost))
        self._maybe_fail()
        return self.queue_list

    def queue(self, vhost, name):
        self.calls.append(("queue", vhost, name))
        raise NotFound(f"no queue '{name}' in vhost '{vhost}'")

    def put_policy(self, vhost, name, body):
        self.calls.append(("put_policy", vhost, name, body))
        if "pattern" not in body:
            raise Invalid("a policy needs 'pattern'")
        created = (vhost, name) not in self.policies_
        self.policies_[(vhost, name)] = body
        return created

    def delete_policy(self, vhost, name):
        if self.policies_.pop((vhost, name), None) is None:
            raise NotFound("no such policy")

    def delete_queue(self, vhost, name, if_empty, if_unused):
        self.calls.append(("delete_queue", vhost, name, if_empty, if_unused))
        return 0

    def purge_queue(self, vhost, name):
        self.calls.append(("purge_queue", vhost, name))
        if name != "q1":
            raise NotFound(f"no queue '{name}' in vhost '{vhost}'")
        return 3

    def queue_action(self, vhost, name, action):
        self.calls.append(("queue_action", vhost, name, action))
        return {}

    def get_messages(self, vhost, name, body, user, password):
        self.calls.append(("get_messages", vhost, name, body, user, password))
        self._maybe_fail()
        return [{"payload": "m", "payload_encoding": "string"}]

    def publish(self, vhost, exchange, body, user, password):
        self.calls.append(("publish", vhost, exchange, body, user, password))
        self._maybe_fail()
        return {"routed": exchange != "unrouted"}

    def put_exchange(self, vhost, name, body, user, password):
        self.calls.append(("put_exchange", vhost, name, body, user))
        return name == "new.x"

    def delete_exchange(self, vhost, name, if_unused, user, password):
        self.calls.append(("delete_exchange", vhost, name, if_unused, user))

    def add_binding(self, vhost, source, kind, destination, body, user, password):
        self.calls.append(("add_binding", vhost, source, kind, destination, body, user))
        return "rk~0123456789abcdef"

    def bindings_of(self, vhost, source=None, kind=None, destination=None):
        self.calls.append(("bindings_of", vhost, source, kind, destination))
        return [{"source": source, "destination": destination, "properties_key": "rk~0123456789abcdef"}]

    def delete_binding(self, vhost, source, kind, destination, props, user, password):
        self.calls.append(("delete_binding", vhost, source, kind, destination, props, user))

    def close_connection(self, name, reason):
        self.calls.append(("close_connection", name, reason))
        if name != "127.0.0.1:5000 -> 127.0.0.1:5672":
            raise NotFound(f"close_connection: no connection {name!r} in the cluster")
        return {}

    def put_vhost(self, name):
        self.calls.append(("put_vhost", name))
        return True

    def metrics_snapshot(self):
        return SNAPSHOT


SNAPSHOT = {
    "node": "node1",
    "view": {"node1": {"state": "up"}, "node2": {"state": "up"}, "node3": {"state": "down"}},
    "registry": {"term": 3, "commit_index": 41, "applied_index": 41, "leader": "node1"},
    "rss": 123456,
    "queues": [
        {
            "vhost": "/",
            "name": "orders",
            "record": {"slave_pids": ["a", "b"], "sync_slave_pids": ["a"]},
            "group": {"members": ["m", "a", "b"], "version": 7},
            "info": {
                "messages": 5,
                "messages_ready": 4,
                "messages_unacknowledged": 1,
                "consumers": 1,
                "mirror_lag": 0,
                "message_stats": {"publish": 10, "deliver_get": 6, "ack": 5, "confirm": 10},
                "sync_records_sent": 9,
                "sync_progress": {"node3/127.0.0.1:1/u": {"sent": 9, "start": 0, "position": 5, "until": 10}},
                "confirm_latency": {"buckets": [0.001, 0.01], "counts": [6, 3, 1], "sum": 0.05, "count": 10},
            },
        }
    ],
}


def run(coro_fn):
    """Run ``coro_fn(client, source)`` against the app over a FakeSource."""
    source = FakeSource()
    logged: list = []

    async def main():
        app = build_app(source, lambda event, level="info", **f: logged.append((event, f)))
        async with TestClient(TestServer(app)) as client:
            await coro_fn(client, source)

    asyncio.run(main())
    return source, logged


def test_auth_401_without_or_with_bad_credentials_403_without_the_tag():
    async def body(client, source):
        r = await client.get("/api/queues")
        assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
        assert (await r.json())["error"] == "not_authorised"
        r = await client.get("/api/queues", headers={"Authorization": "Basic !!notbase64"})
        assert r.status == 401
        r = await client.get("/api/queues", headers=basic("admin", "wrong"))
        assert r.status == 401 and "invalid credentials" in (await r.json())["reason"]
        r = await client.get("/api/queues", headers=basic(*PLAIN))
        assert r.status == 403 and "not an administrator" in (await r.json())["reason"]
        r = await client.get("/", headers=basic(*PLAIN))
        assert r.status == 403
        r = await client.get("/api/queues", headers=basic(*ADMIN))
        assert r.status == 200 and (await r.json())[0]["vhost"] == "/"
        r = await client.get("/metrics")  # open, as rabbitmq_prometheus
        assert r.status == 200

    run(body)


def test_vhost_segments_are_url_decoded_and_puts_answer_201_then_204():
    async def body(client, source):
        h = basic(*ADMIN)
        r = await client.put(
            "/api/policies/%2F/ha", json={"pattern": "^q", "definition": {"ha-mode": "all"}}, headers=h
        )
        assert r.status == 201
        r = await client.put(
            "/api/policies/%2F/ha", json={"pattern": "^q", "definition": {"ha-mode": "all"}}, headers=h
        )
        assert r.status == 204
        assert ("put_policy", "/", "ha", {"pattern": "^q", "definition": {"ha-mode": "all"}}) in source.calls
        r = await client.delete("/api/policies/%2F/ha", headers=h)
        assert r.status == 204
        r = await client.delete("/api/policies/%2F/ha", headers=h)
        assert r.status == 404 and (await r.json()) == {"error": "Object Not Found", "reason": "no such policy"}
        r = await client.delete("/api/queues/my%2Fvhost/q1?if-empty=true", headers=h)
        assert r.status == 204 and source.calls[-1] == ("delete_queue", "my/vhost", "q1", True, False)
        r = await client.put("/api/vhosts/v%201", headers=h)
        assert r.status == 201 and source.calls[-1] == ("put_vhost", "v 1")

    run(body)


def test_errors_are_rabbitmq_json_with_their_status_codes():
    async def body(client, source):
        h = basic(*ADMIN)
        r = await client.put("/api/policies/%2F/p", data=b"{not json", headers=h)
        assert r.status == 400 and (await r.json())["error"] == "bad_request"
        r = await client.put("/api/policies/%2F/p", data=b"[1, 2]", headers=h)
        assert r.status == 400 and "JSON object" in (await r.json())["reason"]
        r = await client.put("/api/policies/%2F/p", json={"definition": {}}, headers=h)
        assert r.status == 400 and (await r.json())["reason"] == "a policy needs 'pattern'"
        r = await client.get("/api/queues/%2F/nope", headers=h)
        assert r.status == 404 and "no queue 'nope'" in (await r.json())["reason"]
        r = await client.get("/api/nothing-here", headers=h)
        assert r.status == 404 and (await r.json())["error"] == "Object Not Found"
        r = await client.post("/api/queues", headers=h)
        assert r.status == 405 and (await r.json())["error"] == "Method Not Allowed"
        for exc, status in (
            (NodeUnavailable("node1 is not running"), 503),
            (CommandTimeout("late"), 503),
            (ClusterError("registry says no"), 500),
            (RuntimeError("bug"), 500),
        ):
            source.fail = exc
            r = await client.get("/api/queues", headers=h)
            assert r.status == status, exc
            assert set(await r.json()) == {"error", "reason"}

    _, logged = run(body)
    assert any(e == "mgmt_handler_error" and "RuntimeError: bug" in f["error"] for e, f in logged)
    access = [f for e, f in logged if e == "http_request"]
    assert any(a["method"] == "GET" and a["status"] == 404 and a["path"].endswith("/nope") for a in access), access
    assert any(a["status"] == 503 for a in access) and all("ms" in a and "peer" in a for a in access)


def test_page_embeds_the_queues_and_cannot_be_broken_out_of():
    async def body(client, source):
        r = await client.get("/", headers=basic(*ADMIN))
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
        start = html.index('<script type="application/json" id="initial">') + len(
            '<script type="application/json" id="initial">'
        )
        data = html[start : html.index("</script>", start)]
        assert json.loads(data)[0]["name"] == "q</script>1"  # escaped inside, intact once parsed
        r = await client.get("/static/ring.js", headers=basic(*ADMIN))
        assert r.status == 200 and "api/queues" in await r.text()

    run(body)


def test_metrics_render_parses_with_rabbitmq_names():
    text = metrics.render(SNAPSHOT).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    q = (("queue", "orders"), ("vhost", "/"))
    assert samples[("rabbitmq_queue_messages_ready", q)] == 4
    assert samples[("rabbitmq_queue_messages_unacked", q)] == 1
    assert samples[("rabbitmq_queue_messages_published_total", q)] == 10
    assert samples[("rabbitmq_queue_messages_confirmed_total", q)] == 10
    assert samples[("mirrorq_queue_gm_ring_size", q)] == 3
    assert samples[("mirrorq_queue_gm_view_version", q)] == 7
    assert samples[("mirrorq_queue_mirrors_synchronised", q)] == 1
    assert samples[("mirrorq_queue_sync_progress_ratio", (("mirror", "node3"),) + q)] == 0.5
    assert samples[("mirrorq_queue_confirm_latency_seconds_bucket", (("le", "0.001"),) + q)] == 6
    assert samples[("mirrorq_queue_confirm_latency_seconds_bucket", (("le", "+Inf"),) + q)] == 10
    assert samples[("mirrorq_queue_confirm_latency_seconds_count", q)] == 10
    assert samples[("mirrorq_node_up", (("node", "node3"),))] == 0
    assert samples[("mirrorq_node_up", (("node", "node2"),))] == 1
    assert samples[("rabbitmq_raft_term_total", (("raft_cluster", "registry"),))] == 3
    assert samples[("rabbitmq_raft_log_commit_index", (("raft_cluster", "registry"),))] == 41
    assert samples[("mirrorq_raft_is_leader", (("raft_cluster", "registry"),))] == 1
    assert samples[("rabbitmq_process_resident_memory_bytes", ())] == 123456


def test_rates_slope_over_the_window_and_a_counter_reset():
    now = [0.0]
    r = Rates(clock=lambda: now[0], window=10.0)
    assert r.sample("k", 100) == 0.0
    now[0] = 2.0
    assert r.sample("k", 120) == 10.0
    now[0] = 4.0
    assert r.sample("k", 160) == 15.0  # (160 - 100) / 4
    now[0] = 5.0
    assert r.sample("k", 3) == 0.0  # a failover: the new master counts from zero
    now[0] = 6.0
    assert r.sample("k", 13) == 10.0
    assert r.sample("gauge", 5, counter=False) == 0.0
    now[0] = 7.0
    assert r.sample("gauge", 3, counter=False) == -2.0  # a depth may go down


def test_helpers():
    assert auth.parse_basic("Basic " + base64.b64encode(b"u:p:q").decode()) == ("u", "p:q")
    assert auth.parse_basic("Bearer x") is None and auth.parse_basic(None) is None
    assert shapes.sync_fraction({"start": 10, "position": 15, "until": 20}) == 0.5
    assert shapes.sync_fraction(None) is None
    assert shapes.properties_key("rk", {}) == "rk" and shapes.properties_key("", {}) == "~"
    assert shapes.properties_key("rk", {"x": 1}).startswith("rk~")
    assert page.render("a<!--initial-->b", []) == 'a<script type="application/json" id="initial">[]</script>b'
