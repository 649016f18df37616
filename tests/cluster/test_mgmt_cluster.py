"""The HTTP management API, /metrics and the ring page against a real 3-node
cluster (issue #17 items 2 and 3): every resource's GET shape and status
codes, PUT/DELETE round trips, basic auth (401/403), Prometheus metrics that
move under a pika load, the page, and the server's life with its node
(restarted when it dies, gone with a killed or stopped node).

One cluster for the module (always stopped); plain urllib as the client.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.error
import urllib.request

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")
prom_parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.cluster

GUEST = ("guest", "guest")
NODES = ("node1", "node2", "node3")


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        for i, n in enumerate(NODES):  # the servers are not waited for by the start: wait here
            wait_for(lambda i=i: (_answers(c, i), None), 30, f"the management server of {n}")
        yield c


def mport(c, node: int) -> int:
    return c.management_base_port + node


def http(c, method: str, path: str, body=None, node: int = 0, auth=GUEST, raw: bytes | None = None):
    """(status, parsed JSON body or text, headers)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{mport(c, node)}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text, headers = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, headers = e.code, e.read().decode(), e.headers
    try:
        return status, json.loads(text) if text else None, headers
    except ValueError:
        return status, text, headers


def ok(c, method: str, path: str, body=None, node: int = 0, want: int = 200):
    status, out, _ = http(c, method, path, body, node)
    assert status == want, (method, path, status, out)
    return out


def _answers(c, node: int) -> bool:
    try:
        return http(c, "GET", "/api/vhosts", node=node)[0] == 200
    except OSError:
        return False


def conn(c, node: int = 0):
    return pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node, connection_attempts=3)
    )


def metrics(c, node: int) -> dict:
    status, text, headers = http(c, "GET", "/metrics", node=node, auth=None)
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, text)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in prom_parser.text_string_to_metric_families(text)
        for s in fam.samples
    }


# ---- GET shapes ---------------------------------------------------------------------------------
def test_every_resource_answers_rabbitmq_shapes(cluster):
    c = cluster
    ok(c, "PUT", "/api/policies/%2F/mgmt-ha", {"pattern": "^mgmt\\.", "definition": {"ha-mode": "all"}}, want=201)
    cn = conn(c, 1)
    try:
        ch = cn.channel()
        ch.queue_declare("mgmt.shapes", durable=True)
        ch.exchange_declare("mgmt.ex", "topic")
        ch.queue_bind("mgmt.shapes", "mgmt.ex", "a.#")
        ch.basic_consume("mgmt.shapes", lambda *a: None, consumer_tag="mgmt-ctag")
        q = wait_for(
            lambda: (lambda q: (len(q["synchronised_slave_nodes"]) == 2, q))(
                ok(c, "GET", "/api/queues/%2F/mgmt.shapes")
            ),
            30,
            "mgmt.shapes mirrored on both other nodes",
        )
        assert q["vhost"] == "/" and q["durable"] is True and q["type"] == "classic" and q["state"] == "running"
        assert q["policy"] == "mgmt-ha" and q["effective_policy_definition"] == {"ha-mode": "all"}
        assert q["node"] in NODES and sorted([q["node"], *q["slave_nodes"]]) == list(NODES)
        assert q["consumers"] == 1 and q["messages"] == 0 and "rate" in q["messages_details"]
        assert [m["node"] for m in q["ring"]].count(q["node"]) == 1 and len(q["ring"]) == 3
        assert {m["state"] for m in q["ring"]} == {"master", "synchronised"}
        assert any(x["name"] == "mgmt.shapes" for x in ok(c, "GET", "/api/queues"))
        assert [x["name"] for x in ok(c, "GET", "/api/queues/%2F", node=2)] == [
            x["name"] for x in ok(c, "GET", "/api/queues/%2F")
        ]

        ov = ok(c, "GET", "/api/overview")
        assert ov["node"] == "node1" and ov["product_name"] == "mirrorq"
        assert ov["object_totals"]["queues"] >= 1 and ov["object_totals"]["connections"] >= 1
        assert ov["object_totals"]["consumers"] >= 1 and "messages" in ov["queue_totals"]
        assert {"node": "node1", "protocol": "http", "ip_address": "127.0.0.1", "port": mport(c, 0)} in ov["listeners"]

        nodes = ok(c, "GET", "/api/nodes")
        assert [n["name"] for n in nodes] == list(NODES) and all(n["running"] for n in nodes)
        assert all(n["mem_used"] > 0 and n["registry"]["term"] >= 1 for n in nodes)
        assert ok(c, "GET", "/api/nodes/node2")["name"] == "node2"

        ex = ok(c, "GET", "/api/exchanges/%2F")
        e = next(e for e in ex if e["name"] == "mgmt.ex")
        assert (e["vhost"], e["type"], e["durable"], e["internal"], e["policy"]) == (
            "/",
            "topic",
            False,
            False,
            "mgmt-ha",
        )
        assert any(e["name"] == "amq.fanout" for e in ok(c, "GET", "/api/exchanges"))
        b = ok(c, "GET", "/api/bindings/%2F")
        assert {
            "source": "mgmt.ex",
            "vhost": "/",
            "destination": "mgmt.shapes",
            "destination_type": "queue",
            "routing_key": "a.#",
            "arguments": {},
            "properties_key": "a.#",
        } in b
        assert any(x["source"] == "" and x["destination"] == "mgmt.shapes" for x in ok(c, "GET", "/api/bindings"))

        conns = ok(c, "GET", "/api/connections", node=2)  # every node's, asked from node3
        mine = [x for x in conns if x["node"] == "node2"]
        assert mine and mine[0]["user"] == "guest" and mine[0]["vhost"] == "/" and mine[0]["type"] == "network"
        chans = ok(c, "GET", "/api/channels")
        assert any(x["node"] == "node2" and x["connection_details"]["name"] == mine[0]["name"] for x in chans)
        cons = ok(c, "GET", "/api/consumers/%2F")
        assert any(
            x["queue"] == {"name": "mgmt.shapes", "vhost": "/"}
            and x["consumer_tag"] == "mgmt-ctag"
            and x["channel_details"]["node"] == "node2"
            for x in cons
        )
        assert cons == ok(c, "GET", "/api/consumers")

        assert {
            "vhost": "/",
            "name": "mgmt-ha",
            "pattern": "^mgmt\\.",
            "apply-to": "all",
            "definition": {"ha-mode": "all"},
            "priority": 0,
        } in ok(c, "GET", "/api/policies")
        assert ok(c, "GET", "/api/policies/%2F/mgmt-ha")["pattern"] == "^mgmt\\."
        assert {"name": "guest", "tags": ["administrator"], "limits": {}} in ok(c, "GET", "/api/users")
        assert ok(c, "GET", "/api/users/guest")["tags"] == ["administrator"]
        vh = ok(c, "GET", "/api/vhosts")
        assert vh[0]["name"] == "/" and vh[0]["cluster_state"] == {n: "running" for n in NODES}
        assert ok(c, "GET", "/api/vhosts/%2F")["name"] == "/"
        assert {"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"} in ok(
            c, "GET", "/api/permissions"
        )
        assert ok(c, "GET", "/api/permissions/%2F/guest")["read"] == ".*"
    finally:
        cn.close()

    # unknown objects: 404 with RabbitMQ's JSON error
    for path in (
        "/api/queues/%2F/mgmt.nope",
        "/api/queues/no-such-vhost",
        "/api/exchanges/no-such-vhost",
        "/api/policies/%2F/nope",
        "/api/users/nobody",
        "/api/vhosts/nope",
        "/api/permissions/%2F/nobody",
        "/api/nodes/node9",
        "/api/not-a-resource",
    ):
        status, body, _ = http(c, "GET", path)
        assert status == 404 and body["error"] == "Object Not Found" and body["reason"], (path, body)
    status, body, _ = http(c, "POST", "/api/queues")
    assert status == 405 and body["error"] == "Method Not Allowed"


# ---- PUT / DELETE round trips -----------------------------------------------------------------------
def test_put_delete_round_trips(cluster):
    c = cluster
    # vhosts
    ok(c, "PUT", "/api/vhosts/mgmt-v1", want=201)
    ok(c, "PUT", "/api/vhosts/mgmt-v1", want=204)
    assert ok(c, "GET", "/api/vhosts/mgmt-v1", node=1)["name"] == "mgmt-v1"  # linearizable on any node
    # users: created (201), changed (204), password checked by the AMQP login too
    ok(c, "PUT", "/api/users/mgmt-alice", {"password": "s3cret", "tags": "monitoring"}, want=201)
    assert ok(c, "GET", "/api/users/mgmt-alice")["tags"] == ["monitoring"]
    ok(c, "PUT", "/api/users/mgmt-alice", {"tags": ["administrator", "monitoring"]}, want=204)
    assert ok(c, "GET", "/api/users/mgmt-alice", node=2)["tags"] == ["administrator", "monitoring"]
    # permissions
    ok(c, "PUT", "/api/permissions/mgmt-v1/mgmt-alice", {"configure": "^a", "write": ".*", "read": ".*"}, want=201)
    ok(c, "PUT", "/api/permissions/mgmt-v1/mgmt-alice", {"configure": ".*", "write": ".*", "read": ".*"}, want=204)
    assert ok(c, "GET", "/api/permissions/mgmt-v1/mgmt-alice") == {
        "user": "mgmt-alice",
        "vhost": "mgmt-v1",
        "configure": ".*",
        "write": ".*",
        "read": ".*",
    }
    cn = pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            c.amqp_base_port,
            "mgmt-v1",
            pika.PlainCredentials("mgmt-alice", "s3cret"),
            connection_attempts=3,
        )
    )
    cn.close()
    # policies in another vhost
    ok(
        c,
        "PUT",
        "/api/policies/mgmt-v1/p1",
        {"pattern": "^x", "definition": {"ha-mode": "exactly", "ha-params": 2}, "priority": 3, "apply-to": "queues"},
        want=201,
    )
    assert ok(c, "GET", "/api/policies/mgmt-v1/p1")["priority"] == 3
    ok(c, "DELETE", "/api/policies/mgmt-v1/p1", want=204)
    assert http(c, "GET", "/api/policies/mgmt-v1/p1")[0] == 404
    assert http(c, "DELETE", "/api/policies/mgmt-v1/p1")[0] == 404
    # queues: declare (201), equivalent (204), inequivalent (400), delete (204), gone (404)
    ok(c, "PUT", "/api/queues/mgmt-v1/mgmt.q1", {"durable": True, "arguments": {"x-max-length": 10}}, want=201)
    ok(c, "PUT", "/api/queues/mgmt-v1/mgmt.q1", {"durable": True, "arguments": {"x-max-length": 10}}, want=204)
    status, body, _ = http(c, "PUT", "/api/queues/mgmt-v1/mgmt.q1", {"durable": False})
    assert status == 400 and "inequivalent arg 'durable'" in body["reason"]
    q = ok(c, "GET", "/api/queues/mgmt-v1/mgmt.q1")
    assert q["arguments"] == {"x-max-length": 10} and q["vhost"] == "mgmt-v1" and q["node"] in NODES
    ok(c, "DELETE", "/api/queues/mgmt-v1/mgmt.q1", want=204)
    assert http(c, "GET", "/api/queues/mgmt-v1/mgmt.q1")[0] == 404
    assert http(c, "DELETE", "/api/queues/mgmt-v1/mgmt.q1")[0] == 404
    # delete the permission, the user, the vhost
    ok(c, "DELETE", "/api/permissions/mgmt-v1/mgmt-alice", want=204)
    assert http(c, "GET", "/api/permissions/mgmt-v1/mgmt-alice")[0] == 404
    assert http(c, "DELETE", "/api/permissions/mgmt-v1/mgmt-alice")[0] == 404
    ok(c, "DELETE", "/api/users/mgmt-alice", want=204)
    assert http(c, "GET", "/api/users/mgmt-alice")[0] == 404
    ok(c, "DELETE", "/api/vhosts/mgmt-v1", want=204)
    assert http(c, "GET", "/api/vhosts/mgmt-v1")[0] == 404
    assert http(c, "DELETE", "/api/vhosts/mgmt-v1")[0] == 404

    # bad bodies: 400 naming what is wrong
    for method, path, body, raw, says in (
        ("PUT", "/api/policies/%2F/bad", {"pattern": "^a"}, None, "needs 'definition'"),
        ("PUT", "/api/policies/%2F/bad", {"pattern": "(", "definition": {}}, None, "regular expression"),
        ("PUT", "/api/policies/%2F/bad", {"pattern": "^a", "definition": {"ha-mode": "sometimes"}}, None, "ha-mode"),
        ("PUT", "/api/policies/%2F/bad", None, b"{nope", "not JSON"),
        ("PUT", "/api/users/mgmt-bob", {"tags": "x"}, None, "needs 'password'"),
        ("PUT", "/api/permissions/%2F/guest", {"configure": ".*"}, None, "missing 'write'"),
        ("PUT", "/api/permissions/%2F/guest", {"configure": "(", "write": "", "read": ""}, None, "regular"),
        ("PUT", "/api/queues/%2F/mgmt.bad", {"arguments": {"x-max-length": "ten"}}, None, "x-max-length"),
        ("PUT", "/api/queues/%2F/amq.nope", {}, None, "reserved"),
    ):
        status, out, _ = http(c, method, path, body, raw=raw)
        assert status == 400 and out["error"] == "bad_request" and says in out["reason"], (path, body, out)
    assert http(c, "PUT", "/api/permissions/%2F/nobody", {"configure": "", "write": "", "read": ""})[0] == 404
    assert http(c, "PUT", "/api/queues/no-such-vhost/q", {})[0] == 404


# ---- auth ------------------------------------------------------------------------------------------
def test_queue_actions_purge_sync_cancel_sync(cluster):
    """The console queue page's actions (#35): purge empties the queue as every
    node sees it; sync and cancel_sync are run by the master (204); a missing
    queue is a 404, an unknown action a 400."""
    c = cluster
    name = "mgmt.actions"
    ok(
        c,
        "PUT",
        "/api/policies/%2F/mgmt-actions",
        {"pattern": r"^mgmt\.actions$", "definition": {"ha-mode": "all"}},
        want=201,
    )
    ok(c, "PUT", f"/api/queues/%2F/{name}", {"durable": True}, want=201)
    cn = conn(c)
    try:
        ch = cn.channel()
        ch.confirm_delivery()
        for i in range(5):
            ch.basic_publish("", name, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    finally:
        cn.close()
    c.wait_mirrored(name)
    assert ok(c, "GET", f"/api/queues/%2F/{name}", node=2)["messages"] == 5
    for action in ("sync", "cancel_sync"):
        ok(c, "POST", f"/api/queues/%2F/{name}/actions", {"action": action}, node=1, want=204)
    status, out, _ = http(c, "POST", f"/api/queues/%2F/{name}/actions", {"action": "resync"})
    assert status == 400 and out["reason"].startswith("action: "), out
    ok(c, "DELETE", f"/api/queues/%2F/{name}/contents", node=1, want=204)
    for node in range(3):
        assert ok(c, "GET", f"/api/queues/%2F/{name}", node=node)["messages"] == 0
    assert c.queue_row(name)["messages"] == 0
    for method, path, body in (
        ("DELETE", "/api/queues/%2F/mgmt.nope/contents", None),
        ("POST", "/api/queues/%2F/mgmt.nope/actions", {"action": "sync"}),
    ):
        status, out, _ = http(c, method, path, body)
        assert status == 404 and "no queue 'mgmt.nope'" in out["reason"], (method, path, out)
    ok(c, "DELETE", f"/api/queues/%2F/{name}", want=204)
    ok(c, "DELETE", "/api/policies/%2F/mgmt-actions", want=204)


def test_basic_auth_administrators_only(cluster):
    c = cluster
    ok(c, "PUT", "/api/users/mgmt-mon", {"password": "pw", "tags": ["monitoring"]}, want=201)
    try:
        status, body, headers = http(c, "GET", "/api/overview", auth=None)
        assert status == 401 and body["error"] == "not_authorised" and headers["WWW-Authenticate"].startswith("Basic")
        assert http(c, "GET", "/api/queues", auth=("guest", "wrong"))[0] == 401
        assert http(c, "GET", "/api/queues", auth=("nobody", "x"))[0] == 401
        status, body, _ = http(c, "GET", "/api/queues", auth=("mgmt-mon", "pw"))
        assert status == 403 and "not an administrator" in body["reason"]
        assert http(c, "PUT", "/api/vhosts/mgmt-x", auth=("mgmt-mon", "pw"))[0] == 403
        assert http(c, "GET", "/", auth=None)[0] == 401
        # given the tag, the same user is let in at once (users are read on every request)
        ok(c, "PUT", "/api/users/mgmt-mon", {"tags": "administrator"}, want=204)
        assert http(c, "GET", "/api/queues", auth=("mgmt-mon", "pw"), node=1)[0] == 200
        assert http(c, "GET", "/metrics", auth=None)[0] == 200  # open, as rabbitmq_prometheus
    finally:
        ok(c, "DELETE", "/api/users/mgmt-mon", want=204)
    assert http(c, "GET", "/api/queues", auth=("mgmt-mon", "pw"))[0] == 401


# ---- /metrics -----------------------------------------------------------------------------------------
def test_metrics_parse_and_move_under_load(cluster):
    c = cluster
    assert http(c, "PUT", "/api/policies/%2F/mgmt-ha", {"pattern": "^mgmt\\.", "definition": {"ha-mode": "all"}})[
        0
    ] in (201, 204)  # 204: the first test set it already
    ok(c, "PUT", "/api/queues/%2F/mgmt.load", {"durable": True}, want=201)
    master = wait_for(
        lambda: (lambda q: (len(q["synchronised_slave_nodes"]) == 2, q))(ok(c, "GET", "/api/queues/%2F/mgmt.load")),
        30,
        "mgmt.load mirrored",
    )["node"]
    mi = NODES.index(master)
    q = (("queue", "mgmt.load"), ("vhost", "/"))
    before = metrics(c, mi)
    assert before[("rabbitmq_queue_messages_ready", q)] == 0
    assert before[("rabbitmq_queue_messages_published_total", q)] == 0
    assert before[("mirrorq_queue_gm_ring_size", q)] == 3 and before[("mirrorq_queue_gm_view_version", q)] >= 1
    assert before[("mirrorq_queue_mirrors_synchronised", q)] == 2
    assert all(before[("mirrorq_node_up", (("node", n),))] == 1 for n in NODES)
    reg = (("raft_cluster", "registry"),)
    assert before[("rabbitmq_raft_term_total", reg)] >= 1 and before[("rabbitmq_raft_log_commit_index", reg)] >= 1
    assert before[("rabbitmq_process_resident_memory_bytes", ())] > 10 << 20
    other = NODES[(mi + 1) % 3]
    assert not any(k[0] == "rabbitmq_queue_messages_ready" and k[1] == q for k in metrics(c, NODES.index(other))), (
        "a node reports only the queues whose master it holds"
    )

    n, got = 300, 100
    cn = conn(c, (mi + 1) % 3)  # through another node's front end
    try:
        ch = cn.channel()
        ch.confirm_delivery()
        for i in range(n):
            ch.basic_publish("", "mgmt.load", b"m%d" % i, pika.BasicProperties(delivery_mode=2))
        for _ in range(got):
            method, _props, _body = ch.basic_get("mgmt.load")
            ch.basic_ack(method.delivery_tag)
        # one delivered, not yet acknowledged
        held, _p, _b = ch.basic_get("mgmt.load")

        def moved():
            m = metrics(c, mi)
            return (
                m[("rabbitmq_queue_messages_ready", q)] == n - got - 1
                and m[("rabbitmq_queue_messages_unacked", q)] == 1
                and m[("rabbitmq_queue_messages_acked_total", q)] == got
            ), m

        after = wait_for(moved, 20, "the queue's gauges and counters to move")
        ch.basic_ack(held.delivery_tag)
    finally:
        cn.close()
    assert after[("rabbitmq_queue_messages_published_total", q)] == n
    assert after[("rabbitmq_queue_messages_confirmed_total", q)] == n
    assert after[("rabbitmq_queue_messages_delivered_total", q)] == got + 1
    assert after[("mirrorq_queue_confirm_latency_seconds_count", q)] == n
    assert after[("mirrorq_queue_confirm_latency_seconds_bucket", (("le", "+Inf"),) + q)] == n
    assert 0 < after[("mirrorq_queue_confirm_latency_seconds_sum", q)] < n * 10
    # the API's message_stats are the same counters, with rates
    stats = ok(c, "GET", "/api/queues/%2F/mgmt.load")["message_stats"]
    assert stats["publish"] == n and stats["confirm"] == n and "rate" in stats["publish_details"]
    ok(c, "DELETE", "/api/queues/%2F/mgmt.load", want=204)


# ---- the page -------------------------------------------------------------------------------------------
def test_the_ring_page_is_served_and_names_the_queues(cluster):
    c = cluster
    ok(c, "PUT", "/api/queues/%2F/mgmt.page-a", {"durable": True}, want=201)
    ok(c, "PUT", "/api/queues/%2F/mgmt.page-b", {"durable": False}, want=201)
    status, html, headers = http(c, "GET", "/", node=2)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "<title>mirrorq · queue rings</title>" in html and 'src="static/ring.js"' in html
    start = html.index('id="initial">') + len('id="initial">')
    shown = json.loads(html[start : html.index("</script>", start)])
    assert {"mgmt.page-a", "mgmt.page-b"} <= {q["name"] for q in shown}
    assert all(q["ring"] and q["ring"][0]["node"] in NODES for q in shown if q["name"].startswith("mgmt.page"))
    status, js, _ = http(c, "GET", "/static/ring.js", node=2)
    assert status == 200 and "api/queues" in js
    for name in ("mgmt.page-a", "mgmt.page-b"):
        ok(c, "DELETE", f"/api/queues/%2F/{name}", want=204)


# ---- the server's life with its node ----------------------------------------------------------------------
def _server_pids(c, node: str) -> list[int]:
    """The management server processes of ``node`` (by command line)."""
    needle = str(c.data_dir / node).encode()
    out = []
    for pid in conftest.processes_under(c.data_dir / node):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"mirrorq.mgmt.server" in cmd and needle in cmd:
            out.append(pid)
    return out


def test_server_is_restarted_and_dies_with_its_node(cluster):
    from mirrorq.node.log import read

    c = cluster
    (pid,) = _server_pids(c, "node3")
    assert os.getpgid(pid) == int(c.cluster.pid_info("node3")["pgid"]), "the server is in the node's process group"
    import mirrorq

    with open(f"/proc/{pid}/environ", "rb") as f:  # it runs the code these tests import
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert env[b"PYTHONPATH"].decode().split(os.pathsep)[0] == os.path.dirname(os.path.dirname(mirrorq.__file__))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (lambda p: (p and p != [pid], p))(_server_pids(c, "node3")), 20, "a new server for node3")
    wait_for(lambda: (_answers(c, 2), None), 20, "node3's new server to answer")
    events = [r["event"] for r in read(str(c.data_dir / "node3")) if r.get("component", "").startswith("mgmt")]
    assert events.count("mgmt_started") >= 2 and "mgmt_exited" in events and "mgmt_ready" in events
    access = read(str(c.data_dir / "node3"), "mgmt.log")
    assert any(r["event"] == "http_request" and r["path"] == "/api/vhosts" and r["status"] == 200 for r in access)

    # killed with its node (SIGKILL of the group), back when the node starts again
    assert c.cluster.kill_node("node3")
    assert _server_pids(c, "node3") == [] and not _answers(c, 2)
    c.cluster.start_node("node3")
    wait_for(lambda: (_answers(c, 2), None), 30, "node3's server after a restart of the node")
    # and gone with a graceful stop
    assert c.cluster.stop_node("node3")
    assert _server_pids(c, "node3") == []
    c.cluster.start_node("node3")
    wait_for(lambda: (_answers(c, 2), None), 30, "node3's server after a stop and start")
    assert all(
        n["running"]
        for n in wait_for(
            lambda: (lambda ns: (all(n["running"] for n in ns), ns))(ok(c, "GET", "/api/nodes")), 30, "node3 up again"
        )
    )


def test_mirrorctl_reports_the_port_and_clears_permissions(cluster, capsys):
    c = cluster
    rows = c.ctl_json(capsys, "cluster", "status")
    assert [r["management_port"] for r in rows] == [mport(c, i) for i in range(3)]
    st = c.ctl_json(capsys, "status", "-n", "node2")
    assert {
        "node": "node2",
        "protocol": "http",
        "interface": "127.0.0.1",
        "port": mport(c, 1),
        "purpose": "HTTP API (management, /metrics, ring page)",
    } in st["listeners"]
    # clear_permissions (rabbitmqctl's), the same operation as DELETE /api/permissions
    c.ctl_json(capsys, "add_vhost", "mgmt-cp")
    c.ctl_json(capsys, "set_permissions", "-p", "mgmt-cp", "guest", ".*", ".*", ".*")
    assert ok(c, "GET", "/api/permissions/mgmt-cp/guest")["configure"] == ".*"
    c.ctl_json(capsys, "clear_permissions", "-p", "mgmt-cp", "guest")
    assert http(c, "GET", "/api/permissions/mgmt-cp/guest")[0] == 404
    capsys.readouterr()
    assert c.ctl("clear_permissions", "-p", "mgmt-cp", "guest") == 70
    assert "has no permissions" in capsys.readouterr().err
    ok(c, "DELETE", "/api/vhosts/mgmt-cp", want=204)
