"""Every rabbitmqctl command of mirrorctl against a real 3-node cluster, and
the AMQP fixes of issue #17 with a real client (pika).

One cluster for the module (started once, always stopped).  Each command
is run with ``--formatter json`` and its values and exit code are checked;
the error exits are rabbitmqctl's: 64 usage, 69 node unavailable, 70
software error.
"""

from __future__ import annotations

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        yield c


def params(c, node: int = 0, **kw):
    return pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node, connection_attempts=1, **kw)


def rc_of(c, capsys, *argv) -> tuple[int, str]:
    """``mirrorctl ARGV`` expected to fail: (exit code, stderr)."""
    capsys.readouterr()
    try:
        rc = c.ctl(*argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


def log_events(c, event: str) -> list[dict]:
    from mirrorq.node.log import read

    return [r for n in ("node1", "node2", "node3") for r in read(str(c.data_dir / n)) if r.get("event") == event]


def test_users_vhosts_permissions(cluster, capsys):
    c = cluster
    users = c.ctl_json(capsys, "list_users")
    assert {"user": "guest", "tags": ["administrator"]} in users
    assert c.ctl_json(capsys, "list_vhosts") == [{"name": "/"}]
    c.ctl_json(capsys, "add_vhost", "ops.v1")
    c.ctl_json(capsys, "add_user", "alice", "secret1")
    # the built-in guest can be given permissions in a new vhost (issue #17) ...
    c.ctl_json(capsys, "set_permissions", "-p", "ops.v1", "guest", ".*", ".*", ".*")
    assert c.ctl_json(capsys, "list_permissions", "-p", "ops.v1") == [
        {"user": "guest", "configure": ".*", "write": ".*", "read": ".*"}
    ]
    assert c.ctl_json(capsys, "list_user_permissions", "guest") == [
        {"vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        {"vhost": "ops.v1", "configure": ".*", "write": ".*", "read": ".*"},
    ]
    # ... and still logs in, to both vhosts
    for vhost in ("/", "ops.v1"):
        conn = pika.BlockingConnection(params(c, 1, virtual_host=vhost))
        conn.close()
    vhosts = c.ctl_json(capsys, "list_vhosts", "name", "description", "cluster_state")
    assert [v["name"] for v in vhosts] == ["/", "ops.v1"]
    assert vhosts[0]["cluster_state"] == {"node1": "running", "node2": "running", "node3": "running"}

    c.ctl_json(capsys, "set_permissions", "-p", "ops.v1", "alice", "^alice", ".*", ".*")
    c.ctl_json(capsys, "change_password", "alice", "secret2")
    c.ctl_json(capsys, "set_user_tags", "alice", "management", "monitoring")
    assert {"user": "alice", "tags": ["management", "monitoring"]} in c.ctl_json(capsys, "list_users")
    creds = pika.PlainCredentials("alice", "secret2")
    pika.BlockingConnection(params(c, 2, virtual_host="ops.v1", credentials=creds)).close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(
            params(c, 2, virtual_host="ops.v1", credentials=pika.PlainCredentials("alice", "secret1"))
        )
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
        pika.BlockingConnection(params(c, 2, virtual_host="no.such.vhost"))
    # AMQP errors leave a structured line in the node's log
    logins = wait_for(
        lambda: (lambda ev: (any(e["code"] == 403 for e in ev) and any(e["code"] == 530 for e in ev), ev))(
            log_events(c, "amqp_connection_error")
        ),
        10,
        "a 403 and a 530 in node3's log",
    )
    refused = [e for e in logins if e["code"] == 403]
    assert refused[0]["node"] == "node3" and "alice" in refused[0]["text"] and refused[0]["reply"] == "ACCESS_REFUSED"
    assert any(e["code"] == 530 and "no.such.vhost" in e["text"] for e in logins)

    c.ctl_json(capsys, "delete_vhost", "ops.v1")
    assert c.ctl_json(capsys, "list_vhosts") == [{"name": "/"}]
    assert c.ctl_json(capsys, "list_user_permissions", "alice") == []
    assert rc_of(c, capsys, "delete_vhost", "ops.v1")[0] == 70
    assert rc_of(c, capsys, "list_user_permissions", "nobody")[0] == 70
    assert rc_of(c, capsys, "change_password", "nobody", "x")[0] == 70


def test_exchanges_bindings_queues(cluster, capsys):
    c = cluster
    conn = pika.BlockingConnection(params(c, 0))
    try:
        ch = conn.channel()
        ch.exchange_declare("ops.ex", "topic", durable=True)
        ch.queue_declare("ops.q1", durable=True)
        ch.queue_bind("ops.q1", "ops.ex", "a.#")
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("ops.ex", "a.b", f"m{i}".encode())
    finally:
        conn.close()
    exchanges = c.ctl_json(capsys, "list_exchanges")
    assert {"name": "ops.ex", "type": "topic"} in exchanges and {"name": "amq.direct", "type": "direct"} in exchanges
    assert {"name": "", "type": "direct"} in exchanges
    (ex,) = [
        e
        for e in c.ctl_json(capsys, "list_exchanges", "name", "durable", "auto_delete", "internal", "arguments")
        if e["name"] == "ops.ex"
    ]
    assert ex == {"name": "ops.ex", "durable": True, "auto_delete": False, "internal": False, "arguments": {}}
    bindings = c.ctl_json(capsys, "list_bindings")
    assert {
        "source_name": "",
        "source_kind": "exchange",
        "destination_name": "ops.q1",
        "destination_kind": "queue",
        "routing_key": "ops.q1",
        "arguments": {},
    } in bindings
    assert {
        "source_name": "ops.ex",
        "source_kind": "exchange",
        "destination_name": "ops.q1",
        "destination_kind": "queue",
        "routing_key": "a.#",
        "arguments": {},
    } in bindings
    assert c.ctl_json(capsys, "list_bindings", "source_name", "routing_key")[0] == {
        "source_name": "",
        "routing_key": "ops.q1",
    }

    assert c.ctl_json(capsys, "purge_queue", "ops.q1") == {"vhost": "/", "name": "ops.q1", "message_count": 3}
    (row,) = [r for r in c.ctl_json(capsys, "list_queues", "name", "messages", "durable") if r["name"] == "ops.q1"]
    assert row == {"name": "ops.q1", "messages": 0, "durable": True}
    assert c.ctl_json(capsys, "delete_queue", "ops.q1") == {"vhost": "/", "name": "ops.q1", "message_count": 0}
    assert all(r["name"] != "ops.q1" for r in c.ctl_json(capsys, "list_queues"))
    assert all(b["destination_name"] != "ops.q1" for b in c.ctl_json(capsys, "list_bindings"))
    assert rc_of(c, capsys, "purge_queue", "ops.no.such.q")[0] == 70
    assert rc_of(c, capsys, "delete_queue", "ops.no.such.q")[0] == 70
    assert rc_of(c, capsys, "list_exchanges", "-p", "no.such.vhost")[0] == 70
    assert rc_of(c, capsys, "list_exchanges", "colour")[0] == 64


def test_connections_channels_consumers_close(cluster, capsys):
    c = cluster
    conn = pika.BlockingConnection(params(c, 1, client_properties={"connection_name": "ops-test"}))
    try:
        ch = conn.channel()
        ch.queue_declare("ops.cq")
        ch.basic_qos(prefetch_count=7)
        tag = ch.basic_consume("ops.cq", lambda *a: None, consumer_tag="ops-consumer")
        conns = [
            x
            for x in c.ctl_json(
                capsys,
                "list_connections",
                "pid",
                "name",
                "node",
                "user",
                "vhost",
                "peer_host",
                "peer_port",
                "state",
                "channels",
                "client_properties",
                "protocol",
            )
            if x["client_properties"].get("connection_name") == "ops-test"
        ]
        (mine,) = conns
        assert mine["node"] == "node2" and mine["user"] == "guest" and mine["vhost"] == "/"
        assert mine["state"] == "running" and mine["channels"] == 1 and mine["peer_host"] == "127.0.0.1"
        assert mine["name"] == f"127.0.0.1:{mine['peer_port']} -> 127.0.0.1:{c.amqp_base_port + 1}"
        assert mine["pid"].startswith("<node2.") and mine["protocol"] == "AMQP 0-9-1"
        default = c.ctl_json(capsys, "list_connections")
        assert {
            "user": "guest",
            "peer_host": "127.0.0.1",
            "peer_port": mine["peer_port"],
            "state": "running",
        } in default
        chans = [
            x
            for x in c.ctl_json(
                capsys,
                "list_channels",
                "pid",
                "connection",
                "number",
                "user",
                "consumer_count",
                "messages_unacknowledged",
                "prefetch_count",
            )
            if x["connection"] == mine["pid"]
        ]
        assert chans == [
            {
                "pid": mine["pid"][:-1] + ".1>",
                "connection": mine["pid"],
                "number": 1,
                "user": "guest",
                "consumer_count": 1,
                "messages_unacknowledged": 0,
                "prefetch_count": 7,
            }
        ]
        consumers = c.ctl_json(capsys, "list_consumers")
        assert {
            "queue_name": "ops.cq",
            "channel_pid": chans[0]["pid"],
            "consumer_tag": tag,
            "ack_required": True,
            "prefetch_count": 7,
            "active": True,
            "activity_status": "up",
            "arguments": {},
        } in consumers
        # close_connection: the client is told 320 CONNECTION_FORCED with the reason
        assert c.ctl_json(capsys, "close_connection", mine["pid"], "maintenance") == {
            "closed": mine["pid"],
            "name": mine["name"],
            "node": "node2",
        }
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
            conn.process_data_events(time_limit=5)
            conn.process_data_events(time_limit=5)
        assert e.value.reply_code == 320 and "maintenance" in e.value.reply_text
        wait_for(
            lambda: (lambda xs: (all(x["pid"] != mine["pid"] for x in xs), xs))(
                c.ctl_json(capsys, "list_connections", "pid")
            ),
            10,
            "the closed connection to leave the listing",
        )
    finally:
        if conn.is_open:
            conn.close()
    assert rc_of(c, capsys, "close_connection", "<node2.999999>", "x")[0] == 70


def test_node_commands(cluster, capsys):
    c = cluster
    st = c.ctl_json(capsys, "status", "-n", "node2")
    assert st["node"] == "node2" and st["product_name"] == "mirrorq" and st["alarms"] == []
    assert {
        "node": "node2",
        "protocol": "amqp",
        "interface": "127.0.0.1",
        "port": c.amqp_base_port + 1,
        "purpose": "AMQP 0-9-1",
    } in st["listeners"]
    assert st["memory"]["total"]["rss"] > 0 and st["cluster"] == {"node1": "up", "node2": "up", "node3": "up"}
    env = c.ctl_json(capsys, "environment", "-n", "node3")
    assert env["mirrorq"]["name"] == "node3" and env["mirrorq"]["amqp_port"] == c.amqp_base_port + 2
    report = c.ctl_json(capsys, "report")
    assert {"status", "environment", "cluster_status", "users", "connections", "channels", "vhosts"} <= set(report)
    assert set(report["vhosts"]["/"]) == {"queues", "exchanges", "bindings", "consumers", "permissions", "policies"}
    assert c.ctl("await_startup", "-n", "node1", "--timeout", "30") == 0
    assert c.ctl_json(capsys, "ping", "-n", "node3") == {"result": "ok", "node": "node3"}
    assert c.ctl_json(capsys, "node_health_check", "-n", "node1") == {"result": "ok", "node": "node1"}
    # policies: a listing right after a set shows it (linearizable read, retried across a leader change)
    c.ctl_json(capsys, "set_policy", "ops-pol", "^ops\\.nothing$", '{"ha-mode":"all"}')
    assert [p["name"] for p in c.ctl_json(capsys, "list_policies")] == ["ops-pol"]
    c.ctl_json(capsys, "clear_policy", "ops-pol")
    # exit codes
    assert rc_of(c, capsys, "list_nothing")[0] == 64
    assert rc_of(c, capsys, "list_users", "--timeout", "0")[0] == 64
    assert rc_of(c, capsys, "status", "-n", "node9")[0] == 69
    assert rc_of(c, capsys, "ping", "-n", "node9")[0] == 69


def test_exclusive_queue_redeclared_with_identical_arguments(cluster, capsys):
    """pika's acceptance failure: an exclusive queue re-declared with the
    same arguments got 406 "inequivalent arg 'x-ha-policy'" (an argument
    the broker added to pin it on its connection's node)."""
    c = cluster
    conn = pika.BlockingConnection(params(c, 2))
    try:
        ch = conn.channel()
        args = {"x-message-ttl": 60000}
        name = ch.queue_declare("ops.excl", exclusive=True, arguments=args).method.queue
        ch.queue_declare(name, exclusive=True, arguments=args)
        ch.queue_declare(name, exclusive=True, arguments=args, passive=True)
        (row,) = [
            r for r in c.ctl_json(capsys, "list_queues", "name", "arguments", "exclusive", "pid") if r["name"] == name
        ]
        assert row == {"name": name, "arguments": {"x-message-ttl": 60000}, "exclusive": True, "pid": "node3"}
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(name, exclusive=True, arguments={"x-message-ttl": 1})
        assert e.value.reply_code == 406 and "x-message-ttl" in e.value.reply_text
    finally:
        conn.close()
    ev = wait_for(
        lambda: (lambda ev: (bool(ev), ev))(
            [e for e in log_events(c, "amqp_channel_error") if e["code"] == 406 and name in e["text"]]
        ),
        10,
        "the 406 in node3's log",
    )
    assert ev[0]["channel"] == 1 and ev[0]["reply"] == "PRECONDITION_FAILED" and ev[0]["node"] == "node3"


def test_queue_under_a_policy_redeclared_with_the_same_arguments(cluster, capsys):
    c = cluster
    c.ctl_json(capsys, "set_policy", "ops-ha", "^ops\\.mirrored", '{"ha-mode":"all","ha-sync-mode":"automatic"}')
    try:
        args = {"x-max-length": 100}
        conn = pika.BlockingConnection(params(c, 0))
        try:
            conn.channel().queue_declare("ops.mirrored", durable=True, arguments=args)
        finally:
            conn.close()
        wait_for(
            lambda: (lambda r: (len(r.get("slave_pids") or []) == 2, r))(
                next(
                    (r for r in c.ctl_json(capsys, "list_queues", "name", "slave_pids") if r["name"] == "ops.mirrored"),
                    {},
                )
            ),
            30,
            "ops.mirrored to have two mirrors",
        )
        for node in (1, 2, 0):  # through every node, the master's and the mirrors'
            conn = pika.BlockingConnection(params(c, node))
            try:
                conn.channel().queue_declare("ops.mirrored", durable=True, arguments=args)
            finally:
                conn.close()
        (row,) = [
            r for r in c.ctl_json(capsys, "list_queues", "name", "arguments", "policy") if r["name"] == "ops.mirrored"
        ]
        assert row == {"name": "ops.mirrored", "arguments": {"x-max-length": 100}, "policy": "ops-ha"}
    finally:
        c.ctl_json(capsys, "clear_policy", "ops-ha")
        c.ctl_json(capsys, "delete_queue", "ops.mirrored")


def test_stopped_node_is_unavailable(cluster, capsys):
    """Last: stops node3 (the module's cluster is not used after this)."""
    c = cluster
    assert c.ctl("stop_node", "node3") == 0
    assert rc_of(c, capsys, "ping", "-n", "node3")[0] == 69
    assert rc_of(c, capsys, "status", "-n", "node3")[0] == 69
    assert rc_of(c, capsys, "list_users", "-n", "node3")[0] == 69
    # the others still answer every listing
    assert {"user": "guest", "tags": ["administrator"]} in c.ctl_json(capsys, "list_users")
    assert c.ctl_json(capsys, "node_health_check", "-n", "node1") == {"result": "ok", "node": "node1"}
